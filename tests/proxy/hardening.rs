//! Regression tests for the proxy hardening: each attack that got a stale write past
//! a realistic configuration, sent over raw sockets (or raw HTTP/2 frames) as an attacker
//! would, against a "legacy" upstream that behaves like Python's `BaseHTTPRequestHandler`.

use crate::support;

use support::closed_within;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the legacy upstream executed: `(method, path, host, token, connection header)`.
#[derive(Debug, Clone, Default)]
struct Executed(Arc<Mutex<Vec<Exec>>>);

#[derive(Debug, Clone)]
struct Exec {
    method: String,
    path: String,
    host: Option<String>,
    token: Option<String>,
}

impl Executed {
    fn all(&self) -> Vec<Exec> {
        self.0.lock().unwrap().clone()
    }
    fn stale_writes(&self, stale: &str) -> Vec<Exec> {
        self.all()
            .into_iter()
            .filter(|e| e.token.as_deref() == Some(stale))
            .collect()
    }
}

/// A keep-alive HTTP/1.1 server in the manner of `BaseHTTPRequestHandler`: it reads a body
/// only when Content-Length is set and the method is not GET/HEAD/OPTIONS/TRACE, never
/// understands chunked bodies, and honours `Connection: close`. Bytes it does not read are
/// parsed as the next request.
async fn legacy_upstream() -> (std::net::SocketAddr, Executed) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let log = Executed::default();
    let out = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let log = log.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(s);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut words = line.split_whitespace();
                    let (Some(method), Some(path)) = (words.next(), words.next()) else {
                        let _ = r.get_mut().write_all(b"HTTP/1.1 400 Bad\r\n\r\n").await;
                        return;
                    };
                    let (method, path) = (method.to_owned(), path.to_owned());
                    let (mut len, mut close, mut token, mut host) = (0usize, false, None, None);
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        let (k, v) = h.split_once(':').unwrap_or((h, ""));
                        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_owned());
                        match k.as_str() {
                            "content-length" => len = v.parse().unwrap_or(0),
                            "connection" => close = v.eq_ignore_ascii_case("close"),
                            "x-fencing-token" => token = Some(v),
                            "host" => host = Some(v),
                            _ => {}
                        }
                    }
                    if !matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS" | "TRACE") {
                        let mut body = vec![0; len];
                        if r.read_exact(&mut body).await.is_err() {
                            return;
                        }
                    }
                    log.0.lock().unwrap().push(Exec {
                        method,
                        path,
                        host,
                        token,
                    });
                    let resp = if close {
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    } else {
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    };
                    if r.get_mut().write_all(resp.as_bytes()).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (addr, out)
}

/// The realistic shape: a guarded write route, a host-scoped guarded route, and an unguarded
/// catch-all that lists no methods (the configuration the attacks were found with).
const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
{proxy_extra}
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
methods = ["POST", "PUT", "PATCH", "DELETE"]
resource = "orders"
{orders_extra}
[[route]]
name = "hosted"
upstream = "legacy"
host = "api.example.com"
path_prefix = "/hosted"
resource = "hosted"
[[route]]
name = "capped"
upstream = "legacy"
path_prefix = "/capped"
resource = "capped"
max_token = 1000
[[route]]
name = "forwarding"
upstream = "legacy"
path_prefix = "/forwarding"
guard = false
get_bodies = "forward"
[[route]]
name = "everything-else"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

struct Env {
    proxy: support::Proxy,
    exec: Executed,
    _dir: tempfile::TempDir,
}

async fn env_with(proxy_extra: &str, orders_extra: &str) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let (up, exec) = legacy_upstream().await;
    let text = support::render(CONFIG, up, &dir.path().join("marks.json"))
        .replace("{proxy_extra}", proxy_extra)
        .replace("{orders_extra}", orders_extra);
    let proxy = support::proxy(&text, dir.path()).await;
    let e = Env {
        proxy,
        exec,
        _dir: dir,
    };
    // Owner B wrote with 51: every 34 from now on is a zombie.
    assert_eq!(e.raw(&req("POST", "/orders/1", "h", "51")).await, 200);
    assert_eq!(
        e.raw(&req("POST", "/hosted/1", "api.example.com", "51"))
            .await,
        200
    );
    e
}

