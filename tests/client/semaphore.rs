//! Semaphores with fencing, end to end: real contender processes on a real etcd,
//! the real `palisade` proxy in front of a recording upstream, one guarded route per slot.
//!
//! The contenders are this test binary run again as children (`PALISADE_SEM_CHILD=1` makes
//! [`contender_child`] do the work; without it, it returns at once).

use crate::etcd;
use crate::support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use palisade::client::provider::etcd::EtcdProvider;
use palisade::{MemoryProvider, Provider, SemaphoreService, SessionOptions, SessionState};

const CHILD: &str = "PALISADE_SEM_CHILD";
const NS: &str = "/sem";
const NAME: &str = "jobs";
const PERMITS: u32 = 3;
const TTL: Duration = Duration::from_secs(2);
const RUN: Duration = Duration::from_secs(20);

/// One guarded route per slot: the slot is in the path, the resource is `jobs/<slot>`.
fn config(upstream: std::net::SocketAddr) -> String {
    let mut c = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[marks]\n\
         store = \"memory\"\n[[upstream]]\nname = \"jobs\"\nurl = \"http://{upstream}\"\n"
    );
    for slot in 0..PERMITS {
        c.push_str(&format!(
            "[[route]]\nname = \"slot-{slot}\"\nupstream = \"jobs\"\npath_prefix = \"/jobs/{slot}/\"\n\
             resource = \"jobs/{slot}\"\n"
        ));
    }
    c
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "sem {line}");
    let _ = out.flush();
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
fn contender_child() {
    let Ok(args) = std::env::var(CHILD) else {
        return;
    };
    let [endpoint, proxy, secs]: [&str; 3] = args
        .split(' ')
        .collect::<Vec<_>>()
        .try_into()
        .expect("endpoint proxy secs");
    let until = Instant::now() + Duration::from_secs(secs.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(contend(endpoint, proxy, until));
    say("done");
}

/// Acquire, write `enter`, `work`... `leave` through the proxy for a random hold, release;
/// on a refusal, report whether the permit was lost (it must be) and start a new session.
async fn contend(endpoint: &str, proxy: &str, until: Instant) {
    let client = etcd::Etcd::client_at(endpoint).await;
    let provider = EtcdProvider::new(&client);
    let mut rng = Rng(u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    'session: while Instant::now() < until {
        let options = SessionOptions::new().with_ttl(TTL).with_namespace(NS);
        let Ok(session) = provider.session(options).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while Instant::now() < until {
            let permit = tokio::select! {
                p = session.acquire(NAME, PERMITS) => match p {
                    Ok(p) => p,
                    Err(_) => continue 'session,
                },
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(until)) => return,
            };
            let (slot, token) = (permit.slot(), permit.token().get());
            say(&format!("acquired {slot} {token}"));
            let mut lost = permit.loss_signal();
            let hold = Duration::from_millis(50 + rng.below(500));
            let (start, mut last) = (Instant::now(), Instant::now());
            let (mut stopped, mut refused) = (false, false);
            let mut kind = "enter";
            loop {
                let url = format!("http://{proxy}/jobs/{slot}/{kind}");
                let got = support::post(&url, Some(token.to_string().as_str())).await;
                // The monotonic clock runs on while the process is stopped.
                stopped |= last.elapsed() > Duration::from_secs(1);
                last = Instant::now();
                match got.status.as_u16() {
                    200 => {}
                    409 => {
                        refused = true;
                        break;
                    }
                    other => say(&format!("unexpected {other} {}", got.text())),
                }
                if kind == "leave" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
                kind = if start.elapsed() >= hold {
                    "leave"
                } else {
                    "work"
                };
            }
            if refused {
                // A live holder is never refused: a refused one must learn that it lost.
                let lost = tokio::time::timeout(TTL + Duration::from_secs(2), lost.wait())
                    .await
                    .is_ok();
                say(&format!(
                    "refused {slot} {token} stopped={stopped} lost={lost}"
                ));
                continue 'session;
            }
            let released = permit.release().await;
            say(&format!("released {slot} {token} {}", released.is_ok()));
            if session.state() != SessionState::Alive {
                continue 'session;
            }
        }
    }
}

struct Contender {
    child: Child,
}

impl Contender {
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
    }
}

