//! End-to-end tests of the `palisade` proxy over real loopback sockets.

use crate::support;

use std::time::Duration;

use http::{Method, StatusCode};
use http_body::Body as _;
use support::{get, h2c_client, http1_client, metric, post, send};

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
shutdown_grace_ms = 3000

[admin]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"
protocol = "http1"

[[upstream]]
name = "legacy-h2"
url = "http://{upstream}"
protocol = "h2c"

[[upstream]]
name = "nowhere"
url = "http://127.0.0.1:1"

[[upstream]]
name = "impatient"
url = "http://{upstream}"
response_timeout_ms = 150

[[route]]
name = "orders-write"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST", "PUT", "PATCH", "DELETE"]
resource = "orders"

[[route]]
name = "h2-write"
upstream = "legacy-h2"
path_prefix = "/h2/"
resource = "h2res"

[[route]]
name = "stripped"
upstream = "legacy"
path_prefix = "/stripped/"
resource = "orders"
strip_token = true

[[route]]
name = "lenient"
upstream = "legacy"
path_prefix = "/lenient"
missing_token = "allow"

[[route]]
name = "exact"
upstream = "legacy"
path = "/exact"

[[route]]
name = "dead"
upstream = "nowhere"
path_prefix = "/dead"
guard = false

[[route]]
name = "timeout"
upstream = "impatient"
path_prefix = "/timeout"
guard = false

[[route]]
name = "h2-trailers"
upstream = "legacy-h2"
path_prefix = "/h2t/"
guard = false

[[route]]
name = "everything-else"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

struct Env {
    up: support::Upstream,
    proxy: support::Proxy,
    dir: tempfile::TempDir,
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(CONFIG, up.addr, &dir.path().join("marks/marks.json"));
    let proxy = support::proxy(&text, dir.path()).await;
    Env { up, proxy, dir }
}

async fn stale_token_is_rejected_with_409_and_never_reaches_upstream() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    assert_eq!(
        post(&url, Some("34")).await.status,
        StatusCode::OK,
        "owner A"
    );
    assert_eq!(
        post(&url, Some("51")).await.status,
        StatusCode::OK,
        "owner B"
    );
    let zombie = post(&url, Some("34")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT);
    assert_eq!(zombie.headers["x-fencing-mark"], "51");
    assert_eq!(zombie.headers["content-type"], "application/json");
    let body = zombie.json();
    assert_eq!(body["error"], "stale_token");
    assert_eq!(body["route"], "orders-write");
    assert_eq!(body["resource"], "orders");
    assert_eq!(body["token"], 34);
    assert_eq!(body["mark"], 51);
    assert!(body["message"].as_str().unwrap().contains("below"));
    assert_eq!(
        e.up.log.tokens(),
        [Some("34".into()), Some("51".into())],
        "the zombie never arrived"
    );

    assert_eq!(
        post(&url, Some("51")).await.status,
        StatusCode::OK,
        "equal token admitted"
    );
    assert_eq!(e.proxy.marks().await["orders"], 51);
    assert_eq!(
        post(&url, Some("52")).await.status,
        StatusCode::OK,
        "higher token advances"
    );
    assert_eq!(e.proxy.marks().await["orders"], 52);
    assert_eq!(post(&url, Some("51")).await.status, StatusCode::CONFLICT);
    assert_eq!(e.up.log.len(), 4);
}

async fn malformed_tokens_get_400_and_missing_gets_428() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    let client = http1_client();
    let malformed: &[&[u8]] = &[
        b"",
        b"0",
        b"00",
        b"034",
        b"+34",
        b"-34",
        b"3 4",
        b"34,35",
        b"0x22",
        b"\xc3\xa9",
        b"34\xff",
        b"18446744073709551616",
        b"123456789012345678901",
        b"1e3",
        b"34.0",
    ];
    for bad in malformed {
        let r = send(
            &client,
            Method::POST,
            &url,
            &[("x-fencing-token", bad)],
            b"",
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "token {:?}",
            String::from_utf8_lossy(bad)
        );
        assert_eq!(r.json()["error"], "malformed_token");
    }
    let twice = send(
        &client,
        Method::POST,
        &url,
        &[("x-fencing-token", b"7"), ("x-fencing-token", b"7")],
        b"",
    )
    .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST, "repeated header");
    assert!(twice.json()["message"]
        .as_str()
        .unwrap()
        .contains("more than once"));

    let missing = post(&url, None).await;
    assert_eq!(missing.status, StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(missing.json()["error"], "missing_token");
    assert_eq!(
        e.up.log.len(),
        0,
        "nothing malformed or missing reached the upstream"
    );

    let lenient = post(&e.proxy.url("/lenient/x"), None).await;
    assert_eq!(
        lenient.status,
        StatusCode::OK,
        "missing_token = allow forwards"
    );
    assert_eq!(e.up.log.paths(), ["/lenient/x"]);
    let m = e.proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="missing",route="lenient"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="missing",route="orders-write"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="malformed",route="orders-write"}"#
        ),
        Some(malformed.len() as f64 + 1.0)
    );
}

