//! The abort reaches requests of kept-alive connections, whatever the connection did before
//! under this or other marks (the fast path registers a connection for a mark's abort once, at
//! its first request under that mark: `drain::AbortWatch`), and cuts the relay of an answer
//! the upstream sent before the body was whole.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::harness::{
    assert_gone, drain_metrics, post_now, read_response, setup, wait_until, write_mark, KeptConn,
    CONFIG,
};
use super::recorder::{recorder, Kind, Recorder};

/// The abort reaches a request that is not its connection's first under the mark: the fast
/// path registers a connection for a mark's abort once, at its first request, and keeps that
/// registration for the next ones. Request 2 of a kept-alive connection stalls mid-body; a
/// newer owner's drain runs out and aborts it: its body never completes at the upstream, its
/// client gets no 200, and the newer owner's request goes through.
async fn an_abort_reaches_a_later_request_of_a_kept_connection() {
    let (up, proxy, _dir) = setup(100, Some(1)).await;
    let mut kept = TcpStream::connect(proxy.addr).await.unwrap();
    kept.set_nodelay(true).unwrap();
    let head = |id: &str| {
        format!(
            "POST /orders/k HTTP/1.1\r\nhost: x\r\nx-fencing-token: 2\r\nx-id: {id}\r\n\
             content-length: 10\r\n\r\n"
        )
    };
    kept.write_all(format!("{}0123456789", head("first")).as_bytes())
        .await
        .unwrap();
    assert_eq!(read_response(&mut kept).await.map(|r| r.0), Ok(200));
    kept.write_all(format!("{}01234", head("second")).as_bytes())
        .await
        .unwrap();
    wait_until(
        "the second request at the upstream",
        Duration::from_secs(5),
        || up.rec.received("second") == 5,
    )
    .await;
    let (newer, _) = post_now(proxy.addr, "/orders/k", 3, "newer", b"0123456789").await;
    assert_eq!(newer.map(|r| r.0), Ok(200));
    wait_until(
        "the aborted body to end at the upstream",
        Duration::from_secs(5),
        || up.rec.find("second", Kind::Gone).is_some(),
    )
    .await;
    assert!(up.rec.find("second", Kind::Complete).is_none());
    let answer = tokio::time::timeout(Duration::from_secs(5), read_response(&mut kept))
        .await
        .expect("the aborted request's client is answered or cut at once");
    assert_ne!(answer.map(|r| r.0), Ok(200));
    assert_eq!(drain_metrics(&proxy, "orders").await.aborted, 1.0);
}

/// A connection registered for mark 2 (its first request) serves a request under mark 3, which
/// stalls mid-body; mark 4's drain runs out: the abort must reach it.
async fn an_abort_reaches_a_kept_connection_that_moved_to_a_newer_mark() {
    let (up, proxy, _dir) = setup(100, Some(1)).await;
    let mut kept = KeptConn::open(proxy.addr).await;
    kept.whole("/orders/k", 2, "k-2").await;
    // Mark 3, nothing in flight: no abort (mark 2's generation is only superseded).
    let (adv, _) = post_now(proxy.addr, "/orders/k", 3, "adv-3", b"0123456789").await;
    assert_eq!(adv.map(|r| r.0), Ok(200));
    kept.start("/orders/k", 3, "k-3", 10, 5).await;
    kept.aborted_by_advance(&up, proxy.addr, "/orders/k", 4, "k-3")
        .await;
    assert_eq!(drain_metrics(&proxy, "orders").await.aborted, 1.0);
}

/// Short connections under mark 2, `n` at once: their registrations are taken and given back
/// in an interleaved order (slab keys freed and reused around the kept ones').
async fn burst(addr: SocketAddr, n: usize, prefix: &str) {
    let all: Vec<_> = (0..n)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            tokio::spawn(async move { post_now(addr, "/orders/m", 2, &id, b"0123456789").await.0 })
        })
        .collect();
    for r in all {
        assert_eq!(r.await.unwrap().map(|r| r.0), Ok(200));
    }
}

