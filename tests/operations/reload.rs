//! Configuration reload under load: routes change, connections stay, marks stay.
//!
//! Clients hold one connection each for the whole test (HTTP/1.1 keep-alive and one h2c
//! connection with concurrent streams): a connection palisade closed would fail their next
//! request, so "no failed request" also means "no dropped connection".

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use palisade::MarkStore;
use support::metric;
use tokio::net::TcpStream;

const COMMON: &str = r#"
[proxy]
listen = "127.0.0.1:0"
shutdown_grace_ms = 3000

[marks]
store = "file"
path = "marks.json"

[[upstream]]
name = "legacy"
url = "http://{legacy}"

[[upstream]]
name = "legacy-h2"
url = "http://{legacy}"
protocol = "h2c"

[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"

[[route]]
name = "h2-orders"
upstream = "legacy-h2"
path_prefix = "/h2/"
resource = "h2res"

[[route]]
name = "ledger"
upstream = "legacy"
path_prefix = "/ledger"
resource = "ledger"

[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/both"
guard = false
"#;

/// Config A: `/a-only` exists, the `/moved` route is named `moved-a`.
const ONLY_A: &str = r#"
[[route]]
name = "moved-a"
upstream = "legacy"
path_prefix = "/moved"
resource = "moved"

[[route]]
name = "a-only"
upstream = "legacy"
path_prefix = "/a-only"
guard = false
"#;

/// Config B: `/b-only` on an upstream of its own, `/moved` renamed (same resource), and a
/// guarded route whose resource is new to the configuration but has a stored mark.
const ONLY_B: &str = r#"
[[upstream]]
name = "spare"
url = "http://{spare}"

[[route]]
name = "moved-b"
upstream = "legacy"
path_prefix = "/moved"
resource = "moved"

[[route]]
name = "fresh"
upstream = "legacy"
path_prefix = "/fresh"
resource = "fresh"

[[route]]
name = "b-only"
upstream = "spare"
path_prefix = "/b-only"
guard = false
"#;

/// An upstream that counts the connections it accepted and answers `<name> <method> <path>`
/// (after reading the request whole).
async fn upstream(name: &'static str) -> support::Upstream {
    support::upstream::builder()
        .reply(move |s| support::upstream::Reply::text(format!("{name} {} {}", s.method, s.path)))
        .start()
        .await
}

fn config(b: bool, legacy: &support::Upstream, spare: &support::Upstream) -> String {
    let only = if b { ONLY_B } else { ONLY_A };
    format!("{COMMON}{only}")
        .replace("{legacy}", &legacy.addr.to_string())
        .replace("{spare}", &spare.addr.to_string())
}

/// Replaces the file in one step, as an editor or a deploy tool does.
fn install(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The requests the clients cycle through, each with a valid token where guarded.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Orders,
    H2Orders,
    Both,
    Moved,
    AOnly,
    BOnly,
    Fresh,
}

const KINDS: [Kind; 7] = [
    Kind::Orders,
    Kind::H2Orders,
    Kind::Both,
    Kind::Moved,
    Kind::AOnly,
    Kind::BOnly,
    Kind::Fresh,
];

impl Kind {
    fn request(self, authority: &str) -> Request<Full<Bytes>> {
        let (method, path, token) = match self {
            Kind::Orders => ("POST", "/orders/1", Some("7")),
            Kind::H2Orders => ("POST", "/h2/x", Some("9")),
            Kind::Both => ("GET", "/both/x", None),
            Kind::Moved => ("POST", "/moved/1", Some("5")),
            Kind::AOnly => ("GET", "/a-only/x", None),
            Kind::BOnly => ("GET", "/b-only/x", None),
            Kind::Fresh => ("POST", "/fresh/1", Some("100")),
        };
        let mut r = Request::builder()
            .method(method)
            .uri(format!("http://{authority}{path}"));
        if let Some(t) = token {
            r = r.header("x-fencing-token", t);
        }
        let body = if method == "POST" { "payload" } else { "" };
        r.body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    }

    /// The status and upstream answer config A (`b == false`) or B gives.
    fn expected(self, b: bool) -> (StatusCode, Option<&'static str>) {
        let ok = |line| (StatusCode::OK, Some(line));
        match (self, b) {
            (Kind::Orders, _) => ok("legacy POST /orders/1"),
            (Kind::H2Orders, _) => ok("legacy POST /h2/x"),
            (Kind::Both, _) => ok("legacy GET /both/x"),
            (Kind::Moved, _) => ok("legacy POST /moved/1"),
            (Kind::AOnly, false) => ok("legacy GET /a-only/x"),
            (Kind::BOnly, true) => ok("spare GET /b-only/x"),
            (Kind::Fresh, true) => ok("legacy POST /fresh/1"),
            (Kind::AOnly | Kind::BOnly | Kind::Fresh, _) => (StatusCode::NOT_FOUND, None),
        }
    }
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// Answered while no reload ran: checked against the one configuration in force.
    exact: [u64; 2],
    /// Overlapping a reload: checked against either configuration.
    overlapping: u64,
    failures: Vec<String>,
}

/// Sends one request and checks its answer. `epoch` is odd while a reload runs and counts
/// completed reloads times two otherwise: an answer that started and ended at the same even
/// value came from configuration `epoch / 2 % 2` (0 = A, 1 = B), and must be exactly its.
async fn check<F, Fut>(kind: Kind, epoch: &AtomicU64, tally: &Mutex<Tally>, send: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<Response<Incoming>, hyper::Error>>,
{
    let before = epoch.load(SeqCst);
    let answer = match send().await {
        Ok(resp) => {
            let status = resp.status();
            match resp.into_body().collect().await {
                Ok(body) => Ok((status, body.to_bytes())),
                Err(e) => Err(format!("{kind:?}: body failed: {e}")),
            }
        }
        Err(e) => Err(format!("{kind:?}: request failed: {e}")),
    };
    let after = epoch.load(SeqCst);
    let mut t = tally.lock().unwrap();
    let (status, body) = match answer {
        Ok(a) => a,
        Err(e) => return t.failures.push(e),
    };
    let fits = |b: bool| {
        let (want, line) = kind.expected(b);
        status == want && line.is_none_or(|l| body == l.as_bytes())
    };
    let exact = (before == after && before.is_multiple_of(2)).then_some(before / 2 % 2 == 1);
    let ok = match exact {
        Some(b) => fits(b),
        None => fits(false) || fits(true),
    };
    if !ok {
        t.failures.push(format!(
            "{kind:?} at epoch {before}..{after}: {status} {:?}",
            String::from_utf8_lossy(&body)
        ));
    } else if let Some(b) = exact {
        t.exact[usize::from(b)] += 1;
    } else {
        t.overlapping += 1;
    }
}

async fn h1_connection(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

async fn h2_connection(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    send
}

/// Writes the marks a previous run left: every resource starts above 0, and `fresh`, which
/// only config B guards, must start from its stored 100 (not 0) when B is loaded.
async fn seed_marks(path: &Path) {
    let store = palisade::FileStore::open(path).unwrap();
    for (r, m) in [
        ("orders", 7),
        ("h2res", 9),
        ("moved", 5),
        ("fresh", 100),
        ("ledger", 10),
    ] {
        store.persist(r, m).await.unwrap();
    }
}

const LOAD: Duration = Duration::from_secs(10);
const RELOADS: u64 = 20;
const H1_CLIENTS: usize = 4;
const H2_STREAMS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_under_load_fail_no_request_drop_no_connection_and_keep_every_mark() {
    // Ten seconds of load: alone among the binary's timing tests (`support::serial`).
    let _serial = support::serial().await;
    let dir = tempfile::tempdir().unwrap();
    let (legacy, spare) = (upstream("legacy").await, upstream("spare").await);
    seed_marks(&dir.path().join("marks.json")).await;
    let file = dir.path().join("palisade.toml");
    install(&file, &config(false, &legacy, &spare));
    let proxy = support::proxy_file(&file).await;
    let authority = proxy.addr.to_string();

    let epoch = Arc::new(AtomicU64::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Instant::now() + LOAD;
    let mut clients = Vec::new();
    for c in 0..H1_CLIENTS {
        let mut send = h1_connection(proxy.addr).await;
        let (epoch, tally, authority) = (epoch.clone(), tally.clone(), authority.clone());
        clients.push(tokio::spawn(async move {
            for kind in KINDS.iter().cycle().skip(c) {
                if Instant::now() >= stop {
                    break;
                }
                let mut req = kind.request(&authority);
                // HTTP/1.1 in origin form, as browsers and most clients send it.
                *req.uri_mut() = req.uri().path().parse().unwrap();
                req.headers_mut().insert("host", authority.parse().unwrap());
                check(*kind, &epoch, &tally, || send.send_request(req)).await;
            }
        }));
    }
    let h2 = h2_connection(proxy.addr).await;
    for s in 0..H2_STREAMS {
        let mut send = h2.clone();
        let (epoch, tally, authority) = (epoch.clone(), tally.clone(), authority.clone());
        clients.push(tokio::spawn(async move {
            for kind in KINDS.iter().cycle().skip(s * 2) {
                if Instant::now() >= stop {
                    break;
                }
                let req = kind.request(&authority);
                check(*kind, &epoch, &tally, || send.send_request(req)).await;
            }
        }));
    }

    // The operator: advances the ledger's mark, then reloads, 20 times, alternating B and A.
    let pause = LOAD / (RELOADS as u32 + 1);
    for k in 1..=RELOADS {
        tokio::time::sleep(pause).await;
        let ledger = 10 + k;
        let r = support::post(&proxy.url("/ledger/1"), Some(&ledger.to_string())).await;
        assert_eq!(r.status, StatusCode::OK, "ledger advance to {ledger}");
        install(&file, &config(k % 2 == 1, &legacy, &spare));
        epoch.fetch_add(1, SeqCst);
        let reloaded = proxy.reloader.reload().await.unwrap();
        epoch.fetch_add(1, SeqCst);
        assert_eq!(
            reloaded.carried.upstreams_kept, 2,
            "legacy and legacy-h2 keep their connections"
        );
        assert!(reloaded.kept.is_empty(), "{:?}", reloaded.kept);
        let marks = proxy.marks().await;
        assert_eq!(
            marks["ledger"], ledger,
            "the advance made before reload {k} stands"
        );
        assert_eq!(marks["orders"], 7);
        if k == 1 {
            assert_eq!(reloaded.new_resources, ["fresh"]);
            let zombie = support::post(&proxy.url("/fresh/1"), Some("99")).await;
            assert_eq!(
                zombie.status,
                StatusCode::CONFLICT,
                "fresh starts at its stored 100"
            );
            assert_eq!(zombie.headers["x-fencing-mark"], "100");
        } else {
            assert!(
                reloaded.new_resources.is_empty(),
                "known resources are not reopened"
            );
        }
    }
    for c in clients {
        c.await.unwrap();
    }

    let t = std::mem::take(&mut *tally.lock().unwrap());
    let total = t.exact[0] + t.exact[1] + t.overlapping;
    eprintln!(
        "{total} requests in {LOAD:?} over {RELOADS} reloads: {} checked against A, {} against B, \
         {} overlapping a reload; {} failed; upstream connections: legacy {}, spare {}",
        t.exact[0],
        t.exact[1],
        t.overlapping,
        t.failures.len(),
        legacy.connections(),
        spare.connections(),
    );
    assert!(
        t.failures.is_empty(),
        "{:#?}",
        &t.failures[..t.failures.len().min(20)]
    );
    assert!(
        t.exact[0] > 100 && t.exact[1] > 100,
        "both configurations served"
    );

    let marks = proxy.marks().await;
    let want = serde_json::json!({"orders": 7, "h2res": 9, "moved": 5, "fresh": 100, "ledger": 30});
    assert_eq!(marks, want, "no mark reset, none lost");
    let m = proxy.metrics().await;
    for r in ["orders", "h2res", "moved", "fresh"] {
        let series = format!("palisade_mark_advances_total{{resource=\"{r}\"}}");
        assert_eq!(metric(&m, &series), Some(0.0), "{r} never moved");
    }
    assert_eq!(
        metric(&m, "palisade_mark_advances_total{resource=\"ledger\"}"),
        Some(20.0)
    );
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"ok\"}"),
        Some(20.0)
    );
    // Unchanged upstreams keep their connections: at most one per concurrent request (4
    // keep-alive clients, 4 h2 streams) plus the h2c upstream's, with slack for races at start.
    // Rebuilt on every reload,
    // each reload would have opened new ones for every client.
    let legacy_conns = legacy.connections();
    assert!(
        legacy_conns <= 2 * (H1_CLIENTS + H2_STREAMS),
        "{legacy_conns} upstream connections"
    );
    proxy.shutdown().await;
}
