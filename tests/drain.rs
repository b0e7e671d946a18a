//! Drains, end to end over loopback sockets: an advance waits for (or
//! aborts) the requests older owners still have in flight before the new owner's first request
//! is forwarded, so an upstream never completes a lower token's request after a higher token's
//! request reached it.
//!
//! The upstream here records, in one global sequence, when each request's head arrived (its
//! body starts) and when its whole body had been read (the write is "applied"), or that the
//! request went away before its end.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use support::grpc::{EchoClient, Msg};
use support::metric;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

// ------------------------------------------------------------------------------------------
// The recording upstream.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The request's head reached the upstream: its body starts.
    Start,
    /// The whole body was read.
    Complete,
    /// The request failed or was dropped before its body's end.
    Gone,
}

#[derive(Debug, Clone)]
struct Ev {
    seq: u64,
    kind: Kind,
    id: String,
    token: u64,
    bytes: u64,
    at: Instant,
}

#[derive(Default)]
struct RecState {
    seq: u64,
    events: Vec<Ev>,
    received: HashMap<String, u64>,
}

#[derive(Clone, Default)]
struct Rec(Arc<Mutex<RecState>>);

impl Rec {
    fn push(&self, kind: Kind, id: &str, token: u64, bytes: u64) {
        let mut s = self.0.lock().unwrap();
        s.seq += 1;
        let seq = s.seq;
        s.events.push(Ev {
            seq,
            kind,
            id: id.to_owned(),
            token,
            bytes,
            at: Instant::now(),
        });
    }
    fn progress(&self, id: &str, n: u64) {
        self.0.lock().unwrap().received.insert(id.to_owned(), n);
    }
    fn events(&self) -> Vec<Ev> {
        self.0.lock().unwrap().events.clone()
    }
    fn find(&self, id: &str, kind: Kind) -> Option<Ev> {
        let s = self.0.lock().unwrap();
        s.events
            .iter()
            .find(|e| e.id == id && e.kind == kind)
            .cloned()
    }
    fn received(&self, id: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .received
            .get(id)
            .copied()
            .unwrap_or(0)
    }
}

/// Logs `Gone` for a request whose handler ends (or is dropped) before the body's end.
struct GoneGuard {
    rec: Rec,
    id: String,
    token: u64,
    bytes: u64,
    done: bool,
}

impl Drop for GoneGuard {
    fn drop(&mut self) {
        if !self.done {
            self.rec.push(Kind::Gone, &self.id, self.token, self.bytes);
        }
    }
}

struct Recorder {
    addr: SocketAddr,
    rec: Rec,
    _stop: oneshot::Sender<()>,
}

/// An HTTP/1.1 + h2c upstream that reads every request body whole, then answers 200.
async fn recorder() -> Recorder {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rec = Rec::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let r = rec.clone();
    tokio::spawn(palisade::server::serve(
        listener,
        move |req, _peer| record(req, r.clone()),
        async move {
            let _ = stopped.await;
        },
        Duration::from_secs(1),
    ));
    Recorder {
        addr,
        rec,
        _stop: stop,
    }
}

async fn record(req: Request<Incoming>, rec: Rec) -> Response<Full<Bytes>> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let id = header("x-id").unwrap_or_default();
    let apply_after: Option<u64> = header("x-apply-after-ms").and_then(|v| v.parse().ok());
    let token: u64 = header("x-fencing-token")
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    rec.push(Kind::Start, &id, token, 0);
    let mut guard = GoneGuard {
        rec: rec.clone(),
        id: id.clone(),
        token,
        bytes: 0,
        done: false,
    };
    let mut body = req.into_body();
    loop {
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    guard.bytes += d.len() as u64;
                    rec.progress(&id, guard.bytes);
                }
            }
            Some(Err(_)) => {
                let mut r = Response::new(Full::new(Bytes::from_static(b"broken body")));
                *r.status_mut() = http::StatusCode::BAD_REQUEST;
                return r; // the guard logs Gone
            }
            None => break,
        }
    }
    guard.done = true;
    // An upstream that works a while on a request it read whole before its write is applied,
    // and does not stop when the client's connection goes away (a task of its own).
    if let Some(ms) = apply_after {
        let (rec, bytes) = (rec.clone(), guard.bytes);
        let applied = id.clone();
        let _ = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            rec.push(Kind::Complete, &applied, token, bytes);
        })
        .await;
        return Response::new(Full::new(Bytes::from(format!("applied {id} {bytes}"))));
    }
    rec.push(Kind::Complete, &id, token, guard.bytes);
    Response::new(Full::new(Bytes::from(format!(
        "applied {id} {}",
        guard.bytes
    ))))
}

