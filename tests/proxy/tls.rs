//! TLS on the listener (`[proxy.tls]`), with certificates made by the test (rcgen): HTTPS over
//! HTTP/1.1 and HTTP/2 (ALPN), gRPC over TLS, client certificates when `client_ca` is set, and
//! `palisade check` naming what is wrong with the files.

use crate::support;

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;

struct Pki {
    ca_pem: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
    /// A client certificate from a CA the proxy does not trust.
    rogue_cert: String,
    rogue_key: String,
}

fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(p, key))
}

fn leaf(names: &[&str], issuer: &Issuer<'_, KeyPair>) -> (String, String) {
    let p =
        CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn pki() -> Pki {
    let (ca_pem, issuer) = ca("palisade test CA");
    let (server_cert, server_key) = leaf(&["localhost", "127.0.0.1"], &issuer);
    let (client_cert, client_key) = leaf(&["client"], &issuer);
    let (_, rogue) = ca("someone else's CA");
    let (rogue_cert, rogue_key) = leaf(&["client"], &rogue);
    Pki {
        ca_pem,
        server_cert,
        server_key,
        client_cert,
        client_key,
        rogue_cert,
        rogue_key,
    }
}

fn write_pki(dir: &Path, pki: &Pki) {
    for (name, text) in [
        ("ca.pem", &pki.ca_pem),
        ("server.pem", &pki.server_cert),
        ("server.key", &pki.server_key),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

fn config(client_auth: bool) -> String {
    let ca = if client_auth {
        "client_ca = \"ca.pem\"\n"
    } else {
        ""
    };
    format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[proxy.tls]
cert = "server.pem"
key = "server.key"
{ca}
[marks]
store = "file"
path = "marks.json"
[[upstream]]
name = "legacy"
url = "http://{{upstream}}"
[[upstream]]
name = "echo"
url = "http://{{grpc}}"
protocol = "h2c"
[[route]]
name = "echo"
upstream = "echo"
path_prefix = "/test.Echo/"
resource = "echo"
[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"
[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/"
methods = ["GET"]
guard = false
"#
    )
}

fn client_config(pki: &Pki, alpn: &[&[u8]], cert: Option<(&str, &str)>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut c = match cert {
        None => b.with_no_client_auth(),
        Some((cert, key)) => b
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
    };
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(c)
}

struct Env {
    proxy: support::Proxy,
    up: support::Upstream,
    pki: Pki,
    _grpc: support::grpc::GrpcUpstream,
    _dir: tempfile::TempDir,
}

async fn setup(client_auth: bool) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    write_pki(dir.path(), &pki);
    let up = support::upstream().await;
    let grpc = support::grpc::upstream().await;
    let text = config(client_auth)
        .replace("{upstream}", &up.addr.to_string())
        .replace("{grpc}", &grpc.addr.to_string());
    let proxy = support::proxy(&text, dir.path()).await;
    Env {
        proxy,
        up,
        pki,
        _grpc: grpc,
        _dir: dir,
    }
}

/// One HTTPS request on a new TLS connection; the ALPN protocol decides HTTP/1.1 or HTTP/2.
async fn https(
    env: &Env,
    tls: Arc<ClientConfig>,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> Result<(StatusCode, String, Option<Vec<u8>>), Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect(env.proxy.addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let stream = TlsConnector::from(tls).connect(name, tcp).await?;
    let alpn = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let mut req = Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"));
    if let Some(t) = token {
        req = req.header("x-fencing-token", t);
    }
    let req = req.body(Full::new(Bytes::new()))?;
    let resp = if alpn.as_deref() == Some(b"h2") {
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(stream),
        )
        .await?;
        tokio::spawn(conn);
        send.send_request(req).await?
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let mut req = req;
        req.headers_mut()
            .insert("host", "localhost".parse().unwrap());
        send.send_request(req).await?
    };
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned(), alpn))
}

#[tokio::test]
async fn https_over_http1_and_http2_reaches_the_upstream_and_is_guarded() {
    let env = setup(false).await;
    let h1 = client_config(&env.pki, &[b"http/1.1"], None);
    let (status, _, alpn) = https(&env, Arc::clone(&h1), "GET", "/items/1", None)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    let seen = env.up.log.all();
    assert_eq!(seen.last().unwrap().headers["x-forwarded-proto"], "https");

    let h2 = client_config(&env.pki, &[b"h2", b"http/1.1"], None);
    let (status, _, alpn) = https(&env, Arc::clone(&h2), "POST", "/orders/1", Some("7"))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        alpn.as_deref(),
        Some(&b"h2"[..]),
        "ALPN must pick h2 when offered"
    );
    let (status, body, _) = https(&env, h2, "POST", "/orders/1", Some("6"))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(env.proxy.marks().await["orders"], 7);
}