async fn zombie_story_shows_in_metrics() {
    let e = env().await;
    let url = e.proxy.url("/orders/7");
    post(&url, Some("34")).await;
    post(&url, Some("51")).await;
    post(&url, Some("34")).await;
    let m = e.proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_stale_rejections_total{resource="orders",route="orders-write"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, r#"palisade_mark{resource="orders"}"#),
        Some(51.0)
    );
    assert_eq!(
        metric(&m, r#"palisade_mark_advances_total{resource="orders"}"#),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="admitted",route="orders-write"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="stale",route="orders-write"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, r#"palisade_inflight_requests{route="orders-write"}"#),
        Some(0.0)
    );
    assert!(m.contains("palisade_request_duration_seconds_bucket{route=\"orders-write\""));
    assert!(m.contains(
        "palisade_store_operation_duration_seconds_count{op=\"persist\",store=\"file\"} 2"
    ));
    assert_eq!(
        get(&format!("http://{}/livez", e.proxy.admin)).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&format!("http://{}/readyz", e.proxy.admin))
            .await
            .status,
        StatusCode::OK
    );
}

async fn cross_protocol_h2c_to_http1_and_http1_to_h2c() {
    let e = env().await;
    let r = send(
        &h2c_client(),
        Method::POST,
        &e.proxy.url("/orders/9"),
        &[("x-fencing-token", b"3")],
        b"hello",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "ok POST /orders/9");
    let r = send(
        &http1_client(),
        Method::PUT,
        &e.proxy.url("/h2/thing"),
        &[("x-fencing-token", b"3")],
        b"hello",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "ok PUT /h2/thing");
    let seen = e.up.log.all();
    assert_eq!(
        seen[0].version,
        http::Version::HTTP_11,
        "h2c client -> http1 upstream"
    );
    assert_eq!(
        seen[1].version,
        http::Version::HTTP_2,
        "http1 client -> h2c upstream"
    );
    assert_eq!(
        seen[0].token.as_deref(),
        Some("3"),
        "the token is forwarded unchanged"
    );
}

async fn trailers_pass_both_ways_between_protocols() {
    let e = env().await;
    let te: &[(&str, &[u8])] = &[("te", b"trailers")];
    let via_h1 = send(
        &h2c_client(),
        Method::GET,
        &e.proxy.url("/trailers"),
        te,
        b"",
    )
    .await;
    assert_eq!(via_h1.text(), "body");
    assert_eq!(
        via_h1.trailers.as_ref().map(|t| t["x-checksum"].clone()),
        Some("42".parse().unwrap()),
        "h2c client, http1 upstream"
    );
    let via_h2 = send(
        &http1_client(),
        Method::GET,
        &e.proxy.url("/h2t/trailers"),
        te,
        b"",
    )
    .await;
    assert_eq!(via_h2.text(), "body");
    assert_eq!(
        via_h2.trailers.as_ref().map(|t| t["x-checksum"].clone()),
        Some("42".parse().unwrap()),
        "http1 client, h2c upstream"
    );
    let seen = e.up.log.all();
    assert_eq!(seen[1].version, http::Version::HTTP_2);
    assert_eq!(seen[1].headers["te"], "trailers");
}

async fn forwarded_headers_added_and_hop_by_hop_removed() {
    let e = env().await;
    let headers: &[(&str, &[u8])] = &[
        (
            "connection",
            b"keep-alive, x-private, x-fencing-token, host",
        ),
        ("x-fencing-token", b"12"),
        ("x-private", b"secret"),
        ("keep-alive", b"timeout=5"),
        ("proxy-authorization", b"Basic Zm9v"),
        ("x-forwarded-for", b"10.0.0.1"),
        ("host", b"api.example.com"),
    ];
    let r = send(
        &http1_client(),
        Method::GET,
        &e.proxy.url("/anything"),
        headers,
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let seen = &e.up.log.all()[0];
    assert_eq!(seen.headers["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.headers["host"], "api.example.com", "host is kept");
    assert_eq!(
        seen.headers["x-fencing-token"], "12",
        "Connection cannot strip the token"
    );
    for gone in ["x-private", "keep-alive", "proxy-authorization"] {
        assert!(!seen.headers.contains_key(gone), "{gone} was forwarded");
    }
    assert!(seen
        .headers
        .get("connection")
        .is_none_or(|v| v != "keep-alive, x-private"));
}

async fn no_route_is_404_and_upstream_failures_are_502_and_504() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(
        &CONFIG.replace(
            "[[route]]\nname = \"everything-else\"",
            "[[route]]\nname = \"everything-else\"\nmethods = [\"GET\"]",
        ),
        up.addr,
        &dir.path().join("m.json"),
    );
    let proxy = support::proxy(&text, dir.path()).await;
    let r = send(
        &http1_client(),
        Method::DELETE,
        &proxy.url("/nothing-here"),
        &[],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["error"], "no_route");
    assert_eq!(r.json()["token"], serde_json::Value::Null, "none sent");
    // A well-formed token is echoed back, as on every other refusal.
    let r = send(
        &http1_client(),
        Method::DELETE,
        &proxy.url("/nothing-here"),
        &[("x-fencing-token", b"42")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["token"], 42, "{}", r.text());

    let r = get(&proxy.url("/dead/x")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.json()["error"], "upstream_unavailable");
    let r = get(&proxy.url("/timeout/slow?2000")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.json()["error"], "upstream_timeout");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="upstream_error",route="dead"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="no_route",route=""}"#
        ),
        Some(2.0),
        "both DELETEs"
    );
}