// ------------------------------------------------------------------------------------------
// The proxy.

const CONFIG: &str = r#"
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
fn write_mark(path: &Path, resource: &str, mark: u64) {
    std::fs::write(
        path,
        format!(r#"{{"format":"palisade-marks/1","marks":{{"{resource}":{mark}}}}}"#),
    )
    .unwrap();
}

async fn setup(drain_ms: u64, mark: Option<u64>) -> (Recorder, support::Proxy, tempfile::TempDir) {
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

struct DrainMetrics {
    count: f64,
    sum: f64,
    timeouts: f64,
    aborted: f64,
}

async fn drain_metrics(proxy: &support::Proxy, resource: &str) -> DrainMetrics {
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
struct Raw {
    s: TcpStream,
    chunked: bool,
}

impl Raw {
    /// Sends the head; `len: None` is a chunked body.
    async fn open(addr: SocketAddr, path: &str, token: u64, id: &str, len: Option<usize>) -> Raw {
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

    async fn send(&mut self, data: &[u8]) -> std::io::Result<()> {
        if self.chunked {
            let mut frame = format!("{:x}\r\n", data.len()).into_bytes();
            frame.extend_from_slice(data);
            frame.extend_from_slice(b"\r\n");
            self.s.write_all(&frame).await
        } else {
            self.s.write_all(data).await
        }
    }

    async fn end(&mut self) -> std::io::Result<()> {
        if self.chunked {
            self.s.write_all(b"0\r\n\r\n").await
        } else {
            Ok(())
        }
    }

    /// The response's status and body, or why there is none (reset, EOF, timeout).
    async fn response(&mut self, limit: Duration) -> Result<(u16, String), String> {
        match tokio::time::timeout(limit, read_response(&mut self.s)).await {
            Ok(r) => r,
            Err(_) => Err("timeout".to_owned()),
        }
    }
}

async fn read_response(s: &mut TcpStream) -> Result<(u16, String), String> {
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

fn parse_head(head: &[u8]) -> Result<(u16, usize), String> {
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
async fn post_now(
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
async fn every_request_ended_in_token_order(up: &Recorder, seed: u64) -> Vec<Ev> {
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
async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ------------------------------------------------------------------------------------------
// The new owner's request waits for the old owner's body, or aborts it.

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

// ------------------------------------------------------------------------------------------
// A zombie frozen mid-body, in a real client process, is drained or aborted.

const CHILD_H1: &str = "PALISADE_DRAIN_ZOMBIE_H1";
const CHILD_GRPC: &str = "PALISADE_DRAIN_ZOMBIE_GRPC";
const HALF_SENT: &str = "ZOMBIE-HALF-SENT";
const RESULT: &str = "ZOMBIE-RESULT";

/// This test binary, re-run as a client process executing one child test.
struct Zombie {
    child: std::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
}

impl Zombie {
    fn spawn(test: &str, env: &str, proxy: SocketAddr) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env, proxy.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first line (from now on) containing `marker`.
    async fn line(&mut self, marker: &str, limit: Duration) -> String {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(l)) => {
                    self.seen.push(l.clone());
                    if l.contains(marker) {
                        return l;
                    }
                }
                Ok(None) => panic!("the client exited before {marker:?}: {:#?}", self.seen),
                Err(_) => panic!("no {marker:?} from the client: {:#?}", self.seen),
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    /// The process state letter from /proc (T: stopped).
    fn state(&self) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 1..];
        after.trim_start().chars().next().unwrap()
    }

    /// Freezes the client and waits until the kernel reports it stopped.
    async fn freeze(&self) {
        self.signal("STOP");
        wait_until("the client to be stopped", Duration::from_secs(5), || {
            self.state() == 'T'
        })
        .await;
    }

    /// Resumes the client and tells it to go on with the rest of its body.
    fn resume(&mut self) {
        self.signal("CONT");
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    async fn exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the client did not exit");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Zombie {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for_go() {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
}

/// The HTTP/1.1 zombie (runs only as the child process of `zombie_frozen_mid_body_http1`):
/// half of a 200-byte Content-Length body under token 34, then it waits (and is frozen);
/// once resumed it sends the rest and reports the response.
#[test]
fn zombie_child_h1() {
    let Ok(addr) = std::env::var(CHILD_H1) else {
        return;
    };
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_nodelay(true).unwrap();
    let head = format!(
        "POST /orders/zombie HTTP/1.1\r\nhost: {addr}\r\nx-fencing-token: 34\r\nx-id: Z\r\n\
         content-length: 200\r\n\r\n"
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&[b'z'; 100]).unwrap();
    println!("{HALF_SENT}");
    std::io::stdout().flush().unwrap();
    wait_for_go();
    let rest = s.write_all(&[b'z'; 100]);
    println!("ZOMBIE-REST-SENT {rest:?}");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let outcome = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break match parse_head(&buf[..i + 4]) {
                Ok((status, _)) => format!("status {status}"),
                Err(e) => format!("error {e}"),
            };
        }
        match s.read(&mut chunk) {
            Ok(0) => break format!("error eof after {} bytes", buf.len()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => break format!("error {e}"),
        }
    };
    println!("{RESULT} {outcome}");
    std::io::stdout().flush().unwrap();
}

/// A client process sends half of a body under token 34 and is SIGSTOPped; B writes with 51
/// (admitted after the 300 ms drain time); the client is resumed and sends the rest. The
/// upstream never completes (applies) the zombie's write, and does apply B's.
async fn zombie_frozen_mid_body_http1() {
    let (up, proxy, _dir) = setup(300, Some(34)).await;
    let mut z = Zombie::spawn("zombie_child_h1", CHILD_H1, proxy.addr);
    z.line(HALF_SENT, Duration::from_secs(20)).await;
    wait_until(
        "the zombie's first half at the upstream",
        Duration::from_secs(5),
        || up.rec.received("Z") >= 100,
    )
    .await;
    z.freeze().await;

    let (b, b_latency) = post_now(proxy.addr, "/orders/b", 51, "B", b"new owner").await;
    assert_eq!(b.as_ref().map(|r| r.0), Ok(200), "B: {b:?}");
    assert!(
        b_latency >= Duration::from_millis(300),
        "B after {b_latency:?}"
    );
    assert!(up.rec.find("B", Kind::Complete).is_some(), "B was applied");
    assert_eq!(z.state(), 'T', "the zombie stayed frozen while B wrote");

    z.resume();
    let result = z.line(RESULT, Duration::from_secs(10)).await;
    let status = z.exit(Duration::from_secs(10)).await;
    assert!(status.success(), "client: {status:?} {:#?}", z.seen);
    // The zombie was answered 409 (no response had started), or its connection was reset.
    assert!(
        result.contains("status 409") || result.contains("error"),
        "zombie got {result:?}"
    );
    wait_until(
        "the upstream to see the zombie's request end",
        Duration::from_secs(5),
        || up.rec.find("Z", Kind::Gone).is_some(),
    )
    .await;
    assert!(
        up.rec.find("Z", Kind::Complete).is_none(),
        "the upstream applied the zombie's write: {:#?}",
        up.rec.events()
    );
    assert_eq!(up.rec.received("Z"), 100);
    let m = drain_metrics(&proxy, "orders").await;
    assert_eq!((m.timeouts, m.aborted), (1.0, 1.0));
    println!(
        "http1 zombie: B latency {b_latency:?}, zombie: {:?}",
        z.seen
            .iter()
            .filter(|l| l.contains("ZOMBIE"))
            .collect::<Vec<_>>()
    );
}

/// The gRPC zombie (runs only as the child process of `zombie_frozen_mid_body_grpc`): a
/// client-streaming `Sum` under token 34, three messages, then it waits (and is frozen); once
/// resumed it sends three more, ends the stream and reports the call's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_child_grpc() {
    let Ok(addr) = std::env::var(CHILD_GRPC) else {
        return;
    };
    let mut c = EchoClient::connect(addr.parse().unwrap()).await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let call = tokio::spawn(async move {
        c.sum(tokio_stream::wrappers::ReceiverStream::new(rx), Some("34"))
            .await
    });
    for n in 1..=3 {
        tx.send(Msg {
            text: "zombie".to_owned(),
            n,
        })
        .await
        .unwrap();
    }
    println!("{HALF_SENT}");
    std::io::stdout().flush().unwrap();
    tokio::task::spawn_blocking(wait_for_go).await.unwrap();
    let mut sent = 0;
    for n in 4..=6 {
        if tx
            .send(Msg {
                text: "zombie".to_owned(),
                n,
            })
            .await
            .is_ok()
        {
            sent += 1;
        }
    }
    drop(tx);
    println!("ZOMBIE-REST-SENT {sent} more messages handed to the call");
    let outcome = match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(Ok(Ok(r))) => format!("ok n={}", r.get_ref().n),
        Ok(Ok(Err(status))) => format!("code {:?} {}", status.code(), status.message()),
        Ok(Err(e)) => format!("panic {e}"),
        Err(_) => "timeout".to_owned(),
    };
    println!("{RESULT} {outcome}");
    std::io::stdout().flush().unwrap();
}

const GRPC_CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "file"
path = "{marks}"
[[upstream]]
name = "echo"
url = "http://{upstream}"
protocol = "h2c"
[[route]]
name = "echo"
upstream = "echo"
path_prefix = "/test.Echo/"
resource = "echo"
drain_timeout_ms = 300
"#;

/// The same zombie over gRPC client streaming: the upstream's `Sum` never sees the end of the
/// zombie's stream (END_STREAM), and B's call with 51 completes after the drain time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_frozen_mid_body_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    write_mark(&marks, "echo", 34);
    let up = support::grpc::sum_upstream().await;
    let proxy = support::proxy(&support::render(GRPC_CONFIG, up.addr, &marks), dir.path()).await;

    let mut z = Zombie::spawn("zombie_child_grpc", CHILD_GRPC, proxy.addr);
    z.line(HALF_SENT, Duration::from_secs(20)).await;
    let zombie = |up: &support::grpc::SumUpstream| {
        up.sums
            .calls()
            .into_iter()
            .find(|c| c.label.as_deref() == Some("zombie"))
    };
    wait_until(
        "the zombie's 3 messages at the upstream",
        Duration::from_secs(5),
        || zombie(&up).is_some_and(|c| c.received >= 3),
    )
    .await;
    z.freeze().await;

    let mut b = EchoClient::connect(proxy.addr).await;
    let started = Instant::now();
    let msgs = (1..=3).map(|n| Msg {
        text: "owner-b".to_owned(),
        n,
    });
    let r = b
        .sum(tokio_stream::iter(msgs.collect::<Vec<_>>()), Some("51"))
        .await;
    let b_latency = started.elapsed();
    assert_eq!(r.as_ref().map(|r| r.get_ref().n).ok(), Some(6), "B: {r:?}");
    assert!(
        b_latency >= Duration::from_millis(300),
        "B after {b_latency:?}"
    );
    assert_eq!(z.state(), 'T', "the zombie stayed frozen while B wrote");

    z.resume();
    let result = z.line(RESULT, Duration::from_secs(10)).await;
    let status = z.exit(Duration::from_secs(10)).await;
    assert!(status.success(), "client: {status:?} {:#?}", z.seen);
    assert!(result.contains("code Aborted"), "zombie got {result:?}");
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if zombie(&up).is_some_and(|c| c.error.is_some() || c.ended) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the zombie's call never ended at the upstream: {:#?}, child {:#?}",
        up.sums.calls(),
        z.seen
    );
    let calls = up.sums.calls();
    let zc = zombie(&up).unwrap();
    assert!(
        !zc.ended,
        "the upstream saw the end of the zombie's stream: {calls:#?}"
    );
    assert_eq!(zc.received, 3, "{calls:#?}");
    assert_eq!(zc.token.as_deref(), Some("34"));
    let bc = calls
        .iter()
        .find(|c| c.label.as_deref() == Some("owner-b"))
        .unwrap();
    assert!(bc.ended && bc.received == 3 && bc.token.as_deref() == Some("51"));
    let m = drain_metrics(&proxy, "echo").await;
    assert_eq!((m.timeouts, m.aborted), (1.0, 1.0));
    println!(
        "grpc zombie: B latency {b_latency:?}, zombie's call at the upstream: {zc:?}, zombie: \
         {:?}",
        z.seen
            .iter()
            .filter(|l| l.contains("ZOMBIE"))
            .collect::<Vec<_>>()
    );
}

// ------------------------------------------------------------------------------------------
// Many owners at random body speeds: no lower token completes after a higher one arrived.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug)]
struct Sent {
    id: String,
    token: u64,
    outcome: Result<u16, String>,
}

/// Eight clients for 5 s: tokens from a shared counter (a fifth of the requests take a new,
/// higher token; most reuse the newest; some use an older one), bodies instant or slow
/// (Content-Length or chunked, 2-5 pieces 10-120 ms apart), HTTP/1.1 or h2c to the upstream,
/// a 150 ms drain time. At the upstream, no request completes after a request with a higher
/// token started.
async fn stress_no_lower_token_completes_after_a_higher_one_started() {
    let (up, proxy, _dir) = setup(150, None).await;
    let seed = std::env::var("DRAIN_STRESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("stress seed {seed} (DRAIN_STRESS_SEED)");
    let newest = Arc::new(AtomicU64::new(1));
    let deadline = Instant::now() + Duration::from_secs(5);
    let addr = proxy.addr;
    let mut tasks = Vec::new();
    for task in 0..8u64 {
        let newest = newest.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(task * 2 + 1).wrapping_add(task) | 1);
            let mut sent = Vec::new();
            let mut i = 0;
            while Instant::now() < deadline {
                i += 1;
                let id = format!("{task}-{i}");
                let token = match rng.below(100) {
                    0..=19 => newest.fetch_add(1, SeqCst) + 1,
                    20..=84 => newest.load(SeqCst),
                    _ => newest.load(SeqCst).saturating_sub(1 + rng.below(3)).max(1),
                };
                let path = if rng.below(2) == 0 {
                    "/orders/w"
                } else {
                    "/h2/orders/w"
                };
                let speed = rng.below(10);
                let pieces = 2 + rng.below(4) as usize;
                let len = pieces * 50;
                let mut c = Raw::open(
                    addr,
                    path,
                    token,
                    &id,
                    if speed < 8 { Some(len) } else { None },
                )
                .await;
                let mut write_failed = false;
                if speed < 4 {
                    write_failed = c.send(&vec![b'x'; len]).await.is_err();
                } else {
                    for p in 0..pieces {
                        if c.send(&[b'x'; 50]).await.is_err() {
                            write_failed = true;
                            break;
                        }
                        if p + 1 < pieces {
                            // The slowness under test.
                            let pause = 10 + rng.below(111);
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                        }
                    }
                }
                if !write_failed {
                    let _ = c.end().await;
                }
                let outcome = c
                    .response(Duration::from_secs(10))
                    .await
                    .map(|(status, _)| status);
                sent.push(Sent { id, token, outcome });
            }
            sent
        }));
    }
    let mut sent = Vec::new();
    for t in tasks {
        sent.extend(t.await.unwrap());
    }
    let events = every_request_ended_in_token_order(&up, seed).await;

    let by_id: HashMap<&str, Vec<Kind>> = events.iter().fold(HashMap::new(), |mut m, e| {
        m.entry(e.id.as_str()).or_default().push(e.kind);
        m
    });
    let (mut ok, mut stale, mut aborted, mut other) = (0, 0, 0, Vec::new());
    for s in &sent {
        let at_upstream = by_id.get(s.id.as_str());
        let completed = at_upstream.is_some_and(|k| k.contains(&Kind::Complete));
        match (&s.outcome, at_upstream) {
            (Ok(200), _) => {
                assert!(
                    completed,
                    "{} answered 200 but never completed upstream",
                    s.id
                );
                ok += 1;
            }
            (Ok(409), None) => stale += 1,
            (_, Some(_)) if !completed => aborted += 1,
            _ => other.push((s, at_upstream.cloned().unwrap_or_default())),
        }
    }
    let m = drain_metrics(&proxy, "orders").await;
    let top = sent.iter().map(|s| s.token).max().unwrap_or(0);
    println!(
        "stress: {} requests, tokens up to {top} ({} handed out), {ok} admitted and applied, {stale} refused \
         stale, {aborted} aborted mid-body, {} other {:?}; {} upstream events; drains {} \
         (timed out {}, aborted requests {}, total drain time {:.2}s)",
        sent.len(),
        newest.load(SeqCst),
        other.len(),
        other.iter().take(5).collect::<Vec<_>>(),
        events.len(),
        m.count,
        m.timeouts,
        m.aborted,
        m.sum
    );
    assert!(ok > 20, "{ok} admitted");
    assert!(stale > 5, "{stale} stale");
    assert!(aborted > 2, "{aborted} aborted");
    assert!(m.timeouts >= 1.0 && m.aborted >= aborted as f64);
    // Every aborted request counted in the metric came from a request the upstream saw
    // without its end, or from one aborted before its head left the proxy.
    assert!(
        other.len() * 20 <= sent.len(),
        "too many unexplained outcomes: {other:?}"
    );
}