#[tokio::test]
async fn grpc_over_tls_with_alpn_h2_is_guarded() {
    use tonic::Code;
    let env = setup(false).await;
    let tls = client_config(&env.pki, &[b"h2"], None);
    let mut client = support::grpc::EchoClient::connect_tls(env.proxy.addr, tls)
        .await
        .unwrap();
    let r = client.say("hello", Some("5")).await.unwrap();
    assert_eq!(r.get_ref().text, "echo hello");
    let e = client.say("stale", Some("4")).await.unwrap_err();
    assert_eq!(e.code(), Code::Aborted);
}

#[tokio::test]
async fn with_client_ca_only_clients_with_a_valid_certificate_get_through() {
    let env = setup(true).await;
    let good = client_config(
        &env.pki,
        &[b"http/1.1"],
        Some((env.pki.client_cert.as_str(), env.pki.client_key.as_str())),
    );
    let (status, _, _) = https(&env, good, "GET", "/items/1", None).await.unwrap();
    assert_eq!(status, StatusCode::OK);

    let before = env.up.log.len();
    let none = client_config(&env.pki, &[b"http/1.1"], None);
    assert!(
        https(&env, none, "GET", "/items/2", None).await.is_err(),
        "no certificate"
    );
    let rogue = client_config(
        &env.pki,
        &[b"http/1.1"],
        Some((env.pki.rogue_cert.as_str(), env.pki.rogue_key.as_str())),
    );
    assert!(
        https(&env, rogue, "GET", "/items/3", None).await.is_err(),
        "untrusted certificate"
    );
    assert_eq!(
        env.up.log.len(),
        before,
        "refused clients reached the upstream"
    );
    let m = env.proxy.metrics().await;
    assert!(
        support::metric(
            &m,
            "palisade_connections_closed_total{listener=\"proxy\",reason=\"tls_handshake\"}"
        )
        .unwrap_or(0.0)
            >= 2.0,
        "{m}"
    );
}

#[test]
fn tls_file_errors_name_the_key_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let p = pki();
    write_pki(dir.path(), &p);
    let file = dir.path().join("palisade.toml");
    let parse = |text: &str| {
        palisade::Config::parse(text, &file)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let base = config(true)
        .replace("{upstream}", "127.0.0.1:1")
        .replace("{grpc}", "127.0.0.1:2");
    assert_eq!(parse(&base), Ok(()));
    // Missing file.
    let e = parse(&base.replace("cert = \"server.pem\"", "cert = \"nope.pem\"")).unwrap_err();
    assert!(
        e.contains("proxy.tls.cert") && e.contains("cannot read"),
        "{e}"
    );
    // A key that belongs to another certificate.
    std::fs::write(dir.path().join("other.key"), &p.client_key).unwrap();
    let e = parse(&base.replace("key = \"server.key\"", "key = \"other.key\"")).unwrap_err();
    assert!(
        e.contains("proxy.tls.key") && e.contains("does not go with"),
        "{e}"
    );
    // Not PEM at all.
    std::fs::write(dir.path().join("junk.pem"), "hello").unwrap();
    let e = parse(&base.replace("client_ca = \"ca.pem\"", "client_ca = \"junk.pem\"")).unwrap_err();
    assert!(
        e.contains("proxy.tls.client_ca") && e.contains("no PEM certificate"),
        "{e}"
    );
    // file:line:column.
    assert!(e.contains(&format!("{}:", file.display())), "{e}");
}

fn server_config(pki: &Pki) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(pki.server_cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(pki.server_key.as_bytes()).unwrap(),
        )
        .unwrap();
    c.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(c)
}

/// An HTTPS upstream (palisade's own server with TLS) that answers with what it saw:
/// `version tls=<TLS connection> proto=<x-forwarded-proto> token=<x-fencing-token>`.
async fn https_upstream(pki: &Pki) -> support::Upstream {
    support::upstream::builder()
        .tls(server_config(pki))
        .reply(|s| {
            let h = |n: &str| {
                s.headers
                    .get(n)
                    .map(|v| v.to_str().unwrap_or("?").to_owned())
                    .unwrap_or_default()
            };
            let text = format!(
                "{:?} tls={} proto={} token={}",
                s.version,
                s.tls,
                h("x-forwarded-proto"),
                h("x-fencing-token")
            );
            support::upstream::Reply::text(text).unread()
        })
        .start()
        .await
}

