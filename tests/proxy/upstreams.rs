//! Upstreams with several addresses, per-route timeouts, and request size limits
//! (`urls`, `max_fails`, `connect_timeout_ms`/`response_timeout_ms` per route,
//! `max_body_bytes`, `proxy.max_header_bytes`).

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::StreamBody;
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The size of every upload to `/upload` the upstream read whole.
fn uploads(up: &support::Upstream) -> Vec<u64> {
    up.log
        .all()
        .into_iter()
        .filter(|s| s.path == "/upload" && s.complete)
        .map(|s| s.body_len)
        .collect()
}

/// An address nothing listens on (bound, then released).
async fn dead_address() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

async fn proxy(config: &str) -> (support::Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let text = config.replace(
        "{marks}",
        &dir.path().join("marks.json").display().to_string(),
    );
    let p = support::proxy(&text, dir.path()).await;
    (p, dir)
}

fn config(upstream: &str, route_extra: &str) -> String {
    format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[marks]
store = "file"
path = "{{marks}}"
[[upstream]]
name = "legacy"
{upstream}
[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/"
methods = ["POST", "PUT"]
resource = "orders"
{route_extra}
[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/"
guard = false
{route_extra}
"#
    )
}

/// GET on a new client connection each time, so that every request may need a new upstream
/// connection.
async fn get_fresh(url: &str) -> support::Got {
    support::get(url).await
}

async fn an_upstream_with_a_dead_address_answers_every_request() {
    let seen = support::upstream().await;
    let live = seen.addr;
    let dead = dead_address().await;
    let (p, _dir) = proxy(&config(
        &format!(r#"urls = ["http://{dead}", "http://{live}"]"#),
        "",
    ))
    .await;
    // Concurrent requests need several upstream connections: several dials, round robin.
    let mut tasks = Vec::new();
    for i in 0..24 {
        let url = p.url(&format!("/slow?{}", 20 + i));
        tasks.push(tokio::spawn(async move { get_fresh(&url).await }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    }
    for i in 0..10 {
        let r = get_fresh(&p.url(&format!("/items/{i}"))).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    }
    assert_eq!(seen.log.len(), 34);
}

async fn an_ejected_address_is_skipped_until_its_fail_timeout() {
    let up = support::upstream().await;
    let live = up.addr;
    let dead = dead_address().await;
    let (p, _dir) = proxy(&config(
        &format!(
            r#"urls = ["http://{dead}", "http://{live}"]
max_fails = 1
fail_timeout_ms = 60000"#
        ),
        "",
    ))
    .await;
    // The first dials find the dead address and eject it.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let url = p.url("/slow?50");
        tasks.push(tokio::spawn(async move { get_fresh(&url).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::OK);
    }
    // The dead address comes back, counting connections: while ejected, it gets none.
    let back = TcpListener::bind(dead).await.unwrap();
    let accepted = Arc::new(Mutex::new(0usize));
    let a = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((s, _)) = back.accept().await {
            *a.lock().unwrap() += 1;
            drop(s);
        }
    });
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let url = p.url("/slow?50");
        tasks.push(tokio::spawn(async move { get_fresh(&url).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(
        *accepted.lock().unwrap(),
        0,
        "an ejected address was dialed"
    );
}

async fn a_stopped_upstream_gives_502_quickly() {
    let dead = dead_address().await;
    let (p, _dir) = proxy(&config(
        &format!("url = \"http://{dead}\"\nconnect_timeout_ms = 10000"),
        "",
    ))
    .await;
    let started = Instant::now();
    let r = get_fresh(&p.url("/items/1")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(r.text().contains("connect"), "{}", r.text());
    // Refused at once: no waiting for the connect timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

async fn a_slow_upstream_gives_504_after_the_routes_timeout() {
    let up = support::upstream().await;
    let live = up.addr;
    let (p, _dir) = proxy(&config(
        &format!("url = \"http://{live}\"\nresponse_timeout_ms = 30000"),
        "response_timeout_ms = 300",
    ))
    .await;
    let started = Instant::now();
    let r = get_fresh(&p.url("/slow?5000")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.text());
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_millis(4000), "{took:?}");
    // Within the limit: answered.
    let r = get_fresh(&p.url("/slow?10")).await;
    assert_eq!(r.status, StatusCode::OK);
}

/// An upstream that reads a whole request (head and Content-Length body), counts it, and
/// closes the connection without answering.
async fn breaking_upstream() -> support::Upstream {
    support::upstream::builder().raw().close().start().await
}

async fn a_post_whose_upstream_breaks_after_the_body_gets_502_and_is_sent_once() {
    let up = breaking_upstream().await;
    let addr = up.addr;
    let (p, _dir) = proxy(&config(&format!("url = \"http://{addr}\""), "")).await;
    let mut sock = TcpStream::connect(p.addr).await.unwrap();
    sock.write_all(
        b"POST /orders/1 HTTP/1.1\r\nhost: api.test\r\nx-fencing-token: 3\r\ncontent-length: 5\r\n\r\nhello",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&out).contains("\r\n\r\n") {
        let n = sock.read(&mut chunk).await.unwrap();
        assert!(n > 0);
        out.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&out).into_owned();
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    assert_eq!(
        up.log.count(|s| s.complete),
        1,
        "the upstream saw the request once"
    );
}

async fn bodies_over_max_body_bytes_get_413_and_never_reach_the_upstream_whole() {
    let seen = support::upstream().await;
    let live = seen.addr;
    let (p, _dir) = proxy(&config(
        &format!("url = \"http://{live}\""),
        "max_body_bytes = 1000",
    ))
    .await;
    let client = support::http1_client();
    // Known length over the limit: refused before the guard; the mark does not move.
    let r = support::send(
        &client,
        http::Method::POST,
        &p.url("/upload"),
        &[("x-fencing-token", b"9")],
        &[b'x'; 1001],
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.text());
    assert_eq!(r.json()["error"], "body_too_large");
    assert!(p.marks().await.get("orders").is_none_or(|m| m != 9));
    // At the limit: forwarded.
    let r = support::send(
        &client,
        http::Method::POST,
        &p.url("/upload"),
        &[("x-fencing-token", b"4")],
        &[b'x'; 1000],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "1000");
    // Unknown length (chunked), over the limit while streaming: 413, and the upstream never
    // got a complete body.
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> = (0..8)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 400]))))
        .collect();
    let req = Request::post(p.url("/upload"))
        .header("x-fencing-token", "4")
        .body(StreamBody::new(tokio_stream::iter(chunks)))
        .unwrap();
    let resp = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http()
        .request(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        uploads(&seen),
        vec![1000],
        "only the upload within the limit completed"
    );
    let m = p.metrics().await;
    assert_eq!(
        support::metric(
            &m,
            "palisade_requests_total{outcome=\"too_large\",route=\"orders\"}"
        ),
        Some(2.0)
    );
}

async fn a_request_head_over_max_header_bytes_gets_431() {
    let seen = support::upstream().await;
    let live = seen.addr;
    let text = config(&format!("url = \"http://{live}\""), "").replace(
        "listen = \"127.0.0.1:0\"\n",
        "listen = \"127.0.0.1:0\"\nmax_header_bytes = 16384\n",
    );
    let (p, _dir) = proxy(&text).await;
    let mut sock = TcpStream::connect(p.addr).await.unwrap();
    let big = "a".repeat(20_000);
    sock.write_all(
        format!("GET /items/1 HTTP/1.1\r\nhost: api.test\r\nx-big: {big}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let _ = sock.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    assert!(seen.log.is_empty());
    // Under the limit: forwarded.
    let r = support::send(
        &support::http1_client(),
        http::Method::GET,
        &p.url("/items/1"),
        &[("x-big", "b".repeat(10_000).as_bytes())],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[test]
fn upstream_config_errors_name_their_key() {
    let cases = [
        (
            "url = \"http://127.0.0.1:1\"\nurls = [\"http://127.0.0.1:2\"]",
            "upstream[0].url",
            "either url or urls",
        ),
        ("urls = []", "upstream[0].urls", "at least one"),
        (
            "urls = [\"http://127.0.0.1:2\", \"http://127.0.0.1:2\"]",
            "upstream[0].urls[1]",
            "listed twice",
        ),
        (
            "urls = [\"ftp://127.0.0.1:2\"]",
            "upstream[0].urls[0]",
            "http:// or https://",
        ),
        (
            "urls = [\"http://127.0.0.1:2\", \"https://127.0.0.1:3\"]",
            "upstream[0].urls",
            "mixes http:// and https://",
        ),
        (
            "url = \"https://127.0.0.1:2\"\nprotocol = \"h2c\"",
            "upstream[0].url",
            "use http://",
        ),
        (
            "url = \"http://127.0.0.1:2\"\nprotocol = \"h2\"",
            "upstream[0].url",
            "use https://",
        ),
        (
            "url = \"http://127.0.0.1:2\"\nca = \"ca.pem\"",
            "upstream[0].ca",
            "only used with https://",
        ),
        (
            "url = \"https://127.0.0.1:2\"\nca = \"missing.pem\"",
            "upstream[0].ca",
            "cannot read",
        ),
        (
            "url = \"http://127.0.0.1:1\"\nmax_fails = 0",
            "upstream[0].max_fails",
            "at least 1",
        ),
        (
            "protocol = \"http1\"",
            "upstream[0].url",
            "url (one address) or urls",
        ),
    ];
    for (upstream, key, why) in cases {
        let text = config(upstream, "").replace("{marks}", "/tmp/m.json");
        let err = palisade::Config::parse(&text, std::path::Path::new("/etc/p.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{upstream}: {err}");
        assert!(err.contains(why), "{upstream}: {err}");
        assert!(err.contains("/etc/p.toml:"), "{upstream}: {err}");
    }
    let text = config("url = \"http://127.0.0.1:1\"", "connect_timeout_ms = 0")
        .replace("{marks}", "/tmp/m.json");
    let err = palisade::Config::parse(&text, std::path::Path::new("/etc/p.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("route[0].connect_timeout_ms"), "{err}");
}

/// An upstream whose `/healthz` answers `health` (shared, changeable); other requests get
/// `ok` 50 ms later. Its log tells health checks and other requests apart.
async fn checked_upstream(health: Arc<std::sync::atomic::AtomicU16>) -> support::Upstream {
    use support::upstream::Reply;
    support::upstream::builder()
        .reply(move |s| {
            if s.path == "/healthz" {
                Reply::text("ok").status(health.load(std::sync::atomic::Ordering::SeqCst))
            } else {
                Reply::text("ok").after(Duration::from_millis(50))
            }
        })
        .start()
        .await
}

/// Health checks that reached `up`.
fn checks(up: &support::Upstream) -> usize {
    up.log.count(|s| s.path == "/healthz")
}

/// Other requests that reached `up`.
fn served(up: &support::Upstream) -> usize {
    up.log.count(|s| s.path != "/healthz")
}

async fn wait_for_checks(up: &support::Upstream, more_than: usize) {
    for _ in 0..500 {
        if checks(up) > more_than {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no health check arrived");
}

async fn an_address_failing_its_health_check_gets_no_traffic_until_it_passes() {
    use std::sync::atomic::{AtomicU16, Ordering};
    let health = Arc::new(AtomicU16::new(503));
    let sick = checked_upstream(Arc::clone(&health)).await;
    let well = checked_upstream(Arc::new(AtomicU16::new(200))).await;
    let (p, _dir) = proxy(&config(
        &format!(
            r#"urls = ["http://{}", "http://{}"]
health_check_path = "/healthz"
health_check_interval_ms = 50"#,
            sick.addr, well.addr
        ),
        "",
    ))
    .await;
    // Two checks: the first one that answered 503 has been recorded.
    wait_for_checks(&sick, 1).await;
    let burst = |n: usize| {
        let urls: Vec<String> = (0..n).map(|i| p.url(&format!("/items/{i}"))).collect();
        async move {
            let tasks: Vec<_> = urls
                .into_iter()
                .map(|u| tokio::spawn(async move { get_fresh(&u).await }))
                .collect();
            for t in tasks {
                assert_eq!(t.await.unwrap().status, StatusCode::OK);
            }
        }
    };
    burst(16).await;
    assert_eq!(served(&sick), 0, "a down address got requests");
    assert_eq!(served(&well), 16);
    // It recovers: after its next passing check, new connections reach it again.
    health.store(200, Ordering::SeqCst);
    let seen = checks(&sick);
    wait_for_checks(&sick, seen + 1).await;
    burst(48).await;
    assert!(served(&sick) > 0, "a recovered address got no requests");
}

/// hyper's buffer limit caught only a connection's first head over the limit: a later one on
/// the same connection that arrived whole was served. Every request is held to the limit.
async fn a_later_head_over_max_header_bytes_on_a_kept_connection_gets_431() {
    let seen = support::upstream().await;
    let live = seen.addr;
    let text = config(&format!("url = \"http://{live}\""), "").replace(
        "listen = \"127.0.0.1:0\"\n",
        "listen = \"127.0.0.1:0\"\nmax_header_bytes = 16384\n",
    );
    let (p, _dir) = proxy(&text).await;
    let mut sock = TcpStream::connect(p.addr).await.unwrap();
    let head = |n: usize| {
        format!(
            "GET /items/1 HTTP/1.1\r\nhost: api.test\r\nx-big: {}\r\n\r\n",
            "a".repeat(n)
        )
    };
    sock.write_all(head(10).as_bytes()).await.unwrap();
    let mut buf = vec![0; 64 * 1024];
    let n = sock.read(&mut buf).await.unwrap();
    let first = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // 30 KB in one write: it arrives whole, after a first request grew the read buffer.
    sock.write_all(head(30_000).as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = sock.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    assert_eq!(seen.log.len(), 1, "only the first request was forwarded");
}

// These run on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    an_upstream_with_a_dead_address_answers_every_request,
    an_ejected_address_is_skipped_until_its_fail_timeout,
    a_stopped_upstream_gives_502_quickly,
    a_slow_upstream_gives_504_after_the_routes_timeout,
    a_post_whose_upstream_breaks_after_the_body_gets_502_and_is_sent_once,
    bodies_over_max_body_bytes_get_413_and_never_reach_the_upstream_whole,
    a_request_head_over_max_header_bytes_gets_431,
    a_later_head_over_max_header_bytes_on_a_kept_connection_gets_431,
    an_address_failing_its_health_check_gets_no_traffic_until_it_passes,
);

/// An upstream that answers every `GET /<id>` with `<id>` and then, in a write of its own, a
/// second response nobody asked for (`400 EXTRA`), as a server does that answered early and
/// then read the rest of a body it did not understand as a request. Once the extra response is
/// in the socket, the id goes to `written`.
async fn doubly_answering_upstream(written: tokio::sync::mpsc::UnboundedSender<u64>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let written = written.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    buf.drain(..end + 4);
                    let id: u64 = head
                        .split(' ')
                        .nth(1)
                        .and_then(|p| p.trim_start_matches('/').parse().ok())
                        .unwrap_or(0);
                    let body = id.to_string();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    let extra = "HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nEXTRA";
                    if s.write_all(extra.as_bytes()).await.is_err() {
                        return;
                    }
                    let _ = written.send(id);
                }
            });
        }
    });
    addr
}

/// Reads one response with a `content-length` body from `s`: its status line and body.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> (String, String) {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                let status = head.lines().next().unwrap().to_owned();
                let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).to_string();
                buf.drain(..end + 4 + len);
                return (status, body);
            }
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the proxy closed the client connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A response the upstream sent after the one asked for, unasked, must never reach a later
/// client: the proxy checks the socket itself before it reuses a connection (an extra
/// response is already there before the next request is sent: the client waits for it) and
/// closes a connection with anything pending. Several clients at once, kept-alive, so that
/// connections change hands between them.
async fn an_unasked_response_never_reaches_a_later_client() {
    let (written, mut extras) = tokio::sync::mpsc::unbounded_channel();
    let up = doubly_answering_upstream(written).await;
    let (p, _dir) = proxy(&config(&format!("url = \"http://{up}\""), "")).await;
    let done = Arc::new(Mutex::new(std::collections::HashSet::<u64>::new()));
    let wake = Arc::new(tokio::sync::Notify::new());
    let (d, w) = (Arc::clone(&done), Arc::clone(&wake));
    tokio::spawn(async move {
        while let Some(id) = extras.recv().await {
            d.lock().unwrap().insert(id);
            w.notify_waiters();
        }
    });
    let clients = (0..8u64).map(|c| {
        let (done, wake, addr) = (Arc::clone(&done), Arc::clone(&wake), p.addr);
        tokio::spawn(async move {
            let mut wrong = Vec::new();
            for i in 0..40u64 {
                // A new client connection every ten requests: the upstream connections then
                // move between client connections through the shared idle cache too.
                let mut s = TcpStream::connect(addr).await.unwrap();
                let mut buf = Vec::new();
                for j in 0..10u64 {
                    let id = 1 + c * 10_000 + i * 10 + j;
                    let req = format!("GET /{id} HTTP/1.1\r\nhost: api.test\r\n\r\n");
                    s.write_all(req.as_bytes()).await.unwrap();
                    let (status, body) = read_response(&mut s, &mut buf).await;
                    if !status.starts_with("http/1.1 200") || body != id.to_string() {
                        wrong.push(format!("request {id} got {status:?} {body:?}"));
                    }
                    // The extra response is in the upstream connection before the next request.
                    loop {
                        let notified = wake.notified();
                        if done.lock().unwrap().contains(&id) {
                            break;
                        }
                        notified.await;
                    }
                }
            }
            wrong
        })
    });
    let mut wrong = Vec::new();
    for c in clients.collect::<Vec<_>>() {
        wrong.extend(c.await.unwrap());
    }
    assert!(
        wrong.is_empty(),
        "{} of 3200 answers were another exchange's: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_unasked_response_never_reaches_a_later_client,
);

/// An h2c upstream that closes each connection gracefully (GOAWAY with NO_ERROR, then the
/// last stream id it will process) after every `every` requests, as nginx does after
/// `keepalive_requests`. Every request it processed (its `x-id`) is recorded.
async fn rotating_h2c_upstream(every: usize) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let processed = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&processed);
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(sock).await else {
                    return;
                };
                let mut served = 0;
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    let id = req
                        .headers()
                        .get("x-id")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    seen.lock().unwrap().push(id.clone());
                    let resp = http::Response::new(());
                    if let Ok(mut body) = respond.send_response(resp, false) {
                        let _ = body.send_data(Bytes::from(id), true);
                    }
                    served += 1;
                    if served == every {
                        conn.graceful_shutdown();
                    }
                }
                // Until every response went out.
                let _ = std::future::poll_fn(|cx| conn.poll_closed(cx)).await;
            });
        }
    });
    (addr, processed)
}