async fn env() -> Env {
    env_with("", "").await
}

fn req(method: &str, target: &str, host: &str, token: &str) -> String {
    format!(
        "{method} {target} HTTP/1.1\r\nhost: {host}\r\nx-fencing-token: {token}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
}

impl Env {
    /// Sends `bytes` on a new connection and returns the first response's status (0 when the
    /// connection closed without one).
    async fn raw(&self, bytes: &str) -> u16 {
        raw_response(self.proxy.addr, bytes.as_bytes()).await.0
    }
}

async fn raw_response(addr: std::net::SocketAddr, bytes: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut resp = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut resp)).await;
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

async fn a_request_smuggled_in_a_get_body_never_reaches_the_upstream() {
    let e = env().await;
    let inner =
        "POST /orders/1 HTTP/1.1\r\nhost: h\r\nx-fencing-token: 34\r\ncontent-length: 0\r\n\r\n";
    let outer = |path: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nhost: h\r\ncontent-length: {}\r\n\r\n{inner}",
            inner.len()
        )
    };
    // Refused by default, on the catch-all too.
    let (status, text) = raw_response(e.proxy.addr, outer("/public").as_bytes()).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("bad_request"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "the unread body must not be read as the next request: {text}"
    );
    // Methods are routed whatever their case (a legacy upstream may take `get` for GET), so
    // a body on `get`, `Head` or `options` is refused the same way, on both framings.
    for m in ["get", "Head", "options", "tRACE"] {
        let lower = outer("/public").replacen("GET", m, 1);
        let (status, text) = raw_response(e.proxy.addr, lower.as_bytes()).await;
        assert_eq!(status, 400, "{m}: {text}");
        assert!(
            text.to_ascii_lowercase().contains("connection: close"),
            "{text}"
        );
    }
    // The same with chunked framing, and on HEAD/OPTIONS.
    for m in ["GET", "HEAD", "OPTIONS", "TRACE", "get", "head"] {
        let chunked = format!(
            "{m} /public HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{inner}\r\n0\r\n\r\n",
            inner.len()
        );
        assert_eq!(e.raw(&chunked).await, 400, "{m} chunked");
    }
    // A route that opts in forwards the body, and the upstream connection is closed after it,
    // so the embedded request is never parsed.
    let forward = outer("/forwarding").replacen("\r\n\r\n", "\r\nconnection: close\r\n\r\n", 1);
    let (status, text) = raw_response(e.proxy.addr, forward.as_bytes()).await;
    assert_eq!(status, 200, "{text}");
    // A later request on a pooled connection must not find the leftovers either.
    assert_eq!(e.raw(&req("GET", "/public", "h", "1")).await, 200);
    assert!(
        e.exec.stale_writes("34").is_empty(),
        "the smuggled POST was executed: {:?}",
        e.exec.all()
    );
    assert!(e
        .exec
        .all()
        .iter()
        .any(|x| x.method == "GET" && x.path == "/forwarding"));
    // An empty body is no body.
    assert_eq!(
        e.raw("GET /public HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await,
        200
    );
}

const UNLISTED: [&str; 12] = [
    "PROPFIND",
    "MKCOL",
    "MOVE",
    "COPY",
    "LOCK",
    "PROPPATCH",
    "MERGE",
    "REPORT",
    "SEARCH",
    "QUERY",
    "FOO",
    "UNLOCK",
];

async fn unlisted_methods_are_refused_with_405_when_the_guarded_route_says_so() {
    let e = env_with("", "other_methods = \"reject\"").await;
    for m in UNLISTED {
        let (status, text) =
            raw_response(e.proxy.addr, req(m, "/orders/1", "h", "34").as_bytes()).await;
        assert_eq!(status, 405, "{m}: {text}");
        let allow = text
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("allow:"))
            .unwrap_or_else(|| panic!("no Allow header: {text}"));
        assert!(allow.contains("POST, PUT, PATCH, DELETE"), "{allow}");
    }
    // CONNECT in authority form has no path to route: 400.
    let connect = "CONNECT api.example.com:443 HTTP/1.1\r\nhost: api.example.com:443\r\nx-fencing-token: 34\r\nconnection: close\r\n\r\n";
    assert_eq!(e.raw(connect).await / 100, 4);
    assert!(e.exec.stale_writes("34").is_empty(), "{:?}", e.exec.all());
    let m = e.proxy.metrics().await;
    assert_eq!(
        support::metric(
            &m,
            "palisade_requests_total{outcome=\"method_not_allowed\",route=\"orders-write\"}"
        ),
        Some(UNLISTED.len() as f64)
    );
}

