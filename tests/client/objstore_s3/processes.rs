//! Five candidate processes against moto for 60 s, the leader SIGSTOPped past its TTL again
//! and again.
//!
//! The candidates are this test binary run again as children (`PALISADE_OBJSTORE_CHILD`
//! makes [`candidate_child`] do the work; without it, it returns at once). The resource they
//! write to is the `palisade` proxy (memory marks) in front of a recording upstream: what
//! reaches the upstream is the record of the tokens accepted.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use palisade::client::objstore::Elector;
use tokio::time::Instant;

use super::checks::{check_failovers, check_terms, check_writes};
use super::{moto, moto_bucket, options, support, CHILD, NAME, PAUSE, POLL, RUN, TTL};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "objstore {line}");
    let _ = out.flush();
}

fn wall_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// A small xorshift: holds and pauses need no more randomness than this.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn candidate_child() {
    let Ok(args) = std::env::var(CHILD) else {
        return;
    };
    let [endpoint, bucket, proxy, secs, id]: [&str; 5] = args
        .split(' ')
        .collect::<Vec<_>>()
        .try_into()
        .expect("endpoint bucket proxy secs id");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let until = Instant::now() + Duration::from_secs(secs.parse().unwrap());
        candidate(endpoint, bucket, proxy, until, id).await;
    });
    say("done");
}

/// Campaign; lead for a random hold, writing the token to the resource every 50 ms while
/// the term is live; release; again. A write made on waking from a stop goes out before the
/// loss is checked: the request a frozen leader had in flight, which only the fence stops.
async fn candidate(endpoint: &str, bucket: &str, proxy: &str, until: Instant, id: &str) {
    let store = moto::s3(endpoint, bucket);
    let elector = match Elector::new(store, options(&format!("candidate-{id}"))).await {
        Ok(e) => e,
        Err(e) => return say(&format!("error start {e}")),
    };
    let url = format!("http://{proxy}/leader/write");
    let mut rng = Rng(u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    while Instant::now() < until {
        let won = tokio::select! {
            won = elector.campaign(NAME) => won,
            () = tokio::time::sleep_until(until) => return,
        };
        let mut leadership = match won {
            Ok(l) => l,
            Err(e) => {
                say(&format!("error campaign {e}"));
                tokio::time::sleep(POLL).await;
                continue;
            }
        };
        let token = leadership.token().get();
        say(&format!("acquired {token} {}", wall_micros()));
        let lost = leadership.loss_signal();
        let hold = Duration::from_millis(1000 + rng.below(3000));
        let (start, mut last) = (Instant::now(), Instant::now());
        let end = loop {
            let paused = last.elapsed() > PAUSE;
            last = Instant::now();
            let live = !lost.is_lost();
            if !live && !paused {
                break "noticed";
            }
            let left = lost.deadline().saturating_duration_since(Instant::now());
            let sent = Instant::now();
            let got = support::post(&url, Some(token.to_string().as_str())).await;
            say(&format!(
                "wrote {token} {} live={live} paused={paused} left_ms={} took_ms={}",
                got.status.as_u16(),
                left.as_millis(),
                sent.elapsed().as_millis()
            ));
            if !live {
                break "zombie";
            }
            if got.status.as_u16() != 200 {
                break "refused";
            }
            if start.elapsed() >= hold || Instant::now() >= until {
                break "done";
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let released = leadership.release().await;
        say(&format!(
            "ended {token} {end} released={}",
            released.is_ok()
        ));
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
    }
}

struct Candidate {
    child: Child,
}

impl Candidate {
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy_config(upstream: SocketAddr) -> String {
    format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[marks]\n\
         store = \"memory\"\n[[upstream]]\nname = \"resource\"\nurl = \"http://{upstream}\"\n\
         [[route]]\nname = \"leader\"\nupstream = \"resource\"\npath_prefix = \"/leader/\"\n\
         resource = \"leader\"\n"
    )
}

/// One SIGSTOP of a leader: which child, its token, and when (wall clock, microseconds).
pub(crate) struct Stop {
    pub(crate) child: usize,
    pub(crate) token: u64,
    pub(crate) at: u128,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_candidate_processes_with_sigstopped_leaders_never_act_at_once() {
    // Failovers measured against SLACK for 60 s: alone among the binary's timing tests
    // (`support::serial`).
    let _serial = support::serial().await;
    let (moto, _) = moto_bucket("five");
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::write(dir.path(), "palisade.toml", &proxy_config(up.addr));
    let proxy = support::spawn_proxy(&path).unwrap_or_else(|e| panic!("proxy: {e:?}"));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut candidates = Vec::new();
    for i in 0..5 {
        let args = format!(
            "{} five {} {} {i}",
            moto.endpoint(),
            proxy.addr,
            RUN.as_secs()
        );
        let child = support::child_test(
            (module_path!(), "candidate_child"),
            (CHILD, &args),
            "objstore ",
            (i, tx.clone()),
        );
        candidates.push(Candidate { child });
    }
    drop(tx);
    // Who leads now, as the children report it: the stopper picks the leader from it.
    let support::Reports {
        holding,
        lines,
        reader,
    } = support::reports(rx, 1, &["ended"]);
    let started = Instant::now();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut stops = Vec::new();
    // Stop the leader for TTL + 1.5 s, then let it go on; until 5 s before the children end.
    while started.elapsed() + TTL + Duration::from_secs(5) < RUN {
        tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
        let leader = holding
            .lock()
            .unwrap()
            .iter()
            .max_by_key(|(_, t)| **t)
            .map(|(i, t)| (*i, *t));
        let Some((child, token)) = leader else {
            continue;
        };
        candidates[child].signal("-STOP");
        stops.push(Stop {
            child,
            token,
            at: wall_micros(),
        });
        tokio::time::sleep(TTL + Duration::from_millis(1500)).await;
        candidates[child].signal("-CONT");
    }
    let left = RUN.saturating_sub(started.elapsed()) + Duration::from_secs(15);
    tokio::time::timeout(left, reader)
        .await
        .expect("children finish")
        .unwrap();
    let lines = lines.lock().unwrap().clone();
    let acquired = check_terms(&lines);
    check_writes(&lines, &up.log.all(), &acquired);
    check_failovers(&stops, &lines);
    // The record after the run was never deleted or rewound: at least the last generation.
    let store = moto::s3(&moto.endpoint(), "five");
    let observer = Elector::new(store, options("observer")).await.unwrap();
    let lease = observer.current(NAME).await.unwrap().unwrap();
    let last = acquired.keys().max().copied().unwrap();
    assert!(lease.token.get() >= last, "{lease:?} after term {last}");
    let dones = lines.iter().filter(|(_, l)| l == "done").count();
    assert_eq!(dones, 5, "every child ran to its end");
    eprintln!("run took {:.1} s", started.elapsed().as_secs_f64());
}
