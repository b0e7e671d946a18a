//! The new owner's request waits for the old owner's body, or aborts it: a slow body, a
//! request the upstream has whole (still applying it, or whose client hung up), and a body
//! the server's stop cuts off.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::harness::{
    drain_metrics, post_now, read_response, setup, wait_until, write_mark, Raw, CONFIG,
};
use super::recorder::{recorder, Kind, Recorder};

/// A (token 34, the mark) streams a 400-byte Content-Length body in four pieces 150 ms apart;
/// B (token 51) arrives after A's first piece. With a 3 s drain time, B reaches the upstream
/// only after A's body was read whole, and nothing is aborted.
async fn an_advance_waits_for_the_old_owners_slow_body() {
    let (up, proxy, _dir) = setup(3000, Some(34)).await;
    let addr = proxy.addr;
    let a = tokio::spawn(async move {
        let mut c = Raw::open(addr, "/orders/a", 34, "A", Some(400)).await;
        for i in 0..4 {
            c.send(&[b'a'; 100]).await.unwrap();
            if i < 3 {
                tokio::time::sleep(Duration::from_millis(150)).await; // the slowness under test
            }
        }
        c.response(Duration::from_secs(10)).await
    });
    // A is admitted and its body is streaming.
    wait_until(
        "A's first 100 bytes at the upstream",
        Duration::from_secs(5),
        || up.rec.received("A") >= 100,
    )
    .await;
    let b_sent = Instant::now();
    let (b, b_latency) = post_now(addr, "/orders/b", 51, "B", b"0123456789").await;
    let b_answered = Instant::now();
    let a = a.await.unwrap();
    assert_eq!(a.as_ref().map(|r| r.0), Ok(200), "A: {a:?}");
    assert_eq!(b.as_ref().map(|r| r.0), Ok(200), "B: {b:?}");

    let a_done = up
        .rec
        .find("A", Kind::Complete)
        .expect("A's body completed");
    let b_start = up
        .rec
        .find("B", Kind::Start)
        .expect("B reached the upstream");
    assert_eq!(a_done.bytes, 400);
    assert!(
        b_start.seq > a_done.seq,
        "B started at the upstream (seq {}) before A's body completed (seq {}): {:#?}",
        b_start.seq,
        a_done.seq,
        up.rec.events()
    );
    assert!(b_start.at >= a_done.at && b_answered > a_done.at);
    // B waited for the rest of A's body (about 300 ms of A's pauses were still to come).
    let waited_for_a = a_done.at.duration_since(b_sent);
    assert!(
        b_latency >= waited_for_a && waited_for_a >= Duration::from_millis(200),
        "B took {b_latency:?}, A completed {waited_for_a:?} after B was sent"
    );
    let m = drain_metrics(&proxy, "orders").await;
    assert_eq!((m.count, m.timeouts, m.aborted), (1.0, 0.0, 0.0));
    assert!(m.sum >= 0.2, "drain duration sum {}", m.sum);
    println!(
        "drained in time: B latency {b_latency:?}, A completed {waited_for_a:?} after B was \
         sent, drain {:.3}s",
        m.sum
    );
}