const GRPC_RACE_CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "echo"
url = "http://{upstream}"
protocol = "h2c"
[[route]]
name = "echo"
upstream = "echo"
path_prefix = "/test.Echo/"
resource = "echo"
drain_timeout_ms = 20
"#;

/// A tonic `Sum` upstream behind a proxy with a 20 ms drain.
async fn sum_proxy() -> (
    support::grpc::SumUpstream,
    support::Proxy,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let up = support::grpc::sum_upstream().await;
    let text = support::render(GRPC_RACE_CONFIG, up.addr, dir.path());
    let proxy = support::proxy(&text, dir.path()).await;
    (up, proxy, dir)
}

/// What the upstream saw of the `Sum` call whose first message is `label`.
fn call_of(up: &support::grpc::SumUpstream, label: &str) -> Option<support::grpc::SumCall> {
    up.sums
        .calls()
        .into_iter()
        .find(|c| c.label.as_deref() == Some(label))
}

/// A client-streaming `Sum` call on `c` with `token`, one message (`label`) sent and the
/// stream left open; returns once the upstream has the message.
async fn one_message_open(
    up: &support::grpc::SumUpstream,
    mut c: EchoClient,
    token: &str,
    label: &str,
) -> (
    tokio::sync::mpsc::Sender<Msg>,
    tokio::task::JoinHandle<Result<tonic::Response<Msg>, tonic::Status>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let token = token.to_owned();
    let call = tokio::spawn(async move {
        c.sum(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            Some(&token),
        )
        .await
    });
    tx.send(Msg {
        text: label.to_owned(),
        n: 1,
    })
    .await
    .unwrap();
    wait_until(
        "the message at the upstream",
        Duration::from_secs(5),
        || {
            up.sums
                .calls()
                .iter()
                .any(|c| c.label.as_deref() == Some(label) && c.received == 1)
        },
    )
    .await;
    (tx, call)
}