async fn a_catch_all_listing_safe_methods_forwards_no_unlisted_method() {
    // The shipped example's shape: the catch-all lists GET, HEAD, OPTIONS only.
    let dir = tempfile::tempdir().unwrap();
    let (up, exec) = legacy_upstream().await;
    let text = support::render(CONFIG, up, &dir.path().join("marks.json"))
        .replace("{proxy_extra}", "")
        .replace("{orders_extra}", "")
        .replace(
            "path_prefix = \"/\"\nguard = false",
            "path_prefix = \"/\"\nmethods = [\"GET\", \"HEAD\", \"OPTIONS\"]\nguard = false",
        );
    let config = palisade::Config::parse(&text, &dir.path().join("p.toml")).unwrap();
    assert!(config.warnings.is_empty(), "{:?}", config.warnings);
    let proxy = support::proxy(&text, dir.path()).await;
    for m in UNLISTED {
        let (status, _) = raw_response(proxy.addr, req(m, "/orders/1", "h", "34").as_bytes()).await;
        assert_eq!(status, 404, "{m}");
    }
    assert!(exec.all().is_empty(), "{:?}", exec.all());
    // Reads still pass.
    let (status, _) = raw_response(proxy.addr, req("GET", "/orders/1", "h", "34").as_bytes()).await;
    assert_eq!(status, 200);
}

#[test]
fn check_warns_when_an_unguarded_route_forwards_unlisted_methods() {
    let text = support::render(CONFIG, "127.0.0.1:1".parse().unwrap(), "m.json".as_ref())
        .replace("{proxy_extra}", "")
        .replace("{orders_extra}", "");
    let c = palisade::Config::parse(&text, "p.toml".as_ref()).unwrap();
    let w: Vec<String> = c.warnings.iter().map(ToString::to_string).collect();
    assert!(
        w.iter().any(|w| w.contains("route[4]")
            && w.contains("\"everything-else\"")
            && w.contains("\"orders-write\"")
            && w.contains("other_methods")),
        "{w:?}"
    );
    // other_methods = "reject" is the other fix.
    let fixed = text.replace(
        "resource = \"orders\"\n",
        "resource = \"orders\"\nother_methods = \"reject\"\n",
    );
    let c = palisade::Config::parse(&fixed, "p.toml".as_ref()).unwrap();
    assert!(
        !c.warnings
            .iter()
            .any(|w| w.message.contains("orders-write")),
        "{:?}",
        c.warnings
    );
    // An unguarded route listed first that covers a guarded one is flagged too.
    let shadow = text.replace(
        "[[route]]\nname = \"orders-write\"",
        "[[route]]\nname = \"early\"\nupstream = \"legacy\"\npath_prefix = \"/\"\nguard = false\n[[route]]\nname = \"orders-write\"",
    );
    let c = palisade::Config::parse(&shadow, "p.toml".as_ref()).unwrap();
    assert!(
        c.warnings
            .iter()
            .any(|w| w.message.contains("comes before")),
        "{:?}",
        c.warnings
    );
}

