//! Reload as an operator drives it: SIGHUP to the `palisade` process, `POST /reload` on the
//! admin listener, a file with a mistake in it, and keys that only a restart changes; and the
//! admin listener's status page (`GET /`), which shows what reloads put in force.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{Method, StatusCode};
use palisade::proxy::reload::ReloadError;
use support::{get, http1_client, metric, post, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const A: &str = r#"
[proxy]
listen = "127.0.0.1:{port}"

[admin]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "marks.json"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"

[[route]]
name = "a-only"
upstream = "legacy"
path_prefix = "/a-only"
guard = false
"#;

fn config_a(upstream: SocketAddr, port: u16) -> String {
    A.replace("{upstream}", &upstream.to_string())
        .replace("{port}", &port.to_string())
}

/// A: `/a-only` becomes `/b-only`, and a second guarded route appears.
fn config_b(upstream: SocketAddr, port: u16) -> String {
    config_a(upstream, port).replace("a-only", "b-only")
        + "\n[[route]]\nname = \"invoices\"\nupstream = \"legacy\"\npath_prefix = \"/invoices\"\n"
}

/// B with a misspelt key on line 27 (`gaurd`), which must be named with its place.
fn config_bad(upstream: SocketAddr, port: u16) -> String {
    config_b(upstream, port).replace("guard = false", "gaurd = false")
}

const BAD_PLACE: &str = "palisade.toml:27:1: route[1].gaurd";

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

/// One raw keep-alive connection: `GET path`, the status code of the answer.
async fn get_on(conn: &mut TcpStream, path: &str) -> u16 {
    let head = format!("GET {path} HTTP/1.1\r\nhost: t\r\n\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "palisade closed a keep-alive connection");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        let Some(end) = text.find("\r\n\r\n") else {
            continue;
        };
        let len: usize = text[..end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap();
        if buf.len() >= end + 4 + len {
            return text[9..12].parse().unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_file_and_a_bad_one_keeps_the_running_config() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    write(&file, &config_a(up.addr, 0));
    let p = support::spawn_proxy(&file).unwrap();
    let admin = p.admin.unwrap();
    let base = format!("http://{}", p.addr);
    let mut kept_alive = TcpStream::connect(p.addr).await.unwrap();
    assert_eq!(get_on(&mut kept_alive, "/a-only/1").await, 200);
    assert_eq!(
        post(&format!("{base}/orders/1"), Some("34")).await.status,
        StatusCode::OK
    );

    write(&file, &config_b(up.addr, 0));
    p.signal("HUP");
    let fields = p.wait_log("config reloaded", Duration::from_secs(10));
    assert_eq!(fields["routes"], 3);
    assert_eq!(fields["upstreams_kept"], 1);
    assert_eq!(
        get(&format!("{base}/b-only/1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&format!("{base}/a-only/1")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get_on(&mut kept_alive, "/b-only/2").await,
        200,
        "same connection, new routes"
    );
    let zombie = post(&format!("{base}/orders/1"), Some("33")).await;
    assert_eq!(
        zombie.status,
        StatusCode::CONFLICT,
        "the mark survived the reload"
    );

    write(&file, &config_bad(up.addr, 0));
    p.signal("HUP");
    let failed = p.wait_log(
        "config reload failed; the previous configuration stays in force",
        Duration::from_secs(10),
    );
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains(BAD_PLACE), "{error}");
    assert!(error.contains("unknown field"), "{error}");
    assert_eq!(
        get_on(&mut kept_alive, "/b-only/3").await,
        200,
        "B still serves"
    );
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"error\"}"),
        Some(1.0)
    );
    let marks = get(&format!("http://{admin}/marks")).await.json();
    assert_eq!(marks, serde_json::json!({"orders": 34, "invoices": 0}));
}

#[tokio::test]
async fn a_bad_file_changes_nothing_and_post_reload_reports_the_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    write(&file, &config_a(up.addr, 0));
    let proxy = support::proxy_file(&file).await;

    write(&file, &config_bad(up.addr, 0));
    match proxy.reloader.reload().await {
        Err(ReloadError::Config(e)) => {
            let e = e.to_string();
            assert!(e.contains(BAD_PLACE), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(get(&proxy.url("/a-only/1")).await.status, StatusCode::OK);
    assert_eq!(
        get(&proxy.url("/b-only/1")).await.status,
        StatusCode::NOT_FOUND
    );

    let reload = format!("http://{}/reload", proxy.admin);
    let refused = send(&http1_client(), Method::POST, &reload, &[], b"").await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(refused.text().contains(BAD_PLACE), "{}", refused.text());
    assert_eq!(get(&reload).await.status, StatusCode::METHOD_NOT_ALLOWED);

    write(&file, &config_b(up.addr, 0));
    let done = send(&http1_client(), Method::POST, &reload, &[], b"").await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.text());
    assert!(
        done.text().contains("new resources: [\"invoices\"]"),
        "{}",
        done.text()
    );
    assert_eq!(get(&proxy.url("/b-only/1")).await.status, StatusCode::OK);
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"error\"}"),
        Some(2.0)
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn keys_that_take_a_restart_keep_their_running_values_and_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    write(&file, &config_a(up.addr, 0));
    let proxy = support::proxy_file(&file).await;
    assert_eq!(
        post(&proxy.url("/orders/1"), Some("5")).await.status,
        StatusCode::OK
    );

    // Another listen address, another marks file, and a route change that does apply.
    write(
        &file,
        &config_b(up.addr, 1).replace("marks.json", "other-marks.json"),
    );
    let r = proxy.reloader.reload().await.unwrap();
    let keys: Vec<&str> = r.kept.iter().map(|k| k.key).collect();
    assert_eq!(keys, ["proxy.listen", "marks"]);
    assert!(
        r.kept[0].to_string().contains("takes a restart"),
        "{}",
        r.kept[0]
    );
    assert_eq!(
        get(&proxy.url("/b-only/1")).await.status,
        StatusCode::OK,
        "routes applied"
    );
    let zombie = post(&proxy.url("/orders/1"), Some("4")).await;
    assert_eq!(
        zombie.status,
        StatusCode::CONFLICT,
        "still the running marks file"
    );
    assert!(!dir.path().join("other-marks.json").exists());
    proxy.shutdown().await;
}

/// Warehouse 7 behind a catch-all, as an operator with one elected owner per warehouse has it.
const WAREHOUSES: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[marks]
store = "file"
path = "marks.json"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "wh7"
upstream = "legacy"
path_prefix = "/warehouses/7"
resource = "warehouse-7"

[[route]]
name = "everything-else"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

#[tokio::test]
async fn a_reload_that_renames_a_resource_carries_its_mark_and_the_zombie_stays_out() {
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("palisade.toml");
    let text = WAREHOUSES.replace("{upstream}", &up.addr.to_string());
    write(&file, &text);
    let proxy = support::proxy_file(&file).await;
    let owner = post(&proxy.url("/warehouses/7/stock"), Some("110")).await;
    assert_eq!(owner.status, StatusCode::OK);

    // The operator renames the resource and reloads.
    write(&file, &text.replace("\"warehouse-7\"", "\"wh/7\""));
    let reloaded = proxy.reloader.reload().await.unwrap();
    assert_eq!(reloaded.carried_marks.len(), 1, "{reloaded:?}");
    assert_eq!(reloaded.carried_marks[0].to, "wh/7");
    assert_eq!(reloaded.carried_marks[0].mark, 110);
    assert_eq!(proxy.marks().await["wh/7"], 110, "persisted and published");

    let seen = up.log.len();
    let zombie = post(&proxy.url("/warehouses/7/stock"), Some("21")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT, "{}", zombie.text());
    assert_eq!(zombie.headers["x-fencing-mark"], "110");
    assert_eq!(
        up.log.len(),
        seen,
        "the zombie's write never reached the upstream"
    );
    let current = post(&proxy.url("/warehouses/7/stock"), Some("110")).await;
    assert_eq!(current.status, StatusCode::OK, "the owner goes on");
    proxy.shutdown().await;

    // The carried mark is in the store: a restart on the new file keeps it.
    let again = support::proxy_file(&file).await;
    let zombie = post(&again.url("/warehouses/7/stock"), Some("21")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT);
    again.shutdown().await;
}

#[tokio::test]
async fn a_reload_that_would_forward_a_guarded_resource_unchecked_is_refused_unless_retired() {
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("palisade.toml");
    let text = WAREHOUSES.replace("{upstream}", &up.addr.to_string());
    write(&file, &text);
    let proxy = support::proxy_file(&file).await;
    assert_eq!(
        post(&proxy.url("/warehouses/7/stock"), Some("110"))
            .await
            .status,
        StatusCode::OK
    );
    let wh7 = text.find("[[route]]\nname = \"wh7\"").unwrap();
    let rest = text.find("[[route]]\nname = \"everything-else\"").unwrap();
    let without = format!("{}{}", &text[..wh7], &text[rest..]);

    // The guarded route removed: its requests would reach the catch-all.
    write(&file, &without);
    let err = proxy.reloader.reload().await.unwrap_err();
    assert!(matches!(err, ReloadError::Unprotected(_)), "{err}");
    let why = err.to_string();
    assert!(
        why.contains("\"warehouse-7\"") && why.contains("mark 110") && why.contains("retired"),
        "{why}"
    );
    let r = send(
        &http1_client(),
        Method::POST,
        &format!("http://{}/reload", proxy.admin),
        &[],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    let zombie = post(&proxy.url("/warehouses/7/stock"), Some("21")).await;
    assert_eq!(
        zombie.status,
        StatusCode::CONFLICT,
        "the old routes still serve"
    );
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"error\"}"),
        Some(2.0)
    );

    // The operator's explicit word: retired.
    write(
        &file,
        &without.replace(
            "path = \"marks.json\"",
            "path = \"marks.json\"\nretired = [\"warehouse-7\"]",
        ),
    );
    let reloaded = proxy.reloader.reload().await.unwrap();
    assert_eq!(reloaded.retired.len(), 1, "{reloaded:?}");
    assert_eq!(reloaded.retired[0].resource, "warehouse-7");
    assert_eq!(proxy.marks().await["warehouse-7"], 110, "the mark stays");
    proxy.shutdown().await;
}

#[test]
fn check_with_previous_prints_what_a_reload_would_do_with_marks() {
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("old.toml");
    let text = WAREHOUSES.replace("{upstream}", "127.0.0.1:9");
    write(&old, &text);
    std::fs::write(
        dir.path().join("marks.json"),
        r#"{"format": "palisade-marks/1", "marks": {"warehouse-7": 110}}"#,
    )
    .unwrap();
    let run = |new: &str| {
        let path = dir.path().join("new.toml");
        write(&path, new);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
            .args(["check", "--config"])
            .arg(&path)
            .arg("--previous")
            .arg(&old)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, out) = run(&text.replace("\"warehouse-7\"", "\"wh/7\""));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("mark 110 carried over"), "{out}");
    assert!(
        out.contains("route[0] \"wh7\": path_prefix \"/warehouses/7\"")
            && out.contains("guarded by the mark of resource \"wh/7\""),
        "{out}"
    );
    let (code, out) =
        run(&text.replace("path_prefix = \"/warehouses/7\"", "path_prefix = \"/wh/7\""));
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("would lose its guard") && out.contains("/warehouses/7"),
        "{out}"
    );
}