/// An h2c upstream that rotates its connections (GOAWAY every few requests) under concurrent
/// load: reads on streams it did not process (above the GOAWAY's last stream id, or never
/// written on a connection it had already closed) are sent again on a new connection, so not
/// one fails. A write is sent again only when the upstream refused its stream or hyper gave it
/// back unwritten: h2 gives a stream the upstream did process the same GOAWAY error when the
/// connection ends before its answer (seen here under load: a read processed twice), so a
/// write on a GOAWAY'd stream fails with 502 rather than risk being applied twice. No write is
/// ever processed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_upstream_rotating_its_connections_fails_no_read_and_applies_no_write_twice() {
    // GOAWAYs race answers here, and a busy machine tips the race: alone among the binary's
    // timing tests (`support::serial`).
    let _serial = support::serial().await;
    let (up, processed) = rotating_h2c_upstream(7).await;
    let text = config(&format!("url = \"http://{up}\"\nprotocol = \"h2c\""), "");
    let (p, _dir) = proxy(&text).await;
    let client = support::h2c_client();
    let tasks = (0..16).map(|t| {
        let (client, url) = (client.clone(), p.url("/items"));
        tokio::spawn(async move {
            let (mut failed_reads, mut failed_writes, mut answered_writes) =
                (Vec::new(), 0, Vec::new());
            for i in 0..40 {
                let id = format!("{t}-{i}");
                let write = i % 4 == 3;
                let method = if write {
                    http::Method::POST
                } else {
                    http::Method::GET
                };
                let headers: &[(&str, &[u8])] =
                    &[("x-id", id.as_bytes()), ("x-fencing-token", b"5")];
                let got = support::send(&client, method, &url, headers, b"").await;
                let ok = got.status == StatusCode::OK && got.text() == id;
                if write && !ok {
                    assert_eq!(got.status, StatusCode::BAD_GATEWAY, "{}", got.text());
                    failed_writes += 1;
                } else if write {
                    answered_writes.push(id);
                } else if !ok {
                    failed_reads.push(format!("{id}: {} {}", got.status, got.text()));
                }
            }
            (failed_reads, failed_writes, answered_writes)
        })
    });
    let (mut failed, mut failed_writes, mut answered) = (Vec::new(), 0, Vec::new());
    for t in tasks.collect::<Vec<_>>() {
        let (reads, writes, ok) = t.await.unwrap();
        failed.extend(reads);
        failed_writes += writes;
        answered.extend(ok);
    }
    assert!(
        failed.is_empty(),
        "{} of 480 reads failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let mut ids = processed.lock().unwrap().clone();
    ids.sort();
    let write = |id: &str| id.rsplit('-').next().unwrap().parse::<u32>().unwrap() % 4 == 3;
    let twice: Vec<_> = ids
        .windows(2)
        .filter(|w| w[0] == w[1] && write(&w[0]))
        .map(|w| w[0].clone())
        .collect();
    assert!(twice.is_empty(), "writes processed twice: {twice:?}");
    // Every answered write was processed. A write answered 502 may have been processed too
    // (its answer lost with the connection): at most once, not exactly once.
    assert_eq!(answered.len() + failed_writes, 160);
    let unprocessed: Vec<_> = answered
        .iter()
        .filter(|id| ids.binary_search(id).is_err())
        .collect();
    assert!(
        unprocessed.is_empty(),
        "answered writes never processed: {unprocessed:?}"
    );
    let writes = ids.iter().filter(|id| write(id)).count();
    assert!(
        writes >= answered.len() && writes <= 160,
        "{writes} writes processed, {} answered",
        answered.len()
    );
}

