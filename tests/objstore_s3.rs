//! Object-store leader election against a real S3-compatible server: moto's server
//! (tests/support/moto.rs), through object_store's S3 client.
//!
//! The five candidates of the SIGSTOP test are this test binary run again as children
//! (`PALISADE_OBJSTORE_CHILD` makes [`candidate_child`] do the work; without it, it returns
//! at once). The resource they write to is the `palisade` proxy (memory marks) in front of a
//! recording upstream: what reaches the upstream is the record of the tokens accepted.

#[path = "support/moto.rs"]
mod moto;
mod support;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use palisade::objstore::{Elector, ElectorOptions, Error, Event};
use tokio::sync::oneshot;
use tokio::time::Instant;

const CHILD: &str = "PALISADE_OBJSTORE_CHILD";
const NAME: &str = "leader";
const TTL: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(250);
const RUN: Duration = Duration::from_secs(60);
/// A gap this long between two turns of a leader's write loop means it was stopped.
const PAUSE: Duration = Duration::from_millis(1000);
/// Failover bound beyond TTL + POLL: three round trips to moto (the follower's read, its
/// takeover write, and the read that was in flight) plus process scheduling on a shared
/// 2-core machine.
const SLACK: Duration = Duration::from_millis(400);

fn options(holder: &str) -> ElectorOptions {
    ElectorOptions::new()
        .with_prefix("elections")
        .with_ttl(TTL)
        .with_poll_every(POLL)
        .with_holder(holder)
}

