//! WebSocket through palisade: guarded once at the upgrade request, then bytes both ways; a
//! tunnel opened under an older mark is closed when a newer owner advances it.

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

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
name = "live"
upstream = "legacy"
path_prefix = "/ws"
methods = ["GET"]
resource = "orders"
websocket = true
drain_timeout_ms = 200
[[route]]
name = "plain"
upstream = "legacy"
path_prefix = "/no-ws"
methods = ["GET"]
resource = "orders"
[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"
drain_timeout_ms = 200
"#;

/// A WebSocket echo server on raw TCP (tungstenite's handshake), counting connections; plain
/// HTTP requests (the POSTs) get `200 ok`.
async fn echo_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let upgrades = Arc::new(AtomicUsize::new(0));
    let u = Arc::clone(&upgrades);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let u = Arc::clone(&u);
            tokio::spawn(async move {
                let mut peek = [0u8; 4];
                if sock.peek(&mut peek).await.is_ok() && &peek == b"POST" {
                    plain_ok(sock).await;
                    return;
                }
                let Ok(mut ws) = tokio_tungstenite::accept_async(sock).await else {
                    return;
                };
                u.fetch_add(1, Ordering::SeqCst);
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_text() || msg.is_binary() {
                        let reply = Message::text(format!("echo: {}", msg.into_text().unwrap()));
                        if ws.send(reply).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, upgrades)
}

async fn plain_ok(mut sock: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let _ = sock
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        .await;
}

async fn setup() -> (support::Proxy, Arc<AtomicUsize>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (up, upgrades) = echo_upstream().await;
    let text = support::render(CONFIG, up, &dir.path().join("marks.json"));
    let p = support::proxy(&text, dir.path()).await;
    (p, upgrades, dir)
}

async fn connect(
    p: &support::Proxy,
    path: &str,
    token: &str,
) -> Result<tokio_tungstenite::WebSocketStream<TcpStream>, WsError> {
    let mut req = format!("ws://{}{path}", p.addr)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("x-fencing-token", token.parse().unwrap());
    let sock = TcpStream::connect(p.addr).await.unwrap();
    tokio_tungstenite::client_async(req, sock)
        .await
        .map(|(ws, _)| ws)
}

#[tokio::test]
async fn a_fresh_token_opens_a_websocket_that_echoes_both_ways() {
    let (p, upgrades, _dir) = setup().await;
    let mut ws = connect(&p, "/ws/feed", "5").await.unwrap();
    for i in 0..3 {
        ws.send(Message::text(format!("hello {i}"))).await.unwrap();
        let got = ws.next().await.unwrap().unwrap();
        assert_eq!(
            got.into_text().unwrap().as_str(),
            format!("echo: hello {i}")
        );
    }
    ws.close(None).await.unwrap();
    assert_eq!(upgrades.load(Ordering::SeqCst), 1);
    assert_eq!(p.marks().await["orders"], 5);
}

#[tokio::test]
async fn a_stale_upgrade_gets_409_and_never_reaches_the_upstream() {
    let (p, upgrades, _dir) = setup().await;
    let ws = connect(&p, "/ws/feed", "7").await.unwrap();
    drop(ws);
    match connect(&p, "/ws/feed", "6").await {
        Err(WsError::Http(resp)) => {
            assert_eq!(resp.status(), 409);
            assert_eq!(resp.headers()["x-fencing-mark"], "7");
        }
        other => panic!("expected 409, got {:?}", other.map(|_| "an open websocket")),
    }
    match connect(&p, "/ws/feed", "x7").await {
        Err(WsError::Http(resp)) => assert_eq!(resp.status(), 400),
        other => panic!("expected 400, got {:?}", other.map(|_| "an open websocket")),
    }
    assert_eq!(
        upgrades.load(Ordering::SeqCst),
        1,
        "only the fresh upgrade reached the upstream"
    );
}

#[tokio::test]
async fn a_route_without_websocket_does_not_forward_the_upgrade() {
    let (p, upgrades, _dir) = setup().await;
    let r = connect(&p, "/no-ws/feed", "5").await;
    assert!(r.is_err(), "the upgrade must not succeed");
    assert_eq!(upgrades.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_websocket_of_an_older_owner_is_closed_when_a_newer_owner_advances() {
    let (p, _upgrades, _dir) = setup().await;
    let mut ws = connect(&p, "/ws/feed", "5").await.unwrap();
    ws.send(Message::text("before")).await.unwrap();
    assert!(ws.next().await.unwrap().is_ok());
    // The newer owner writes: its request waits for the older tunnel (drain_timeout_ms =
    // 200), which is then closed, and goes through.
    let r = support::post(&p.url("/orders/1"), Some("6")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The old tunnel is gone: reading ends (closed or reset) instead of echoing.
    let _ = ws.send(Message::text("after")).await;
    let next = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("the old websocket must be closed, not left open");
    assert!(
        !matches!(next, Some(Ok(Message::Text(_)))),
        "the zombie's message was echoed: {next:?}"
    );
}

/// Waits until the proxy's gauge of open client connections reads `n`.
async fn wait_open(p: &support::Proxy, n: f64) {
    for _ in 0..500 {
        let m = p.metrics().await;
        if support::metric(&m, "palisade_connections_open{listener=\"proxy\"}") == Some(n) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("open client connections never reached {n}");
}

/// Whether a new client connection is served (any response) or refused (closed unanswered).
async fn served(p: &support::Proxy) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = TcpStream::connect(p.addr).await.unwrap();
    let _ = sock
        .write_all(b"GET /no-ws/x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = sock.read_to_end(&mut buf).await;
    buf.starts_with(b"HTTP/1.1 ")
}

#[tokio::test]
async fn open_websockets_count_toward_max_connections_until_they_close() {
    // An upgraded connection leaves hyper but keeps its socket: it must keep its place in
    // `max_connections`, or WebSockets could exhaust the process's descriptors.
    let dir = tempfile::tempdir().unwrap();
    let (up, _) = echo_upstream().await;
    let config = CONFIG.replace(
        "listen = \"127.0.0.1:0\"",
        "listen = \"127.0.0.1:0\"\nmax_connections = 2",
    );
    let text = support::render(&config, up, &dir.path().join("marks.json"));
    let p = support::proxy(&text, dir.path()).await;
    let mut a = connect(&p, "/ws/a", "5").await.unwrap();
    let mut b = connect(&p, "/ws/b", "5").await.unwrap();
    for ws in [&mut a, &mut b] {
        ws.send(Message::text("hi")).await.unwrap();
        assert!(ws.next().await.unwrap().is_ok());
    }
    wait_open(&p, 2.0).await;
    assert!(
        !served(&p).await,
        "a third connection was served beside two open WebSockets"
    );
    a.close(None).await.unwrap();
    drop(a);
    wait_open(&p, 1.0).await;
    assert!(
        served(&p).await,
        "a WebSocket that closed still holds its place"
    );
    b.close(None).await.unwrap();
}

/// A tunnel is two independent directions: after the upstream ends its side, what the client
/// sends still reaches the upstream (the proxy's end of the client connection is shut down for
/// writing, never drained as a closing connection's is).
#[tokio::test]
async fn after_the_upstream_ends_its_side_the_client_still_reaches_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let (got_tx, got_rx) = tokio::sync::oneshot::channel::<Vec<u8>>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut b).await.unwrap();
            assert!(n > 0);
            head.extend_from_slice(&b[..n]);
        }
        s.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\
              sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
        )
        .await
        .unwrap();
        s.shutdown().await.unwrap(); // the upstream's side ends here
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
        let _ = got_tx.send(rest);
    });
    let dir = tempfile::tempdir().unwrap();
    let text = support::render(CONFIG, up, &dir.path().join("marks.json"));
    let p = support::proxy(&text, dir.path()).await;
    let mut c = TcpStream::connect(p.addr).await.unwrap();
    c.write_all(
        b"GET /ws HTTP/1.1\r\nhost: a\r\nx-fencing-token: 7\r\nupgrade: websocket\r\n\
          connection: upgrade\r\nsec-websocket-version: 13\r\n\
          sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await
    .unwrap();
    // The 101, then the end of the upstream's side.
    let mut from_up = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut from_up))
        .await
        .expect("the upstream's end reaches the client")
        .unwrap();
    assert!(
        from_up.starts_with(b"HTTP/1.1 101 "),
        "{}",
        String::from_utf8_lossy(&from_up)
    );
    // Enough that the tunnel's writes to the upstream wait at times.
    let sent: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
    c.write_all(&sent).await.unwrap();
    c.shutdown().await.unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(10), got_rx)
        .await
        .expect("the client's side ends at the upstream")
        .unwrap();
    assert!(
        rest == sent,
        "{} of {} bytes arrived",
        rest.len(),
        sent.len()
    );
}

