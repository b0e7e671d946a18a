//! The drain tests' harness: the proxy in front of the recording upstream (`recorder.rs`),
//! its drain metrics, clients that pace their bodies, and the check of the drain's guarantee
//! at the upstream.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::metric;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::recorder::{recorder, Ev, Kind, Recorder};

// ------------------------------------------------------------------------------------------
// The proxy.

pub(super) const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
shutdown_grace_ms = 1000

[admin]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "rec"
url = "http://{upstream}"
protocol = "http1"

[[upstream]]
name = "rec-h2"
url = "http://{upstream}"
protocol = "h2c"

[[route]]
name = "orders"
upstream = "rec"
path_prefix = "/orders"
resource = "orders"
drain_timeout_ms = {drain}

[[route]]
name = "orders-h2"
upstream = "rec-h2"
path_prefix = "/h2/orders"
resource = "orders"
drain_timeout_ms = {drain}
"#;

/// Writes the mark of `resource` to the marks file, as a previous run would have.
pub(super) fn write_mark(path: &Path, resource: &str, mark: u64) {
    std::fs::write(
        path,
        format!(r#"{{"format":"palisade-marks/1","marks":{{"{resource}":{mark}}}}}"#),
    )
    .unwrap();
}

pub(super) async fn setup(
    drain_ms: u64,
    mark: Option<u64>,
) -> (Recorder, support::Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    if let Some(m) = mark {
        write_mark(&marks, "orders", m);
    }
    let up = recorder().await;
    let text = support::render(CONFIG, up.addr, &marks).replace("{drain}", &drain_ms.to_string());
    let proxy = support::proxy(&text, dir.path()).await;
    (up, proxy, dir)
}

pub(super) struct DrainMetrics {
    pub(super) count: f64,
    pub(super) sum: f64,
    pub(super) timeouts: f64,
    pub(super) aborted: f64,
}

pub(super) async fn drain_metrics(proxy: &support::Proxy, resource: &str) -> DrainMetrics {
    let text = proxy.metrics().await;
    let m =
        |name: &str| metric(&text, &format!("{name}{{resource=\"{resource}\"}}")).unwrap_or(0.0);
    DrainMetrics {
        count: m("palisade_drain_duration_seconds_count"),
        sum: m("palisade_drain_duration_seconds_sum"),
        timeouts: m("palisade_drain_timeouts_total"),
        aborted: m("palisade_drain_aborted_requests_total"),
    }
}

// ------------------------------------------------------------------------------------------
// Clients.

/// A raw HTTP/1.1 POST, so that the body's pace (and framing) is the test's.
pub(super) struct Raw {
    s: TcpStream,
    chunked: bool,
}

impl Raw {
    /// Sends the head; `len: None` is a chunked body.
    pub(super) async fn open(
        addr: SocketAddr,
        path: &str,
        token: u64,
        id: &str,
        len: Option<usize>,
    ) -> Raw {
        let s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        let framing = match len {
            Some(n) => format!("content-length: {n}"),
            None => "transfer-encoding: chunked".to_owned(),
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nx-fencing-token: {token}\r\nx-id: {id}\r\n\
             connection: close\r\n{framing}\r\n\r\n"
        );
        let mut raw = Raw {
            s,
            chunked: len.is_none(),
        };
        raw.s.write_all(head.as_bytes()).await.unwrap();
        raw
    }

    pub(super) async fn send(&mut self, data: &[u8]) -> std::io::Result<()> {
        if self.chunked {
            let mut frame = format!("{:x}\r\n", data.len()).into_bytes();
            frame.extend_from_slice(data);
            frame.extend_from_slice(b"\r\n");
            self.s.write_all(&frame).await
        } else {
            self.s.write_all(data).await
        }
    }

    pub(super) async fn end(&mut self) -> std::io::Result<()> {
        if self.chunked {
            self.s.write_all(b"0\r\n\r\n").await
        } else {
            Ok(())
        }
    }

    /// The response's status and body, or why there is none (reset, EOF, timeout).
    pub(super) async fn response(&mut self, limit: Duration) -> Result<(u16, String), String> {
        match tokio::time::timeout(limit, read_response(&mut self.s)).await {
            Ok(r) => r,
            Err(_) => Err("timeout".to_owned()),
        }
    }
}

pub(super) async fn read_response(s: &mut TcpStream) -> Result<(u16, String), String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk).await {
            Ok(0) => return Err(format!("eof after {} bytes", buf.len())),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(e.to_string()),
        }
    };
    let (status, len) = parse_head(&buf[..head_end])?;
    while buf.len() < head_end + len {
        match s.read(&mut chunk).await {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    let body = String::from_utf8_lossy(&buf[head_end..]).into_owned();
    Ok((status, body))
}

pub(super) fn parse_head(head: &[u8]) -> Result<(u16, usize), String> {
    let head = String::from_utf8_lossy(head);
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line: {head:?}"))?;
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    Ok((status, len))
}

/// One whole request with an instant body; returns the response and how long it took.
pub(super) async fn post_now(
    addr: SocketAddr,
    path: &str,
    token: u64,
    id: &str,
    body: &[u8],
) -> (Result<(u16, String), String>, Duration) {
    let started = Instant::now();
    let mut c = Raw::open(addr, path, token, id, Some(body.len())).await;
    c.send(body).await.unwrap();
    let r = c.response(Duration::from_secs(10)).await;
    (r, started.elapsed())
}

/// Waits until every request that started at the upstream ended there (aborted ones
/// included), then checks the guarantee at the upstream: in sequence order, a completion's
/// token is at least the highest token whose request had started by then. Returns the events.
pub(super) async fn every_request_ended_in_token_order(up: &Recorder, seed: u64) -> Vec<Ev> {
    let started: Vec<String> = up
        .rec
        .events()
        .into_iter()
        .filter(|e| e.kind == Kind::Start)
        .map(|e| e.id)
        .collect();
    wait_until(
        "every request to end at the upstream",
        Duration::from_secs(5),
        || {
            let ev = up.rec.events();
            started.iter().all(|id| {
                ev.iter()
                    .any(|e| &e.id == id && matches!(e.kind, Kind::Complete | Kind::Gone))
            })
        },
    )
    .await;
    let events = up.rec.events();
    let mut highest: Option<&Ev> = None;
    for e in &events {
        match e.kind {
            Kind::Start => {
                if highest.is_none_or(|h| e.token > h.token) {
                    highest = Some(e);
                }
            }
            Kind::Complete => {
                if let Some(h) = highest {
                    assert!(
                        e.token >= h.token,
                        "request {} with token {} completed at seq {} after request {} with \
                         token {} started at seq {} (seed {seed})",
                        e.id,
                        e.token,
                        e.seq,
                        h.id,
                        h.token,
                        h.seq
                    );
                }
            }
            Kind::Gone => {}
        }
    }
    events
}

/// Polls `f` every 5 ms until it holds; fails the test after `limit`.
pub(super) async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ------------------------------------------------------------------------------------------
// Kept-alive client connections.

/// A kept-alive client connection and its requests, one at a time.
pub(super) struct KeptConn {
    pub(super) s: TcpStream,
}

impl KeptConn {
    pub(super) async fn open(addr: SocketAddr) -> KeptConn {
        let s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        KeptConn { s }
    }

    /// Sends the head of a `len`-byte POST to `path` and the first `now` body bytes.
    pub(super) async fn start(&mut self, path: &str, token: u64, id: &str, len: usize, now: usize) {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nx-fencing-token: {token}\r\nx-id: {id}\r\n\
             content-length: {len}\r\n\r\n"
        );
        let mut bytes = head.into_bytes();
        bytes.extend(std::iter::repeat_n(b'x', now));
        self.s.write_all(&bytes).await.unwrap();
    }

    /// One whole request, answered 200.
    pub(super) async fn whole(&mut self, path: &str, token: u64, id: &str) {
        self.start(path, token, id, 10, 10).await;
        let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut self.s))
            .await
            .unwrap_or_else(|_| Err("timeout".to_owned()));
        assert_eq!(r.as_ref().map(|r| r.0), Ok(200), "{id}: {r:?}");
    }

    /// The answer to a request aborted mid-body: anything but a 200, and soon.
    /// `id`, stalled on this connection with 5 of its 10 body bytes at the upstream, is
    /// aborted by an advance to `token` on `path`: its client gets no 200, and the rest of its
    /// body, sent now, never reaches the upstream.
    pub(super) async fn aborted_by_advance(
        &mut self,
        up: &Recorder,
        addr: SocketAddr,
        path: &str,
        token: u64,
        id: &str,
    ) {
        wait_until(
            &format!("{id} at the upstream"),
            Duration::from_secs(5),
            || up.rec.received(id) == 5,
        )
        .await;
        let (adv, _) = post_now(addr, path, token, &format!("adv-{id}"), b"0123456789").await;
        assert_eq!(adv.map(|r| r.0), Ok(200));
        self.aborted(id).await;
        let _ = self.s.write_all(b"yyyyy").await;
        assert_gone(up, id, 5).await;
    }

    pub(super) async fn aborted(&mut self, id: &str) {
        let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut self.s))
            .await
            .unwrap_or_else(|_| {
                panic!("{id}: the aborted request's client was neither answered nor cut")
            });
        assert_ne!(r.as_ref().map(|r| r.0), Ok(200), "{id}: {r:?}");
    }
}

/// Asserts that `id` was aborted at the upstream: its body ended early, it never completed,
/// and the upstream got no more than `got` bytes of it even after the client sent the rest.
pub(super) async fn assert_gone(up: &Recorder, id: &str, got: u64) {
    wait_until(
        &format!("{id}'s body to end early at the upstream"),
        Duration::from_secs(5),
        || up.rec.find(id, Kind::Gone).is_some(),
    )
    .await;
    assert!(
        up.rec.find(id, Kind::Complete).is_none(),
        "{id} completed at the upstream: {:#?}",
        up.rec.events()
    );
    assert_eq!(up.rec.received(id), got, "{id}: bytes at the upstream");
}