async fn store_that_cannot_write_answers_503_and_keeps_the_mark() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    assert_eq!(post(&url, Some("10")).await.status, StatusCode::OK);
    let marks_dir = e.dir.path().join("marks");
    std::fs::remove_dir_all(&marks_dir).unwrap();

    let r = post(&url, Some("11")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"], "store_unavailable");
    // It says what failed (persisting 11) and carries the mark it kept.
    let message = r.json()["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("could not persist token 11") && message.contains("the mark stays 10"),
        "{message}"
    );
    assert_eq!(r.json()["mark"], 10);
    assert_eq!(r.headers["x-fencing-mark"], "10");
    assert_eq!(e.proxy.marks().await["orders"], 10, "mark unchanged");
    assert_eq!(
        post(&url, Some("10")).await.status,
        StatusCode::OK,
        "equal tokens still admitted"
    );
    assert_eq!(post(&url, Some("9")).await.status, StatusCode::CONFLICT);
    let ready = get(&format!("http://{}/readyz", e.proxy.admin)).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        e.up.log.tokens(),
        [Some("10".into()), Some("10".into())],
        "11 never reached the upstream"
    );
    let m = e.proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_store_errors_total{op="persist",store="file"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="unavailable",route="orders-write"}"#
        ),
        Some(1.0)
    );

    std::fs::create_dir_all(&marks_dir).unwrap();
    assert_eq!(
        post(&url, Some("11")).await.status,
        StatusCode::OK,
        "recovers once the store can write"
    );
    let on_disk = palisade::fence::marks::file::read(&marks_dir.join("marks.json"))
        .unwrap()
        .unwrap();
    assert_eq!(
        on_disk["orders"], 11,
        "every mark written back, the new one included"
    );
}

async fn graceful_shutdown_lets_in_flight_requests_finish() {
    let e = env().await;
    let url = e.proxy.url("/x/slow?400");
    let in_flight = tokio::spawn(async move { get(&url).await });
    // Wait until the request is at the upstream, then signal shutdown.
    while e.up.log.is_empty() {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let addr = e.proxy.addr;
    e.proxy.shutdown().await;
    let r = in_flight.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.text(), "slow done");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed after shutdown"
    );
}

