use super::*;

#[tokio::test(start_paused = true)]
async fn an_advance_waits_for_older_requests_and_aborts_the_slow_ones() {
    let d = Drain::new(34);
    let Entry::Entered(a) = d.enter(34) else {
        panic!()
    };
    let (a, a_body) = a.split();
    assert_eq!(d.draining(), None);
    let (b, old) = d.install(51);
    assert_eq!(d.draining(), Some(51), "the advance to 51 drains");
    assert!(matches!(d.enter(34), Entry::Stale { mark: 51 }));
    let Entry::NotReady(g) = d.enter(51) else {
        panic!("equal tokens wait for the drain")
    };
    // A ends within the drain time: B goes on without an abort.
    let done = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(a);
        drop(a_body);
    });
    let drained = d.finish(&b, &old, Duration::from_secs(2)).await;
    done.await.unwrap();
    assert_eq!(drained.aborted, 0);
    assert_eq!(drained.waited, Duration::from_millis(300));
    Drain::wait_ready(&g).await;
    assert_eq!(d.draining(), None);
    assert!(matches!(d.enter(51), Entry::Entered(_)));
    drop(b); // the advancing request's exchange is over

    // A request slower than the drain time is aborted.
    let Entry::Entered(slow) = d.enter(51) else {
        panic!()
    };
    let mut signal = slow.abort_signal();
    let (c, old) = d.install(60);
    let finish = d.finish(&c, &old, Duration::from_millis(500));
    tokio::pin!(finish);
    let aborted = tokio::select! {
        r = &mut finish => panic!("drained without the slow request: {r:?}"),
        () = std::future::poll_fn(|cx| signal.poll_aborted(cx)) => true,
    };
    assert!(aborted && slow.generation().is_aborted());
    drop(slow);
    let drained = finish.await;
    assert_eq!(drained.aborted, 1);
    assert_eq!(drained.waited, Duration::from_millis(500));
}

/// Threads admit equal tokens flat out while the mark advances again and again: every drain
/// that ends without an abort must end with no request of an older mark still holding a
/// ticket (the store-buffer argument in the module docs: a request is either counted by the
/// drainer or sees `superseded` and backs out). Also checks that the thread caches never hand
/// out a ticket of the wrong generation.
#[test]
fn a_drain_never_ends_while_a_request_under_an_older_mark_is_registered() {
    never_ends_early(Drain::new(1));
}

/// The same for an entity's one-shard drain.
#[test]
fn a_one_shard_drain_never_ends_while_a_request_under_an_older_mark_is_registered() {
    never_ends_early(Drain::single(1, Arc::default()));
}

fn never_ends_early(drain: Drain) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

    const THREADS: usize = 3;
    const ROUNDS: u64 = 400;
    let drain = Arc::new(drain);
    // The mark, published after the new generation is installed (as `advance` does).
    let mark = Arc::new(AtomicU64::new(1));
    // Tickets held per token, raised after entering and lowered before the ticket is dropped.
    let live: Arc<Vec<AtomicU64>> = Arc::new((0..=ROUNDS + 1).map(|_| AtomicU64::new(0)).collect());
    // The highest mark whose drain has ended: nobody may hold a ticket of it afterwards.
    let drained_upto = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let admitters: Vec<_> = (0..THREADS)
        .map(|_| {
            let (drain, mark, live, stop) =
                (drain.clone(), mark.clone(), live.clone(), stop.clone());
            let drained_upto = drained_upto.clone();
            std::thread::spawn(move || {
                let mut entered = 0u64;
                while !stop.load(SeqCst) {
                    let t = mark.load(SeqCst);
                    match drain.enter(t) {
                        Entry::Entered(ticket) => {
                            assert_eq!(ticket.generation().token, t, "a ticket of another mark");
                            live[t as usize].fetch_add(1, SeqCst);
                            let upto = drained_upto.load(SeqCst);
                            assert!(upto < t, "entered {t} after its drain ended ({upto})");
                            for _ in 0..entered % 64 {
                                std::hint::spin_loop();
                            }
                            live[t as usize].fetch_sub(1, SeqCst);
                            drop(ticket);
                            entered += 1;
                        }
                        Entry::Stale { mark } => assert!(mark > t),
                        Entry::NotReady(_) | Entry::Retry => std::thread::yield_now(),
                    }
                }
                entered
            })
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    for next in 2..=ROUNDS + 1 {
        let (ticket, old) = drain.install(next);
        mark.store(next, SeqCst);
        let drained = rt.block_on(drain.finish(&ticket, &old, Duration::from_secs(30)));
        assert_eq!(drained.aborted, 0);
        let older: u64 = live[..next as usize].iter().map(|l| l.load(SeqCst)).sum();
        assert_eq!(
            older, 0,
            "round {next}: the drain ended with older requests in flight"
        );
        drained_upto.store(next - 1, SeqCst);
        drop(ticket);
        // Let the admitters enter the new generation before the next advance.
        std::thread::sleep(Duration::from_micros(200));
    }
    stop.store(true, SeqCst);
    let entered: u64 = admitters.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(entered > ROUNDS, "the admitters barely ran: {entered}");
}

/// A split request stays counted until both halves are given back (in either order), and an
/// abort reports it as one request, not two.
#[tokio::test(start_paused = true)]
async fn a_split_request_counts_once_until_both_halves_end() {
    let d = Drain::new(5);
    let Entry::Entered(t) = d.enter(5) else {
        panic!()
    };
    let (body, response) = t.split();
    let (next, old) = d.install(6);
    drop(response);
    // One half left: the drain cannot end, and times out with one request aborted.
    let drained = d.finish(&next, &old, Duration::from_millis(100)).await;
    assert_eq!(drained.aborted, 1);
    assert!(body.generation().is_aborted());
    drop(body);
    assert_eq!(old.in_flight(), 0);
    drop(next); // the advancing request's exchange is over

    // Both halves alive: still one request; released body first, then response.
    let Entry::Entered(t) = d.enter(6) else {
        panic!()
    };
    let (body, response) = t.split();
    let (again, old) = d.install(7);
    let finish = d.finish(&again, &old, Duration::from_secs(1));
    tokio::pin!(finish);
    tokio::select! {
        _ = &mut finish => panic!("drained with both halves in flight"),
        () = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    drop(body);
    tokio::select! {
        _ = &mut finish => panic!("drained with the response half in flight"),
        () = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    drop(response);
    let drained = finish.await;
    assert_eq!(drained.aborted, 0);
    assert_eq!(drained.waited, Duration::from_millis(20));
}

#[tokio::test]
async fn a_half_split_again_keeps_the_request_counted_on_both_kinds_of_drain() {
    for d in [Drain::new(5), Drain::single(5, Arc::default())] {
        let Entry::Entered(t) = d.enter(5) else {
            panic!()
        };
        let (body, response) = t.split();
        let (a, b) = response.split();
        assert_eq!(d.in_flight(), 2, "three halves round up to two requests");
        let (next, old) = d.install(6);
        for half in [body, a] {
            drop(half);
            assert!(old.in_flight() > 0, "a half is still in flight");
        }
        drop(b);
        assert_eq!(old.in_flight(), 0, "every half gave its weight back");
        let drained = d.finish(&next, &old, Duration::from_secs(1)).await;
        assert_eq!(drained.aborted, 0);
    }
}