/// A (token 34) sends half of a 400-byte body and stalls; B (token 51) arrives. With a 300 ms
/// drain time, A is aborted (its client gets 409), the upstream never reads A's body whole
/// (not even after A's client sends the rest), and B is forwarded after the drain time.
async fn slow_old_owner_is_aborted(path_a: &str, path_b: &str) {
    const DRAIN: Duration = Duration::from_millis(300);
    let (up, proxy, _dir) = setup(300, Some(34)).await;
    let addr = proxy.addr;
    let mut a = Raw::open(addr, path_a, 34, "A", Some(400)).await;
    a.send(&[b'a'; 200]).await.unwrap();
    wait_until(
        "A's first half at the upstream",
        Duration::from_secs(5),
        || up.rec.received("A") >= 200,
    )
    .await;

    let (b, b_latency) = post_now(addr, path_b, 51, "B", b"0123456789").await;
    assert_eq!(b.as_ref().map(|r| r.0), Ok(200), "B: {b:?}");
    assert!(
        b_latency >= DRAIN,
        "B was answered after {b_latency:?}, before the drain time"
    );
    assert!(
        b_latency < DRAIN + Duration::from_millis(1500),
        "B waited {b_latency:?}"
    );
    let b_start = up.rec.find("B", Kind::Start).unwrap();
    assert!(up.rec.find("B", Kind::Complete).is_some());

    // A's client: no response had started, so 409.
    let ra = a.response(Duration::from_secs(5)).await;
    let (status, text) = ra
        .clone()
        .unwrap_or_else(|e| panic!("A got no response: {e}"));
    assert_eq!(status, 409, "A: {text}");
    // The zombie sends the rest anyway; the upstream must not complete A.
    let rest = a.send(&[b'a'; 200]).await;
    wait_until(
        "the upstream to see A's request end early",
        Duration::from_secs(5),
        || up.rec.find("A", Kind::Gone).is_some(),
    )
    .await;
    let gone = up.rec.find("A", Kind::Gone).unwrap();
    assert!(
        up.rec.find("A", Kind::Complete).is_none(),
        "{:#?}",
        up.rec.events()
    );
    assert_eq!(
        up.rec.received("A"),
        200,
        "the upstream got more of A than its first half"
    );
    assert_eq!(gone.token, 34);

    let m = drain_metrics(&proxy, "orders").await;
    assert_eq!(m.count, 1.0, "one advance, one drain");
    assert_eq!(m.timeouts, 1.0, "the drain timed out");
    assert_eq!(m.aborted, 1.0, "one request (A) was aborted");
    assert!(m.sum >= DRAIN.as_secs_f64(), "drain duration {}", m.sum);
    println!(
        "{path_a}: B latency {b_latency:?}, drain {:.3}s, A -> {status}, A's rest after the \
         abort: {rest:?}, A gone at the upstream {:?} relative to B's start",
        m.sum,
        if gone.seq < b_start.seq {
            "before"
        } else {
            "after"
        }
    );
}

async fn an_old_owner_slower_than_the_drain_time_is_aborted_http1_upstream() {
    slow_old_owner_is_aborted("/orders/a", "/orders/b").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_owner_slower_than_the_drain_time_is_aborted_h2c_upstream() {
    slow_old_owner_is_aborted("/h2/orders/a", "/h2/orders/b").await;
}

/// An old owner's whole write (10 bytes), which the upstream applies 400 ms after it read it.
async fn slow_write(addr: SocketAddr, path: &str, token: u64, id: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nx-fencing-token: {token}\r\n\
             x-id: {id}\r\nx-apply-after-ms: 400\r\ncontent-length: 10\r\n\r\n0123456789"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    s
}

/// The old owner's write was applied before the new owner's request reached the upstream.
fn applied_first(up: &Recorder, old_id: &str, new_id: &str, path: &str) {
    let applied = up.rec.find(old_id, Kind::Complete).unwrap_or_else(|| {
        panic!("{path}: the new owner went ahead before the old write was applied")
    });
    let started = up.rec.find(new_id, Kind::Start).unwrap();
    assert!(
        applied.seq < started.seq,
        "{path}: the old owner's write was applied after the new owner's request reached the \
         upstream ({applied:?} after {started:?})"
    );
}

/// A request whose body was handed to the upstream whole cannot be taken back: when the drain
/// runs out of time it is waited for (until its response head, within the abort grace) rather
/// than abandoned while the upstream may still apply it. Here the upstream reads the old
/// owner's body whole at once and applies it 400 ms later, well past the 100 ms drain: the new
/// owner's request must reach it only after that, on HTTP/1.1 and on h2c upstreams. (Seen first as a
/// rare failure of the stress test below: a write applied after a newer owner's started.)
async fn a_request_delivered_whole_is_waited_for_when_the_drain_runs_out() {
    let (up, proxy, _dir) = setup(100, Some(1)).await;
    for (round, path) in ["/orders/w", "/h2/orders/w"].into_iter().enumerate() {
        let old_token = 1 + round as u64;
        let (old_id, new_id) = (format!("old-{round}"), format!("new-{round}"));
        let mut old = slow_write(proxy.addr, path, old_token, &old_id).await;
        wait_until(
            "the old request at the upstream",
            Duration::from_secs(5),
            || up.rec.find(&old_id, Kind::Start).is_some(),
        )
        .await;
        let mut new = Raw::open(proxy.addr, path, old_token + 1, &new_id, Some(10)).await;
        new.send(b"0123456789").await.unwrap();
        let old_answer = read_response(&mut old).await;
        let new_answer = new.response(Duration::from_secs(5)).await;
        assert_eq!(new_answer.map(|r| r.0), Ok(200), "{path}");
        wait_until(
            "the old write to be applied",
            Duration::from_secs(2),
            || up.rec.find(&old_id, Kind::Complete).is_some(),
        )
        .await;
        applied_first(&up, &old_id, &new_id, path);
        // The upstream applied it: its client is told so, not 409.
        assert_eq!(old_answer.map(|r| r.0), Ok(200), "{path}");
    }
    assert!(drain_metrics(&proxy, "orders").await.timeouts >= 2.0);
}

/// A client that hangs up after its request went to the upstream whole does not take the
/// request back: the upstream may still apply it. Its exchange stays tracked until the
/// upstream answers, so a newer owner's drain waits for it as for any other delivered request.
/// Here the old owner's client closes its connection as soon as the upstream has the request;
/// the upstream applies it 400 ms later. The new owner's request (drain time 3 s) must reach
/// the upstream only after that, on HTTP/1.1 and on h2c upstreams; and the drain does not run
/// out (the upstream answered well within it).
async fn a_delivered_request_whose_client_hung_up_is_still_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    write_mark(&marks, "orders", 1);
    let up = recorder().await;
    let log = dir.path().join("access.log");
    let text = support::render(CONFIG, up.addr, &marks).replace("{drain}", "3000")
        + &format!(
            "\n[access_log]\nformat = \"json\"\npath = \"{}\"\n",
            log.display()
        );
    let proxy = support::proxy(&text, dir.path()).await;
    let hung_up = |n: usize| {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"status\":499"))
            .count()
            >= n
    };
    for (round, path) in ["/orders/h", "/h2/orders/h"].into_iter().enumerate() {
        let old_token = 1 + round as u64;
        let (old_id, new_id) = (format!("old-{round}"), format!("new-{round}"));
        let old = slow_write(proxy.addr, path, old_token, &old_id).await;
        wait_until(
            "the old request read whole at the upstream",
            Duration::from_secs(5),
            || up.rec.received(&old_id) == 10,
        )
        .await;
        drop(old);
        // The proxy saw the hang-up (its 499 is logged then) before the new owner comes.
        wait_until("the hang-up logged", Duration::from_secs(5), || {
            hung_up(round + 1)
        })
        .await;
        let (new_answer, _) =
            post_now(proxy.addr, path, old_token + 1, &new_id, b"0123456789").await;
        assert_eq!(new_answer.map(|r| r.0), Ok(200), "{path}");
        applied_first(&up, &old_id, &new_id, path);
    }
    let m = drain_metrics(&proxy, "orders").await;
    assert_eq!((m.timeouts, m.aborted), (0.0, 0.0));
    assert_eq!(m.count, 2.0);
}