/// Sends a raw HTTP/1.1 request line so no client library can normalize the path first.
async fn raw_status(
    addr: std::net::SocketAddr,
    method: &str,
    target: &[u8],
    token: Option<&str>,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} ").into_bytes();
    req.extend_from_slice(target);
    req.extend_from_slice(
        b" HTTP/1.1\r\nhost: example\r\nconnection: close\r\ncontent-length: 0\r\n",
    );
    if let Some(t) = token {
        req.extend_from_slice(format!("x-fencing-token: {t}\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    s.write_all(&req).await.unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.unwrap();
    let line = String::from_utf8_lossy(&resp);
    line.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {line:?}"))
}

async fn alternative_spellings_of_a_guarded_path_never_bypass_the_guard() {
    let e = env().await;
    // Advance the mark so that a stale token is a real zombie.
    assert_eq!(
        post(&e.proxy.url("/orders/1"), Some("51")).await.status,
        StatusCode::OK
    );
    let spellings: &[&[u8]] = &[
        b"//orders/1",
        b"///orders/1",
        b"/./orders/1",
        b"/.//orders/1",
        b"/x/../orders/1",
        b"/x/y/../../orders/1",
        b"/x/..;/orders/1",
        b"/x/..;a=b/orders/1",
        b"/.;/orders/1",
        b"/;/orders/1",
        b"/;x/orders/1",
        b"/%6Frders/1",
        b"/%6frders/1",
        b"/ord%65rs/1",
        b"/%2Forders/1",
        b"/%2forders/1",
        b"/x%2F..%2Forders/1",
        b"/%2E/orders/1",
        b"/%2e%2e/orders/1",
        b"/x/%2E%2E/orders/1",
        b"/x/.%2E/orders/1",
        b"/%5Corders/1",
        b"/x%5C..%5Corders/1",
        b"/\\orders/1",
        b"/x\\..\\orders/1",
        b"/%00/../orders/1",
        b"/%25%36%46rders/1",
        b"/%252E%252E/orders/1",
        b"/x/%2e%2E%2forders/1",
        b"/orders%",
        b"/%zzorders/1",
        b"http://example/x/../orders/1",
        // Spellings that are accepted, and therefore guarded like /orders:
        b"/orders;jsessionid=1/1",
        b"/orders/1;x",
        b"/orders/",
        b"http://example/orders/1",
    ];
    for s in spellings {
        for token in [None, Some("34")] {
            let status = raw_status(e.proxy.addr, "POST", s, token).await;
            assert!(
                matches!(status, 400 | 409 | 428),
                "{:?} with token {token:?} got {status}",
                String::from_utf8_lossy(s)
            );
        }
    }
    assert_eq!(
        e.up.log.paths(),
        ["/orders/1"],
        "only the first, admitted request reached the upstream"
    );
    assert_eq!(
        raw_status(e.proxy.addr, "POST", b"/orders;jsessionid=1/1", Some("51")).await,
        200
    );
    assert_eq!(
        e.up.log.paths()[1],
        "/orders;jsessionid=1/1",
        "accepted spellings are forwarded as they came"
    );
}

async fn exact_route_guards_trailing_slash_format_suffix_and_segment_parameters() {
    let e = env().await;
    for p in ["/exact", "/exact/", "/exact;v=1", "/exact.json"] {
        assert_eq!(
            post(&e.proxy.url(p), None).await.status,
            StatusCode::PRECONDITION_REQUIRED,
            "{p}"
        );
    }
    assert_eq!(
        post(&e.proxy.url("/exactly"), None).await.status,
        StatusCode::OK,
        "a different path"
    );
}

mod grpc {
    use super::*;
    use support::grpc::{upstream, EchoClient, COUNT, SAY};
    use tonic::Code;

    const GRPC_CONFIG: &str = r#"
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
"#;

    async fn setup() -> (
        support::grpc::GrpcUpstream,
        support::Proxy,
        EchoClient,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let up = upstream().await;
        let proxy = support::proxy(
            &support::render(GRPC_CONFIG, up.addr, dir.path()),
            dir.path(),
        )
        .await;
        let client = EchoClient::connect(proxy.addr).await;
        (up, proxy, client, dir)
    }

    #[tokio::test]
    async fn fresh_unary_call_succeeds_and_stale_one_is_aborted() {
        let (up, _proxy, mut c, _d) = setup().await;
        let ok = c.say("hello", Some("5")).await.unwrap();
        assert_eq!(ok.get_ref().text, "echo hello");
        c.say("newer", Some("8")).await.unwrap();
        let stale = c.say("zombie", Some("5")).await.unwrap_err();
        assert_eq!(stale.code(), Code::Aborted, "{stale:?}");
        assert!(
            stale.message().contains("below the resource's mark 8"),
            "{}",
            stale.message()
        );
        let missing = c.say("anon", None).await.unwrap_err();
        assert_eq!(missing.code(), Code::InvalidArgument);
        let malformed = c.say("bad", Some("05")).await.unwrap_err();
        assert_eq!(malformed.code(), Code::InvalidArgument);
        assert_eq!(up.log.tokens(), [Some("5".into()), Some("8".into())]);
    }

    #[tokio::test]
    async fn stale_grpc_rejection_is_trailers_only() {
        let (_up, proxy, mut c, _d) = setup().await;
        c.say("x", Some("8")).await.unwrap();
        let client = h2c_client();
        let req = http::Request::post(proxy.url(SAY))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-fencing-token", "5")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                b"\0\0\0\0\0",
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["grpc-status"], "10");
        assert_eq!(resp.headers()["x-fencing-mark"], "8");
        assert!(
            resp.body().is_end_stream(),
            "END_STREAM on the HEADERS frame"
        );
        let got = support::read(resp).await;
        assert!(got.body.is_empty() && got.trailers.is_none());
    }

    #[tokio::test]
    async fn server_streaming_delivers_every_message_and_the_trailers() {
        let (up, _proxy, mut c, _d) = setup().await;
        let resp = c.count(50, Some("3")).await.unwrap();
        assert_eq!(resp.metadata().get("x-server").unwrap(), "echo");
        let mut stream = resp.into_inner();
        let mut got = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            got.push(m.n);
        }
        assert_eq!(got, (1..=50).collect::<Vec<_>>());
        let trailers = stream.trailers().await.unwrap().expect("trailers arrive");
        assert!(trailers.get("grpc-status").is_none_or(|s| s == "0"));
        assert_eq!(up.log.paths(), [COUNT]);
        let stale = c.count(5, Some("2")).await.unwrap_err();
        assert_eq!(stale.code(), Code::Aborted);
    }
}

async fn ambiguous_hosts_are_refused_before_routing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = env().await;
    for request in [
        &b"POST /orders/1 HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"[..],
        &b"POST http://a.example/orders/1 HTTP/1.1\r\nhost: b.example\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"[..],
    ] {
        let mut s = tokio::net::TcpStream::connect(e.proxy.addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await.unwrap();
        let text = String::from_utf8_lossy(&resp);
        assert!(text.starts_with("HTTP/1.1 400"), "{text}");
        assert!(text.contains("bad_request"), "{text}");
    }
    assert_eq!(e.up.log.len(), 0);
}