/// An upstream that answers an upgrade with 101 and then keeps reading HTTP requests on the
/// same connection (as a framework that hands the socket back to its HTTP parser would),
/// recording each request line with its token and answering 200.
async fn parse_after_101_upstream() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < end + 4 + length {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let token = head
                        .lines()
                        .find_map(|l| l.strip_prefix("x-fencing-token:"))
                        .map(|t| t.trim().to_owned());
                    let line = head.lines().next().unwrap_or_default().to_owned();
                    log.lock().unwrap().push(format!("{line} token={token:?}"));
                    buf.drain(..end + 4 + length);
                    let answer: &[u8] = if head.contains("upgrade: websocket") {
                        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    };
                    if sock.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// A guarded write route and a catch-all with WebSocket upgrades, on one upstream.
const TUNNEL: &str = r#"
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
methods = ["POST"]
resource = "orders"
[[route]]
name = "everything-else"
upstream = "legacy"
path_prefix = "/"
websocket = true
guard = false
"#;

/// Opens an upgrade through the proxy (with `token`, if any), then sends a raw stale
/// `POST /orders` through whatever the connection has become; returns what came back.
async fn write_through_a_tunnel(proxy: SocketAddr, token: Option<&str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = TcpStream::connect(proxy).await.unwrap();
    let token = token.map_or_else(String::new, |t| format!("x-fencing-token: {t}\r\n"));
    let upgrade = format!(
        "GET /chat HTTP/1.1\r\nhost: app\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
         sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n{token}\r\n"
    );
    c.write_all(upgrade.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut got))
        .await
        .unwrap()
        .unwrap_or(0);
    let mut answer = String::from_utf8_lossy(&got[..n]).into_owned();
    if answer.starts_with("HTTP/1.1 101") {
        c.write_all(b"POST /orders HTTP/1.1\r\nhost: app\r\nx-fencing-token: 1\r\ncontent-length: 5\r\n\r\nstale")
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut got))
            .await
            .unwrap()
            .unwrap_or(0);
        answer.push_str(&String::from_utf8_lossy(&got[..n]));
    }
    answer
}