/// Connections registered for mark 2 by a first request while short connections come and go
/// under the same mark in bursts (their registrations taken and given back: slab keys freed
/// and reused around the kept ones), a third of the kept ones close, more kept ones come; then
/// every remaining kept connection stalls a second request mid-body and mark 3's drain must
/// abort them all.
async fn an_abort_reaches_every_kept_connection_after_others_came_and_went() {
    let (up, proxy, _dir) = setup(150, Some(1)).await;
    let mut kept = Vec::new();
    for i in 0..12 {
        let mut c = KeptConn::open(proxy.addr).await;
        c.whole("/orders/m", 2, &format!("first-{i}")).await;
        kept.push(c);
        burst(proxy.addr, 1 + i % 4, &format!("short-{i}")).await;
    }
    // Close every third kept connection (their registrations go), then more short ones and
    // more kept ones.
    let mut kept: Vec<KeptConn> = kept
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| (i % 3 != 0).then_some(c))
        .collect();
    for i in 0..6 {
        burst(proxy.addr, 5, &format!("later-{i}")).await;
        let mut c = KeptConn::open(proxy.addr).await;
        c.whole("/orders/m", 2, &format!("late-first-{i}")).await;
        kept.push(c);
    }
    burst(proxy.addr, 8, "last").await;
    for (i, c) in kept.iter_mut().enumerate() {
        c.start("/orders/m", 2, &format!("second-{i}"), 10, 5).await;
    }
    for i in 0..kept.len() {
        let id = format!("second-{i}");
        wait_until(&id, Duration::from_secs(5), || up.rec.received(&id) == 5).await;
    }
    let (adv, _) = post_now(proxy.addr, "/orders/m", 3, "adv-3", b"0123456789").await;
    assert_eq!(adv.map(|r| r.0), Ok(200));
    for (i, c) in kept.iter_mut().enumerate() {
        c.aborted(&format!("second-{i}")).await;
        let _ = c.s.write_all(b"yyyyy").await;
    }
    for i in 0..kept.len() {
        assert_gone(&up, &format!("second-{i}"), 5).await;
    }
    assert_eq!(
        drain_metrics(&proxy, "orders").await.aborted,
        kept.len() as f64
    );
}

/// A proxy on [`CONFIG`] (drains of 100 ms) with `route` (TOML, its own drain 100 ms too)
/// added, in front of a recorder.
async fn with_route(route: &str) -> (Recorder, support::Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let up = recorder().await;
    let text = support::render(CONFIG, up.addr, &marks).replace("{drain}", "100") + route;
    let proxy = support::proxy(&text, dir.path()).await;
    (up, proxy, dir)
}

/// A connection serves a request of resource `orders` (registered for its mark), one of
/// resource `stock` (registered for that one instead), then an `orders` request that stalls
/// mid-body: `orders`' next drain must abort it. Then a new connection: an `orders`
/// request, then a `stock` one that stalls: `stock`'s drain must abort it.
async fn an_abort_reaches_a_kept_connection_that_served_another_resource_in_between() {
    let (up, proxy, _dir) = with_route(
        r#"
[[route]]
name = "stock"
upstream = "rec"
path_prefix = "/stock"
resource = "stock"
drain_timeout_ms = 100
"#,
    )
    .await;
    let mut kept = KeptConn::open(proxy.addr).await;
    kept.whole("/orders/x", 2, "o-1").await;
    kept.whole("/stock/x", 7, "s-1").await;
    kept.start("/orders/x", 2, "o-2", 10, 5).await;
    kept.aborted_by_advance(&up, proxy.addr, "/orders/x", 3, "o-2")
        .await;

    let mut kept = KeptConn::open(proxy.addr).await;
    kept.whole("/orders/x", 3, "o-3").await;
    kept.start("/stock/x", 7, "s-3", 10, 5).await;
    kept.aborted_by_advance(&up, proxy.addr, "/stock/x", 8, "s-3")
        .await;
    assert_eq!(drain_metrics(&proxy, "orders").await.aborted, 1.0);
    assert_eq!(drain_metrics(&proxy, "stock").await.aborted, 1.0);
}

/// A kept connection's second request goes out whole and is applied 400 ms later; the drain
/// (100 ms) runs out meanwhile: the answer is relayed whole (200), and the connection, kept,
/// serves a request under the new mark that stalls mid-body; the next drain must abort that
/// one (the connection's registration was for the aborted mark).
async fn after_a_delivered_request_outlived_an_abort_the_next_abort_reaches_the_connection() {
    let (up, proxy, _dir) = setup(100, Some(1)).await;
    let mut kept = KeptConn::open(proxy.addr).await;
    kept.whole("/orders/d", 2, "d-1").await;
    kept.s
        .write_all(
            b"POST /orders/d HTTP/1.1\r\nhost: x\r\nx-fencing-token: 2\r\nx-id: d-2\r\n\
              x-apply-after-ms: 400\r\ncontent-length: 10\r\n\r\n0123456789",
        )
        .await
        .unwrap();
    wait_until("d-2 read whole", Duration::from_secs(5), || {
        up.rec.received("d-2") == 10
    })
    .await;
    let (adv, _) = post_now(proxy.addr, "/orders/d", 3, "adv-3", b"0123456789").await;
    assert_eq!(adv.map(|r| r.0), Ok(200));
    let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut kept.s))
        .await
        .unwrap();
    assert_eq!(
        r.map(|r| r.0),
        Ok(200),
        "a delivered request is relayed whole"
    );
    kept.start("/orders/d", 3, "d-3", 10, 5).await;
    kept.aborted_by_advance(&up, proxy.addr, "/orders/d", 4, "d-3")
        .await;
}