async fn strip_token_removes_the_header_and_shares_the_resource_mark() {
    let e = env().await;
    assert_eq!(
        post(&e.proxy.url("/stripped/1"), Some("40")).await.status,
        StatusCode::OK
    );
    assert_eq!(e.up.log.tokens(), [None], "stripped before forwarding");
    assert_eq!(
        post(&e.proxy.url("/orders/1"), Some("39")).await.status,
        StatusCode::CONFLICT,
        "same resource, same mark"
    );
}

async fn an_admitted_request_is_sent_upstream_once_even_when_the_upstream_fails() {
    // An upstream that reads each request and hangs up without answering.
    let up = support::upstream::builder().raw().close().start().await;
    let addr = up.addr;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::proxy(
        &support::render(CONFIG, addr, &dir.path().join("m.json")),
        dir.path(),
    )
    .await;
    let r = post(&proxy.url("/orders/1"), Some("7")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(up.log.len(), 1, "no retry after admission");
    assert_eq!(
        proxy.marks().await["orders"],
        7,
        "the mark advanced before forwarding"
    );
}

/// The admission table every fence passes (`tests/support/cases.rs`; `tests/layer/main.rs`
/// runs it against the in-process layer), through the proxy, over HTTP/1.1 and gRPC.
async fn the_proxy_passes_the_admission_table_over_http_and_grpc() {
    use support::cases::{recording_upstream, seed, Seen, CASES, MARK};
    for grpc in [false, true] {
        for case in CASES {
            let dir = tempfile::tempdir().unwrap();
            let marks = dir.path().join("m/marks.json");
            seed(&marks);
            let seen = Seen::default();
            let up = recording_upstream(marks.clone(), seen.clone()).await;
            let text = format!(
                "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\
                 [marks]\nstore = \"file\"\npath = \"{}\"\n[[upstream]]\nname = \"u\"\n\
                 url = \"http://{up}\"\nprotocol = \"h2c\"\n[[route]]\nname = \"w\"\n\
                 upstream = \"u\"\npath_prefix = \"/\"\nresource = \"orders\"\n",
                marks.display()
            );
            let proxy = support::proxy(&text, dir.path()).await;
            // The admin endpoint answers once the marks are loaded.
            assert_eq!(proxy.marks().await["orders"], MARK);
            if case.store_down {
                std::fs::remove_dir_all(dir.path().join("m")).unwrap();
            }
            let ok = if grpc {
                let mut client = support::grpc::EchoClient::connect(proxy.addr).await;
                let code = match client.say("hi", case.token).await {
                    Ok(_) => 0,
                    Err(s) => s.code() as u8,
                };
                code == case.grpc
            } else {
                let headers: Vec<(&str, &[u8])> = case
                    .token
                    .map(|t| ("x-fencing-token", t.as_bytes()))
                    .into_iter()
                    .collect();
                let got = send(
                    &http1_client(),
                    Method::POST,
                    &proxy.url("/orders/7"),
                    &headers,
                    b"payload",
                )
                .await;
                if case.http == 409 {
                    assert_eq!(got.json()["mark"], MARK);
                }
                got.status.as_u16() == case.http
            };
            assert!(ok, "{} (grpc: {grpc})", case.name);
            let seen = seen.lock().unwrap().clone();
            assert_eq!(
                seen.len(),
                usize::from(case.reaches),
                "{}: {seen:?}",
                case.name
            );
            if let (Some(&(token, then)), Some(t)) = (seen.first(), case.token) {
                let t: u64 = t.parse().unwrap();
                assert_eq!(token, Some(t), "{}", case.name);
                if !case.store_down {
                    assert_eq!(then, t, "{}: durable before forwarding", case.name);
                }
            }
            let m = proxy.marks().await;
            assert_eq!(m["orders"], case.mark_after, "{}", case.name);
        }
    }
}

/// Two warehouses whose paths share a prefix, each with its own owner and mark.
const WAREHOUSES: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

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
name = "reads"
upstream = "legacy"
path_prefix = "/"
methods = ["GET"]
guard = false
"#;

async fn a_path_prefix_stops_at_a_segment_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(WAREHOUSES, up.addr, &dir.path().join("m.json"));
    let proxy = support::proxy(&text, dir.path()).await;
    // Warehouse 1's owner (token 51) first: with plain string prefixes warehouse 12's
    // requests would be judged against this mark and its owner (token 40) refused.
    let wh1 = post(&proxy.url("/warehouses/1/stock"), Some("51")).await;
    assert_eq!(wh1.status, StatusCode::OK);
    let wh12 = post(&proxy.url("/warehouses/12/stock"), Some("40")).await;
    assert_eq!(wh12.status, StatusCode::OK, "{}", wh12.text());
    let marks = proxy.marks().await;
    assert_eq!(marks["warehouse-1"], 51);
    assert_eq!(marks["warehouse-12"], 40);
    // Each warehouse's zombie is refused against its own mark.
    let z12 = post(&proxy.url("/warehouses/12"), Some("39")).await;
    assert_eq!(z12.status, StatusCode::CONFLICT);
    assert_eq!(z12.json()["resource"], "warehouse-12");
    // The prefix itself, below it and its `.format` spelling are warehouse 1's.
    for path in ["/warehouses/1", "/warehouses/1/", "/warehouses/1.json"] {
        let z = post(&proxy.url(path), Some("50")).await;
        assert_eq!(z.status, StatusCode::CONFLICT, "{path}");
        assert_eq!(z.json()["resource"], "warehouse-1", "{path}");
    }
    // A longer segment is not: no route takes a POST to /warehouses/100.
    let other = post(&proxy.url("/warehouses/100"), Some("1")).await;
    assert_eq!(other.status, StatusCode::NOT_FOUND);
    assert_eq!(
        up.log.tokens(),
        [Some("51".into()), Some("40".into())],
        "only the two owners' writes arrived"
    );
    // One mark at a time on the admin listener, guarded or only stored.
    let one = get(&format!("http://{}/marks/warehouse-12", proxy.admin)).await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(
        one.json(),
        serde_json::json!({"resource": "warehouse-12", "mark": 40, "guarded": true})
    );
    let none = get(&format!("http://{}/marks/warehouse%2F9", proxy.admin)).await;
    assert_eq!(
        none.json(),
        serde_json::json!({"resource": "warehouse/9", "mark": 0, "guarded": false})
    );
}

