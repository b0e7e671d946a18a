//! Tests that run the `palisade` binary as a real process: restart after `kill -9`, startup on a
//! corrupt marks file, memory use under large bodies, and `palisade check`.

use crate::support;

use std::convert::Infallible;
use std::path::Path;
use std::process::Command;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::{post, spawn_proxy, write};

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
workers = 2

[admin]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "orders-write"
upstream = "legacy"
path_prefix = "/orders"
resource = "orders"

[[route]]
name = "bulk"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

/// A recording upstream and a config file for it, with marks in a fresh directory.
struct Setup {
    dir: tempfile::TempDir,
    up: support::Upstream,
    marks: std::path::PathBuf,
    config: std::path::PathBuf,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let marks = dir.path().join("marks.db");
    let config = write(
        dir.path(),
        "palisade.toml",
        &support::render(CONFIG, up.addr, &marks),
    );
    Setup {
        dir,
        up,
        marks,
        config,
    }
}

async fn a_mark_survives_kill_9_and_the_zombie_is_still_rejected() {
    let Setup {
        dir: _dir,
        up,
        config,
        ..
    } = setup().await;

    let mut first = spawn_proxy(&config).unwrap();
    let url = format!("http://{}/orders/1", first.addr);
    assert_eq!(post(&url, Some("34")).await.status, StatusCode::OK);
    assert_eq!(post(&url, Some("51")).await.status, StatusCode::OK);
    first.kill9();

    let second = spawn_proxy(&config).unwrap();
    let url = format!("http://{}/orders/1", second.addr);
    let zombie = post(&url, Some("34")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT);
    assert_eq!(zombie.headers["x-fencing-mark"], "51");
    assert_eq!(post(&url, Some("51")).await.status, StatusCode::OK);
    assert_eq!(
        up.log.tokens(),
        [Some("34".into()), Some("51".into()), Some("51".into())]
    );
}

#[tokio::test]
async fn a_corrupt_or_truncated_marks_file_stops_startup() {
    let Setup {
        dir: _dir,
        up,
        marks,
        config,
    } = setup().await;
    let mut p = spawn_proxy(&config).unwrap();
    assert_eq!(
        post(&format!("http://{}/orders/1", p.addr), Some("51"))
            .await
            .status,
        StatusCode::OK
    );
    p.kill9();
    // Opened and closed once more, so the whole database is in the main file (a kill -9
    // leaves the last commits in its write-ahead log).
    drop(palisade::FileStore::open(&marks).unwrap());
    let good = std::fs::read(&marks).unwrap();
    assert!(
        good.starts_with(b"SQLite format 3\0"),
        "the marks file is a database"
    );

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() / 2].to_vec()),
        ("empty", Vec::new()),
        ("garbage", b"\x00\x01not json".to_vec()),
        (
            "wrong type",
            br#"{"format":"palisade-marks/1","marks":{"orders":"51"}}"#.to_vec(),
        ),
    ];
    for (what, bytes) in cases {
        std::fs::write(&marks, &bytes).unwrap();
        let (code, stderr) = match spawn_proxy(&config) {
            Ok(_) => panic!("{what}: palisade started on a bad marks file"),
            Err(e) => e,
        };
        assert_eq!(code, Some(1), "{what}: {stderr}");
        assert!(
            stderr.contains("corrupt")
                && stderr.contains("refusing to start")
                && stderr.contains("marks.db"),
            "{what}: {stderr}"
        );
        assert_eq!(
            std::fs::read(&marks).unwrap(),
            bytes,
            "{what}: the file is left as it was"
        );
    }
    assert_eq!(up.log.len(), 1);
}

type Streamed = http_body_util::combinators::BoxBody<Bytes, Infallible>;

const BIG: usize = 256 * 1024 * 1024;

fn chunks(total: usize) -> Streamed {
    let chunk = Bytes::from(vec![b'u'; 256 * 1024]);
    let mut left = total;
    let stream = tokio_stream::iter(std::iter::from_fn(move || {
        let n = left.min(chunk.len());
        left -= n;
        (n > 0).then(|| Ok::<_, Infallible>(Frame::data(chunk.slice(..n))))
    }));
    BodyExt::boxed(StreamBody::new(stream))
}