async fn proxy_to(upstream: &str, grpc: &str, pki: &Pki) -> (support::Proxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    write_pki(dir.path(), pki);
    let text = format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "secure"
{upstream}
[[upstream]]
name = "echo"
{grpc}
[[route]]
name = "echo"
upstream = "echo"
path_prefix = "/test.Echo/"
resource = "echo"
[[route]]
name = "orders"
upstream = "secure"
path_prefix = "/"
resource = "orders"
"#
    );
    let p = support::proxy(&text, dir.path()).await;
    (p, dir)
}

#[tokio::test]
async fn https_client_to_palisade_to_an_https_upstream_and_grpc_to_an_h2_tls_upstream() {
    let pki = pki();
    let up = https_upstream(&pki).await;
    let grpc = support::grpc::upstream_tls(server_config(&pki)).await;
    let (p, _dir) = proxy_to(
        &format!(
            "url = \"https://127.0.0.1:{}\"\nca = \"ca.pem\"",
            up.addr.port()
        ),
        &format!(
            "url = \"https://127.0.0.1:{}\"\nprotocol = \"h2\"\nca = \"ca.pem\"",
            grpc.addr.port()
        ),
        &pki,
    )
    .await;
    // Plain HTTP/1.1 client -> palisade -> HTTPS upstream (HTTP/1.1 by ALPN).
    let r = support::post(&p.url("/orders/1"), Some("3")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.text(), "HTTP/1.1 tls=true proto=http token=3");
    let r = support::post(&p.url("/orders/1"), Some("2")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    // gRPC (h2c in) -> palisade -> gRPC over TLS (h2 by ALPN).
    let mut client = support::grpc::EchoClient::connect(p.addr).await;
    let reply = client.say("over tls", Some("1")).await.unwrap();
    assert_eq!(reply.get_ref().text, "echo over tls");
    assert_eq!(grpc.log.len(), 1);
}

#[tokio::test]
async fn an_https_upstream_with_a_certificate_nobody_trusts_gets_502() {
    let pki = pki();
    let up = https_upstream(&pki).await;
    // No `ca`: the system's roots, which do not know the test CA.
    let (p, _dir) = proxy_to(
        &format!("url = \"https://127.0.0.1:{}\"", up.addr.port()),
        "url = \"http://127.0.0.1:1\"\nprotocol = \"h2c\"",
        &pki,
    )
    .await;
    let r = support::post(&p.url("/orders/1"), Some("3")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(r.text().contains("certificate"), "{}", r.text());
}

/// `GET /items/1` over a new TLS connection (HTTP/1.1) to `addr`.
async fn get_tls(
    addr: std::net::SocketAddr,
    tls: Arc<ClientConfig>,
) -> Result<StatusCode, Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let stream = TlsConnector::from(tls).connect(name, tcp).await?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = Request::get("/items/1")
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))?;
    Ok(send.send_request(req).await?.status())
}

#[tokio::test]
async fn a_reload_puts_new_certificates_in_force_for_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let old = pki();
    write_pki(dir.path(), &old);
    let file = dir.path().join("palisade.toml");
    let text = config(false)
        .replace("{upstream}", &up.addr.to_string())
        .replace("{grpc}", "127.0.0.1:1");
    std::fs::write(&file, text).unwrap();
    let proxy = support::proxy_file(&file).await;
    let trusts_old = client_config(&old, &[b"http/1.1"], None);
    assert_eq!(
        get_tls(proxy.addr, Arc::clone(&trusts_old)).await.unwrap(),
        StatusCode::OK
    );

    // Certificates renewed under another CA: the files change, then the reload.
    let new = pki();
    write_pki(dir.path(), &new);
    proxy.reloader.reload().await.unwrap();
    let trusts_new = client_config(&new, &[b"http/1.1"], None);
    assert_eq!(
        get_tls(proxy.addr, trusts_new).await.unwrap(),
        StatusCode::OK
    );
    assert!(
        get_tls(proxy.addr, trusts_old).await.is_err(),
        "new connections must get the new certificate"
    );
}

/// `GET path` over a new TLS connection (HTTP/1.1) to `addr`: the status and the body.
async fn get_tls_path(
    addr: std::net::SocketAddr,
    tls: Arc<ClientConfig>,
    path: &str,
) -> Result<(StatusCode, String), Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let stream = TlsConnector::from(tls).connect(name, tcp).await?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))?;
    let resp = send.send_request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test]
