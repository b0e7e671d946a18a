//! The loop between the three parties: owners on real etcd, the proxy in front of a recording
//! upstream. A fence request moves the mark before the new owner writes (`palisade lock
//! --fence`), and an owner refused as stale is told at once (its loss signal, `lead`'s work).

use crate::etcd;
use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use palisade::client::provider::etcd::EtcdProvider;
use palisade::client::session::Loss;
use palisade::client::transport::{self, StampError, StampLayer};
use palisade::{Error, LockService, Provider, Session, SessionOptions};
use support::{h2c_client, http1_client, post};
use tower::{Layer, ServiceExt};

const BIN: &str = env!("CARGO_BIN_EXE_palisade");

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[admin]
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
resource = "orders"

[[route]]
name = "stock"
upstream = "legacy"
path_prefix = "/stock"
resource = "stock"
"#;

struct Env {
    up: support::Upstream,
    proxy: support::Proxy,
    dir: tempfile::TempDir,
    etcd: etcd::Etcd,
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(CONFIG, up.addr, &dir.path().join("marks.db"));
    std::fs::write(dir.path().join("palisade.toml"), &text).unwrap();
    let proxy = support::proxy(&text, dir.path()).await;
    let etcd = etcd::Etcd::single().await;
    Env {
        up,
        proxy,
        dir,
        etcd,
    }
}

/// A session on `etcd` (TTL 5 s).
async fn session(etcd: &etcd::Etcd) -> Session {
    let client = etcd.client().await;
    EtcdProvider::new(&client)
        .session(SessionOptions::new().with_ttl(Duration::from_secs(5)))
        .await
        .unwrap()
}

/// `palisade SUB orders --fence URL -- sh -c SCRIPT` (`lock` or `elect`) against `e`'s etcd.
fn hold_cmd(e: &Env, sub: &str, fence: &str, script: &str) -> std::process::Command {
    let mut c = std::process::Command::new(BIN);
    c.args([sub, "--endpoints", &e.etcd.endpoint(), "--fence", fence])
        .args(["orders", "--", "sh", "-c", script])
        .env("PALISADE", BIN)
        .env("CFG", e.dir.path().join("palisade.toml"))
        .env("D", e.dir.path())
        .stdin(std::process::Stdio::null());
    c
}