async fn large_uploads_and_downloads_stream_with_bounded_memory() {
    // 256 MiB bodies both ways through a proxy process: alone among the binary's timing tests
    // (`support::serial`).
    let _serial = support::serial().await;
    // `_up` keeps the upstream running for the whole test.
    let Setup {
        dir: _dir,
        up: _up,
        config,
        ..
    } = setup().await;
    let p = spawn_proxy(&config).unwrap();

    let h1: Client<HttpConnector, Streamed> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{}/upload", p.addr))
        .body(chunks(BIG))
        .unwrap();
    let resp = h1.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        BIG.to_string(),
        "upstream received every byte of the upload"
    );

    let h2: Client<HttpConnector, Streamed> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    for client in [&h1, &h2] {
        let req = Request::get(format!("http://{}/download?{BIG}", p.addr))
            // No body at all: palisade refuses a body (even an empty chunked one) on GET.
            .body(BodyExt::boxed(Empty::new()))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.into_body();
        let mut n = 0;
        while let Some(frame) = body.frame().await {
            if let Ok(d) = frame.unwrap().into_data() {
                n += d.len();
            }
        }
        assert_eq!(n, BIG, "client received every byte of the download");
    }
    let peak = p.peak_rss_kib();
    eprintln!("palisade peak RSS after 3 x 256 MiB: {peak} KiB");
    assert!(peak < 64 * 1024, "peak RSS {peak} KiB is not under 64 MiB");
}

fn check(dir: &Path, text: &str) -> (Option<i32>, String) {
    let path = write(dir, "bad.toml", text);
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_names_file_line_column_and_key_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let base = support::render(CONFIG, "127.0.0.1:9".parse().unwrap(), Path::new("m.json"));
    let (code, out) = check(dir.path(), &base);
    assert_eq!(code, Some(0), "{out}");

    let file = dir.path().join("bad.toml").display().to_string();
    let cases = [
        (
            "unknown key",
            base.replace("workers = 2", "workers = 2\nlisten_backlog = 5"),
            "5:1: proxy.listen_backlog:",
        ),
        (
            "unknown upstream",
            base.replace(
                "upstream = \"legacy\"\npath_prefix = \"/orders\"",
                "upstream = \"legcy\"\npath_prefix = \"/orders\"",
            ),
            "19:12: route[0].upstream:",
        ),
        (
            "duplicate route",
            base.replace("name = \"bulk\"", "name = \"orders-write\""),
            "24:8: route[1].name:",
        ),
        (
            "bad listen address",
            base.replace(
                "listen = \"127.0.0.1:0\"\nworkers",
                "listen = \"127.0.0.1\"\nworkers",
            ),
            "3:10: proxy.listen:",
        ),
        (
            "bad method",
            base.replace(
                "resource = \"orders\"",
                "resource = \"orders\"\nmethods = [\"POST\", \"FETCH ME\"]",
            ),
            "22:20: route[0].methods[1]:",
        ),
        (
            "bad store",
            base.replace("store = \"file\"", "store = \"etc\""),
            "10:9: marks.store:",
        ),
    ];
    for (what, text, want) in cases {
        let (code, out) = check(dir.path(), &text);
        assert_eq!(code, Some(2), "{what}: {out}");
        assert!(
            out.contains(&format!("{file}:{want}")),
            "{what}: wanted {file}:{want} in {out:?}"
        );
    }
}

#[test]
fn the_shipped_example_config_is_valid_without_warnings() {
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/palisade.toml"),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("0 warnings"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn check_prints_a_warning_for_a_catch_all_that_forwards_unlisted_methods() {
    let dir = tempfile::tempdir().unwrap();
    let shipped =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/palisade.toml"))
            .unwrap();
    let risky = shipped.replace("methods = [\"GET\", \"HEAD\", \"OPTIONS\"]\n", "");
    assert_ne!(risky, shipped, "the shipped catch-all lists safe methods");
    let path = write(dir.path(), "risky.toml", &risky);
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a warning is not an error: {stderr}");
    assert!(
        stderr.contains("warning:")
            && stderr.contains("risky.toml:")
            && stderr.contains("\"reads\""),
        "{stderr}"
    );
}