/// A body the server's stop cuts off (its grace runs out while the client is still sending)
/// never ends cleanly at the upstream: HTTP/1.1 and h2c upstreams, chunked and Content-Length
/// bodies. hyper's server drops a connection's request body without an error when the
/// connection is dropped, which reads as the body's end: the upstream must not see one.
async fn a_body_cut_by_the_servers_stop_never_ends_cleanly_upstream() {
    for (path, len) in [
        ("/h2/orders/s", None),
        ("/h2/orders/s", Some(10)),
        ("/orders/s", None),
        ("/orders/s", Some(10)),
    ] {
        let (up, proxy, _dir) = setup(3000, Some(1)).await;
        let id = format!("cut-{path}-{len:?}");
        let mut c = Raw::open(proxy.addr, path, 1, &id, len).await;
        c.send(b"01234").await.unwrap();
        wait_until(
            "the first bytes at the upstream",
            Duration::from_secs(5),
            || up.rec.received(&id) == 5,
        )
        .await;
        // The grace is 1 s: the connection is dropped with its body half sent.
        proxy.shutdown().await;
        wait_until(
            "the request to end at the upstream",
            Duration::from_secs(5),
            || up.rec.find(&id, Kind::Gone).is_some() || up.rec.find(&id, Kind::Complete).is_some(),
        )
        .await;
        assert!(
            up.rec.find(&id, Kind::Complete).is_none(),
            "{path} {len:?}: the upstream took a body cut by the server's stop for a whole one"
        );
    }
}

// The HTTP/1.1 drain tests run on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_advance_waits_for_the_old_owners_slow_body,
    an_old_owner_slower_than_the_drain_time_is_aborted_http1_upstream,
    a_request_delivered_whole_is_waited_for_when_the_drain_runs_out,
    a_delivered_request_whose_client_hung_up_is_still_waited_for,
    a_body_cut_by_the_servers_stop_never_ends_cleanly_upstream,
);