/// A refusal of an HTTP/2 HEAD request carries no body (python-h2 rejects a stream that
/// answers HEAD with DATA): the status and headers only, the stream ended with them.
#[tokio::test]
async fn an_http2_refusal_of_head_has_no_body() {
    let live = support::upstream().await;
    let up = live.addr;
    let (p, _dir) = proxy(&config(&format!("url = \"http://{up}\""), "")).await;
    let tcp = TcpStream::connect(p.addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    // A path not in normal form: refused with 400 before routing.
    let req = http::Request::head(format!("http://{}/a/../b", p.addr))
        .body(())
        .unwrap();
    let (response, _) = h2.send_request(req, true).unwrap();
    let resp = response.await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let mut body = resp.into_body();
    assert!(body.is_end_stream(), "the stream ended with the head");
    assert!(body.data().await.is_none());
}

/// An HTTP/2 GET whose HEADERS frame leaves the stream open and whose body is one empty DATA
/// frame (what many clients send) has no body: forwarded and answered, as nginx does, where it
/// was refused 400 by the GET-body rule. Body bytes on a GET are still refused; where a route
/// forwards GET bodies, the frames read to tell (data or trailers) reach the upstream whole.
#[tokio::test]
async fn an_http2_get_ended_by_an_empty_data_frame_has_no_body() {
    // Reads every body before it answers.
    let live = support::upstream::builder()
        .reply(|_| support::upstream::Reply::text("ok"))
        .start()
        .await;
    let up = live.addr;
    // Reads and writes alike: both routes of `config` refuse GET bodies (the default).
    let (p, _dir) = proxy(&config(&format!("url = \"http://{up}\""), "")).await;
    let send = |addr: std::net::SocketAddr, path: &'static str, frames: Vec<H2Frame>| async move {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut h2 = h2.ready().await.unwrap();
        let mut req = http::Request::get(format!("http://{addr}{path}"))
            .body(())
            .unwrap();
        for f in &frames {
            match f {
                H2Frame::Trailers(name) => {
                    req.headers_mut()
                        .insert(http::header::TRAILER, name.parse().unwrap());
                }
                H2Frame::Header(name, value) => {
                    req.headers_mut().insert(*name, value.parse().unwrap());
                }
                H2Frame::Data(_) => {}
            }
        }
        let frames: Vec<H2Frame> = frames
            .into_iter()
            .filter(|f| !matches!(f, H2Frame::Header(..)))
            .collect();
        let (response, mut stream) = h2.send_request(req, false).unwrap();
        let last = frames.len() - 1;
        for (i, f) in frames.into_iter().enumerate() {
            match f {
                H2Frame::Data(d) => stream.send_data(Bytes::from(d), i == last).unwrap(),
                H2Frame::Header(..) => unreachable!("sent in the head"),
                H2Frame::Trailers(name) => {
                    let mut t = http::HeaderMap::new();
                    t.insert(name, "1".parse().unwrap());
                    stream.send_trailers(t).unwrap();
                }
            }
        }
        response.await.unwrap().status()
    };
    use H2Frame::{Data, Header, Trailers};
    for frames in [
        vec![Data("")],
        vec![Data(""), Data(""), Data("")],
        vec![Header("content-length", "0"), Data("")],
    ] {
        assert_eq!(send(p.addr, "/items/1", frames).await, StatusCode::OK);
    }
    let seen = live.log.find(|s| s.path == "/items/1").expect("forwarded");
    assert_eq!((seen.body_len, seen.trailers.is_some()), (0, false));
    for frames in [
        vec![Data("x")],
        vec![Data(""), Data("abc")],
        vec![Trailers("x-sum")],
    ] {
        assert_eq!(
            send(p.addr, "/items/2", frames).await,
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(live.log.count(|s| s.path == "/items/2"), 0);

    let (p, _dir) = proxy(&config(
        &format!("url = \"http://{up}\""),
        "get_bodies = \"forward\"",
    ))
    .await;
    let ok = send(p.addr, "/items/3", vec![Data(""), Data("abc"), Data("de")]).await;
    assert_eq!(ok, StatusCode::OK);
    let ok = send(p.addr, "/items/4", vec![Trailers("x-sum")]).await;
    assert_eq!(ok, StatusCode::OK);
    // The same over HTTP/1.1 with a chunked body (handed to hyper's path).
    let mut tcp = TcpStream::connect(p.addr).await.unwrap();
    tcp.write_all(
        b"GET /items/5 HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for (path, sent) in [("/items/3", &b"abcde"[..]), ("/items/5", b"abc")] {
        let seen = live.log.find(|s| s.path == path).expect("forwarded");
        assert_eq!(seen.body, sent, "{seen:?}");
    }
    let trailers = live.log.find(|s| s.path == "/items/4").expect("forwarded");
    assert!(
        trailers.trailers.is_some_and(|t| t.contains_key("x-sum")),
        "the trailers read to tell arrive"
    );
}

/// On a route that forwards GET bodies, an HTTP/2 GET whose stream stays open goes upstream at
/// once, its body streamed after it: only a route that refuses GET bodies waits (up to one
/// second) for the first frame to tell an empty body from none. Before, every route waited.
#[tokio::test]
async fn an_http2_get_on_a_route_forwarding_get_bodies_is_not_held_back() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let (head_seen, seen) = tokio::sync::oneshot::channel();
    let upstream = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut read = Vec::new();
        let mut buf = [0; 1024];
        let mut head_seen = Some(head_seen);
        // The head, then the chunked body to its last chunk.
        while !read.ends_with(b"0\r\n\r\n") {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "the proxy closed before the body ended: {read:?}");
            read.extend_from_slice(&buf[..n]);
            if read.windows(4).any(|w| w == b"\r\n\r\n") {
                if let Some(tx) = head_seen.take() {
                    let _ = tx.send(());
                }
            }
        }
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            .await
            .unwrap();
        String::from_utf8(read).unwrap()
    });
    let (p, _dir) = proxy(&config(
        &format!("url = \"http://{up}\""),
        "get_bodies = \"forward\"",
    ))
    .await;
    let tcp = TcpStream::connect(p.addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let req = http::Request::get(format!("http://{}/items/6", p.addr))
        .body(())
        .unwrap();
    let sent = Instant::now();
    let (response, mut stream) = h2.send_request(req, false).unwrap();
    // No frame after HEADERS until the upstream has the request.
    seen.await.unwrap();
    let waited = sent.elapsed();
    assert!(
        waited < Duration::from_millis(500),
        "the head went upstream after {waited:?}: held back for a first frame"
    );
    stream.send_data(Bytes::from_static(b"abc"), true).unwrap();
    assert_eq!(response.await.unwrap().status(), StatusCode::OK);
    let read = upstream.await.unwrap();
    assert!(read.starts_with("GET /items/6 HTTP/1.1\r\n"), "{read}");
    assert!(
        read.ends_with("\r\n\r\n3\r\nabc\r\n0\r\n\r\n"),
        "the body, whole: {read}"
    );
}

