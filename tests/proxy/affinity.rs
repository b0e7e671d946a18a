//! Connection-affine HTTP/1.1 upstreams: a client connection keeps its upstream connection,
//! idle ones are handed on to later client connections, and a connection the upstream closed
//! while idle is never used.
//!
//! The upstream here is the raw HTTP/1.1 fake (`tests/support/upstream.rs`), so that the test
//! sees exactly how many connections palisade opened and what each request head looked like.

use crate::support;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST", "PUT", "PATCH", "DELETE"]
resource = "orders"

[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

/// A raw HTTP/1.1 upstream: answers every request head with `200 ok`, counts connections and
/// keeps every request head it read. With `idle_close`, it closes a connection that stayed
/// idle that long (a keep-alive timeout, as most servers have), without telling anyone.
async fn raw_upstream(idle_close: Option<Duration>) -> support::Upstream {
    let up = support::upstream::builder().raw();
    match idle_close {
        Some(d) => up.idle_close(d),
        None => up,
    }
    .start()
    .await
}

/// Sends `GET path` on `sock` (HTTP/1.1, keep-alive) and reads the whole `200 ok` answer.
async fn get_on(sock: &mut TcpStream, path: &str) -> String {
    let req = format!("GET {path} HTTP/1.1\r\nhost: api.test\r\n\r\n");
    sock.write_all(req.as_bytes()).await.unwrap();
    read_response(sock).await
}

async fn read_response(sock: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.unwrap();
        assert!(n > 0, "palisade closed the connection; got {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return text;
            }
        }
    }
}

async fn setup(
    idle_close: Option<Duration>,
) -> (support::Upstream, support::Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let up = raw_upstream(idle_close).await;
    let text = support::render(CONFIG, up.addr, &dir.path().join("marks.json"));
    let proxy = support::proxy(&text, dir.path()).await;
    (up, proxy, dir)
}

/// Waits until the proxy has no client connection open (its tasks, and what they held, are
/// gone), from its own gauge.
async fn wait_no_client_connections(proxy: &support::Proxy) {
    for _ in 0..500 {
        let m = proxy.metrics().await;
        // The admin request itself is on the admin listener, not counted here.
        if support::metric(&m, "palisade_connections_open{listener=\"proxy\"}") == Some(0.0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("client connections stayed open");
}

async fn a_client_connections_requests_share_one_upstream_connection() {
    let (up, proxy, _dir) = setup(None).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    for i in 0..50 {
        let r = get_on(&mut sock, &format!("/items/{i}")).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    assert_eq!(up.log.len(), 50);
    assert_eq!(up.connections(), 1);
    // Requests are sent in origin-form with the client's Host.
    let first = up.log.all()[0].head.clone();
    assert!(first.starts_with("GET /items/0 HTTP/1.1\r\n"), "{first}");
    assert!(
        first
            .to_ascii_lowercase()
            .contains("\r\nhost: api.test\r\n"),
        "{first}"
    );
}

async fn short_client_connections_take_over_idle_upstream_connections() {
    let (up, proxy, _dir) = setup(None).await;
    for i in 0..10 {
        let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
        let r = get_on(&mut sock, &format!("/items/{i}")).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        drop(sock);
        wait_no_client_connections(&proxy).await;
    }
    assert_eq!(up.log.len(), 10);
    assert_eq!(
        up.connections(),
        1,
        "each new client connection should reuse the idle upstream connection"
    );
}

async fn an_upstream_connection_closed_while_idle_is_replaced_not_used() {
    // The upstream closes connections idle for 50 ms; the client waits longer between its
    // requests, so every request after the first finds its upstream connection closed.
    let (up, proxy, _dir) = setup(Some(Duration::from_millis(50))).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    for i in 0..5 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let r = get_on(&mut sock, &format!("/items/{i}")).await;
        assert!(r.starts_with("HTTP/1.1 200"), "request {i}: {r}");
    }
    let heads = up.log.all();
    assert_eq!(
        heads.len(),
        5,
        "each request reached the upstream exactly once"
    );
    assert_eq!(up.connections(), 5);
}

#[tokio::test]
async fn concurrent_http2_streams_to_an_http1_upstream_reuse_connections() {
    let (up, proxy, _dir) = setup(None).await;
    let client = support::h2c_client();
    for round in 0..3 {
        let mut tasks = Vec::new();
        for i in 0..16 {
            let (client, url) = (client.clone(), proxy.url(&format!("/items/{round}-{i}")));
            tasks.push(tokio::spawn(async move {
                let req = http::Request::get(url)
                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                    .unwrap();
                let resp = client.request(req).await.unwrap();
                support::read(resp).await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().status, 200);
        }
    }
    assert_eq!(up.log.len(), 48);
    let opened = up.connections();
    assert!(
        opened <= 16,
        "at most one upstream connection per concurrent stream, reused across rounds: {opened}"
    );
}

async fn absolute_form_requests_reach_the_upstream_in_origin_form() {
    let (up, proxy, _dir) = setup(None).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    // HTTP/1.0 without Host, naming the host in the request line.
    sock.write_all(b"GET http://api.test/items/1?x=1 HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let r = read_response(&mut sock).await;
    assert!(r.starts_with("HTTP/1.0 200"), "{r}");
    let head = up.log.all()[0].head.to_ascii_lowercase();
    assert!(head.starts_with("get /items/1?x=1 http/1.1\r\n"), "{head}");
    assert!(head.contains("\r\nhost: api.test\r\n"), "{head}");
}

async fn an_upstream_connection_idle_past_idle_timeout_ms_is_closed_not_reused() {
    // palisade's own limit (below the upstream's keep-alive timeout, as config/palisade.toml asks):
    // a connection idle longer than `idle_timeout_ms` is never used again, whether it waited
    // with its client connection or in the upstream's idle cache.
    let dir = tempfile::tempdir().unwrap();
    let up = raw_upstream(None).await;
    let config = CONFIG.replace(
        "url = \"http://{upstream}\"",
        "url = \"http://{upstream}\"\nidle_timeout_ms = 150",
    );
    let text = support::render(&config, up.addr, &dir.path().join("marks.json"));
    let proxy = support::proxy(&text, dir.path()).await;
    // With its client connection.
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    assert!(get_on(&mut sock, "/items/1")
        .await
        .starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(get_on(&mut sock, "/items/2")
        .await
        .starts_with("HTTP/1.1 200"));
    assert_eq!(up.connections(), 2);
    // In the cache: idle since its last exchange, not since its client connection closed.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(sock);
    wait_no_client_connections(&proxy).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    assert!(get_on(&mut sock, "/items/3")
        .await
        .starts_with("HTTP/1.1 200"));
    assert_eq!(up.connections(), 3);
    // A connection used within the limit is reused.
    assert!(get_on(&mut sock, "/items/4")
        .await
        .starts_with("HTTP/1.1 200"));
    assert_eq!(up.connections(), 3);
    assert_eq!(up.log.len(), 4);
}

// These run on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    an_upstream_connection_idle_past_idle_timeout_ms_is_closed_not_reused,
    a_client_connections_requests_share_one_upstream_connection,
    short_client_connections_take_over_idle_upstream_connections,
    an_upstream_connection_closed_while_idle_is_replaced_not_used,
    absolute_form_requests_reach_the_upstream_in_origin_form,
);
