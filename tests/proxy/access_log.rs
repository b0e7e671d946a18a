//! The access log: one line per request, refusals included, as JSON or text, to a file that
//! SIGUSR1 reopens, or to stderr; a log that cannot be written never fails a request.

use crate::support;

use std::path::Path;
use std::time::Duration;

use http::{Method, StatusCode};
use serde_json::Value;
use support::{get, h2c_client, http1_client, metric, post, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "marks.json"

[access_log]
format = "{format}"
path = "{log}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[upstream]]
name = "nowhere"
url = "http://127.0.0.1:1"

[[route]]
name = "orders-write"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"

[[route]]
name = "dead"
upstream = "nowhere"
path_prefix = "/dead"
guard = false

[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/reads"
guard = false
"#;

fn config(format: &str, log: &str, upstream: std::net::SocketAddr) -> String {
    CONFIG
        .replace("{format}", format)
        .replace("{log}", log)
        .replace("{upstream}", &upstream.to_string())
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn json_lines_name_route_status_outcome_token_mark_and_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let proxy = support::proxy(&config("json", "access.log", up.addr), dir.path()).await;
    let orders = proxy.url("/orders/1");
    assert_eq!(post(&orders, Some("34")).await.status, StatusCode::OK);
    assert_eq!(post(&orders, Some("51")).await.status, StatusCode::OK);
    assert_eq!(post(&orders, Some("34")).await.status, StatusCode::CONFLICT);
    assert_eq!(
        post(&orders, None).await.status,
        StatusCode::PRECONDITION_REQUIRED
    );
    assert_eq!(
        post(&orders, Some("0x1")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        get(&proxy.url("/nowhere?secret=1")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(&proxy.url("/dead")).await.status,
        StatusCode::BAD_GATEWAY
    );
    let h2 = send(&h2c_client(), Method::GET, &proxy.url("/reads/x"), &[], b"").await;
    assert_eq!(h2.status, StatusCode::OK);
    let fence = [("x-fencing-token", &b"60"[..]), ("x-fencing-fence", b"1")];
    let fenced = send(&http1_client(), Method::POST, &orders, &fence, b"").await;
    assert_eq!(fenced.status, StatusCode::NO_CONTENT);
    proxy.shutdown().await; // flushes the log

    let got: Vec<Value> = lines(&dir.path().join("access.log"))
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let brief: Vec<_> = got
        .iter()
        .map(|v| {
            (
                v["method"].as_str().unwrap(),
                v["route"].as_str(),
                v["status"].as_u64().unwrap(),
                v["outcome"].as_str().unwrap(),
                v["token"].as_u64(),
                v["mark"].as_u64(),
                v["upstream"].as_str(),
            )
        })
        .collect();
    let orders = Some("orders-write");
    let legacy = Some("legacy");
    assert_eq!(
        brief,
        [
            ("POST", orders, 200, "admitted", Some(34), Some(34), legacy),
            ("POST", orders, 200, "admitted", Some(51), Some(51), legacy),
            ("POST", orders, 409, "stale", Some(34), Some(51), None),
            ("POST", orders, 428, "missing", None, Some(51), None),
            ("POST", orders, 400, "malformed", None, Some(51), None),
            ("GET", None, 404, "no_route", None, None, None),
            (
                "GET",
                Some("dead"),
                502,
                "upstream_error",
                None,
                None,
                Some("nowhere")
            ),
            ("GET", Some("reads"), 200, "passthrough", None, None, legacy),
            ("POST", orders, 204, "fence", Some(60), Some(60), None),
        ]
    );
    assert_eq!(got[0]["path"], "/orders/1");
    assert_eq!(got[0]["resource"], "orders");
    assert_eq!(got[5]["path"], "/nowhere", "no query string");
    assert_eq!(got[7]["path"], "/reads/x", "over h2c");
    for v in &got {
        assert!(v["time"].as_str().unwrap().ends_with('Z'), "{v}");
        assert!(v["peer"].as_str().unwrap().starts_with("127.0.0.1:"), "{v}");
        assert!(v["latency_us"].as_u64().unwrap() < 10_000_000, "{v}");
    }
}

async fn text_lines_are_key_value_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let proxy = support::proxy(&config("text", "logs-access.log", up.addr), dir.path()).await;
    assert_eq!(
        post(&proxy.url("/orders/1"), Some("7")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        post(&proxy.url("/orders/1"), Some("6")).await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        get(&proxy.url("/elsewhere")).await.status,
        StatusCode::NOT_FOUND
    );
    proxy.shutdown().await;
    let got = lines(&dir.path().join("logs-access.log"));
    assert_eq!(got.len(), 3, "{got:#?}");
    let tail = |l: &str| {
        l.split_once(" method=")
            .unwrap()
            .1
            .rsplit_once(" latency_us=")
            .unwrap()
            .0
            .to_owned()
    };
    assert_eq!(
        tail(&got[0]),
        "POST path=/orders/1 route=orders-write resource=orders status=200 outcome=admitted \
         token=7 mark=7 upstream=legacy"
    );
    assert_eq!(
        tail(&got[1]),
        "POST path=/orders/1 route=orders-write resource=orders status=409 outcome=stale \
         token=6 mark=7 upstream=-"
    );
    assert_eq!(
        tail(&got[2]),
        "GET path=/elsewhere route=- resource=- status=404 outcome=no_route token=- mark=- \
         upstream=-"
    );
    assert!(
        got[0].starts_with("time=") && got[0].contains(" peer=127.0.0.1:"),
        "{}",
        got[0]
    );
}

async fn a_log_that_cannot_be_written_counts_errors_and_never_fails_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    // Every write to /dev/full fails with ENOSPC, like a full disk.
    let file = support::write(
        dir.path(),
        "palisade.toml",
        &config("json", "/dev/full", up.addr),
    );
    let p = support::spawn_proxy(&file).unwrap();
    let url = format!("http://{}/orders/1", p.addr);
    assert_eq!(post(&url, Some("1")).await.status, StatusCode::OK);
    let failed = p.wait_log(
        "cannot write the access log; dropping lines",
        Duration::from_secs(10),
    );
    assert!(
        failed["error"].as_str().unwrap().contains("No space left"),
        "{failed}"
    );
    for t in 2..=20 {
        let r = post(&url, Some(&t.to_string())).await;
        assert_eq!(r.status, StatusCode::OK, "request {t}");
    }
    let m = get(&format!("http://{}/metrics", p.admin.unwrap()))
        .await
        .text();
    let errors = metric(&m, "palisade_access_log_write_errors_total").unwrap();
    let dropped = r#"palisade_access_log_dropped_lines_total{reason="write_error"}"#;
    assert!(errors >= 1.0 && metric(&m, dropped).unwrap() >= 1.0, "{m}");
    assert_eq!(metric(&m, "palisade_access_log_lines_total"), Some(0.0));
}

/// What logrotate does: rename the file, then SIGUSR1. Lines written before the signal stay
/// in the renamed file; after it, palisade writes to a new file at the configured path.
async fn sigusr1_after_a_rename_writes_to_a_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = support::write(
        dir.path(),
        "palisade.toml",
        &config("json", "access.log", up.addr),
    );
    let mut p = support::spawn_proxy(&file).unwrap();
    let base = format!("http://{}", p.addr);
    assert_eq!(
        get(&format!("{base}/reads/before")).await.status,
        StatusCode::OK
    );
    let (log, rotated) = (
        dir.path().join("access.log"),
        dir.path().join("access.log.1"),
    );
    std::fs::rename(&log, &rotated).unwrap();
    assert_eq!(
        get(&format!("{base}/reads/between")).await.status,
        StatusCode::OK
    );
    p.signal("USR1");
    let fields = p.wait_log("access log reopened", Duration::from_secs(10));
    assert_eq!(fields["path"], log.display().to_string());
    assert_eq!(
        get(&format!("{base}/reads/after")).await.status,
        StatusCode::OK
    );
    p.signal("TERM");
    assert!(p.child.wait().unwrap().success());

    let paths = |f: &Path| -> Vec<String> {
        lines(f)
            .iter()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["path"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    // Both lines from before the signal are in the renamed file, in either order: a line is
    // written once its exchange is over, which for "before" can be after the client, having
    // read the whole answer, already sent "between".
    let mut before = paths(&rotated);
    before.sort();
    assert_eq!(before, ["/reads/before", "/reads/between"]);
    assert_eq!(paths(&log), ["/reads/after"]);
}

#[test]
fn path_dash_writes_json_lines_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(support::upstream());
    let file = support::write(dir.path(), "palisade.toml", &config("json", "-", up.addr));
    let p = support::spawn_proxy(&file).unwrap();
    let url = format!("http://{}/reads/on-stderr", p.addr);
    assert_eq!(rt.block_on(get(&url)).status, StatusCode::OK);
    let line = p.wait_json(Duration::from_secs(10), |v| v["path"] == "/reads/on-stderr");
    assert_eq!(line["outcome"], "passthrough");
    assert_eq!(line["upstream"], "legacy");
}

async fn a_reload_turns_the_access_log_on_and_moves_it_without_losing_lines() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    let with = |format: &str, log: &str| config(format, log, up.addr);
    let off = with("json", "x").replace("[access_log]\nformat = \"json\"\npath = \"x\"\n", "");
    assert!(!off.contains("access_log"));
    std::fs::write(&file, &off).unwrap();
    let proxy = support::proxy_file(&file).await;
    let read = |n: u32| proxy.url(&format!("/reads/{n}"));
    assert_eq!(get(&read(1)).await.status, StatusCode::OK);
    for (n, text) in [
        (2, with("json", "a.log")),
        (3, with("text", "b.log")),
        (4, with("text", "b.log")),
    ] {
        std::fs::write(&file, text).unwrap();
        proxy.reloader.reload().await.unwrap();
        assert_eq!(get(&read(n)).await.status, StatusCode::OK);
    }
    proxy.shutdown().await; // waits for the replaced log's writer too
    let a = lines(&dir.path().join("a.log"));
    assert_eq!(a.len(), 1, "{a:#?}");
    assert_eq!(
        serde_json::from_str::<Value>(&a[0]).unwrap()["path"],
        "/reads/2"
    );
    let b = lines(&dir.path().join("b.log"));
    assert_eq!(b.len(), 2, "{b:#?}");
    assert!(
        b[0].contains(" path=/reads/3 ") && b[1].contains(" path=/reads/4 "),
        "{b:#?}"
    );
}

/// An upstream that never answers; its log says when a request reached it.
async fn hanging_upstream() -> support::Upstream {
    support::upstream::builder().hang().start().await
}

/// JSON lines to `access.log`, the write route giving up on `upstream` after 300 ms.
fn hanging_config(upstream: std::net::SocketAddr) -> String {
    config("json", "access.log", upstream).replace(
        "resource = \"orders\"\n",
        "resource = \"orders\"\nresponse_timeout_ms = 300\n",
    )
}

/// The lines of the access log at `path` once there is one (5 s at most).
async fn first_lines(path: &Path) -> Vec<String> {
    let limit = std::time::Instant::now() + Duration::from_secs(5);
    while lines(path).is_empty() {
        assert!(std::time::Instant::now() < limit, "no access log line");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    lines(path)
}

/// A client that hangs up after its request went upstream (here with its body in two
/// writes) is logged at once as 499, once: not again when the upstream's response timeout
/// (300 ms here) runs out, nor when the server stops.
async fn a_client_that_hangs_up_before_its_answer_is_logged_as_499() {
    let dir = tempfile::tempdir().unwrap();
    let up = hanging_upstream().await;
    let text = hanging_config(up.addr);
    let proxy = support::proxy(&text, dir.path()).await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    client.set_nodelay(true).unwrap();
    let head =
        "POST /orders/1 HTTP/1.1\r\nhost: t\r\nx-fencing-token: 8\r\ncontent-length: 10\r\n\r\n01234";
    client.write_all(head.as_bytes()).await.unwrap();
    up.log.wait(1).await; // admitted and forwarded
    tokio::time::sleep(Duration::from_millis(20)).await;
    client.write_all(b"56789").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(client);
    // Logged when the hang-up is seen, not when the upstream's time runs out or the server
    // stops.
    let path = dir.path().join("access.log");
    let got = first_lines(&path).await;
    assert_eq!(got.len(), 1, "{got:#?}");
    let v: Value = serde_json::from_str(&got[0]).unwrap();
    assert_eq!(v["status"], 499);
    assert_eq!(v["outcome"], "client_closed");
    assert_eq!(v["route"], "orders-write");
    assert_eq!(v["token"], 8);
    assert_eq!(v["mark"], 8);
    assert_eq!(v["upstream"], "legacy");
    let latency = v["latency_us"].as_u64().unwrap();
    assert!(
        latency < 250_000,
        "logged at the hang-up, not at the timeout: {latency} us"
    );
    // Past the response timeout and through the shutdown: still the one line.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.shutdown().await;
    let got = lines(&path);
    assert_eq!(got.len(), 1, "{got:#?}");
}

// These run on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    json_lines_name_route_status_outcome_token_mark_and_upstream,
    text_lines_are_key_value_pairs,
    a_reload_turns_the_access_log_on_and_moves_it_without_losing_lines,
    a_client_that_hangs_up_before_its_answer_is_logged_as_499,
    clients_gone_before_their_answer_are_client_closed_not_upstream_errors,
    a_malformed_chunked_body_from_a_client_still_there_is_a_400,
);
support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    a_log_that_cannot_be_written_counts_errors_and_never_fails_a_request,
    sigusr1_after_a_rename_writes_to_a_new_file,
);

/// Scrapes the admin listener's `/metrics` of a proxy process.
async fn scrape(admin: std::net::SocketAddr) -> String {
    support::get(&format!("http://{admin}/metrics"))
        .await
        .text()
}

/// A proxy process on [`hanging_config`] in front of a [`hanging_upstream`].
async fn hanging_proxy_process() -> (tempfile::TempDir, support::Upstream, support::ProxyProcess) {
    let dir = tempfile::tempdir().unwrap();
    let up = hanging_upstream().await;
    let path = support::write(dir.path(), "palisade.toml", &hanging_config(up.addr));
    let proxy = support::spawn_proxy(&path).unwrap();
    (dir, up, proxy)
}

/// An HTTP/2 client connection (prior knowledge) to `addr`, ready for a request.
async fn h2_client(addr: std::net::SocketAddr) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    h2.ready().await.unwrap()
}

