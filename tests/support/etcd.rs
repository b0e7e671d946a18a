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
    /// `None` while the node is stopped ([`Etcd::stop`]).
    child: Option<Child>,
    client_url: String,
    /// The full command line, to start the node again on the same ports and data.
    args: Vec<String>,
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

/// A free port below the kernel's ephemeral range: a port taken from that range (port 0) is
/// free only until etcd binds it, and meanwhile any outgoing connection of a parallel test
/// may take it (a node that cannot listen never joins its cluster).
fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let low: u64 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let seed = u64::from(std::process::id()) << 20
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64;
    loop {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // A multiplicative hash spreads the candidates over the range.
        let pick = (seed ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33;
        let port = (10_000 + pick % (low.max(10_001) - 10_000)) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
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

    /// One node started with `extra` flags (for example `--max-request-bytes=512`).
    pub async fn single_with(extra: &[&str]) -> Etcd {
        Self::start_with(1, extra).await
    }

    async fn start(n: usize) -> Etcd {
        Self::start_with(n, &[]).await
    }

    async fn start_with(n: usize, extra: &[&str]) -> Etcd {
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
                let mut args = vec![
                    format!("--name=n{i}"),
                    format!("--data-dir={}", dir.path().join(format!("n{i}")).display()),
                    format!("--listen-client-urls={client_url}"),
                    format!("--advertise-client-urls={client_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster={initial}"),
                    format!("--initial-cluster-token={token}"),
                    "--initial-cluster-state=new".to_owned(),
                    "--heartbeat-interval=10".to_owned(),
                    "--election-timeout=100".to_owned(),
                    "--logger=zap".to_owned(),
                    "--log-level=error".to_owned(),
                ];
                args.extend(extra.iter().map(|a| (*a).to_owned()));
                let child = Some(spawn(&args));
                Node {
                    child,
                    client_url,
                    args,
                }
            })
            .collect();
        let etcd = Etcd { nodes, _dir: dir };
        etcd.wait_ready().await;
        etcd
    }

    /// Kills every node (as a crash would); [`Etcd::restart`] brings them back with their data.
    pub fn stop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Starts stopped nodes again on the same ports and data directories, and waits until
    /// the cluster answers.
    pub async fn restart(&mut self) {
        for n in &mut self.nodes {
            if n.child.is_none() {
                n.child = Some(spawn(&n.args));
            }
        }
        self.wait_ready().await;
    }

    /// A single node's data copied aside, taken with the node stopped and then started again:
    /// what an operator's backup (or a disk snapshot) holds.
    pub async fn backup(&mut self) -> tempfile::TempDir {
        assert_eq!(self.nodes.len(), 1, "backups of a single node only");
        self.stop();
        let copy = tempfile::tempdir().unwrap();
        copy_dir(&self.data_dir(0), copy.path());
        self.restart().await;
        copy
    }

    /// Replaces the single node's data by `backup` (from [`Etcd::backup`]) and starts it
    /// again: etcd restored from an older snapshot, revisions and all.
    pub async fn restore(&mut self, backup: &std::path::Path) {
        self.stop();
        let data = self.data_dir(0);
        std::fs::remove_dir_all(&data).unwrap();
        copy_dir(backup, &data);
        self.restart().await;
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        let arg = self.nodes[i]
            .args
            .iter()
            .find_map(|a| a.strip_prefix("--data-dir="))
            .expect("a data dir");
        PathBuf::from(arg)
    }

    /// Kills node `i` alone (a crash of one member).
    pub fn stop_node(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts node `i` again on its ports and data; does not wait for the cluster.
    pub fn start_node(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if n.child.is_none() {
            n.child = Some(spawn(&n.args));
        }
    }

    /// Waits until the cluster takes writes again (a quorum is up).
    pub async fn wait_writable(&self) {
        self.wait_ready().await;
    }

    /// The index of the current leader among the running nodes, asked of each node.
    pub async fn leader(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader = None;
        for n in &self.nodes {
            let mut id = None;
            if n.child.is_some() {
                if let Ok(mut c) = etcd_client::Client::connect([n.client_url.as_str()], None).await
                {
                    if let Ok(st) = c.status().await {
                        id = st.header().map(|h| h.member_id());
                        if st.leader() != 0 {
                            leader = Some(st.leader());
                        }
                    }
                }
            }
            ids.push(id);
        }
        let leader = leader?;
        ids.iter().position(|id| *id == Some(leader))
    }

    async fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            if let Ok(mut c) = etcd_client::Client::connect(self.endpoints(), None).await {
                if c.put("/palisade-test/ready", "1", None).await.is_ok() {
                    return;
                }
            }
            if started.elapsed() > Duration::from_secs(20) {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| {
                        let log = std::fs::read_to_string(log_of(&n.args)).unwrap_or_default();
                        let tail: Vec<&str> = log.lines().rev().take(5).collect();
                        format!("{}: {:?}", n.client_url, tail)
                    })
                    .collect();
                panic!("etcd did not become ready in 20 s; its errors: {logs:#?}");
            }
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
        self.stop();
    }
}

/// Where node `args` writes its errors: beside its data directory.
fn log_of(args: &[String]) -> PathBuf {
    let data = args
        .iter()
        .find_map(|a| a.strip_prefix("--data-dir="))
        .expect("every node has a data directory");
    PathBuf::from(format!("{data}.log"))
}

fn spawn(args: &[String]) -> Child {
    let bin = binary();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_of(args))
        .unwrap();
    Command::new(&bin)
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
}

impl Etcd {
    /// The process id of node `i` while it runs (to SIGSTOP and SIGCONT it: a frozen etcd
    /// keeps its sockets open but answers nothing, and expires no lease).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].child.as_ref().map(Child::id)
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}