/// The token a job wrote to `path`.
fn read_token(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// `palisade lock --fence` fences before the command starts: the mark is the new token, durable,
/// when the command reads the store, and the fence never reached the upstream. A stale fence
/// (a newer owner moved the mark) or a fence nobody answers: the command never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_with_fence_starts_the_command_only_after_the_fence_was_admitted() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    let out = hold_cmd(
        &e,
        "lock",
        &url,
        r#"echo "$PALISADE_FENCING_TOKEN" > "$D/token"; "$PALISADE" marks list --config "$CFG" > "$D/marks""#,
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = read_token(&e.dir.path().join("token"));
    let marks = std::fs::read_to_string(e.dir.path().join("marks")).unwrap();
    assert!(
        marks
            .lines()
            .any(|l| l.split_whitespace().eq(["orders", &token.to_string()])),
        "the mark was the new token when the command ran: {marks}"
    );
    assert_eq!(e.up.log.len(), 0, "the fence never reached the upstream");
    // `elect` fences the same way, with its term's (higher) token.
    let mut elect = hold_cmd(
        &e,
        "elect",
        &url,
        r#"echo "$PALISADE_FENCING_TOKEN" > "$D/term""#,
    );
    let out = elect.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let term = read_token(&e.dir.path().join("term"));
    assert!(term > token);
    assert_eq!(e.proxy.marks().await["orders"], term);
    assert_eq!(e.up.log.len(), 0);

    // A newer owner's token (far above any this etcd issues soon) moved the mark: the next
    // holder's fence is stale, and its command does not run.
    assert_eq!(post(&url, Some("1000000")).await.status, StatusCode::OK);
    let out = hold_cmd(&e, "lock", &url, r#"touch "$D/ran""#)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("newer owner"), "{stderr}");
    assert!(
        !e.dir.path().join("ran").exists(),
        "the command ran after a stale fence"
    );

    // Nothing listens there: no answer, no command.
    let out = hold_cmd(&e, "lock", "http://127.0.0.1:1/orders", r#"touch "$D/ran""#)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!e.dir.path().join("ran").exists());
    // An https URL is refused when the arguments are read.
    let out = hold_cmd(&e, "lock", "https://example.invalid/x", "true")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("https"));
}

/// A lock holder writing through [`StampLayer`]: the write refused as stale is returned as
/// `Fenced`, and by the time that one request returns, the grant's loss signal has fired
/// with `Loss::Fenced`. Over HTTP/1.1 and h2c.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_refused_as_stale_loses_its_grant_within_that_request() {
    let e = env().await;
    for (client, path) in [(http1_client(), "/orders/1"), (h2c_client(), "/stock/1")] {
        let url = e.proxy.url(path);
        let s = session(&e.etcd).await;
        let grant = s.lock("orders").await.unwrap();
        let svc = StampLayer::new(grant.owner()).layer(client.clone());
        let write = || {
            let req = Request::post(url.as_str())
                .body(Full::new(Bytes::from_static(b"w")))
                .unwrap();
            svc.clone().oneshot(req)
        };
        let resp = write().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(!grant.loss_signal().is_lost());
        // A newer owner wrote with a higher token.
        let newer = grant.token().get() + 1000;
        assert_eq!(
            post(&url, Some(&newer.to_string())).await.status,
            StatusCode::OK
        );
        match write().await {
            Err(StampError::Fenced(f)) => assert_eq!(f.mark, newer),
            other => panic!("{:?}", other.map(|r| r.status())),
        }
        assert!(grant.loss_signal().is_lost(), "lost within the request");
        assert_eq!(
            grant.loss_signal().wait().await,
            Loss::Fenced { mark: newer }
        );
        assert_eq!(grant.owner().fenced_by(), Some(newer));
        // The grant let go of its queue entry: the lock is free for the next owner.
        let other = session(&e.etcd).await;
        let next = tokio::time::timeout(Duration::from_secs(5), other.lock("orders"))
            .await
            .expect("the fenced holder's entry is let go")
            .unwrap();
        assert!(next.token() > grant.token());
        next.unlock().await.unwrap();
        other.close().await.unwrap();
        s.close().await.unwrap();
    }
    // A 409 of the upstream's own, without a mark, is not a fence.
    assert!(transport::fenced_parts(StatusCode::CONFLICT, &http::HeaderMap::new()).is_none());
}

