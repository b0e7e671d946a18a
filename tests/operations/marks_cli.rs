//! `palisade marks list|set` against real proxy processes and real marks files: recovery from a
//! forged token, the lock a running proxy holds, the audit trail, and the refusals.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use http::StatusCode;
use support::{post, spawn_proxy, write};

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
workers = 1

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
name = "reads"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

const FORGED: &str = "18446744073709551615";

struct Setup {
    dir: tempfile::TempDir,
    up: support::Upstream,
    marks: PathBuf,
    config: PathBuf,
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

/// Runs `palisade marks <args> --config <config>` to completion.
fn marks_cmd(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_palisade"))
        .arg("marks")
        .args(args)
        .arg("--config")
        .arg(config)
        .env("USER", "alice")
        .env_remove("SUDO_USER")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stored(marks: &Path) -> serde_json::Value {
    let m = palisade::fence::marks::file::read(marks)
        .unwrap()
        .unwrap_or_default();
    serde_json::to_value(m).unwrap()
}

fn audit_log(marks: &Path) -> PathBuf {
    let mut p = marks.as_os_str().to_owned();
    p.push(".audit.log");
    p.into()
}

#[tokio::test]
async fn a_forged_token_is_recovered_with_an_audited_set_once_the_proxy_is_stopped() {
    let s = setup().await;
    let mut proxy = spawn_proxy(&s.config).unwrap();
    let url = format!("http://{}/orders/1", proxy.addr);

    assert_eq!(post(&url, Some(FORGED)).await.status, StatusCode::OK);
    assert_eq!(
        post(&url, Some("52")).await.status,
        StatusCode::CONFLICT,
        "the honest owner is locked out by the forged token"
    );
    assert_eq!(stored(&s.marks)["orders"].as_u64(), Some(u64::MAX));

    let refused = marks_cmd(&s.config, &["set", "orders", "51", "--force"]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    let msg = stderr(&refused);
    assert!(msg.starts_with("error: a palisade process holds"), "{msg}");
    assert!(msg.contains(&s.marks.display().to_string()), "{msg}");
    assert!(msg.contains("marks.db.lock"), "{msg}");
    assert_eq!(
        stored(&s.marks)["orders"].as_u64(),
        Some(u64::MAX),
        "nothing changes under a running proxy"
    );
    assert!(
        !audit_log(&s.marks).exists(),
        "a refused set is not a change"
    );

    // The advisory lock dies with the process.
    proxy.kill9();
    let set = marks_cmd(&s.config, &["set", "orders", "51", "--force"]);
    assert!(set.status.success(), "{}", stderr(&set));
    assert!(
        stdout(&set).starts_with(&format!("orders: {FORGED} -> 51")),
        "{}",
        stdout(&set)
    );
    assert!(
        stderr(&set).contains("mark set by an operator"),
        "logged at warn: {}",
        stderr(&set)
    );
    assert_eq!(stored(&s.marks)["orders"].as_u64(), Some(51));

    let audit = std::fs::read_to_string(audit_log(&s.marks)).unwrap();
    let lines: Vec<serde_json::Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{audit}");
    let line = &lines[0];
    assert_eq!(line["event"], "marks.set");
    assert_eq!(line["resource"], "orders");
    assert_eq!(line["old"].as_u64(), Some(u64::MAX));
    assert_eq!(line["new"].as_u64(), Some(51));
    assert_eq!(line["user"], "alice");
    assert!(line["uid"].is_u64(), "{line}");
    assert!(line["host"].is_string(), "{line}");
    let time = line["time"].as_str().unwrap();
    assert!(time.len() == 24 && time.ends_with('Z'), "{time}");

    let list = marks_cmd(&s.config, &["list"]);
    assert!(list.status.success(), "{}", stderr(&list));
    let listed = stdout(&list);
    let row = listed
        .lines()
        .find(|l| l.starts_with("orders "))
        .map(|l| l.split_whitespace().collect::<Vec<_>>());
    assert_eq!(row, Some(vec!["orders", "51"]), "{listed}");

    let proxy = spawn_proxy(&s.config).unwrap();
    let url = format!("http://{}/orders/1", proxy.addr);
    assert_eq!(post(&url, Some("52")).await.status, StatusCode::OK);
    assert_eq!(post(&url, Some("34")).await.status, StatusCode::CONFLICT);
    assert_eq!(
        s.up.log.tokens(),
        vec![Some(FORGED.to_owned()), Some("52".to_owned())],
        "only the forged request and the owner's request after recovery reached the upstream"
    );
    drop(s.dir);
}

#[tokio::test]
async fn set_without_force_refuses_explains_and_changes_nothing() {
    let s = setup().await;
    let before = format!("{{\"format\":\"palisade-marks/1\",\"marks\":{{\"orders\":{FORGED}}}}}\n");
    std::fs::write(&s.marks, &before).unwrap();

    let o = marks_cmd(&s.config, &["set", "orders", "51"]);
    assert_eq!(o.status.code(), Some(1));
    let msg = stderr(&o);
    assert!(
        msg.starts_with("error: refusing to set orders to 51 without --force"),
        "{msg}"
    );
    assert!(msg.contains(&format!("its mark is {FORGED}")), "{msg}");
    assert!(msg.contains("zombies"), "{msg}");
    assert_eq!(std::fs::read_to_string(&s.marks).unwrap(), before);
    assert!(!audit_log(&s.marks).exists());
}

#[tokio::test]
async fn list_shows_every_mark_and_notes_resources_no_route_guards() {
    let s = setup().await;
    std::fs::write(
        &s.marks,
        r#"{"format":"palisade-marks/1","marks":{"orders":7,"retired":9}}"#,
    )
    .unwrap();
    let o = marks_cmd(&s.config, &["list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec!["orders", "7"],
            vec!["retired", "9", "no", "route", "guards", "it"]
        ],
        "{out}"
    );

    // Value 0 removes an entry.
    let o = marks_cmd(&s.config, &["set", "retired", "0", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stored(&s.marks), serde_json::json!({"orders": 7}));
}

#[tokio::test]
async fn the_memory_store_and_a_bad_config_give_clear_errors() {
    let s = setup().await;
    let memory = write(
        s.dir.path(),
        "memory.toml",
        &support::render(CONFIG, s.up.addr, &s.marks)
            .replace("store = \"file\"", "store = \"memory\"")
            .replace(&format!("path = \"{}\"", s.marks.display()), ""),
    );
    for args in [&["list"][..], &["set", "orders", "51", "--force"][..]] {
        let o = marks_cmd(&memory, args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let msg = stderr(&o);
        assert!(
            msg.starts_with("error: ")
                && msg.contains("store = \"memory\"")
                && msg.contains("running proxy"),
            "{msg}"
        );
    }

    let o = marks_cmd(&s.dir.path().join("missing.toml"), &["list"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "a config error exits 2 like `check`"
    );
    assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
}

#[tokio::test]
async fn a_second_proxy_on_the_same_marks_file_refuses_to_start() {
    let s = setup().await;
    let mut first = spawn_proxy(&s.config).unwrap();
    let second = write(
        s.dir.path(),
        "second.toml",
        &support::render(CONFIG, s.up.addr, &s.marks),
    );
    let (code, log) = match spawn_proxy(&second) {
        Ok(_) => panic!("two proxies run on one marks file"),
        Err(e) => e,
    };
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("a palisade process holds"), "{log}");
    assert!(log.contains(&s.marks.display().to_string()), "{log}");

    first.kill9();
    spawn_proxy(&second).expect("starts once the first is gone");
}

#[tokio::test]
async fn readyz_fails_when_the_marks_directory_takes_no_writes() {
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let sub = dir.path().join("d");
    let marks = sub.join("marks.db");
    let config = write(
        dir.path(),
        "palisade.toml",
        &support::render(CONFIG, up.addr, &marks),
    );
    let proxy = spawn_proxy(&config).unwrap();
    let readyz = format!("http://{}/readyz", proxy.admin.unwrap());

    // The directory is still there (a stat, as /readyz did before, says ready), but nothing
    // can be written where the probe goes; as root, permission bits would not stop the write.
    // Nothing has probed yet (the first probe runs on the first /readyz), so the answer below
    // is not a result cached from before.
    std::fs::create_dir(sub.join("marks.db.probe")).unwrap();
    let r = support::get(&readyz).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert!(r.text().contains("marks.db.probe"), "{}", r.text());
    assert!(r.text().contains("probe create failed"), "{}", r.text());
}
