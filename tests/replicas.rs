//! Several palisade replicas sharing their marks through etcd (the `etcd` mark store): real
//! etcd processes, real `palisade` processes, a real upstream.

mod support;

#[path = "support/etcd.rs"]
mod etcd;

use std::path::Path;

use support::{post, spawn_proxy, write, ProxyProcess};

/// A replica's config: `store = "etcd"` on `endpoints`, one guarded route per resource in
/// `resources` (`/<resource>/...`), and an unguarded `/open/` route.
fn replica_config(
    upstream: std::net::SocketAddr,
    endpoints: &[String],
    prefix: &str,
    consistency: &str,
    resources: &[String],
) -> String {
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("{e:?}")).collect();
    let mut text = format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "etcd"
[marks.etcd]
endpoints = [{}]
prefix = "{prefix}"
consistency = "{consistency}"
request_timeout_ms = 1000
dial_timeout_ms = 2000
[[upstream]]
name = "up"
url = "http://{upstream}"
[[route]]
name = "open"
upstream = "up"
path_prefix = "/open/"
guard = false
"#,
        endpoints.join(", ")
    );
    for r in resources {
        text.push_str(&format!(
            "[[route]]\nname = \"{r}\"\nupstream = \"up\"\npath_prefix = \"/{r}/\"\nresource = \"{r}\"\n"
        ));
    }
    text
}

fn spawn_replica(dir: &Path, name: &str, text: &str) -> ProxyProcess {
    let path = write(dir, name, text);
    spawn_proxy(&path).unwrap_or_else(|(code, log)| panic!("{name} exited {code:?}: {log}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_marks_and_a_restarted_replica_keeps_them() {
    let etcd = etcd::Etcd::single().await;
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let resources = vec!["orders".to_owned()];
    for consistency in ["linearizable", "cached"] {
        let prefix = format!("/smoke-{consistency}/");
        let text = replica_config(up.addr, &etcd.endpoints(), &prefix, consistency, &resources);
        let r1 = spawn_replica(dir.path(), "r1.toml", &text);
        let mut r2 = spawn_replica(dir.path(), "r2.toml", &text);
        let url = |p: &ProxyProcess| format!("http://{}/orders/1", p.addr);
        assert_eq!(post(&url(&r1), Some("34")).await.status, 200);
        assert_eq!(post(&url(&r1), Some("51")).await.status, 200, "B via r1");
        if consistency == "cached" {
            // The watch needs a moment; a linearizable replica needs none.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while post(&url(&r2), Some("51")).await.status != 200 {
                assert!(std::time::Instant::now() < deadline);
            }
        }
        let before = up.log.len();
        assert_eq!(
            post(&url(&r2), Some("34")).await.status,
            409,
            "zombie via r2"
        );
        assert_eq!(
            up.log.len(),
            before,
            "the zombie never reached the upstream"
        );
        r2.kill9();
        let r2 = spawn_replica(dir.path(), "r2.toml", &text);
        assert_eq!(
            post(&url(&r2), Some("34")).await.status,
            409,
            "after kill -9"
        );
        assert_eq!(post(&url(&r2), Some("51")).await.status, 200);
        // The stored value is 8-byte big-endian.
        let mut c = etcd.client().await;
        let got = c.get(format!("{prefix}orders"), None).await.unwrap();
        assert_eq!(got.kvs()[0].value(), &51u64.to_be_bytes());
    }
}