/// moto with one bucket, and a store on it.
fn moto_bucket(
    bucket: &str,
) -> (
    moto::Moto,
    Arc<dyn palisade::objstore::object_store::ObjectStore>,
) {
    let m = moto::Moto::start();
    m.bucket(bucket);
    let store = moto::s3(&m.endpoint(), bucket);
    (m, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_honours_if_none_match_and_if_match_and_terms_count_up_across_release() {
    let (_moto, store) = moto_bucket("terms");
    let a = Elector::new(store.clone(), options("a")).await.unwrap();
    let b = Elector::new(store.clone(), options("b")).await.unwrap();
    let mut events = a.events();
    let mut first = a.campaign(NAME).await.unwrap();
    assert_eq!(first.token().get(), 1);
    assert!(matches!(events.next().await, Some(Event::Acquired { .. })));
    // Renewals change the ETag although moto's ETag is the content's MD5 (the record's
    // revision changes): the follower keeps seeing a live leader.
    let mut b_events = b.events();
    let follower = tokio::spawn(async move { b.campaign(NAME).await.map(|l| l.token().get()) });
    for _ in 0..4 {
        assert!(matches!(events.next().await, Some(Event::Renewed { .. })));
    }
    assert!(!follower.is_finished(), "a live leader was taken over");
    let released_at = Instant::now();
    first.release().await.unwrap();
    assert_eq!(follower.await.unwrap().unwrap(), 2);
    assert!(
        released_at.elapsed() <= POLL + SLACK,
        "{:?}",
        released_at.elapsed()
    );
    let lease = a.current(NAME).await.unwrap().unwrap();
    assert_eq!((lease.token.get(), lease.holder.as_str()), (2, "b"));
    // The follower's leadership was dropped with its task: released in the background.
    loop {
        match b_events.next().await {
            Some(Event::Released { token, .. }) => break assert_eq!(token.get(), 2),
            Some(_) => {}
            None => panic!("b's events ended"),
        }
    }
    let lease = a.current(NAME).await.unwrap().unwrap();
    assert_eq!((lease.token.get(), lease.released), (2, true));
    assert_eq!(a.campaign(NAME).await.unwrap().token().get(), 3);
}

/// A forwarder in front of moto that drops one request header: a store that ignores it.
async fn dropping(target: SocketAddr, header: &'static str) -> (SocketAddr, oneshot::Sender<()>) {
    type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let (stop, stopped) = oneshot::channel::<()>();
    let handle = move |mut req: Request<Incoming>, _peer| {
        let client = client.clone();
        async move {
            req.headers_mut().remove(header);
            let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
            *req.uri_mut() = format!("http://{target}{path}").parse().unwrap();
            match client.request(req).await {
                Ok(resp) => resp.map(|b| -> Body { b.map_err(Into::into).boxed() }),
                Err(e) => {
                    let body = Full::new(Bytes::from(e.to_string())).map_err(|n| match n {});
                    let mut r = Response::new(body.boxed());
                    *r.status_mut() = http::StatusCode::BAD_GATEWAY;
                    r
                }
            }
        }
    };
    let shutdown = async move {
        let _ = stopped.await;
    };
    tokio::spawn(palisade::server::serve(
        listener,
        handle,
        shutdown,
        Duration::from_secs(1),
    ));
    (addr, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_if_match_or_if_none_match_is_refused_at_startup() {
    let (m, _) = moto_bucket("probe");
    for (header, check) in [
        ("if-match", "If-Match"),
        ("if-none-match", "If-None-Match: *"),
    ] {
        let (addr, _stop) = dropping(m.addr, header).await;
        let store = moto::s3(&format!("http://{addr}"), "probe");
        match Elector::new(store, options("a")).await {
            Err(Error::PreconditionsIgnored { check: c }) => assert_eq!(c, check),
            other => panic!("without {header}: {other:?}"),
        }
    }
}

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
struct Stop {
    child: usize,
    token: u64,
    at: u128,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_candidate_processes_with_sigstopped_leaders_never_act_at_once() {
    let (moto, _) = moto_bucket("five");
    let up = support::upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let path = support::write(dir.path(), "palisade.toml", &proxy_config(up.addr));
    let proxy = support::spawn_proxy(&path).unwrap_or_else(|e| panic!("proxy: {e:?}"));
    let exe = std::env::current_exe().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut candidates = Vec::new();
    for i in 0..5 {
        let args = format!(
            "{} five {} {} {i}",
            moto.endpoint(),
            proxy.addr,
            RUN.as_secs()
        );
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "candidate_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // libtest's "test candidate_child ... " has no newline before the first line.
                if let Some((_, l)) = line.split_once("objstore ") {
                    let _ = tx.send((i, l.to_owned()));
                }
            }
        });
        candidates.push(Candidate { child });
    }
    drop(tx);
    // Who leads now, as the children report it: the stopper picks the leader from it.
    let holding: Arc<Mutex<HashMap<usize, u64>>> = Arc::default();
    let lines: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let reader = {
        let (holding, lines) = (holding.clone(), lines.clone());
        tokio::spawn(async move {
            while let Some((i, l)) = rx.recv().await {
                let w: Vec<&str> = l.split(' ').collect();
                match w[0] {
                    "acquired" => {
                        holding.lock().unwrap().insert(i, w[1].parse().unwrap());
                    }
                    "ended" => {
                        holding.lock().unwrap().remove(&i);
                    }
                    _ => {}
                }
                lines.lock().unwrap().push((i, l));
            }
        })
    };
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

/// Generations: every term has its own token (none reused), each candidate's tokens go up,
/// and releases are followed by their generation + 1. Returns token -> child.
fn check_terms(lines: &[(usize, String)]) -> BTreeMap<u64, usize> {
    let mut acquired = BTreeMap::new();
    let mut per_child: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut released = Vec::new();
    for (i, l) in lines {
        let w: Vec<&str> = l.split(' ').collect();
        match w[0] {
            "error" => panic!("child {i}: {l}"),
            "acquired" => {
                let t: u64 = w[1].parse().unwrap();
                assert!(acquired.insert(t, *i).is_none(), "token {t} won twice");
                per_child.entry(*i).or_default().push(t);
            }
            "ended" if w[3] == "released=true" => released.push(w[1].parse::<u64>().unwrap()),
            _ => {}
        }
    }
    for (i, tokens) in &per_child {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "child {i}: {tokens:?}"
        );
    }
    let n = acquired.len() as u64;
    // A generation nobody reported would be a takeover write that landed while both its
    // answer and the read-back were lost (a safe gap: the record then simply expires).
    let highest = acquired.keys().max().copied().unwrap_or(0);
    let handed_on = released
        .iter()
        .filter(|t| acquired.contains_key(&(*t + 1)))
        .count();
    eprintln!(
        "terms: {n} (generations 1..={highest}, {} unreported); per candidate: {:?}; released \
         and re-acquired with generation + 1: {handed_on}",
        highest - n,
        (0..5)
            .map(|i| per_child.get(&i).map_or(0, Vec::len))
            .collect::<Vec<_>>()
    );
    assert!(
        n >= 10 && handed_on >= 3,
        "too few terms: {n}, {handed_on} hand-overs"
    );
    acquired
}

/// Writes: what reached the resource never goes down and comes from won terms only; a leader
/// that believed its term live was never refused (unless its request arrived after its own
/// deadline); every write sent by a leader woken past its term was refused.
fn check_writes(
    lines: &[(usize, String)],
    seen: &[support::Seen],
    acquired: &BTreeMap<u64, usize>,
) {
    let tokens: Vec<u64> = seen
        .iter()
        .map(|s| s.token.as_deref().unwrap().parse().unwrap())
        .collect();
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "the accepted tokens went down"
    );
    assert!(
        tokens.iter().all(|t| acquired.contains_key(t)),
        "a token nobody won"
    );
    let (mut live, mut late, mut zombies) = (0, 0, 0);
    for (i, l) in lines {
        let w: Vec<&str> = l.split(' ').collect();
        if w[0] != "wrote" {
            continue;
        }
        let field = |k: &str| w.iter().find_map(|f| f.strip_prefix(k)).unwrap();
        let status: u16 = w[2].parse().unwrap();
        let left: u64 = field("left_ms=").parse().unwrap();
        let took: u64 = field("took_ms=").parse().unwrap();
        if field("live=") == "true" {
            live += 1;
            if status != 200 {
                assert!(
                    status == 409 && took >= left,
                    "child {i}: a live leader's write was refused before its deadline: {l}"
                );
                late += 1;
            }
        } else {
            zombies += 1;
            assert_eq!(status, 409, "child {i}: a stale write was accepted: {l}");
        }
    }
    eprintln!(
        "writes: {live} by live leaders ({late} refused, sent in time but arriving after the \
         leader's own deadline), {zombies} by leaders woken after their term (all refused); \
         accepted by the resource: {}",
        tokens.len()
    );
    assert!(zombies >= 1, "no stopped leader came back to write");
    assert!(live >= 200, "too little work: {live} writes");
}

/// Failover: the next term began within TTL + POLL (+ round trips) of the leader's stop.
fn check_failovers(stops: &[Stop], lines: &[(usize, String)]) {
    let acquisitions: Vec<(u64, u128)> = lines
        .iter()
        .filter_map(|(_, l)| {
            let w: Vec<&str> = l.split(' ').collect();
            (w[0] == "acquired").then(|| (w[1].parse().unwrap(), w[2].parse().unwrap()))
        })
        .collect();
    let mut taken = Vec::new();
    for s in stops {
        let next = acquisitions
            .iter()
            .filter(|(t, _)| *t > s.token)
            .map(|(_, at)| *at)
            .min()
            .unwrap_or_else(|| {
                panic!("nobody took over from child {}'s term {}", s.child, s.token)
            });
        let after = Duration::from_micros(u64::try_from(next.saturating_sub(s.at)).unwrap());
        taken.push(after);
    }
    let ms: Vec<u128> = taken.iter().map(Duration::as_millis).collect();
    eprintln!(
        "leaders stopped: {}; failover after the stop (ms): {ms:?}",
        stops.len()
    );
    assert!(stops.len() >= 6, "too few stops: {}", stops.len());
    for (s, after) in stops.iter().zip(&taken) {
        assert!(
            *after <= TTL + POLL + SLACK,
            "child {} (term {}): failover took {after:?} > TTL + poll + {SLACK:?}",
            s.child,
            s.token
        );
    }
}