async fn a_missing_or_malformed_host_never_skips_a_host_scoped_route() {
    let e = env().await;
    let body = "x-fencing-token: 34\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
    let cases = [
        format!("POST /hosted/1 HTTP/1.1\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.0\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: \r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com..\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com:80:80\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: u@api.example.com\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com, other\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com,other\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com/x\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: .api.example.com\r\n{body}"),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com:\r\n{body}"),
        format!(
            "POST http://u@api.example.com/hosted/1 HTTP/1.1\r\nhost: u@api.example.com\r\n{body}"
        ),
        format!(
            "POST http://u@api.example.com/hosted/1 HTTP/1.1\r\nhost: api.example.com\r\n{body}"
        ),
        format!(
            "POST http://api.example.com/hosted/1 HTTP/1.1\r\nhost: other.example.com\r\n{body}"
        ),
        format!("POST /hosted/1 HTTP/1.1\r\nhost: api.example.com\r\nhost: other\r\n{body}"),
    ];
    for c in &cases {
        let (status, text) = raw_response(e.proxy.addr, c.as_bytes()).await;
        assert_eq!(status, 400, "{c:?}: {text}");
    }
    // A trailing dot names the same host: judged by the guard, and forwarded without the dot.
    let dotted = format!("POST /hosted/1 HTTP/1.1\r\nhost: API.example.com.:8080\r\n{body}");
    assert_eq!(e.raw(&dotted).await, 409);
    assert!(e.exec.stale_writes("34").is_empty(), "{:?}", e.exec.all());
    let fresh = dotted.replace("34", "52");
    assert_eq!(e.raw(&fresh).await, 200);
    let last = e.exec.all().pop().unwrap();
    assert_eq!(
        last.host.as_deref(),
        Some("API.example.com:8080"),
        "{last:?}"
    );
}