/// A frame an HTTP/2 test client sends after HEADERS (or a field of the HEADERS themselves).
enum H2Frame {
    Data(&'static str),
    Trailers(&'static str),
    Header(&'static str, &'static str),
}

/// An h2c upstream that resets its first `refuse` streams with REFUSED_STREAM and answers the
/// rest; it records when each stream arrived.
async fn refusing_h2c_upstream(refuse: usize) -> (SocketAddr, Arc<Mutex<Vec<Instant>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&arrivals);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(sock).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    let n = {
                        let mut seen = seen.lock().unwrap();
                        seen.push(Instant::now());
                        seen.len()
                    };
                    if n <= refuse {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                    } else if let Ok(mut body) =
                        respond.send_response(http::Response::new(()), false)
                    {
                        let _ = body.send_data(Bytes::from_static(b"served"), true);
                    }
                }
            });
        }
    });
    (addr, arrivals)
}

/// A read the h2c upstream refuses (REFUSED_STREAM: never processed) is sent again at most
/// three times: the first resend at once, then after 10 and 20 ms, so that an upstream
/// refusing streams under load is not hammered. Refused twice, the third send is answered;
/// refused every time, the client gets 502 after four sends. A write is never sent again.
#[tokio::test]
async fn reads_an_h2c_upstream_refuses_are_sent_again_with_a_growing_pause() {
    for (refuse, sends, status) in [(2, 3, StatusCode::OK), (9, 4, StatusCode::BAD_GATEWAY)] {
        let (up, arrivals) = refusing_h2c_upstream(refuse).await;
        let text = config(&format!("url = \"http://{up}\"\nprotocol = \"h2c\""), "");
        let (p, _dir) = proxy(&text).await;
        let got = support::send(
            &support::h2c_client(),
            http::Method::GET,
            &p.url("/items"),
            &[],
            b"",
        )
        .await;
        assert_eq!(got.status, status, "{}", got.text());
        let at = arrivals.lock().unwrap().clone();
        assert_eq!(at.len(), sends, "sends of a refused read");
        // Pauses only ever run long: the lower bounds hold on a busy machine too.
        if sends >= 3 {
            assert!(
                at[2] - at[1] >= Duration::from_millis(10),
                "{:?}",
                at[2] - at[1]
            );
        }
        if sends >= 4 {
            assert!(
                at[3] - at[2] >= Duration::from_millis(20),
                "{:?}",
                at[3] - at[2]
            );
        }
    }
    let (up, arrivals) = refusing_h2c_upstream(9).await;
    let text = config(&format!("url = \"http://{up}\"\nprotocol = \"h2c\""), "");
    let (p, _dir) = proxy(&text).await;
    let headers: &[(&str, &[u8])] = &[("x-fencing-token", b"5")];
    let got = support::send(
        &support::h2c_client(),
        http::Method::POST,
        &p.url("/items"),
        headers,
        b"",
    )
    .await;
    assert_eq!(got.status, StatusCode::BAD_GATEWAY, "{}", got.text());
    assert_eq!(arrivals.lock().unwrap().len(), 1, "a write is sent once");
}