/// `lead(..)`'s work is cancelled (dropped) as soon as a resource refuses its term's token,
/// and `lead` says `Error::Fenced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lead_work_is_cancelled_when_a_write_is_refused() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    let s = session(&e.etcd).await;
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&dropped);
    let (raised_tx, raised_rx) = tokio::sync::oneshot::channel::<u64>();
    let raise = {
        let url = url.clone();
        tokio::spawn(async move {
            let mark = raised_rx.await.unwrap();
            assert_eq!(
                post(&url, Some(&mark.to_string())).await.status,
                StatusCode::OK
            );
            mark
        })
    };
    let led = s
        .lead("writer", "me", |ctx| async move {
            struct Dropped(std::sync::Arc<std::sync::atomic::AtomicBool>);
            impl Drop for Dropped {
                fn drop(&mut self) {
                    self.0.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
            let _d = Dropped(flag);
            let svc = StampLayer::new(ctx.owner.clone()).layer(http1_client());
            let mut raised = Some(raised_tx);
            loop {
                let req = Request::post(url.as_str())
                    .body(Full::new(Bytes::from_static(b"w")))
                    .unwrap();
                // Every write either passes or is refused; the refusal cancels this work
                // before the loop goes on.
                let _ = svc.clone().oneshot(req).await;
                if let Some(tx) = raised.take() {
                    tx.send(ctx.token.get() + 1000).unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    let raised = raise.await.unwrap();
    match led {
        Err(Error::Fenced { name, mark }) => {
            assert_eq!(name, "writer");
            assert_eq!(mark, raised);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "the work was dropped"
    );
    s.close().await.unwrap();
}

/// gRPC: a tonic channel behind [`StampLayer`] gets the refusal as ABORTED with the mark
/// (`transport::grpc::fenced_status`), and the owner is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_holder_refused_as_stale_is_told_and_sees_aborted_with_the_mark() {
    use palisade::client::transport::grpc::fenced_status;
    let e = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::grpc::upstream().await;
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\
         [marks]\nstore = \"file\"\npath = \"{}\"\n[[upstream]]\nname = \"u\"\n\
         url = \"http://{}\"\nprotocol = \"h2c\"\n[[route]]\nname = \"g\"\n\
         upstream = \"u\"\npath_prefix = \"/\"\nresource = \"orders\"\n",
        dir.path().join("marks.db").display(),
        up.addr
    );
    let proxy = support::proxy(&text, dir.path()).await;
    let s = session(&e).await;
    let grant = s.lock("orders").await.unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", proxy.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let echo = tonic::client::Grpc::new(StampLayer::new(grant.owner()).layer(channel));
    let say = |text: &str| {
        let req = tonic::Request::new(support::grpc::Msg {
            text: text.to_owned(),
            n: 0,
        });
        let mut echo = echo.clone();
        async move {
            echo.ready()
                .await
                .map_err(|e| tonic::Status::from_error(e.into()))?;
            echo.unary::<_, support::grpc::Msg, _>(
                req,
                http::uri::PathAndQuery::from_static(support::grpc::SAY),
                tonic_prost::ProstCodec::default(),
            )
            .await
        }
    };
    say("a").await.unwrap();
    let newer = grant.token().get() + 1000;
    let mut plain = support::grpc::EchoClient::connect(proxy.addr).await;
    plain.say("b", Some(&newer.to_string())).await.unwrap();
    let refused = say("zombie").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Aborted);
    assert_eq!(fenced_status(&refused).map(|f| f.mark), Some(newer));
    assert!(grant.loss_signal().is_lost());
    assert_eq!(
        grant.loss_signal().wait().await,
        Loss::Fenced { mark: newer }
    );
    // A gRPC fence through the channel helper: stale now.
    let req = transport::grpc::fence_request::<tonic::body::Body>(
        "http",
        &proxy.addr.to_string(),
        support::grpc::SAY,
        grant.token(),
    )
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", proxy.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut ch = channel.clone();
    match transport::fence(&mut ch, req).await {
        Err(transport::FenceError::Fenced(f)) => assert_eq!(f.mark, newer),
        other => panic!("{other:?}"),
    }
    let fresh = palisade::FencingToken::new(newer + 1).unwrap();
    let req = transport::grpc::fence_request::<tonic::body::Body>(
        "http",
        &proxy.addr.to_string(),
        support::grpc::SAY,
        fresh,
    )
    .unwrap();
    let mut ch = channel;
    assert_eq!(transport::fence(&mut ch, req).await.unwrap(), newer + 1);
    assert_eq!(
        up.log.len(),
        2,
        "only the two admitted calls reached the upstream"
    );
    s.close().await.unwrap();
}

/// Two replicas (one on each data path) in front of one upstream, marks in etcd
/// (linearizable), with a route fed by the lock `orders`, one fed per warehouse by
/// `locks/warehouse/{id}`, and a gRPC route fed by `orders` too.
fn lock_routes(
    etcd: &etcd::Etcd,
    http: std::net::SocketAddr,
    grpc: std::net::SocketAddr,
    fast: bool,
    consistency: &str,
) -> String {
    format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
http1_fast_path = {fast}
[admin]
listen = "127.0.0.1:0"
[marks]
store = "etcd"
[marks.etcd]
endpoints = ["{}"]
prefix = "/marks/"
consistency = "{consistency}"
[[upstream]]
name = "legacy"
url = "http://{http}"
[[upstream]]
name = "grpc"
url = "http://{grpc}"
protocol = "h2c"
[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
resource = "orders"
lock = "orders"
[[route]]
name = "stock"
upstream = "legacy"
path_pattern = "/warehouses/{{id}}/stock"
resource = "warehouse/{{id}}"
lock = "locks/warehouse/{{id}}"
[[route]]
name = "calls"
upstream = "grpc"
path_prefix = "/test.Echo/"
resource = "orders-calls"
lock = "orders"
"#,
        etcd.endpoint()
    )
}

/// `palisade lock NAME -- sh -c 'echo $PALISADE_FENCING_TOKEN > $D/FILE; sleep 600'`: a real
/// owner process; its token once it holds the lock.
async fn holder(etcd: &etcd::Etcd, name: &str, dir: &std::path::Path, file: &str) -> (Holder, u64) {
    let holder = Holder(std::process::Command::new(BIN)
        .args(["lock", "--endpoints", &etcd.endpoint(), "--ttl", "1", name])
        .args(["--", "sh", "-c", &format!("echo $PALISADE_FENCING_TOKEN > {}/{file}.tmp && mv {0}/{file}.tmp {0}/{file}; exec sleep 600", dir.display())])
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap());
    let path = dir.join(file);
    let started = std::time::Instant::now();
    loop {
        if let Ok(t) = std::fs::read_to_string(&path) {
            if let Ok(t) = t.trim().parse() {
                return (holder, t);
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{name}: no token"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `palisade lock` process, killed (and reaped) on drop.
struct Holder(std::process::Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Holder, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &child.0.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

/// Owner A (a real `palisade lock` process) holds `orders` and writes; A is
/// frozen (SIGSTOP) past its lease; B acquires and sends nothing; A's writes are refused at
/// once, on both data paths, over gRPC, through two replicas, per entity for the templated
/// lock. B's token passes; a token above it (never issued) is 403 and moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_route_fences_the_old_owner_from_the_new_owners_acquisition() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let grpc_up = support::grpc::upstream().await;
    let replicas: Vec<support::ProxyProcess> = [true, false]
        .iter()
        .map(|fast| {
            let path = support::write(
                dir.path(),
                &format!("r{fast}.toml"),
                &lock_routes(&etcd, up.addr, grpc_up.addr, *fast, "linearizable"),
            );
            support::spawn_proxy(&path).unwrap_or_else(|(c, log)| panic!("{c:?}: {log}"))
        })
        .collect();
    let url = |r: &support::ProxyProcess, path: &str| format!("http://{}{path}", r.addr);
    for (lock, path) in [
        ("orders", "/orders/1"),
        ("locks/warehouse/7", "/warehouses/7/stock"),
    ] {
        let (a, ta) = holder(&etcd, lock, dir.path(), "a").await;
        for r in &replicas {
            assert_eq!(
                post(&url(r, path), Some(&ta.to_string())).await.status,
                StatusCode::OK,
                "{lock}: A writes"
            );
        }
        signal(&a, "STOP");
        let (b, tb) = holder(&etcd, lock, dir.path(), "b").await;
        assert!(tb > ta);
        signal(&a, "CONT");
        let before = up.log.len();
        for r in &replicas {
            let zombie = post(&url(r, path), Some(&ta.to_string())).await;
            assert_eq!(
                zombie.status,
                StatusCode::CONFLICT,
                "{lock}: A is refused before B writes"
            );
            assert_eq!(zombie.headers["x-fencing-mark"], tb.to_string().as_str());
        }
        assert_eq!(
            up.log.len(),
            before,
            "{lock}: no zombie write reached the upstream"
        );
        // A token never issued: 403, the mark stays B's.
        for r in &replicas {
            let forged = post(&url(r, path), Some(&(tb + 1000).to_string())).await;
            assert_eq!(
                forged.status,
                StatusCode::FORBIDDEN,
                "{lock}: {}",
                forged.text()
            );
            assert_eq!(forged.json()["error"], "unissued");
            assert_eq!(forged.headers["x-fencing-mark"], tb.to_string().as_str());
        }
        for r in &replicas {
            assert_eq!(
                post(&url(r, path), Some(&tb.to_string())).await.status,
                StatusCode::OK,
                "{lock}: B writes"
            );
        }
        drop(a);
        drop(b);
        std::fs::remove_file(dir.path().join("a")).unwrap();
        std::fs::remove_file(dir.path().join("b")).unwrap();
    }
    // gRPC, fed by `orders` too: B's successor C fences everyone below it, A and B alike.
    let (c, tc) = holder(&etcd, "orders", dir.path(), "c").await;
    for r in &replicas {
        let mut client = support::grpc::EchoClient::connect(r.addr).await;
        let stale = client
            .say("zombie", Some(&(tc - 1).to_string()))
            .await
            .unwrap_err();
        assert_eq!(stale.code(), tonic::Code::Aborted);
        assert_eq!(
            stale.metadata().get("x-fencing-mark").unwrap(),
            tc.to_string().as_str()
        );
        let forged = client
            .say("forged", Some(&(tc + 1).to_string()))
            .await
            .unwrap_err();
        assert_eq!(forged.code(), tonic::Code::PermissionDenied);
        client.say("c", Some(&tc.to_string())).await.unwrap();
    }
    assert_eq!(grpc_up.log.len(), 2, "only C's calls reached the upstream");
    for r in &replicas {
        let m = support::get(&format!("http://{}/metrics", r.admin.unwrap()))
            .await
            .text();
        for (route, n) in [("orders", 1.0), ("stock", 1.0), ("calls", 1.0)] {
            let series =
                format!("palisade_requests_total{{outcome=\"unissued\",route=\"{route}\"}}");
            assert_eq!(support::metric(&m, &series), Some(n), "{series}");
        }
    }
    // Nothing under the marks prefix took a forged token: a lock route learns the epoch
    // (durable in etcd already) and stores no mark of its own above it.
    let mut kv = etcd.client().await;
    let stored = kv
        .get(
            "/marks/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    for v in stored.kvs() {
        let m = u64::from_be_bytes(v.value().try_into().unwrap());
        assert!(m <= tc, "{}: {m}", String::from_utf8_lossy(v.key()));
    }
    drop(c);
}

/// An epoch key deleted behind the proxy's back (an operator's `etcdctl del`) fails closed:
/// 503 with the reason logged, never an admission on the stored mark alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_epoch_key_fails_closed() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let grpc_up = support::grpc::upstream().await;
    let path = support::write(
        dir.path(),
        "r.toml",
        &lock_routes(&etcd, up.addr, grpc_up.addr, true, "linearizable"),
    );
    let r = support::spawn_proxy(&path).unwrap_or_else(|(c, log)| panic!("{c:?}: {log}"));
    let url = format!("http://{}/orders/1", r.addr);
    // Never acquired: no owner exists, nothing is admitted.
    assert_eq!(
        post(&url, Some("5")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (a, ta) = holder(&etcd, "orders", dir.path(), "a").await;
    assert_eq!(
        post(&url, Some(&ta.to_string())).await.status,
        StatusCode::OK
    );
    let mut kv = etcd.client().await;
    kv.delete("/palisade/lock/orders/epoch", None)
        .await
        .unwrap();
    let got = post(&url, Some(&ta.to_string())).await;
    assert_eq!(
        got.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        got.text()
    );
    assert!(
        got.json()["message"].as_str().unwrap().contains("epoch"),
        "{}",
        got.text()
    );
    r.wait_log(
        "the feeding lock's epoch is missing or went back; refusing the request",
        Duration::from_secs(5),
    );
    assert_eq!(up.log.len(), 1);
    drop(a);
}

/// etcd restored from an older backup: the epoch key's revision goes back to the old owner's
/// token. A replica that read the newer epoch fails closed (503, logged) instead of admitting
/// the old owner again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_restored_from_an_older_backup_fails_closed() {
    let mut etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let grpc_up = support::grpc::upstream().await;
    let path = support::write(
        dir.path(),
        "r.toml",
        &lock_routes(&etcd, up.addr, grpc_up.addr, true, "linearizable"),
    );
    let r = support::spawn_proxy(&path).unwrap_or_else(|(c, log)| panic!("{c:?}: {log}"));
    let url = format!("http://{}/orders/1", r.addr);
    let (a, ta) = holder(&etcd, "orders", dir.path(), "a").await;
    assert_eq!(
        post(&url, Some(&ta.to_string())).await.status,
        StatusCode::OK
    );
    drop(a);
    let backup = etcd.backup().await; // holds A's epoch
    let (b, tb) = holder(&etcd, "orders", dir.path(), "b").await;
    assert!(tb > ta);
    let started = std::time::Instant::now();
    while post(&url, Some(&tb.to_string())).await.status != StatusCode::OK {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "B never got through"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(b);
    etcd.restore(backup.path()).await;
    // The proxy reconnects; then every answer for the resource is the rewound epoch's 503.
    let started = std::time::Instant::now();
    loop {
        let got = post(&url, Some(&ta.to_string())).await;
        assert_ne!(
            got.status,
            StatusCode::OK,
            "the old owner was admitted after the restore"
        );
        if got.status == StatusCode::SERVICE_UNAVAILABLE
            && got.json()["message"]
                .as_str()
                .unwrap_or("")
                .contains("went back")
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{}",
            got.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    r.wait_log(
        "the feeding lock's epoch is missing or went back; refusing the request",
        Duration::from_secs(5),
    );
    let seen = up.log.tokens();
    let a_writes = seen.iter().filter(|t| **t == Some(ta.to_string())).count();
    assert_eq!(a_writes, 1, "A wrote once, before B: {seen:?}");
}

/// `cached` mode: equal tokens are judged on the local mark, which the watch of the lock's
/// epoch keeps. The new owner's acquisition reaches every replica with the watch, B sending
/// nothing: the mark moves there, A's requests in flight are drained then (a request the
/// upstream already received whole is waited for and relayed, as any drain does), and A is
/// refused from then on. The delay from B's acquisition to each replica's move is printed.
/// A token above the local mark is read afresh, so a forged one is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_lock_route_refuses_the_old_owner_once_the_watch_delivers_the_epoch() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let grpc_up = support::grpc::upstream().await;
    let replicas: Vec<support::ProxyProcess> = [true, false]
        .iter()
        .map(|fast| {
            let text = lock_routes(&etcd, up.addr, grpc_up.addr, *fast, "cached");
            let path = support::write(dir.path(), &format!("c{fast}.toml"), &text);
            support::spawn_proxy(&path).unwrap_or_else(|(c, log)| panic!("{c:?}: {log}"))
        })
        .collect();
    let url = |r: &support::ProxyProcess, path: &str| format!("http://{}{path}", r.addr);
    let (a, ta) = holder(&etcd, "orders", dir.path(), "a").await;
    for r in &replicas {
        let got = post(&url(r, "/orders/1"), Some(&ta.to_string())).await;
        assert_eq!(got.status, StatusCode::OK, "A writes: {}", got.text());
    }
    // A's long write, in flight on the first replica when B takes over.
    let slow = {
        let u = url(&replicas[0], "/orders/slow?3000");
        let t = ta.to_string();
        tokio::spawn(async move { post(&u, Some(&t)).await.status })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    signal(&a, "STOP");
    let (b, tb) = holder(&etcd, "orders", dir.path(), "b").await;
    let acquired = std::time::Instant::now();
    signal(&a, "CONT");
    let mut delays = Vec::new();
    for r in &replicas {
        r.wait_json(Duration::from_secs(5), |v| {
            v["fields"]["message"] == "mark advanced by another replica"
                && v["fields"]["to"].as_u64() == Some(tb)
        });
        delays.push(acquired.elapsed());
        let zombie = post(&url(r, "/orders/1"), Some(&ta.to_string())).await;
        assert_eq!(
            zombie.status,
            StatusCode::CONFLICT,
            "A is refused, B sent nothing"
        );
        assert_eq!(zombie.headers["x-fencing-mark"], tb.to_string().as_str());
    }
    let drained = replicas[0].wait_json(Duration::from_secs(5), |v| {
        v["fields"]["message"]
            == "requests under older marks aborted: another replica admitted a newer owner"
    });
    assert_eq!(drained["fields"]["aborted"], 1, "{drained}");
    assert_eq!(
        slow.await.unwrap(),
        StatusCode::OK,
        "delivered whole: relayed"
    );
    for r in &replicas {
        let forged = post(&url(r, "/orders/1"), Some(&(tb + 1000).to_string())).await;
        assert_eq!(forged.status, StatusCode::FORBIDDEN, "{}", forged.text());
        let b_writes = post(&url(r, "/orders/1"), Some(&tb.to_string())).await;
        assert_eq!(b_writes.status, StatusCode::OK);
    }
    // A deleted epoch key: the watch tells, and B's equal token, judged on the local mark a
    // moment ago, now needs a read, which fails closed.
    let mut kv = etcd.client().await;
    kv.delete("/palisade/lock/orders/epoch", None)
        .await
        .unwrap();
    for r in &replicas {
        let started = std::time::Instant::now();
        loop {
            let got = post(&url(r, "/orders/1"), Some(&tb.to_string())).await;
            if got.status == StatusCode::SERVICE_UNAVAILABLE {
                break;
            }
            assert_eq!(got.status, StatusCode::OK);
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the deletion was never seen"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    eprintln!("cached lock route: each replica moved to B's epoch {delays:?} after the test saw B acquire");
    drop(a);
    drop(b);
}

/// A route fed by a semaphore: each slot's epoch (`jobs/epoch/<slot>`) feeds that slot's
/// resource (`jobs/<slot>`, as `Permit::resource` names it). When A's slot passes to B, A is
/// refused before B writes; the holder of the other slot is not disturbed; a token above the
/// slot's epoch is 403; a slot spelled another way (`01`) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_route_fences_each_slot_from_its_new_holders_acquisition() {
    use palisade::SemaphoreService;
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\n[marks]\nstore = \"etcd\"\n[marks.etcd]\n\
         endpoints = [\"{}\"]\nprefix = \"/marks/\"\n[[upstream]]\nname = \"u\"\n\
         url = \"http://{}\"\n[[route]]\nname = \"jobs\"\nupstream = \"u\"\n\
         path_pattern = \"/jobs/{{slot}}/run\"\nresource = \"jobs/{{slot}}\"\nsemaphore = \"jobs\"\n",
        etcd.endpoint(),
        up.addr
    );
    let proxy = support::proxy(&text, dir.path()).await;
    let (sa, sd, sb) = (
        session(&etcd).await,
        session(&etcd).await,
        session(&etcd).await,
    );
    let a = sa.acquire("jobs", 2).await.unwrap();
    let d = sd.acquire("jobs", 2).await.unwrap();
    assert_ne!(a.slot(), d.slot());
    let url = |slot: u32| proxy.url(&format!("/jobs/{slot}/run"));
    for p in [&a, &d] {
        assert_eq!(p.resource(), format!("jobs/{}", p.slot()));
        let got = post(&url(p.slot()), Some(&p.token().to_string())).await;
        assert_eq!(got.status, StatusCode::OK, "{}", got.text());
    }
    let (slot, ta) = (a.slot(), a.token().get());
    drop(a);
    sa.close().await.unwrap(); // A's slot is free: B takes it
    let b = sb.acquire("jobs", 2).await.unwrap();
    assert_eq!(b.slot(), slot);
    let zombie = post(&url(slot), Some(&ta.to_string())).await;
    assert_eq!(
        zombie.status,
        StatusCode::CONFLICT,
        "A is refused before B writes"
    );
    assert_eq!(
        zombie.headers["x-fencing-mark"],
        b.token().to_string().as_str()
    );
    let forged = post(&url(slot), Some(&(b.token().get() + 1000).to_string())).await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    assert_eq!(
        post(&url(slot), Some(&b.token().to_string())).await.status,
        StatusCode::OK
    );
    // The other slot's holder was not fenced by B's acquisition.
    let other = post(&url(d.slot()), Some(&d.token().to_string())).await;
    assert_eq!(other.status, StatusCode::OK);
    let odd = post(
        &proxy.url(&format!("/jobs/0{slot}/run")),
        Some(&b.token().to_string()),
    )
    .await;
    assert_eq!(odd.status, StatusCode::BAD_REQUEST, "{}", odd.text());
}