async fn the_admin_listener_serves_tls_with_admin_tls_and_a_reload_renews_its_certificate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let old = pki();
    write_pki(dir.path(), &old);
    let file = dir.path().join("palisade.toml");
    let text = config(false)
        .replace("{upstream}", "127.0.0.1:1")
        .replace("{grpc}", "127.0.0.1:2")
        + "[admin]\nlisten = \"127.0.0.1:0\"\n[admin.tls]\ncert = \"server.pem\"\nkey = \"server.key\"\n";
    std::fs::write(&file, text).unwrap();
    let proxy = support::proxy_file(&file).await;
    let trusts_old = client_config(&old, &[b"http/1.1"], None);
    let (status, body) = get_tls_path(proxy.admin, Arc::clone(&trusts_old), "/metrics")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("palisade_ready 1"), "{body}");

    // Plain HTTP gets no answer: the listener speaks TLS only.
    let mut plain = TcpStream::connect(proxy.admin).await.unwrap();
    plain
        .write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer).await;
    assert!(
        !String::from_utf8_lossy(&answer).contains("200"),
        "{answer:?}"
    );

    // Renewed under another CA, then a reload: new connections get the new certificate.
    let new = pki();
    write_pki(dir.path(), &new);
    proxy.reloader.reload().await.unwrap();
    let trusts_new = client_config(&new, &[b"http/1.1"], None);
    let (status, _) = get_tls_path(proxy.admin, trusts_new, "/livez")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(
        get_tls_path(proxy.admin, trusts_old, "/livez")
            .await
            .is_err(),
        "new connections must get the new certificate"
    );
}

/// Runs curl (the real client that drops an HTTP/2 answer followed by an early
/// `RST_STREAM(NO_ERROR)`) with `args`: the status it reports (`000` when it dropped the
/// answer) and how many body bytes it uploaded.
fn curl(args: &[&str]) -> (String, u64) {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code} %{size_upload}"])
        .args(args)
        .output()
        .expect("curl (scripts/test installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (code, sent) = text.split_once(' ').unwrap_or((&text, "0"));
    (code.to_owned(), sent.parse().unwrap_or(0))
}

/// A stale POST over HTTP/2 is refused before its body has arrived. The stream used to end
/// with `RST_STREAM(NO_ERROR)` right after the 409, and curl then dropped the 409 (157 of
/// 300 tries got no status): the small body that is still arriving is read and discarded
/// first, so every try gets its 409, over h2c and TLS h2 alike. A body larger than the bound
/// is still cut, and no refused body ever reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_refusal_reaches_a_client_still_sending_its_body() {
    // curl sends bodies of up to 8 MiB, over TLS too: seconds of both cores; alone among the
    // binary's timing tests (`support::serial`).
    let _serial = support::serial().await;
    let env = setup(false).await;
    let dir = env._dir.path();
    let plain = support::proxy(
        &config(false)
            .replace(
                "[proxy.tls]\ncert = \"server.pem\"\nkey = \"server.key\"\n",
                "",
            )
            .replace("{upstream}", &env.up.addr.to_string())
            .replace("{grpc}", "127.0.0.1:9")
            .replace("marks.json", "plain-marks.json"),
        dir,
    )
    .await;
    let ca = dir.join("ca.pem").display().to_string();
    let tls_url = format!("https://localhost:{}/orders/1", env.proxy.addr.port());
    let h2c_url = format!("http://127.0.0.1:{}/orders/1", plain.addr.port());
    let tls: &[&str] = &["--http2", "--cacert", &ca, "--resolve"];
    let resolve = format!("localhost:{}:127.0.0.1", env.proxy.addr.port());
    let over = |h2c: bool| -> Vec<String> {
        if h2c {
            vec!["--http2-prior-knowledge".into(), h2c_url.clone()]
        } else {
            let mut a: Vec<String> = tls.iter().map(|s| (*s).to_owned()).collect();
            a.push(resolve.clone());
            a.push(tls_url.clone());
            a
        }
    };
    let small = dir.join("1b");
    std::fs::write(&small, b"x").unwrap();
    let medium = dir.join("64k");
    std::fs::write(&medium, vec![b'm'; 64 * 1024]).unwrap();
    let large = dir.join("8m");
    std::fs::write(&large, vec![b'l'; 8 << 20]).unwrap();
    for h2c in [true, false] {
        let run = |token: &str, file: &Path| {
            let data = format!("@{}", file.display());
            let mut args = vec!["-H".to_owned(), format!("x-fencing-token: {token}")];
            args.extend(["--data-binary".to_owned(), data]);
            args.extend(over(h2c));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            curl(&args)
        };
        assert_eq!(run("51", &small).0, "200", "the newer owner's write");
        let forwarded = env.up.log.len();
        for file in [&small, &medium] {
            let lost = (0..100).filter(|_| run("34", file).0 != "409").count();
            assert_eq!(
                lost,
                0,
                "h2c {h2c}, {}: tries without their 409",
                file.display()
            );
        }
        let (_, sent) = run("34", &large);
        assert!(
            sent < 8 << 20,
            "h2c {h2c}: a large refused body is cut ({sent} bytes sent)"
        );
        assert_eq!(
            env.up.log.len(),
            forwarded,
            "no refused request reached the upstream"
        );
    }
}