async fn smaller_holes_overlong_escapes_token_aliases_max_token_grpc_types() {
    let e = env_with("require_nfkc_paths = true", "").await;
    // Overlong UTF-8 (an old spelling of '/') and other invalid escapes: 400.
    for target in ["/x%C0%AF..%C0%AForders/1", "/orders%C0%AF1", "/x%ED%A0%80"] {
        assert_eq!(
            e.raw(&req("POST", target, "h", "34")).await,
            400,
            "{target}"
        );
    }
    // A full-width 'o' that an NFKC-normalising upstream reads as /orders.
    assert_eq!(
        e.raw(&req("POST", "/%EF%BD%8Frders/1", "h", "34")).await,
        400
    );
    // `x_fencing_token` next to (or instead of) the real header on a guarded route.
    for alias in ["x_fencing_token", "x-fencing_token"] {
        let r = format!("POST /orders/1 HTTP/1.1\r\nhost: h\r\nx-fencing-token: 51\r\n{alias}: 34\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        let (status, text) = raw_response(e.proxy.addr, r.as_bytes()).await;
        assert_eq!(status, 400, "{alias}: {text}");
        assert!(text.contains("token_alias"), "{text}");
    }
    // max_token: a forged huge token is refused and leaves the mark alone.
    assert_eq!(e.raw(&req("POST", "/capped/1", "h", "1000")).await, 200);
    let (status, text) = raw_response(
        e.proxy.addr,
        req("POST", "/capped/1", "h", "18446744073709551615").as_bytes(),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("token_above_max"), "{text}");
    assert_eq!(e.proxy.marks().await["capped"], 1000);
    // Only real gRPC content types get the trailers-only form.
    let ct = |t: &str| {
        format!("POST /orders/1 HTTP/1.1\r\nhost: h\r\ncontent-type: {t}\r\nx-fencing-token: 34\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    };
    let (status, text) = raw_response(e.proxy.addr, ct("application/grpcfoo").as_bytes()).await;
    assert_eq!(status, 409, "{text}");
    let (status, text) = raw_response(e.proxy.addr, ct("application/grpc+proto").as_bytes()).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("grpc-status: 10"),
        "{text}"
    );
    assert!(e.exec.stale_writes("34").is_empty(), "{:?}", e.exec.all());
}

async fn silent_partial_and_idle_connections_are_closed() {
    let e = env_with(
        "header_read_timeout_ms = 300\nidle_timeout_ms = 600\nhttp2_keepalive_interval_ms = 0",
        "",
    )
    .await;
    let addr = e.proxy.addr;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"GET / HTTP/1.1\r\nhost: h\r\n")
        .await
        .unwrap();
    let mut half_preface = TcpStream::connect(addr).await.unwrap();
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // h2c: a full preface and SETTINGS, then a HEADERS frame without END_HEADERS that never
    // gets its CONTINUATION.
    let mut h2 = TcpStream::connect(addr).await.unwrap();
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    h2.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap(); // empty SETTINGS
                                                               // HEADERS on stream 1 with END_STREAM but not END_HEADERS; payload `:method GET`.
    h2.write_all(&[0, 0, 1, 1, 0x1, 0, 0, 0, 1, 0x82])
        .await
        .unwrap();
    // A keep-alive connection that served one request, then went quiet.
    let mut keep = TcpStream::connect(addr).await.unwrap();
    keep.write_all(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 256];
    let n = keep.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));

    for (name, s) in [
        ("silent", &mut silent),
        ("partial head", &mut partial),
        ("half preface", &mut half_preface),
        ("h2 headers without end", &mut h2),
        ("keep-alive idle", &mut keep),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "{name} connection still open"
        );
    }
    let m = e.proxy.metrics().await;
    let closed = |r: &str| {
        support::metric(
            &m,
            &format!("palisade_connections_closed_total{{listener=\"proxy\",reason=\"{r}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(closed("header_read_timeout") >= 3.0, "{m}");
    assert!(closed("idle_timeout") >= 2.0, "{m}");
}

async fn a_response_slower_than_the_idle_timeout_is_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let text = support::render(
        r#"
[proxy]
listen = "127.0.0.1:0"
header_read_timeout_ms = 200
idle_timeout_ms = 200
[admin]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "u"
url = "http://{upstream}"
[[route]]
name = "all"
upstream = "u"
path_prefix = "/"
guard = false
"#,
        up.addr,
        &dir.path().join("m.json"),
    );
    let proxy = support::proxy(&text, dir.path()).await;
    for client in [support::http1_client(), support::h2c_client()] {
        let got = support::send(
            &client,
            http::Method::GET,
            &proxy.url("/a/slow?700"),
            &[],
            b"",
        )
        .await;
        assert_eq!(got.status, 200);
        assert_eq!(got.text(), "slow done");
    }
}

async fn strip_token_also_removes_the_token_from_request_trailers() {
    use bytes::Bytes;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    // An upstream that records the trailers of every request it receives.
    let upstream = support::upstream::builder().start().await;
    let up = upstream.addr;
    let dir = tempfile::tempdir().unwrap();
    let text = support::render(
        r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "u"
url = "http://{upstream}"
protocol = "h2c"
[[route]]
name = "stripped"
upstream = "u"
path_prefix = "/stripped"
resource = "r"
strip_token = true
[[route]]
name = "kept"
upstream = "u"
path_prefix = "/kept"
resource = "r"
"#,
        up,
        &dir.path().join("m.json"),
    );
    let proxy = support::proxy(&text, dir.path()).await;
    let client: hyper_util::client::legacy::Client<_, StreamBody<_>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    for path in ["/stripped/1", "/kept/1"] {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-fencing-token", http::HeaderValue::from_static("34"));
        trailers.insert("x-other", http::HeaderValue::from_static("kept"));
        let frames = vec![
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"body"))),
            Ok(Frame::trailers(trailers)),
        ];
        let req = http::Request::post(proxy.url(path))
            .header("x-fencing-token", "51")
            .body(StreamBody::new(tokio_stream::iter(frames)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
    let seen: Vec<http::HeaderMap> = upstream
        .log
        .all()
        .into_iter()
        .map(|s| s.trailers.unwrap_or_default())
        .collect();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].get("x-fencing-token"),
        None,
        "stripped: {:?}",
        seen[0]
    );
    assert_eq!(seen[0]["x-other"], "kept");
    assert_eq!(
        seen[1]["x-fencing-token"], "34",
        "kept route forwards trailers as sent"
    );
}

