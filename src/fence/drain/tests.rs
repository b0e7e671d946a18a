use super::*;

#[tokio::test(start_paused = true)]
async fn an_advance_waits_for_older_requests_and_aborts_the_slow_ones() {
    let d = Drain::new(34);
    let Entry::Entered(a) = d.enter(34) else {
        panic!()
    };
    let (a, a_body) = a.split();
    let (b, old) = d.install(51);
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