/// The abort must reset the upstream stream with an error, never with CANCEL: a tonic server
/// reads RST_STREAM(CANCEL) on a client stream as its clean end (`Streaming` yields `None`),
/// so a `Sum` would apply the aborted caller's partial stream. Forty rounds of: an old owner's
/// client stream with one message, open; a new owner's call (20 ms drain); at the upstream,
/// the old stream must fail, not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_grpc_streams_never_end_cleanly_at_a_tonic_upstream() {
    let (up, proxy, _dir) = sum_proxy().await;
    let call_of = |label: &str| call_of(&up, label);
    let rounds = 40u32;
    for i in 0..rounds {
        let (old, new) = ((2 * i + 1).to_string(), (2 * i + 2).to_string());
        let mut warm = EchoClient::connect(proxy.addr).await;
        let one = |text: &str| {
            tokio_stream::iter(vec![Msg {
                text: text.to_owned(),
                n: 1,
            }])
        };
        warm.sum(one("warm"), Some(&old)).await.unwrap();

        let label = format!("old-{i}");
        let c = EchoClient::connect(proxy.addr).await;
        let (tx, call) = one_message_open(&up, c, &old, &label).await;
        let mut b = EchoClient::connect(proxy.addr).await;
        b.sum(one("new"), Some(&new)).await.unwrap();
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
        wait_until(
            "the old owner's call to end at the upstream",
            Duration::from_secs(5),
            || call_of(&label).is_some_and(|c| c.ended || c.error.is_some()),
        )
        .await;
        let c = call_of(&label).unwrap();
        assert!(
            !c.ended,
            "round {i}: the upstream saw the clean end of an aborted stream: {c:?}"
        );
        drop(tx);
    }
}