#[test]
fn check_reports_every_error_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
[proxy]
listen = "127.0.0.1:8080"
max_connections = 0
[fencing]
header = "X-Token"
[[upstream]]
name = "legacy"
url = "ftp://127.0.0.1:9000"
[[upstream]]
name = "other"
url = "http://127.0.0.1:9001"
[[route]]
name = "a"
upstream = "legacy"
path_prefix = "/a"
[[route]]
name = "b"
upstream = "missing"
path_prefix = "/b"
[[route]]
name = "c"
upstream = "other"
path_prefix = "/c"
methods = ["post"]
"#;
    let path = write(dir.path(), "broken.toml", text);
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // One line per problem, in file order, each with file:line:column and key. Route "a"
    // uses the broken upstream: its upstream's error is the one to fix, no second error.
    let expected = [
        ("broken.toml:4:", "proxy.max_connections"),
        ("broken.toml:6:", "fencing.header"),
        ("broken.toml:9:", "upstream[0].url"),
        ("broken.toml:19:", "route[1].upstream"),
        ("broken.toml:25:", "route[2].methods[0]"),
    ];
    for (place, key) in expected {
        assert!(
            stderr.lines().any(|l| l.contains(place) && l.contains(key)),
            "missing {place} {key}: {stderr}"
        );
    }
    assert!(!stderr.contains("route[0]"), "{stderr}");
}

#[tokio::test]
async fn health_asks_the_admin_endpoint_and_fails_once_the_proxy_is_gone() {
    let s = setup().await;
    let mut p = spawn_proxy(&s.config).unwrap();
    let admin = p.admin.unwrap().to_string();
    let health = |path: &str| {
        Command::new(env!("CARGO_BIN_EXE_palisade"))
            .args(["health", "--admin", &admin, "--path", path])
            .output()
            .unwrap()
    };
    assert!(health("/livez").status.success());
    assert!(health("/readyz").status.success());
    let missing = health("/nope");
    assert_eq!(missing.status.code(), Some(1), "a 404 is not healthy");
    p.kill9();
    let gone = health("/livez");
    assert_eq!(gone.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("unhealthy"));
}

// These two run twice: on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(a_mark_survives_kill_9_and_the_zombie_is_still_rejected,);
support::on_both_paths!(#[flavor = "multi_thread", worker_threads = 2] large_uploads_and_downloads_stream_with_bounded_memory);

#[test]
fn check_lists_each_route_and_flags_one_an_earlier_route_makes_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
[proxy]
listen = "127.0.0.1:8080"
[marks]
store = "memory"
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:9000"
[[route]]
name = "wh1"
upstream = "legacy"
path_prefix = "/warehouses/1"
resource = "warehouse-1"
[[route]]
name = "wh12"
upstream = "legacy"
path_prefix = "/warehouses/12"
resource = "warehouse-12"
[[route]]
name = "all-warehouses"
upstream = "legacy"
path_prefix = "/warehouses"
resource = "warehouses"
[[route]]
name = "wh1-stock"
upstream = "legacy"
path_prefix = "/warehouses/1/stock"
resource = "stock"
"#;
    let path = write(dir.path(), "w.toml", text);
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // Each route says what it takes: /warehouses/1 never takes /warehouses/12.
    assert!(
        stdout.contains(
            "route[0] \"wh1\": path_prefix \"/warehouses/1\": /warehouses/1, \
             /warehouses/1.<format> and everything below /warehouses/1/, never a longer \
             segment such as /warehouses/10"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("guarded by the mark of resource \"warehouse-12\""),
        "{stdout}"
    );
    // wh12 is reachable (no warning); wh1-stock is not: wh1 takes all of its requests.
    assert!(!stderr.contains("\"wh12\" is never reached"), "{stderr}");
    assert!(
        stderr.contains("route \"wh1-stock\" is never reached: route[0] \"wh1\""),
        "{stderr}"
    );
    assert_eq!(stderr.matches("warning:").count(), 1, "{stderr}");
}

#[test]
fn the_default_build_is_the_whole_product() {
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let features = text
        .lines()
        .find_map(|l| l.strip_prefix("features: "))
        .unwrap_or_else(|| panic!("no features line: {text}"));
    let features: Vec<&str> = features.split(", ").collect();
    assert!(
        features.contains(&"proxy") && features.contains(&"etcd"),
        "{text}"
    );
    // The compose file's configuration (marks in etcd) passes `check`.
    let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/compose/palisade.toml"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for sub in ["lock", "elect"] {
        let help = Command::new(env!("CARGO_BIN_EXE_palisade"))
            .args([sub, "--help"])
            .output()
            .unwrap();
        assert!(help.status.success(), "{sub}");
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(text.contains("--recampaign"), "{text}");
        if sub == "elect" {
            // The election is not called a lock.
            assert!(!text.to_lowercase().contains("lock"), "{text}");
        }
    }
}