/// Clients that go away before their answer are `client_closed` (499) in the access log and
/// in `palisade_requests_total`, never `upstream_error` and never a WARN: an HTTP/1.1 client
/// that closes mid-way through a chunked body, an HTTP/2 client that resets its stream
/// mid-body, and a gRPC-style cancel (RST_STREAM(CANCEL) after the whole request, before the
/// response head), each after the upstream got the request.
async fn clients_gone_before_their_answer_are_client_closed_not_upstream_errors() {
    let (dir, up, proxy) = hanging_proxy_process().await;
    let admin = proxy.admin.unwrap();
    // HTTP/1.1, chunked, gone after the first chunk.
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = "POST /orders/1 HTTP/1.1\r\nhost: t\r\nx-fencing-token: 8\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
    client.write_all(head.as_bytes()).await.unwrap();
    up.log.wait(1).await;
    drop(client);
    // HTTP/2: a stream reset mid-body, then one cancelled after its whole request.
    let mut h2 = h2_client(proxy.addr).await;
    for (n, whole) in [(2, false), (3, true)] {
        let req = http::Request::post(format!("http://{}/orders/1", proxy.addr))
            .header("x-fencing-token", "8")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let (_response, mut body) = h2.send_request(req, false).unwrap();
        body.send_data(bytes::Bytes::from_static(b"hello"), whole)
            .unwrap();
        up.log.wait(n).await;
        body.send_reset(h2::Reason::CANCEL);
        h2 = h2.ready().await.unwrap();
    }
    let log = dir.path().join("access.log");
    let limit = std::time::Instant::now() + Duration::from_secs(5);
    let series = r#"palisade_requests_total{outcome="client_closed",route="orders-write"}"#;
    while lines(&log).len() < 3 || metric(&scrape(admin).await, series) != Some(3.0) {
        assert!(std::time::Instant::now() < limit, "{:#?}", lines(&log));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past the upstream's response timeout: nothing more is counted or logged.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = scrape(admin).await;
    assert_eq!(metric(&text, series), Some(3.0));
    let errors = r#"palisade_requests_total{outcome="upstream_error",route="orders-write"}"#;
    assert_eq!(metric(&text, errors), Some(0.0), "{text}");
    let got = lines(&log);
    assert_eq!(got.len(), 3, "{got:#?}");
    for line in &got {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(
            (v["status"].as_u64(), v["outcome"].as_str()),
            (Some(499), Some("client_closed")),
            "{line}"
        );
    }
    let warned: Vec<String> = proxy
        .logs
        .try_iter()
        .filter(|l| l.contains("\"WARN\"") || l.contains("upstream request failed"))
        .collect();
    assert!(warned.is_empty(), "{warned:#?}");
}

/// A client still connected whose chunked body turns malformed after its request went
/// upstream (a chunk size line that is not hex) gets 400 `malformed` and the connection
/// closed, as nginx answers: not 499 `client_closed` (it is there to read the answer), nor
/// an upstream error; the proxy's log says the request was cut, not refused.
async fn a_malformed_chunked_body_from_a_client_still_there_is_a_400() {
    let (dir, up, proxy) = hanging_proxy_process().await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = "POST /orders/1 HTTP/1.1\r\nhost: t\r\nx-fencing-token: 8\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
    client.write_all(head.as_bytes()).await.unwrap();
    up.log.wait(1).await; // admitted and forwarded
    client.write_all(b"zz\r\nmore\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection stayed open");
    let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 400"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    let got = first_lines(&dir.path().join("access.log")).await;
    assert_eq!(got.len(), 1, "{got:#?}");
    let v: Value = serde_json::from_str(&got[0]).unwrap();
    assert_eq!(
        (v["status"].as_u64(), v["outcome"].as_str()),
        (Some(400), Some("malformed")),
        "{}",
        got[0]
    );
    // Logged as what happened: it went upstream and was cut, it was not refused.
    let mut logs = Vec::new();
    let limit = std::time::Instant::now() + Duration::from_secs(5);
    while !logs
        .iter()
        .any(|l: &String| l.contains("request cut after it went upstream"))
    {
        assert!(std::time::Instant::now() < limit, "{logs:#?}");
        logs.extend(proxy.logs.try_iter());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !logs.iter().any(|l| l.contains("request refused")),
        "{logs:#?}"
    );
}

/// An HTTP/2 GET whose client resets its stream while palisade waits for the frame after
/// its HEADERS (to tell an empty body from a real one) is `client_closed` (499) in the access
/// log and in `palisade_requests_total`, as any client gone before its answer: not a GET with
/// a body refused 400 to nobody, and never forwarded.
#[tokio::test]
async fn an_http2_get_reset_before_its_first_frame_is_client_closed() {
    let (dir, up, proxy) = hanging_proxy_process().await;
    let admin = proxy.admin.unwrap();
    let mut h2 = h2_client(proxy.addr).await;
    let req = http::Request::get(format!("http://{}/reads/1", proxy.addr))
        .body(())
        .unwrap();
    let (_response, mut body) = h2.send_request(req, false).unwrap();
    // palisade waits up to a second for that frame: the reset arrives within it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    body.send_reset(h2::Reason::CANCEL);
    let got = first_lines(&dir.path().join("access.log")).await;
    assert_eq!(got.len(), 1, "{got:#?}");
    let v: Value = serde_json::from_str(&got[0]).unwrap();
    assert_eq!(
        (
            v["status"].as_u64(),
            v["outcome"].as_str(),
            v["route"].as_str()
        ),
        (Some(499), Some("client_closed"), Some("reads")),
        "{}",
        got[0]
    );
    let text = scrape(admin).await;
    let series = |o: &str| format!(r#"palisade_requests_total{{outcome="{o}",route="reads"}}"#);
    assert_eq!(metric(&text, &series("client_closed")), Some(1.0), "{text}");
    assert!(
        metric(&text, &series("malformed")).unwrap_or(0.0) == 0.0,
        "{text}"
    );
    assert_eq!(up.log.count(|_| true), 0, "forwarded");
}