/// A caller that goes away in the middle of a client stream (its connection dies, or it
/// cancels the call) must not end that stream cleanly at a tonic upstream either, which would
/// apply its partial stream. Twenty rounds of each: a client stream with one message, open;
/// then the caller's connection is dropped (even rounds) or its call cancelled (odd rounds);
/// at the upstream, the stream must fail, not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_caller_gone_mid_stream_never_ends_it_cleanly_at_a_tonic_upstream() {
    let (up, proxy, _dir) = sum_proxy().await;
    let call_of = |label: &str| call_of(&up, label);
    for i in 0..40u32 {
        let label = format!("gone-{i}");
        let c = EchoClient::connect(proxy.addr).await;
        let keep = (i % 2 == 1).then(|| c.clone());
        let (tx, call) = one_message_open(&up, c, "7", &label).await;
        // Dropping the only client (even rounds) closes its connection; with a clone kept
        // (odd rounds) only the call is cancelled, the connection stays.
        call.abort();
        let _ = call.await;
        wait_until(
            "the call to end at the upstream",
            Duration::from_secs(5),
            || call_of(&label).is_some_and(|c| c.ended || c.error.is_some()),
        )
        .await;
        drop(keep);
        let c = call_of(&label).unwrap();
        assert!(
            !c.ended,
            "round {i}: the upstream saw the clean end of a stream whose caller went away: {c:?}"
        );
        drop(tx);
    }
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

