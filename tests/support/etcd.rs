//! Real etcd processes for tests: a single node or a 3-node cluster on free loopback ports,
//! each with its own temporary data directory, killed (and cleaned up) on drop.
//!
//! Uses `/usr/bin/etcd` from Debian's `etcd-server` (or `$ETCD_BIN`). A missing binary fails
//! the test with the command that installs it; it is never a silent skip.

#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

struct Node {
    child: Child,
    client_url: String,
}

fn binary() -> PathBuf {
    let bin = std::env::var_os("ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
    assert!(
        bin.exists(),
        "etcd is not installed at {}: install it with `apt-get install -y etcd-server` \
         (scripts/test does this when run as root), or set ETCD_BIN",
        bin.display()
    );
    bin
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// One node.
    pub async fn single() -> Etcd {
        Self::start(1).await
    }

    /// A 3-node cluster.
    pub async fn cluster() -> Etcd {
        Self::start(3).await
    }

    async fn start(n: usize) -> Etcd {
        let bin = binary();
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("n{i}=http://127.0.0.1:{peer}"))
            .collect();
        let initial = initial.join(",");
        let token = format!("palisade-test-{}", ports[0].0);
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let child = Command::new(&bin)
                    .arg(format!("--name=n{i}"))
                    .arg(format!(
                        "--data-dir={}",
                        dir.path().join(format!("n{i}")).display()
                    ))
                    .arg(format!("--listen-client-urls={client_url}"))
                    .arg(format!("--advertise-client-urls={client_url}"))
                    .arg(format!("--listen-peer-urls={peer_url}"))
                    .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                    .arg(format!("--initial-cluster={initial}"))
                    .arg(format!("--initial-cluster-token={token}"))
                    .args([
                        "--initial-cluster-state=new",
                        "--heartbeat-interval=10",
                        "--election-timeout=100",
                    ])
                    .args(["--logger=zap", "--log-level=error"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
                Node { child, client_url }
            })
            .collect();
        let etcd = Etcd { nodes, _dir: dir };
        etcd.wait_ready().await;
        etcd
    }

    async fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            if let Ok(mut c) = etcd_client::Client::connect(self.endpoints(), None).await {
                if c.put("/palisade-test/ready", "1", None).await.is_ok() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "etcd did not become ready in 20 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.client_url.clone()).collect()
    }

    pub fn endpoint(&self) -> String {
        self.nodes[0].client_url.clone()
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect(self.endpoints(), None)
            .await
            .unwrap()
    }

    /// A client of node 0 reached through `url` (for example a [`super::netcut::Cut`]).
    pub async fn client_at(url: &str) -> etcd_client::Client {
        etcd_client::Client::connect([url], None).await.unwrap()
    }

    /// Keys under `prefix`.
    pub async fn keys(&self, prefix: &str) -> Vec<String> {
        let mut c = self.client().await;
        let r = c
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_keys_only(),
                ),
            )
            .await
            .unwrap();
        r.kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
    }
}