/// The admin token of the tests below, and a wrong one of the same length.
const ADMIN_TOKEN: &str = "pal-admin-7f3c9e1b2d4a6f80c5e7a9b1";
const WRONG_TOKEN: &str = "pal-admin-7f3c9e1b2d4a6f80c5e7a9b2";

/// `text` with `[admin] token_env` naming `var` (on line 6 of [`A`]-based files).
fn with_token_env(text: &str, var: &str) -> String {
    text.replacen("[admin]\n", &format!("[admin]\ntoken_env = \"{var}\"\n"), 1)
}

/// The `palisade_config_info` series of an exposition: their digests and values.
fn config_info(metrics: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("palisade_config_info{digest=\""))
        .map(|rest| {
            let (digest, value) = rest.split_once("\"} ").unwrap();
            (digest.to_owned(), value.trim().parse().unwrap())
        })
        .collect()
}

async fn post_reload(admin: SocketAddr, authorization: Option<&str>) -> support::Got {
    let headers: Vec<(&str, &[u8])> = authorization
        .map(|a| ("authorization", a.as_bytes()))
        .into_iter()
        .collect();
    send(
        &http1_client(),
        Method::POST,
        &format!("http://{admin}/reload"),
        &headers,
        b"",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_reload_needs_the_admin_bearer_token_which_never_shows_in_logs_or_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    let var = "PALISADE_ADMIN_TOKEN";
    write(&file, &with_token_env(&config_a(up.addr, 0), var));
    let mut p = support::spawn_proxy_with_env(&file, &[(var, ADMIN_TOKEN)])
        .unwrap_or_else(|(code, log)| panic!("exited {code:?}: {log}"));
    let admin = p.admin.unwrap();
    let base = format!("http://{}", p.addr);
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(metric(&m, "palisade_ready"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "palisade_admin_unauthorized_total"), Some(0.0));
    let info = config_info(&m);
    assert_eq!(info.len(), 1, "{info:?}");
    let (digest_a, one) = info[0].clone();
    assert_eq!((digest_a.len(), one), (64, 1.0), "{digest_a}");

    // The file changes; requests without the right token change nothing.
    write(&file, &with_token_env(&config_b(up.addr, 0), var));
    let refusals = [
        None,
        Some(format!("Bearer {WRONG_TOKEN}")),
        Some(format!("Basic {ADMIN_TOKEN}")),
        Some(format!("Bearer {ADMIN_TOKEN}x")),
        Some(format!("Bearer {}", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1])),
    ];
    for auth in &refusals {
        let r = post_reload(admin, auth.as_deref()).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{auth:?}: {}", r.text());
        let challenge = r.headers["www-authenticate"].to_str().unwrap();
        assert!(challenge.starts_with("Bearer"), "{challenge}");
        assert!(!r.text().contains(ADMIN_TOKEN), "{}", r.text());
    }
    let wrong = post_reload(admin, Some(&format!("Bearer {WRONG_TOKEN}"))).await;
    assert!(
        wrong.headers["www-authenticate"]
            .to_str()
            .unwrap()
            .contains("invalid_token"),
        "{:?}",
        wrong.headers
    );
    assert_eq!(
        get(&format!("{base}/a-only/1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&format!("{base}/b-only/1")).await.status,
        StatusCode::NOT_FOUND,
        "not reloaded"
    );
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(
        metric(&m, "palisade_admin_unauthorized_total"),
        Some(refusals.len() as f64 + 1.0)
    );
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"ok\"}"),
        Some(0.0)
    );
    assert_eq!(config_info(&m), [(digest_a.clone(), 1.0)]);
    // The reads stay open.
    for path in ["/metrics", "/livez", "/readyz", "/marks", "/marks/orders"] {
        let r = get(&format!("http://{admin}{path}")).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text());
    }

    // With the token (the scheme in any case) the reload happens.
    let done = post_reload(admin, Some(&format!("bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.text());
    assert_eq!(
        get(&format!("{base}/b-only/1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&format!("{base}/a-only/1")).await.status,
        StatusCode::NOT_FOUND
    );
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(
        metric(&m, "palisade_config_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    let info = config_info(&m);
    assert_eq!(info.len(), 1, "one series: the file in force: {info:?}");
    assert_ne!(info[0].0, digest_a, "another file, another digest");
    assert_eq!(info[0].1, 1.0);

    // Back to A: A's digest again, still one series.
    write(&file, &with_token_env(&config_a(up.addr, 0), var));
    let back = post_reload(admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(back.status, StatusCode::OK, "{}", back.text());
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(config_info(&m), [(digest_a.clone(), 1.0)]);

    // A reload whose file names a variable that is not set is a config error at its place.
    let unset = "PALISADE_TEST_UNSET_ADMIN_TOKEN";
    write(&file, &with_token_env(&config_b(up.addr, 0), unset));
    let refused = post_reload(admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{}",
        refused.text()
    );
    assert!(
        refused.text().contains(&format!(
            "palisade.toml:6:13: admin.token_env: {unset} is not set"
        )),
        "{}",
        refused.text()
    );
    assert_eq!(
        get(&format!("{base}/a-only/1")).await.status,
        StatusCode::OK,
        "A still serves"
    );
    let m = get(&format!("http://{admin}/metrics")).await.text();
    assert_eq!(config_info(&m), [(digest_a, 1.0)]);
    assert!(!m.contains(ADMIN_TOKEN), "{m}");

    // The refusals were logged (peer, method, path), the token never. Every line written so
    // far is in the pipe; killing the process ends it.
    let refused_line = "admin request refused: no valid bearer token ([admin] token_env)";
    p.kill9();
    let log: Vec<String> = std::iter::once(p.started.clone())
        .chain(p.logs.iter())
        .collect();
    let log = log.join("\n");
    assert!(
        !log.contains(ADMIN_TOKEN),
        "the token is in the log:\n{log}"
    );
    assert!(
        !log.contains(&ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]),
        "part of the token is in the log:\n{log}"
    );
    assert!(
        log.contains(refused_line) && log.contains("\"/reload\""),
        "{log}"
    );
}

#[test]
fn palisade_check_needs_the_admin_token_variable_and_never_prints_its_value() {
    let dir = tempfile::tempdir().unwrap();
    let var = "PALISADE_ADMIN_TOKEN";
    let file = dir.path().join("palisade.toml");
    write(
        &file,
        &with_token_env(&config_a("127.0.0.1:9".parse().unwrap(), 0), var),
    );
    let check = |value: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"));
        cmd.args(["check", "--config"]).arg(&file).env_remove(var);
        if let Some(v) = value {
            cmd.env(var, v);
        }
        let out = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let (code, out) = check(Some(ADMIN_TOKEN));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("0 warnings"), "{out}");
    assert!(!out.contains(ADMIN_TOKEN), "{out}");
    let place = format!("{}:6:13: admin.token_env: {var}", file.display());
    for (value, why) in [(None, "is not set"), (Some(""), "is empty")] {
        let (code, out) = check(value);
        assert_eq!(code, Some(2), "{out}");
        assert!(out.contains(&format!("{place} {why}")), "{out}");
    }
    let (code, out) = check(Some(&format!("{ADMIN_TOKEN}\n")));
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("trailing newline"), "{out}");
    assert!(!out.contains(ADMIN_TOKEN), "{out}");

    // `palisade run` refuses to start on it too.
    match support::spawn_proxy_with_env(&file, &[(var, "")]) {
        Err((code, log)) => {
            assert_eq!(code, Some(2), "{log}");
            assert!(log.contains("admin.token_env"), "{log}");
        }
        Ok(_) => panic!("palisade started with an empty admin token"),
    }
}

/// [`A`] with a templated route whose entity a header names (any visible ASCII, `<` too).
fn config_tenants(upstream: SocketAddr) -> String {
    config_a(upstream, 0)
        + "\n[[route]]\nname = \"tenants\"\nupstream = \"legacy\"\npath_prefix = \"/tenants\"\n\
           resource = \"tenant/{header.x-tenant}\"\n"
}

/// The `<tr ...>...</tr>` rows of `page` that start with `open`.
fn rows<'p>(page: &'p str, open: &str) -> Vec<&'p str> {
    page.match_indices(open)
        .map(|(at, _)| &page[at..at + page[at..].find("</tr>").unwrap()])
        .collect()
}

#[tokio::test]
async fn the_status_page_shows_routes_marks_and_a_zombies_refusal_with_every_value_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let file = dir.path().join("palisade.toml");
    write(&file, &config_tenants(up.addr));
    let proxy = support::proxy_file(&file).await;
    let status = format!("http://{}/", proxy.admin);

    let empty = get(&status).await;
    assert_eq!(empty.status, StatusCode::OK);
    assert_eq!(empty.headers["content-type"], "text/html; charset=utf-8");
    let csp = empty.headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(
        empty.text().contains("<p id=\"no-refusals\">"),
        "{}",
        empty.text()
    );

    // The owner writes with 51; the zombie's late write with 34 is refused.
    assert_eq!(
        post(&proxy.url("/orders/1"), Some("51")).await.status,
        StatusCode::OK
    );
    let zombie = post(&proxy.url("/orders/1"), Some("34")).await;
    assert_eq!(zombie.status, StatusCode::CONFLICT);
    // An entity whose name is markup, advanced to 7 and then refused a stale 3.
    let evil = "<script>alert(1)</script>";
    for (token, want) in [("7", StatusCode::OK), ("3", StatusCode::CONFLICT)] {
        let headers: [(&str, &[u8]); 2] = [
            ("x-fencing-token", token.as_bytes()),
            ("x-tenant", evil.as_bytes()),
        ];
        let r = send(
            &http1_client(),
            Method::POST,
            &proxy.url("/tenants/x"),
            &headers,
            b"w",
        )
        .await;
        assert_eq!(r.status, want, "{}", r.text());
    }

    let page = get(&status).await.text();
    let route = rows(&page, "<tr data-route=\"orders\">");
    assert_eq!(route.len(), 1, "{page}");
    for cell in [
        "<code>orders</code>",
        "badge ok\">guarded",
        "<td class=\"num mark\">51</td>",
    ] {
        assert!(route[0].contains(cell), "{cell} not in {}", route[0]);
    }
    let resource = rows(
        &page,
        "<tr data-resource=\"orders\"><td class=\"resource\">",
    );
    assert_eq!(resource.len(), 1, "{page}");
    assert!(
        resource[0].contains("<td class=\"num mark\">51</td>"),
        "{}",
        resource[0]
    );

    let refusals = rows(&page, "<tr class=\"refusal\"");
    assert_eq!(refusals.len(), 2, "{page}");
    // Newest first: the entity's refusal, then the zombie's.
    let stale = refusals[1];
    for cell in [
        "data-reason=\"stale_token\"",
        "<td class=\"route\"><code>orders</code></td>",
        "<td class=\"resource\"><code>orders</code></td>",
        "<td class=\"num token\">34</td>",
        "<td class=\"num mark\">51</td>",
        "<td class=\"num status\">409</td>",
        "<td class=\"peer\"><code>127.0.0.1:",
    ] {
        assert!(stale.contains(cell), "{cell} not in {stale}");
    }

    // The entity's name is shown, escaped, in its refusal and in its template's listing.
    let escaped = "tenant/&lt;script&gt;alert(1)&lt;/script&gt;";
    assert!(
        refusals[0].contains(&format!("<code>{escaped}</code>")),
        "{}",
        refusals[0]
    );
    assert!(
        refusals[0].contains("<td class=\"num token\">3</td>"),
        "{}",
        refusals[0]
    );
    let entity = rows(&page, &format!("<tr data-resource=\"{escaped}\">"));
    assert_eq!(entity.len(), 1, "{page}");
    assert!(
        entity[0].contains("<td class=\"num mark\">7</td>"),
        "{}",
        entity[0]
    );
    assert!(
        !page.contains("<script"),
        "markup from a request reached the page: {page}"
    );
    assert!(
        page.contains("data-template=\"tenant/{header.x-tenant}\""),
        "{page}"
    );

    // The store's health, its latency table, and the configuration's generation.
    assert!(
        page.contains("<span class=\"badge ok\" id=\"ready\">ready</span>"),
        "{page}"
    );
    assert!(page.contains("<tr data-op=\"persist\">"), "{page}");
    assert!(page.contains("<span id=\"generation\">1</span>"), "{page}");
    assert!(
        page.contains(&format!(
            "<span class=\"version\" id=\"version\">{}</span>",
            env!("CARGO_PKG_VERSION")
        )),
        "{page}"
    );

    // Pages of a template's entities, and a query the page does not take.
    let second = get(&format!(
        "{status}?template=tenant%2F%7Bheader.x-tenant%7D&page=2"
    ))
    .await;
    assert_eq!(second.status, StatusCode::OK);
    assert!(
        second.text().contains("No stored marks on this page."),
        "{}",
        second.text()
    );
    assert!(
        second.text().contains("page=1\">‹ previous</a>"),
        "{}",
        second.text()
    );
    for bad in ["?page=0", "?page=1001", "?after=x"] {
        let r = get(&format!("{status}{bad}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.text());
    }

    // A reload is a new generation with its own digest; the refusals stay.
    let before = config_info(&proxy.metrics().await);
    write(&file, &config_b(up.addr, 0));
    proxy.reloader.reload().await.unwrap();
    let after = config_info(&proxy.metrics().await);
    assert_ne!(before, after);
    let page = get(&status).await.text();
    assert!(page.contains("<span id=\"generation\">2</span>"), "{page}");
    assert!(
        page.contains(&format!("title=\"{}\"", after[0].0)),
        "{page}"
    );
    assert_eq!(rows(&page, "<tr class=\"refusal\"").len(), 2, "{page}");
    assert!(page.contains("<tr data-route=\"invoices\">"), "{page}");

    proxy.shutdown().await;
}
