//! A zombie frozen mid-body, in a real client process, is drained or aborted: over HTTP/1.1
//! and over gRPC client streaming. The client is this test binary run again on one child test
//! (its environment variable set), SIGSTOPped once half its body went out.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::grpc::{EchoClient, Msg};

use super::harness::{drain_metrics, parse_head, post_now, setup, wait_until, write_mark};
use super::recorder::Kind;

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
    /// Runs `test`, a test function of this module, with `env` naming the proxy.
    fn spawn(test: &str, env: &str, proxy: SocketAddr) -> Self {
        let test = support::test_name(module_path!(), test);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &test, "--nocapture", "--test-threads=1"])
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

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    zombie_frozen_mid_body_http1,
);