async fn an_unguarded_websocket_route_beside_guarded_ones_is_refused_unless_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (up, seen) = parse_after_101_upstream().await;
    let text = support::render(TUNNEL, up, &dir.path().join("marks.json"));
    // Refused: the config names the route and why.
    let err = palisade::Config::parse(&text, &dir.path().join("palisade.toml")).unwrap_err();
    let why = err.to_string();
    assert!(
        why.contains("route[1].websocket")
            && why.contains("raw tunnel")
            && why.contains("\"orders\""),
        "{why}"
    );
    // The risk is real: accepted on purpose, a stale write goes through the tunnel.
    let accepted = text.replace(
        "guard = false",
        "guard = false\nallow_unguarded_tunnel = true",
    );
    let config = palisade::Config::parse(&accepted, &dir.path().join("palisade.toml")).unwrap();
    assert!(
        config
            .warnings
            .iter()
            .any(|w| w.message.contains("raw tunnel")),
        "{:?}",
        config.warnings
    );
    let p = support::proxy(&accepted, dir.path()).await;
    assert_eq!(
        support::post(&p.url("/orders/1"), Some("7")).await.status,
        http::StatusCode::OK
    );
    let answer = write_through_a_tunnel(p.addr, None).await;
    assert!(answer.contains("200 OK"), "{answer}");
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with("post /orders") && l.contains("\"1\"")),
        "{:?}",
        seen.lock().unwrap()
    );
    p.shutdown().await;

    // Guarded, the upgrade itself needs a current token: the zombie gets no tunnel.
    seen.lock().unwrap().clear();
    let guarded = text.replace("guard = false", "resource = \"orders\"");
    let p = support::proxy(&guarded, dir.path()).await;
    let answer = write_through_a_tunnel(p.addr, Some("1")).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );
    p.shutdown().await;
}

support::on_both_paths!(
    an_unguarded_websocket_route_beside_guarded_ones_is_refused_unless_accepted
);