/// A raw HTTP/1.1 upstream: a request whose `x-id` starts with `early` is answered as soon as
/// a first body byte came (a 1000-byte response of which only 10 bytes are sent, then
/// nothing), before the rest of its body is read; any other request is read whole and
/// answered `ok`.
async fn early_upstream() -> support::Upstream {
    use support::upstream::Reply;
    support::upstream::builder()
        .raw()
        .reply(|s| {
            if s.header("x-id").is_some_and(|id| id.starts_with("early")) {
                Reply::bytes(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789").early()
            } else {
                Reply::text("ok")
            }
        })
        .start()
        .await
}

/// What the early-answering upstream saw of request `id`: body bytes read, and whether the
/// connection it came on was closed by the proxy.
fn early_seen(up: &support::Upstream, id: &str) -> (u64, bool) {
    up.log
        .find(|s| s.header("x-id") == Some(id))
        .map_or((0, false), |s| (s.body_len, s.closed))
}

/// The upstream answers a kept connection's second request before its body is whole (an early
/// answer: the request was not delivered) and then stalls mid-response; a newer owner's drain
/// runs out: the abort must cut the relay (the client sees its connection end before the
/// response's end), close the upstream connection with half the body, and let the newer
/// owner through.
async fn an_abort_cuts_the_relay_of_an_early_answer_on_a_kept_connection() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    write_mark(&marks, "orders", 1);
    let early = early_upstream().await;
    let text = support::render(CONFIG, early.addr, &marks).replace("{drain}", "100");
    let proxy = support::proxy(&text, dir.path()).await;
    let mut kept = KeptConn::open(proxy.addr).await;
    kept.whole("/orders/e", 2, "first").await;
    kept.start("/orders/e", 2, "early-2", 10, 5).await;
    // The response head and its first 10 bytes reach the client.
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout(Duration::from_secs(5), kept.s.read(&mut chunk))
            .await
            .expect("the early answer's head")
            .unwrap();
        assert!(n > 0, "closed before the early answer's head");
        got.extend_from_slice(&chunk[..n]);
    };
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    while got.len() < head_end + 10 {
        let n = kept.s.read(&mut chunk).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&chunk[..n]);
    }
    let (adv, _) = post_now(proxy.addr, "/orders/e", 3, "adv-3", b"0123456789").await;
    assert_eq!(adv.map(|r| r.0), Ok(200));
    // The cut: the connection ends (EOF or reset) well before 1000 body bytes.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match kept.s.read(&mut chunk).await {
                Ok(0) | Err(_) => return got.len() - head_end,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .expect("the aborted relay was not cut");
    assert!(end < 1000, "{end} body bytes relayed");
    let _ = kept.s.write_all(b"yyyyy").await;
    wait_until(
        "the upstream connection closed",
        Duration::from_secs(5),
        || early_seen(&early, "early-2").1,
    )
    .await;
    assert_eq!(
        early_seen(&early, "early-2").0,
        5,
        "the upstream got more than half the body"
    );
}

/// The entities of a template share one abort board (`drain::AbortBoard`): a connection
/// that served entities w/1 and w/2 is registered once, on the board, and its w/1 request
/// that stalls mid-body is aborted by w/1's next drain. Another connection's stalled w/2
/// request is woken by that abort too, finds its own entity not aborted and goes on: the
/// rest of its body completes it (200), and only w/2's own advance aborts its next one.
async fn an_abort_reaches_kept_connections_of_many_entities_and_only_that_entitys_requests() {
    let (up, proxy, _dir) = with_route(
        r#"
[[route]]
name = "w"
upstream = "rec"
path_pattern = "/w/{id}"
resource = "w/{id}"
drain_timeout_ms = 100
"#,
    )
    .await;
    let mut a = KeptConn::open(proxy.addr).await;
    a.whole("/w/1", 2, "a-1").await;
    a.whole("/w/2", 2, "a-2").await;
    let mut b = KeptConn::open(proxy.addr).await;
    b.whole("/w/2", 2, "b-1").await;
    b.start("/w/2", 2, "b-2", 10, 5).await;
    wait_until("b-2 at the upstream", Duration::from_secs(5), || {
        up.rec.received("b-2") == 5
    })
    .await;
    a.start("/w/1", 2, "a-3", 10, 5).await;
    a.aborted_by_advance(&up, proxy.addr, "/w/1", 3, "a-3")
        .await;
    b.s.write_all(b"yyyyy").await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut b.s))
        .await
        .unwrap_or_else(|_| Err("timeout".to_owned()));
    assert_eq!(r.as_ref().map(|r| r.0), Ok(200), "b-2: {r:?}");
    assert!(
        up.rec.find("b-2", Kind::Complete).is_some(),
        "{:#?}",
        up.rec.events()
    );
    b.start("/w/2", 2, "b-3", 10, 5).await;
    b.aborted_by_advance(&up, proxy.addr, "/w/2", 3, "b-3")
        .await;
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_abort_reaches_a_later_request_of_a_kept_connection,
    an_abort_reaches_a_kept_connection_that_moved_to_a_newer_mark,
    an_abort_reaches_every_kept_connection_after_others_came_and_went,
    an_abort_reaches_a_kept_connection_that_served_another_resource_in_between,
    after_a_delivered_request_outlived_an_abort_the_next_abort_reaches_the_connection,
    an_abort_cuts_the_relay_of_an_early_answer_on_a_kept_connection,
    an_abort_reaches_kept_connections_of_many_entities_and_only_that_entitys_requests,
);
