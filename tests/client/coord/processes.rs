//! Real process crashes, against etcd only: the holder is `examples/lock.rs` or
//! `examples/election.rs` running as a child process.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use tokio::sync::mpsc;

use super::*;

struct Proc {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Proc {
    fn start(example: &str, etcd: &etcd::Etcd, name: &str) -> Proc {
        // Examples are built next to the test binary: target/<profile>/examples/<name>.
        let exe = std::env::current_exe().unwrap();
        let path: PathBuf = exe
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples")
            .join(example);
        assert!(
            path.exists(),
            "{} is not built (cargo test --all-features --all-targets builds it)",
            path.display()
        );
        let mut child = Command::new(path)
            .args([
                "--endpoint",
                &etcd.endpoint(),
                "--name",
                name,
                "--ttl",
                "2",
                "--namespace",
                NS,
            ])
            .args(["--hold-secs", "120", "--lead-secs", "120"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Proc { child, lines }
    }

    async fn line(&mut self, within: Duration) -> String {
        tokio::time::timeout(within, self.lines.recv())
            .await
            .expect("a line in time")
            .expect("the process is alive")
    }

    async fn token(&mut self, prefix: &str) -> u64 {
        loop {
            let l = self.line(Duration::from_secs(10)).await;
            if let Some(t) = l.strip_prefix(prefix) {
                return t.parse().unwrap();
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn fx() -> Fx {
    Fx::etcd().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_holder_is_replaced_with_a_higher_token_and_learns_it_lost() {
    let fx = fx().await;
    let Fx::Etcd(etcd, _) = &fx else {
        unreachable!()
    };
    let mut holder = Proc::start("lock", etcd, "stop");
    let t1 = holder.token("token=").await;
    holder.signal("-STOP");
    let waiter = fx.session().await;
    let g = tokio::time::timeout(TTL * 3, waiter.lock("stop"))
        .await
        .expect("the waiter takes over")
        .unwrap();
    assert!(g.token().get() > t1, "{} after {t1}", g.token());
    holder.signal("-CONT");
    assert_eq!(
        holder.line(Duration::from_secs(2)).await,
        "lost",
        "the zombie learns within 2 s of waking"
    );
    let relock = holder.line(Duration::from_secs(5)).await;
    assert_eq!(
        relock, "relock=the session's lease is lost",
        "no token from a lost session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_holder_is_replaced_within_ttl_plus_2s_with_a_higher_token() {
    let fx = fx().await;
    let Fx::Etcd(etcd, _) = &fx else {
        unreachable!()
    };
    let mut holder = Proc::start("lock", etcd, "kill");
    let t1 = holder.token("token=").await;
    let waiter = fx.session().await;
    let pending = tokio::spawn(async move { waiter.lock("kill").await.map(|g| (g.token(), g)) });
    holder.signal("-KILL");
    let killed = Instant::now();
    let (t2, _g) = tokio::time::timeout(TTL + Duration::from_secs(2), pending)
        .await
        .expect("in time")
        .unwrap()
        .unwrap();
    assert!(killed.elapsed() <= TTL + Duration::from_secs(2));
    assert!(t2.get() > t1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_leads_within_ttl_plus_2s_after_the_leader_is_killed() {
    let fx = fx().await;
    let Fx::Etcd(etcd, _) = &fx else {
        unreachable!()
    };
    let mut leader = Proc::start("election", etcd, "jobs");
    let t1 = leader.token("leader token=").await;
    let follower = fx.session().await;
    let mut obs = follower.observe("jobs").await.unwrap();
    let campaign = {
        let f = follower.clone();
        tokio::spawn(async move { f.campaign("jobs", "follower").await.map(|l| (l.token(), l)) })
    };
    leader.signal("-KILL");
    let killed = Instant::now();
    let (t2, _l) = tokio::time::timeout(TTL + Duration::from_secs(2), campaign)
        .await
        .expect("in time")
        .unwrap()
        .unwrap();
    assert!(killed.elapsed() <= TTL + Duration::from_secs(2));
    assert!(t2.get() > t1);
    let mut seen = Vec::new();
    while let Ok(Some(Ok(o))) = tokio::time::timeout(Duration::from_millis(500), obs.next()).await {
        if let Observation::Leader(t) = o {
            seen.push(t.token.get());
        }
    }
    assert_eq!(
        seen.last(),
        Some(&t2.get()),
        "observers see the new term: {seen:?}"
    );
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "terms in increasing order: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_a_three_node_cluster_exclude_and_order_tokens_across_nodes() {
    let etcd = etcd::Etcd::cluster().await;
    let mut sessions = Vec::new();
    for url in etcd.endpoints() {
        let client = etcd::Etcd::client_at(&url).await;
        sessions.push(
            EtcdProvider::new(&client)
                .session(Fx::options(TTL))
                .await
                .unwrap(),
        );
    }
    let inside = Arc::new(AtomicBool::new(false));
    let order = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            let (inside, order) = (inside.clone(), order.clone());
            tokio::spawn(async move {
                for _ in 0..10 {
                    let g = s.lock("cluster").await.unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst));
                    order.lock().unwrap().push(g.token().get());
                    inside.store(false, Ordering::SeqCst);
                    g.unlock().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap();
    assert_eq!(order.len(), 30);
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
}