// The HTTP/1.1 drain tests run on hyper's data path and on the HTTP/1.1 fast path.
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

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_advance_waits_for_the_old_owners_slow_body,
    an_abort_reaches_a_later_request_of_a_kept_connection,
    an_old_owner_slower_than_the_drain_time_is_aborted_http1_upstream,
    zombie_frozen_mid_body_http1,
    stress_no_lower_token_completes_after_a_higher_one_started,
    a_request_delivered_whole_is_waited_for_when_the_drain_runs_out,
    a_delivered_request_whose_client_hung_up_is_still_waited_for,
    a_body_cut_by_the_servers_stop_never_ends_cleanly_upstream,
);

// ------------------------------------------------------------------------------------------
// drain::AbortWatch (the fast path's standing registration for a mark's abort): the abort
// must reach requests of kept-alive connections whatever that connection did before under
// this or other marks.

/// A kept-alive client connection and its requests, one at a time.
struct KeptConn {
    s: TcpStream,
}

impl KeptConn {
    async fn open(addr: SocketAddr) -> KeptConn {
        let s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        KeptConn { s }
    }

    /// Sends the head of a `len`-byte POST to `path` and the first `now` body bytes.
    async fn start(&mut self, path: &str, token: u64, id: &str, len: usize, now: usize) {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nx-fencing-token: {token}\r\nx-id: {id}\r\n\
             content-length: {len}\r\n\r\n"
        );
        let mut bytes = head.into_bytes();
        bytes.extend(std::iter::repeat_n(b'x', now));
        self.s.write_all(&bytes).await.unwrap();
    }

    /// One whole request, answered 200.
    async fn whole(&mut self, path: &str, token: u64, id: &str) {
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
    async fn aborted_by_advance(
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

    async fn aborted(&mut self, id: &str) {
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
async fn assert_gone(up: &Recorder, id: &str, got: u64) {
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

/// A connection serves a request of resource `orders` (registered for its mark), one of
/// resource `stock` (registered for that one instead), then an `orders` request that stalls
/// mid-body: `orders`' next drain must abort it. Then a new connection: an `orders`
/// request, then a `stock` one that stalls: `stock`'s drain must abort it.
async fn an_abort_reaches_a_kept_connection_that_served_another_resource_in_between() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let up = recorder().await;
    let text = support::render(CONFIG, up.addr, &marks).replace("{drain}", "100")
        + r#"
[[route]]
name = "stock"
upstream = "rec"
path_prefix = "/stock"
resource = "stock"
drain_timeout_ms = 100
"#;
    let proxy = support::proxy(&text, dir.path()).await;
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

/// Eight kept-alive clients for 4 s, each sending request after request on one connection
/// (a new one only when the proxy closed it): tokens from a shared counter (a fifth advance),
/// bodies in 2-4 pieces 5-40 ms apart (a few with a 1.3 s pause), a 30 ms drain time. At the upstream, no request
/// completes after a request with a higher token started; every request is answered.
async fn stress_kept_connections_no_lower_token_completes_after_a_higher_one_started() {
    let (up, proxy, _dir) = setup(30, None).await;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("kept stress seed {seed}");
    let newest = Arc::new(AtomicU64::new(1));
    let deadline = Instant::now() + Duration::from_secs(4);
    let addr = proxy.addr;
    let mut tasks = Vec::new();
    for task in 0..8u64 {
        let newest = newest.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(task * 2 + 1).wrapping_add(task) | 1);
            let (mut n, mut answered, mut reconnects) = (0u64, 0u64, 0u64);
            let mut c = KeptConn::open(addr).await;
            while Instant::now() < deadline {
                n += 1;
                let id = format!("{task}-{n}");
                let token = match rng.below(100) {
                    0..=19 => newest.fetch_add(1, SeqCst) + 1,
                    _ => newest.load(SeqCst),
                };
                let pieces = 2 + rng.below(3) as usize;
                // A few zombies: a pause longer than the drain time and the abort grace
                // together, so that an abort that does not reach them lets them complete
                // after a newer owner's request started.
                let zombie = rng.below(100) < 8;
                c.start("/orders/s", token, &id, pieces * 20, 0).await;
                let mut failed = false;
                for p in 0..pieces {
                    if c.s.write_all(&[b'x'; 20]).await.is_err() {
                        failed = true;
                        break;
                    }
                    if p + 1 < pieces {
                        let pause = if zombie && p == 0 {
                            1300
                        } else {
                            5 + rng.below(36)
                        };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                }
                let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut c.s)).await;
                let r = r.unwrap_or_else(|_| {
                    panic!("{id} (token {token}) got no answer in 5 s (write failed: {failed})")
                });
                answered += 1;
                if r.map(|r| r.0) != Ok(200) {
                    c = KeptConn::open(addr).await;
                    reconnects += 1;
                }
            }
            (answered, reconnects)
        }));
    }
    let (mut answered, mut reconnects) = (0, 0);
    for t in tasks {
        let (a, r) = t.await.unwrap();
        answered += a;
        reconnects += r;
    }
    every_request_ended_in_token_order(&up, seed).await;
    let m = drain_metrics(&proxy, "orders").await;
    println!(
        "kept stress: {answered} answered, {reconnects} reconnects, drains {} (timed out {}, \
         aborted {})",
        m.count, m.timeouts, m.aborted
    );
    assert!(
        m.aborted >= 1.0,
        "nothing was aborted: the stress did not stress"
    );
    // An abort that reached every aborted request ends its drain at once: none waits out the
    // abort grace (1 s) for a request that did not notice it.
    let text = proxy.metrics().await;
    let within_1s = text
        .lines()
        .find(|l| {
            l.starts_with("palisade_drain_duration_seconds_bucket{")
                && l.contains("resource=\"orders\"")
                && l.contains("le=\"1\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .expect("the drain duration histogram");
    assert_eq!(
        within_1s,
        m.count,
        "{} of {} drains waited out the abort grace: an abort did not reach its request",
        m.count - within_1s,
        m.count
    );
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_abort_reaches_a_kept_connection_that_moved_to_a_newer_mark,
    an_abort_reaches_every_kept_connection_after_others_came_and_went,
    an_abort_reaches_a_kept_connection_that_served_another_resource_in_between,
    after_a_delivered_request_outlived_an_abort_the_next_abort_reaches_the_connection,
    stress_kept_connections_no_lower_token_completes_after_a_higher_one_started,
);

/// What the early-answering upstream saw of one request: body bytes read, and whether the
/// connection it came on was closed by the proxy.
#[derive(Clone, Default)]
struct EarlyLog(Arc<Mutex<HashMap<String, (u64, bool)>>>);

impl EarlyLog {
    fn get(&self, id: &str) -> (u64, bool) {
        self.0.lock().unwrap().get(id).copied().unwrap_or_default()
    }
}

/// A raw HTTP/1.1 upstream: a request whose `x-id` starts with `early` is answered as soon as
/// a first body byte came (a 1000-byte response of which only 10 bytes are sent, then
/// nothing), and its connection is then only read until the proxy closes it; any other
/// request is read whole and answered `ok`.
async fn early_upstream() -> (SocketAddr, EarlyLog) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = EarlyLog::default();
    let l = log.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let log = l.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                    let field = |name: &str| {
                        head.lines().find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            (k.trim() == name).then(|| v.trim().to_owned())
                        })
                    };
                    let len: u64 = field("content-length")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    let id = field("x-id").unwrap_or_default();
                    buf.drain(..end);
                    if id.starts_with("early") {
                        while buf.is_empty() {
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        let mut got = buf.len() as u64;
                        log.0.lock().unwrap().insert(id.clone(), (got, false));
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789")
                            .await;
                        loop {
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    got += n as u64;
                                    log.0.lock().unwrap().insert(id.clone(), (got, false));
                                }
                            }
                        }
                        log.0.lock().unwrap().insert(id, (got, true));
                        return;
                    }
                    while (buf.len() as u64) < len {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..len as usize);
                    log.0.lock().unwrap().insert(id, (len, false));
                    if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, log)
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
    let (up, log) = early_upstream().await;
    let text = support::render(CONFIG, up, &marks).replace("{drain}", "100");
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
        || log.get("early-2").1,
    )
    .await;
    assert_eq!(
        log.get("early-2").0,
        5,
        "the upstream got more than half the body"
    );
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    an_abort_cuts_the_relay_of_an_early_answer_on_a_kept_connection,
);