impl Drop for Contender {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_permits_eight_sigstopped_contenders_never_exceed_three_and_zombies_are_refused() {
    // Eight contender processes for 20 s: alone among the binary's timing tests
    // (`support::serial`).
    let _serial = support::serial().await;
    let etcd = etcd::Etcd::single().await;
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::write(dir.path(), "palisade.toml", &config(up.addr));
    let proxy = support::spawn_proxy(&path).unwrap_or_else(|e| panic!("proxy: {e:?}"));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut contenders = Vec::new();
    for i in 0..8 {
        let args = format!("{} {} {}", etcd.endpoint(), proxy.addr, RUN.as_secs());
        let child = support::child_test(
            (module_path!(), "contender_child"),
            (CHILD, &args),
            "sem ",
            (i, tx.clone()),
        );
        contenders.push(Contender { child });
    }
    drop(tx);
    // Who holds what now, as the children report it: the stopper picks holders from it.
    let support::Reports {
        holding,
        lines,
        reader,
    } = support::reports(rx, 2, &["released", "refused"]);
    // Four rounds: SIGSTOP one holder and one other contender past the TTL, then SIGCONT.
    let started = Instant::now();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut stopped_tokens = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let holder = holding.lock().unwrap().iter().next().map(|(i, t)| (*i, *t));
        let Some((h, token)) = holder else { continue };
        let other = (h + 1 + rng.below(7) as usize) % 8;
        stopped_tokens.push(token);
        contenders[h].signal("-STOP");
        contenders[other].signal("-STOP");
        tokio::time::sleep(TTL + Duration::from_millis(1500)).await;
        contenders[h].signal("-CONT");
        contenders[other].signal("-CONT");
    }
    let left = RUN.saturating_sub(started.elapsed()) + Duration::from_secs(8);
    tokio::time::timeout(left, reader)
        .await
        .expect("children finish")
        .unwrap();
    let lines = lines.lock().unwrap().clone();
    check(&lines, &up.log.all(), &stopped_tokens);
    let metrics = support::get(&format!("http://{}/metrics", proxy.admin.unwrap())).await;
    let stale: f64 = metrics
        .text()
        .lines()
        .filter(|l| l.starts_with("palisade_stale_rejections_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    eprintln!("stale rejections at the proxy (metric): {stale}");
    assert!(stale >= 1.0);
}

/// The claims, from the children's reports and the resource's own log.
fn check(lines: &[(usize, String)], seen: &[support::Seen], stopped: &[u64]) {
    let words = |l: &str| l.split(' ').map(str::to_owned).collect::<Vec<_>>();
    let mut acquired: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut refused = Vec::new();
    for (i, l) in lines {
        let w = words(l);
        match w[0].as_str() {
            "acquired" => acquired
                .entry(w[1].parse().unwrap())
                .or_default()
                .push(w[2].parse().unwrap()),
            "refused" => refused.push((i, l.clone())),
            "unexpected" => panic!("child {i}: {l}"),
            _ => {}
        }
    }
    let total: usize = acquired.values().map(Vec::len).sum();
    let all: HashSet<u64> = acquired.values().flatten().copied().collect();
    assert_eq!(all.len(), total, "every permit has its own token");
    assert!(
        acquired.keys().all(|s| *s < PERMITS),
        "slots: {:?}",
        acquired.keys()
    );
    // Every refusal hit a holder that had lost its permit, and at least one was a SIGSTOPped
    // holder woken after its slot was taken over.
    for (i, l) in &refused {
        assert!(
            l.ends_with("lost=true"),
            "a live holder was refused: child {i}: {l}"
        );
    }
    let zombies: Vec<_> = refused
        .iter()
        .filter(|(_, l)| l.contains("stopped=true"))
        .collect();
    assert!(
        !zombies.is_empty(),
        "no stopped holder came back to be refused: {refused:?}"
    );
    // The resource's log, in arrival order: per slot, tokens never go down; per token, the
    // span from its first to its last admitted request; never more than 3 spans overlap.
    let mut per_slot: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut span: HashMap<u64, (usize, usize)> = HashMap::new();
    for (n, s) in seen.iter().enumerate() {
        let slot: u32 = s.path.split('/').nth(2).unwrap().parse().unwrap();
        let token: u64 = s.token.as_deref().unwrap().parse().unwrap();
        per_slot.entry(slot).or_default().push(token);
        span.entry(token).and_modify(|e| e.1 = n).or_insert((n, n));
    }
    for (slot, tokens) in &per_slot {
        assert!(
            tokens.windows(2).all(|w| w[0] <= w[1]),
            "slot {slot} went down: {tokens:?}"
        );
        let mut distinct = tokens.clone();
        distinct.dedup();
        assert!(distinct.windows(2).all(|w| w[0] < w[1]));
        let foreign: Vec<_> = distinct
            .iter()
            .filter(|t| !acquired[slot].contains(t))
            .map(|t| {
                (
                    t,
                    acquired
                        .iter()
                        .find(|(_, v)| v.contains(t))
                        .map(|(s, _)| *s),
                )
            })
            .collect();
        assert!(
            foreign.is_empty(),
            "tokens not acquired for slot {slot} (token, slot it was acquired for): {foreign:?}"
        );
    }
    let mut max = 0;
    for n in 0..seen.len() {
        let open = span.values().filter(|(a, b)| *a <= n && n <= *b).count();
        max = max.max(open);
    }
    assert!(
        max <= PERMITS as usize,
        "{max} holders at once at the resource"
    );
    // While the zombies were stopped and refused, the others kept working.
    let others = seen
        .iter()
        .filter(|s| !stopped.contains(&s.token.as_deref().unwrap().parse().unwrap()))
        .count();
    let after: Vec<u64> = per_slot.values().map(|t| *t.last().unwrap()).collect();
    eprintln!(
        "permits acquired: {total}; per slot: {:?}; refusals: {} ({} of stopped holders); \
         admitted requests: {} ({others} from holders never stopped); peak holders at the \
         resource: {max}; last tokens per slot: {after:?}",
        acquired
            .iter()
            .map(|(s, t)| (*s, t.len()))
            .collect::<Vec<_>>(),
        refused.len(),
        zombies.len(),
        seen.len(),
    );
    assert!(
        total >= 30 && others > 100,
        "too little work: {total} permits, {others} requests"
    );
}

/// The safe configuration of `docs/client.md#semaphores`, checked: one resource per slot, and what a client that
/// names another slot can do. A lower token is refused (it fences only itself); a higher one
/// is admitted and stalls that slot's current holder, never a later holder of that slot, and
/// no mark ever goes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_sent_to_another_slot_never_lets_a_stale_write_in() {
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = support::proxy(&config(up.addr), dir.path()).await;
    let provider = MemoryProvider::new();
    let options = || SessionOptions::new().with_ttl(TTL).with_namespace(NS);
    let (a, b) = (
        provider.session(options()).await.unwrap(),
        provider.session(options()).await.unwrap(),
    );
    let pa = a.acquire(NAME, 2).await.unwrap();
    let pb = b.acquire(NAME, 2).await.unwrap();
    assert_eq!((pa.slot(), pb.slot()), (0, 1));
    assert!(pb.token() > pa.token());
    let write = |slot: u32, t: palisade::FencingToken| {
        let url = proxy.url(&format!("/jobs/{slot}/w"));
        async move {
            support::post(&url, Some(t.to_string().as_str()))
                .await
                .status
                .as_u16()
        }
    };
    assert_eq!(write(0, pa.token()).await, 200);
    assert_eq!(write(1, pb.token()).await, 200);
    // A's token at B's slot: lower than slot 1's mark, refused; slot 1 unaffected.
    assert_eq!(write(1, pa.token()).await, 409);
    assert_eq!(write(1, pb.token()).await, 200);
    // B's token at A's slot: higher, admitted; A (slot 0's current holder) is now refused.
    assert_eq!(write(0, pb.token()).await, 200);
    assert_eq!(
        write(0, pa.token()).await,
        409,
        "the older holder of slot 0 is stalled"
    );
    // A re-acquires: its new token is above B's, so slot 0 works again; B can no longer go
    // back to a token below A's new one there.
    pa.release().await.unwrap();
    let pa2 = a.acquire(NAME, 2).await.unwrap();
    assert_eq!(pa2.slot(), 0);
    assert!(pa2.token() > pb.token());
    assert_eq!(write(0, pa2.token()).await, 200);
    assert_eq!(write(0, pb.token()).await, 409);
    assert_eq!(
        write(0, pa.token()).await,
        409,
        "the stale token stays refused"
    );
    let marks = proxy.marks().await;
    assert_eq!(marks["jobs/0"], pa2.token().get());
    assert_eq!(marks["jobs/1"], pb.token().get());
    let admitted: Vec<_> = up
        .log
        .all()
        .iter()
        .map(|s| (s.path.clone(), s.token.clone().unwrap()))
        .collect();
    assert_eq!(admitted.len(), 5, "{admitted:?}");
}