/// One route for every warehouse, one mark per warehouse.
const KEYED: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "{marks}"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "stock"
upstream = "legacy"
path_pattern = "/warehouses/{id}/stock/{sku}"
resource = "warehouse/{id}"

[[route]]
name = "tenant"
upstream = "legacy"
path_prefix = "/tenant"
resource = "tenant/{header.x-tenant}"
"#;

async fn a_templated_route_keeps_one_mark_per_entity() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(KEYED, up.addr, &dir.path().join("m.json"));
    let proxy = support::proxy(&text, dir.path()).await;
    // Tokens of two locks interleave: warehouse 7's leader has 51, warehouse 8's 40.
    let w7 = post(&proxy.url("/warehouses/7/stock/1"), Some("51")).await;
    assert_eq!(w7.status, StatusCode::OK);
    let w8 = post(&proxy.url("/warehouses/8/stock/1"), Some("40")).await;
    assert_eq!(
        w8.status,
        StatusCode::OK,
        "no false rejection: {}",
        w8.text()
    );
    // Each warehouse's zombie is refused against its own mark, whatever its spelling.
    for path in [
        "/warehouses/7/stock/2",
        "/warehouses/7/stock/2/",
        "/warehouses/7/stock/2.json",
    ] {
        let z = post(&proxy.url(path), Some("50")).await;
        assert_eq!(z.status, StatusCode::CONFLICT, "{path}");
        assert_eq!(z.json()["resource"], "warehouse/7", "{path}");
        assert_eq!(z.headers["x-fencing-mark"], "51");
    }
    let z8 = post(&proxy.url("/warehouses/8/stock/3"), Some("39")).await;
    assert_eq!(z8.status, StatusCode::CONFLICT);
    assert_eq!(z8.json()["resource"], "warehouse/8");
    assert_eq!(
        up.log.tokens(),
        [Some("51".into()), Some("40".into())],
        "only the owners' writes arrived"
    );
    let marks = proxy.marks().await;
    assert_eq!(
        (marks["warehouse/7"].clone(), marks["warehouse/8"].clone()),
        (51.into(), 40.into())
    );
    // The store's marks, paged by name.
    let page = get(&format!(
        "http://{}/marks?prefix=warehouse/&limit=1",
        proxy.admin
    ))
    .await;
    assert_eq!(page.json(), serde_json::json!({"warehouse/7": 51}));
    let bad = get(&format!("http://{}/marks?limit=0", proxy.admin)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    // A resource from a header: missing or repeated is a 400, never a guess.
    let r = send(
        &http1_client(),
        Method::POST,
        &proxy.url("/tenant/x"),
        &[("x-fencing-token", b"5")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"], "bad_resource");
    let r = send(
        &http1_client(),
        Method::POST,
        &proxy.url("/tenant/x"),
        &[("x-fencing-token", b"5"), ("x-tenant", b"acme")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(proxy.marks().await["tenant/acme"], 5);
    // A header the upstream would never see (named in Connection) cannot name the entity.
    let r = send(
        &http1_client(),
        Method::POST,
        &proxy.url("/tenant/x"),
        &[
            ("x-fencing-token", b"1"),
            ("x-tenant", b"fresh"),
            ("connection", b"x-tenant"),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    // Nor does another spelling of an entity's name get a mark of its own.
    let r = post(&proxy.url("/warehouses/a%40b/stock/1"), Some("1")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    // A name over 1024 bytes is refused, not truncated.
    let long = format!("/warehouses/{}/stock/1", "7".repeat(1100));
    let r = post(&proxy.url(&long), Some("60")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.json()["message"].as_str().unwrap().contains("1024"),
        "{}",
        r.text()
    );
    // Metrics per route and template, never per entity.
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_stale_rejections_total{resource="warehouse/{id}",route="stock"}"#
        ),
        Some(4.0)
    );
    assert!(
        !m.contains("resource=\"warehouse/7\""),
        "per-entity series:\n{m}"
    );
    proxy.shutdown().await;
    // Marks of entities survive a restart, read from the store on first use.
    let again = support::proxy(&text, dir.path()).await;
    let z = post(&again.url("/warehouses/7/stock/9"), Some("50")).await;
    assert_eq!(z.status, StatusCode::CONFLICT);
    again.shutdown().await;
}

async fn entities_beyond_max_cached_are_evicted_and_beyond_max_marks_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(KEYED, up.addr, &dir.path().join("m.json"))
        .replace("store = \"file\"", "store = \"memory\"\nmax_cached = 8")
        .replace("path = \"", "# path = \"")
        .replace(
            "resource = \"warehouse/{id}\"",
            "resource = \"warehouse/{id}\"\nmax_marks = 1000",
        );
    let proxy = support::proxy(&text, dir.path()).await;
    let client = http1_client();
    for i in 0..1000u64 {
        let token = (100 + i).to_string();
        let r = send(
            &client,
            Method::POST,
            &proxy.url(&format!("/warehouses/{i}/stock/1")),
            &[("x-fencing-token", token.as_bytes())],
            b"",
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "warehouse {i}: {}", r.text());
    }
    // The 1001st entity: refused, nothing stored for it.
    let full = post(&proxy.url("/warehouses/1000/stock/1"), Some("5000")).await;
    assert_eq!(
        full.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        full.text()
    );
    assert_eq!(full.json()["error"], "marks_full");
    // The stored ones keep working, evicted or not: each zombie refused from the store's mark.
    for i in [3u64, 500, 999] {
        let zombie = post(
            &proxy.url(&format!("/warehouses/{i}/stock/2")),
            Some(&(99 + i).to_string()),
        )
        .await;
        assert_eq!(zombie.status, StatusCode::CONFLICT, "warehouse {i}");
        let owner = post(
            &proxy.url(&format!("/warehouses/{i}/stock/2")),
            Some(&(100 + i).to_string()),
        )
        .await;
        assert_eq!(owner.status, StatusCode::OK, "warehouse {i}");
    }
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="marks_full",route="stock"}"#
        ),
        Some(1.0)
    );
    let marks = proxy.marks().await;
    assert!(
        marks.as_object().unwrap().len() <= 9,
        "{} in memory",
        marks.as_object().unwrap().len()
    );
    assert!(
        metric(&m, "palisade_entities_evicted_total").unwrap() >= 990.0
            && metric(&m, "palisade_entities_cached").unwrap() <= 9.0,
        "{m}"
    );
    assert_eq!(
        up.log.len(),
        1003,
        "no zombie and no refused entity reached the upstream"
    );
    proxy.shutdown().await;
}

/// A fence request (`x-fencing-fence: 1`) is judged like any request and answered 204 with
/// the mark, over HTTP/1.1 and h2c; the upstream never sees it. Once the new owner fenced,
/// its predecessor is refused before the new owner wrote anything. Stale, malformed,
/// token-less and unguarded fences get the usual refusals and move nothing.
async fn a_fence_request_moves_the_mark_and_never_reaches_the_upstream() {
    let e = env().await;
    let url = e.proxy.url("/orders/1");
    let fence = |token: &'static str| -> Vec<(&'static str, &'static [u8])> {
        vec![
            ("x-fencing-token", token.as_bytes()),
            ("x-fencing-fence", b"1"),
        ]
    };
    assert_eq!(
        post(&url, Some("34")).await.status,
        StatusCode::OK,
        "owner A writes"
    );
    for (client, token) in [(http1_client(), "51"), (h2c_client(), "52")] {
        let got = send(&client, Method::POST, &url, &fence(token), b"").await;
        assert_eq!(got.status, StatusCode::NO_CONTENT, "{}", got.text());
        assert_eq!(got.headers["x-fencing-mark"], token);
        assert!(
            !got.headers.contains_key("content-length"),
            "a 204 has no length: {:?}",
            got.headers
        );
        assert!(got.body.is_empty());
        // Persisted before the answer, as an advance always is: read from the store itself.
        let stored = palisade::fence::marks::file::read(&e.dir.path().join("marks/marks.json"))
            .unwrap()
            .unwrap();
        assert_eq!(stored["orders"], token.parse::<u64>().unwrap());
    }
    assert_eq!(e.up.log.len(), 1, "no fence reached the upstream");
    // The old owner is refused before the new owner's first write.
    let zombie = post(&url, Some("34")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT);
    assert_eq!(zombie.headers["x-fencing-mark"], "52");
    // A fence with a body, equal to the mark: admitted, the body goes nowhere.
    let got = send(&http1_client(), Method::PUT, &url, &fence("52"), b"ignored").await;
    assert_eq!(got.status, StatusCode::NO_CONTENT);
    // A stale fence is a stale request.
    let got = send(&http1_client(), Method::POST, &url, &fence("51"), b"").await;
    assert_eq!(got.status, StatusCode::CONFLICT);
    assert_eq!(got.json()["error"], "stale_token");
    // Malformed fence headers: 400, nothing moves.
    for bad in [&b"0"[..], b"yes", b"1,1", b""] {
        let headers = [("x-fencing-token", &b"60"[..]), ("x-fencing-fence", bad)];
        let got = send(&http1_client(), Method::POST, &url, &headers, b"").await;
        assert_eq!(got.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(got.json()["error"], "malformed_fence", "{bad:?}");
    }
    let twice = [
        ("x-fencing-token", &b"60"[..]),
        ("x-fencing-fence", b"1"),
        ("x-fencing-fence", b"1"),
    ];
    let got = send(&http1_client(), Method::POST, &url, &twice, b"").await;
    assert_eq!(got.json()["error"], "malformed_fence");
    // A fence needs a token, even on a route that lets token-less requests through.
    for path in ["/orders/1", "/lenient/x"] {
        let headers = [("x-fencing-fence", &b"1"[..])];
        let got = send(
            &http1_client(),
            Method::POST,
            &e.proxy.url(path),
            &headers,
            b"",
        )
        .await;
        assert_eq!(got.status, StatusCode::PRECONDITION_REQUIRED, "{path}");
    }
    // A route that keeps no mark has nothing to fence: refused, never forwarded.
    let got = send(
        &http1_client(),
        Method::POST,
        &e.proxy.url("/other"),
        &fence("60"),
        b"",
    )
    .await;
    assert_eq!(got.status, StatusCode::BAD_REQUEST);
    assert_eq!(got.json()["error"], "nothing_to_fence");
    assert_eq!(e.proxy.marks().await["orders"], 52);
    assert_eq!(e.up.log.len(), 1, "{:?}", e.up.log.paths());
    let m = e.proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"palisade_requests_total{outcome="fence",route="orders-write"}"#
        ),
        Some(3.0),
        "{m}"
    );
}