/// Framing that two hops could read differently is refused the same way on both data paths
/// (as nginx does), never re-framed: a transfer coding other than `chunked` alone, `chunked`
/// twice, two `Transfer-Encoding` fields, `Transfer-Encoding` with `Content-Length` (in
/// either order), two `Content-Length` fields even when equal, a `Content-Length` list, and
/// bare-LF line ends; also when the ambiguous head is not the connection's first. Nothing
/// reaches the upstream and the connection is closed after the refusal (what follows the
/// head is not read as a next request).
async fn ambiguous_framing_is_refused_on_both_paths() {
    let e = env().await;
    let body = "3\r\nabc\r\n0\r\n\r\n";
    let head = |fields: &str| {
        format!(
            "POST /orders/1 HTTP/1.1\r\nhost: h\r\nx-fencing-token: 60\r\n{fields}\r\n{body}GET /public HTTP/1.1\r\nhost: h\r\n\r\n"
        )
    };
    let cases = [
        (head("transfer-encoding: gzip, chunked\r\n"), 501),
        (head("transfer-encoding: identity, chunked\r\n"), 501),
        // Not ending in chunked: the length cannot be known (RFC 9112 6.3).
        (head("transfer-encoding: identity\r\n"), 400),
        (head("transfer-encoding: chunked, chunked\r\n"), 400),
        (
            head("transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n"),
            400,
        ),
        (
            head("transfer-encoding: chunked\r\ncontent-length: 14\r\n"),
            400,
        ),
        (
            head("content-length: 14\r\ntransfer-encoding: chunked\r\n"),
            400,
        ),
        (head("content-length: 14\r\ncontent-length: 14\r\n"), 400),
        (head("content-length: 14, 14\r\n"), 400),
        (
            "POST /orders/1 HTTP/1.1\nhost: h\nx-fencing-token: 61\ncontent-length: 0\n\n"
                .to_owned(),
            400,
        ),
        (
            "POST /orders/1 HTTP/1.1\r\nhost: h\r\nx-fencing-token: 61\ncontent-length: 0\r\n\r\n"
                .to_owned(),
            400,
        ),
    ];
    let before = e.exec.all().len();
    for (bytes, want) in &cases {
        let (status, text) = raw_response(e.proxy.addr, bytes.as_bytes()).await;
        assert_eq!(status, *want, "{bytes:?}: {text}");
        assert_eq!(
            text.matches("HTTP/1.1 ").count(),
            1,
            "{bytes:?}: nothing after the refusal is answered: {text}"
        );
        assert!(
            text.to_ascii_lowercase().contains("connection: close"),
            "{bytes:?}: {text}"
        );
    }
    assert_eq!(e.exec.all().len(), before, "none reached the upstream");
    // After a request served on the same connection (on the fast path: after a chunked one or
    // an upgrade, which hand the connection to hyper), each is refused just the same.
    for first in [
        "GET /public HTTP/1.1\r\nhost: h\r\n\r\n".to_owned(),
        // An upgrade the route does not take: answered as a plain request, the connection
        // goes on, and what follows is judged as ever.
        "GET /public HTTP/1.1\r\nhost: h\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
            .to_owned(),
        format!("POST /public HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n{body}"),
    ] {
        for (bytes, want) in &cases {
            let served = e.exec.all().len();
            let (status, text) =
                raw_response(e.proxy.addr, format!("{first}{bytes}").as_bytes()).await;
            assert_eq!(status, 200, "{text}");
            let second = text.split("HTTP/1.1 ").nth(2).unwrap_or_default();
            assert!(
                second.starts_with(&want.to_string()),
                "{bytes:?} after {first:?}: {text}"
            );
            assert_eq!(e.exec.all().len(), served + 1, "only the first: {text}");
        }
    }
}

// Every test above runs twice: on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    ambiguous_framing_is_refused_on_both_paths,
    a_request_smuggled_in_a_get_body_never_reaches_the_upstream,
    unlisted_methods_are_refused_with_405_when_the_guarded_route_says_so,
    a_catch_all_listing_safe_methods_forwards_no_unlisted_method,
    a_missing_or_malformed_host_never_skips_a_host_scoped_route,
    smaller_holes_overlong_escapes_token_aliases_max_token_grpc_types,
    silent_partial_and_idle_connections_are_closed,
    a_response_slower_than_the_idle_timeout_is_not_cut,
    strip_token_also_removes_the_token_from_request_trailers,
);

/// [`silent_partial_and_idle_connections_are_closed`] on a runtime with two workers: the fast
/// path's sentry runs beside its connection's task, on another thread.
async fn silent_partial_and_idle_connections_are_closed_on_two_workers() {
    silent_partial_and_idle_connections_are_closed().await;
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    silent_partial_and_idle_connections_are_closed_on_two_workers,
);