#[tokio::test]
async fn text_logs_keep_one_record_per_line_and_a_zombie_loop_logs_its_first_refusal_whole() {
    let s = setup().await;
    let stderr_path = s.dir.path().join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["run", "--config"])
        .arg(&s.config)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let read = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let started = std::time::Instant::now();
    let addr: std::net::SocketAddr = loop {
        let text = read();
        if let Some(line) = text.lines().find(|l| l.contains("palisade listening")) {
            let addr = line
                .split("addr=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap();
            break addr.parse().unwrap();
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let url = format!("http://{addr}/orders/1");
    assert_eq!(support::post(&url, Some("51")).await.status, StatusCode::OK);
    for _ in 0..5 {
        let z = support::post(&url, Some("34")).await;
        assert_eq!(z.status, StatusCode::CONFLICT);
    }
    // A file with two mistakes: the reload's error lists both.
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(
        &s.config,
        text.replace("workers = 2", "workers = 0")
            .replace("name = \"bulk\"", "name = \"bulk\"\nmethods = [\"post\"]"),
    )
    .unwrap();
    let ok = Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let started = std::time::Instant::now();
    while !read().contains("config reload failed") {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{}",
            read()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let log = read();
    // Every line is a record of its own: it starts with a timestamp (2026-...).
    for line in log.lines() {
        assert!(
            line.len() > 4 && line[..4].bytes().all(|b| b.is_ascii_digit()),
            "a line that is not a record: {line:?}\n{log}"
        );
    }
    let failed = log
        .lines()
        .find(|l| l.contains("config reload failed"))
        .unwrap();
    assert!(
        failed.contains("proxy.workers") && failed.contains("route[1].methods[0]"),
        "both errors in one record: {failed}"
    );
    // Five refusals of one owner: the first logged whole, the rest only counted.
    let whole = log
        .lines()
        .filter(|l| l.contains("request refused") && l.contains("token=34"))
        .count();
    assert_eq!(whole, 1, "{log}");
}

/// [`CONFIG`]'s proxy, admin, marks and upstream, with one templated route.
fn entities_config() -> String {
    let head = CONFIG.split("[[route]]").next().unwrap();
    format!(
        "{head}[[route]]\nname = \"entities\"\nupstream = \"legacy\"\n\
         path_pattern = \"/r/{{id}}\"\nresource = \"r/{{id}}\"\n"
    )
}

/// `kill -9` while 32 clients advance 1000 resources, 20 times over. Every advance
/// that was answered 200 is in the store afterwards: read by `palisade marks` from the killed
/// proxy's file, and enforced by the restarted proxy (the answered token minus one is stale).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answered_advance_survives_kill_9_during_concurrent_advances() {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::{Arc, Mutex};

    const RESOURCES: u64 = 1000;
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let marks = dir.path().join("marks.db");
    let config = write(
        dir.path(),
        "palisade.toml",
        &support::render(&entities_config(), up.addr, &marks),
    );
    let tokens = Arc::new(AtomicU64::new(100));
    // Per resource, the highest token answered 200 so far.
    let answered: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    let mut total = 0;
    for round in 0..20u64 {
        let mut p = spawn_proxy(&config).unwrap();
        let addr = p.addr;
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..32u64)
            .map(|c| {
                let (tokens, answered, stop) = (tokens.clone(), answered.clone(), stop.clone());
                tokio::spawn(async move {
                    let client = support::http1_client();
                    let mut k = 0u64;
                    let mut oks = 0;
                    while !stop.load(Relaxed) {
                        let id = (c * 31 + k * 97 + round * 13) % RESOURCES;
                        k += 1;
                        let token = tokens.fetch_add(1, Relaxed);
                        let req = Request::post(format!("http://{addr}/r/{id}"))
                            .header("x-fencing-token", token.to_string())
                            .body(http_body_util::Full::new(Bytes::from_static(b"w")))
                            .unwrap();
                        match client.request(req).await {
                            Ok(r) if r.status() == StatusCode::OK => {
                                let mut a = answered.lock().unwrap();
                                let slot = a.entry(id).or_default();
                                *slot = (*slot).max(token);
                                oks += 1;
                            }
                            // Stale (a later token of the same resource won the race) or
                            // 503 while the proxy dies: not answered, nothing to check.
                            Ok(_) => {}
                            Err(_) => break,
                        }
                    }
                    oks
                })
            })
            .collect();
        // Killed at a different moment of the load each round (50 to 290 ms in).
        tokio::time::sleep(std::time::Duration::from_millis(50 + (round * 37) % 241)).await;
        p.kill9();
        stop.store(true, Relaxed);
        for c in clients {
            total += c.await.unwrap();
        }
        // Read as `palisade marks list` reads it, the proxy dead.
        let stored = palisade::fence::marks::file::read(&marks).unwrap().unwrap();
        for (id, token) in answered.lock().unwrap().iter() {
            let mark = stored.get(&format!("r/{id}")).copied().unwrap_or(0);
            assert!(
                mark >= *token,
                "round {round}: r/{id} answered {token} but stored {mark}"
            );
        }
    }
    assert!(
        total > 2000,
        "too few advances answered to mean anything: {total}"
    );
    // The restarted proxy enforces every answered mark.
    let p = spawn_proxy(&config).unwrap();
    let a = answered.lock().unwrap().clone();
    assert!(a.len() > 900, "most resources were advanced: {}", a.len());
    for (id, token) in a.iter().take(50) {
        let r = post(
            &format!("http://{}/r/{id}", p.addr),
            Some(&(token - 1).to_string()),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::CONFLICT,
            "r/{id}: {token} - 1 admitted"
        );
    }
}

#[test]
fn check_warns_when_the_admin_listener_faces_the_network_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let shipped =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/palisade.toml"))
            .unwrap();
    let loopback = "listen = \"127.0.0.1:9901\"";
    assert_eq!(
        shipped.matches(loopback).count(),
        1,
        "the shipped [admin] listen"
    );
    let open = shipped.replace(loopback, "listen = \"0.0.0.0:9901\"");
    let token = "a-token-for-the-check-test-31415926";
    let run = |name: &str, text: &str, token_value: Option<&str>| {
        let path = write(dir.path(), name, text);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_palisade"));
        cmd.args(["check", "--config"])
            .arg(&path)
            .env_remove("PALISADE_ADMIN_TOKEN");
        if let Some(v) = token_value {
            cmd.env("PALISADE_ADMIN_TOKEN", v);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{name}: a warning is not an error: {out:?}"
        );
        (
            String::from_utf8_lossy(&out.stderr).into_owned(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (stderr, stdout) = run("open.toml", &open, None);
    assert!(
        stderr.contains("warning:")
            && stderr.contains("open.toml:")
            && stderr.contains("admin.listen: the admin listener on 0.0.0.0:9901")
            && stderr.contains("token_env"),
        "{stderr}"
    );
    assert!(stdout.contains("1 warnings"), "{stdout}");

    let guarded = open.replacen(
        "[admin]\n",
        "[admin]\ntoken_env = \"PALISADE_ADMIN_TOKEN\"\n",
        1,
    );
    let (stderr, stdout) = run("guarded.toml", &guarded, Some(token));
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(stdout.contains("0 warnings"), "{stdout}");
    assert!(!stderr.contains(token) && !stdout.contains(token));

    let (stderr, stdout) = run("loopback.toml", &shipped, None);
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(stdout.contains("0 warnings"), "{stdout}");
}