/// Over gRPC a fence is answered trailers-only with status OK and the mark as metadata, and
/// a stale call's refusal carries the mark as trailing metadata, as the HTTP header does.
async fn a_grpc_fence_is_ok_and_refusals_carry_the_mark() {
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
    let mut client = support::grpc::EchoClient::connect(proxy.addr).await;
    client.say("a", Some("34")).await.unwrap();
    let headers = [
        ("content-type", &b"application/grpc"[..]),
        ("te", b"trailers"),
        ("x-fencing-token", b"51"),
        ("x-fencing-fence", b"1"),
    ];
    let url = proxy.url(support::grpc::SAY);
    let got = send(&h2c_client(), Method::POST, &url, &headers, b"").await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.headers["grpc-status"], "0", "{:?}", got.headers);
    assert_eq!(got.headers["x-fencing-mark"], "51");
    assert!(got.body.is_empty());
    assert_eq!(proxy.marks().await["orders"], 51);
    let stale = client.say("zombie", Some("34")).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::Aborted);
    assert_eq!(stale.metadata().get("x-fencing-mark").unwrap(), "51");
    assert_eq!(
        up.log.len(),
        1,
        "neither the fence nor the zombie reached the upstream"
    );
}

// Every test above runs twice: on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    stale_token_is_rejected_with_409_and_never_reaches_upstream,
    a_fence_request_moves_the_mark_and_never_reaches_the_upstream,
    a_grpc_fence_is_ok_and_refusals_carry_the_mark,
    malformed_tokens_get_400_and_missing_gets_428,
    zombie_story_shows_in_metrics,
    cross_protocol_h2c_to_http1_and_http1_to_h2c,
    trailers_pass_both_ways_between_protocols,
    forwarded_headers_added_and_hop_by_hop_removed,
    no_route_is_404_and_upstream_failures_are_502_and_504,
    store_that_cannot_write_answers_503_and_keeps_the_mark,
    graceful_shutdown_lets_in_flight_requests_finish,
    alternative_spellings_of_a_guarded_path_never_bypass_the_guard,
    exact_route_guards_trailing_slash_format_suffix_and_segment_parameters,
    ambiguous_hosts_are_refused_before_routing,
    strip_token_removes_the_header_and_shares_the_resource_mark,
    an_admitted_request_is_sent_upstream_once_even_when_the_upstream_fails,
    the_proxy_passes_the_admission_table_over_http_and_grpc,
    a_path_prefix_stops_at_a_segment_boundary,
    a_templated_route_keeps_one_mark_per_entity,
    entities_beyond_max_cached_are_evicted_and_beyond_max_marks_refused,
);
