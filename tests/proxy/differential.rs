//! Differential test of the two HTTP/1.1 data paths: the fast path (`http1_fast_path = true`)
//! and hyper's path (`false`) must answer every request with the same bytes, close the same
//! connections, and send the upstream the same bytes.
//!
//! Two proxies with the same configuration, each in front of its own raw recording upstream
//! (real TCP; it records the exact bytes of every request and answers canned responses chosen
//! by the request's `x-resp` header), get the same seeded corpus of requests in the same order,
//! so their marks evolve identically. Three modes:
//! - each request on a fresh client connection;
//! - a few (tame) requests keep-alive on one connection, one after the other;
//! - a few (tame) requests pipelined on one connection, written at once.
//!
//! Whether a connection stayed open is learnt without sleeps: after the case's response(s) a
//! probe request for an unguarded path is written on the same connection; it is answered only
//! when the proxy kept the connection open (the upstream marks its answer `x-probe: 1`).
//!
//! Per case it compares (1) the response bytes (the `date` value masked), (2) whether the
//! connection was closed, (3) the bytes the upstream received for the case. Every difference
//! is collected, the first ones printed with the seed and case index, then the test fails if
//! there were any.
//!
//! It then compares what the proxies counted and logged (`observe.rs`): every counting
//! `palisade_*` metric series (after the seeded corpus and again after the fixed one), the
//! access log lines (JSON, time/port/latency masked, read after shutdown) and the marks. A
//! second, fixed corpus (`failures.rs`) has upstreams that fail (close without answering or
//! mid-body, garbage, no answer within the `/slow` route's 200 ms, an early answer), bodies of
//! several read chunks and `Expect: 100-continue`.
//!
//! Differences explained as acceptable are made equal first (`normalize_pair`, each with
//! its reason); `DIFF_RAW=1` shows them all as observed, `DIFF_ALL=1` prints every remaining
//! difference, `DIFF_SEED=<n>` runs another corpus.
//!
//! What it found on its first run, all fixed since (the test failed with 45 differing cases):
//! - fast path: its own 400/431 for a head it refuses wrote `content-length: 0` before
//!   `connection: close`; hyper writes `connection: close` first (`fast/write.rs`,
//!   `automatic`);
//! - fast path: an upstream's `content-length` on a 304 was relayed (hyper drops it), a
//!   `content-length: 0` stayed in place (hyper moves it after the other fields), and
//!   `trailer` was relayed on bodiless responses (hyper drops it) (`fast/relay.rs`);
//! - fast path: a refusal of a HEAD request with an empty body (gRPC style) said
//!   `content-length: 0`, hyper writes none (`fast/write.rs`, `refusal`);
//! - fast path: a refused request whose body was not wholly in its read buffer closed the
//!   connection (without saying so), where hyper had the body in its larger buffer and kept
//!   it (`fast/exchange.rs`, `skip_unsent`; `tests/proxy/fast_path.rs` has a test of its own);
//! - hyper's path: an HTTP/1.0 upstream response was answered to an HTTP/1.1 client with an
//!   `HTTP/1.0` status line, and a `content-length` on a 204 to HEAD was kept (RFC 9110 8.6
//!   forbids it; the fast path drops it) (`pipeline/mod.rs`).
//!
//! And when it first compared metrics, access logs and failing upstreams:
//! - fast path: a 502 or 504 closed the client connection even when the request had been
//!   taken whole (no body, or the body sent); hyper keeps it (`fast/exchange.rs`,
//!   `answer_failed`);
//! - hyper's path: a 502's message said hyper's error twice ("connection closed before
//!   message completed: connection closed before message completed"; `forward.rs`,
//!   `error_chain`).
//!
//! Each client connection comes from a source address of its own (`client.rs`): the access
//! log's `peer` then names the connection, which by port it would not (the kernel reuses the
//! ports of closed connections).

use crate::support;

mod client;
mod compare;
mod corpus;
mod failures;
mod observe;
mod upstream;

use client::*;
use compare::*;
use corpus::*;
use failures::*;
use upstream::*;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SEED: u64 = 0x5eed_f00d_d1ff_0001;
/// Requests on fresh connections.
const FRESH_CASES: usize = 1200;
/// Keep-alive and pipelined groups, each of `GROUP` requests.
const KEEPALIVE_GROUPS: usize = 60;
const PIPELINED_GROUPS: usize = 40;
const GROUP: usize = 4;
/// A safety net only: a case that needs it is a finding of its own (both paths should answer).
const CASE_LIMIT: Duration = Duration::from_secs(3);

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
http1_fast_path = FAST

[admin]
listen = "127.0.0.1:0"

[marks]
store = "memory"

[access_log]
format = "json"
path = "{marks}/access.log"

[[upstream]]
name = "raw"
url = "http://{upstream}"
protocol = "http1"

[[route]]
name = "orders"
upstream = "raw"
path_prefix = "/orders"
methods = ["POST", "PUT", "PATCH", "DELETE"]
resource = "orders"

[[route]]
name = "acct"
upstream = "raw"
path_prefix = "/acct"
methods = ["POST", "GET"]
other_methods = "reject"
max_body_bytes = 16
strip_token = true
get_bodies = "forward"
resource = "acct"

[[route]]
name = "hosty"
upstream = "raw"
host = "api.example.com"
path_prefix = "/h"
resource = "orders"
missing_token = "allow"

[[route]]
name = "exact"
upstream = "raw"
path = "/exact"
resource = "ex"

[[route]]
name = "slow"
upstream = "raw"
path_prefix = "/slow"
guard = false
response_timeout_ms = 200

[[route]]
name = "rest"
upstream = "raw"
path_prefix = "/"
guard = false
"#;

const PROBE: &[u8] = b"GET /__probe HTTP/1.1\r\nhost: probe\r\n\r\n";

// ---------------------------------------------------------------------------------------------
// Running a case on one proxy.

/// What one proxy did with one case.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    /// Per request of the case: the response bytes, normalized.
    responses: Vec<Vec<u8>>,
    /// Responses to bytes the case left after its requests (before the probe's).
    extra: Vec<u8>,
    /// The connection was closed before the probe was answered.
    closed: bool,
    /// The upstream's requests for the case (the probe's left out).
    upstream: Vec<Vec<u8>>,
}

struct Side {
    addr: SocketAddr,
    received: Received,
    open: Open,
    /// The upstream's address, as it appears in a forwarded CONNECT (masked).
    upstream: SocketAddr,
    /// The local port of every client connection, in order (the access log's `peer`).
    peers: Mutex<Vec<std::net::IpAddr>>,
}

/// How a case's requests are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One request per connection (or several, one after the other, on one connection).
    Sequential,
    /// All requests written at once.
    Pipelined,
}

async fn run(side: &Side, reqs: &[Case], mode: Mode) -> Outcome {
    let before = side.received.lock().unwrap().len();
    let mut c = Client::connect(side.addr).await;
    side.peers.lock().unwrap().push(c.id());
    let mut responses = Vec::new();
    match mode {
        Mode::Pipelined => {
            let mut all = Vec::new();
            for r in reqs {
                all.extend_from_slice(&r.bytes);
            }
            let mut open = c.write(&all).await;
            for r in reqs {
                let mut out = Vec::new();
                if open {
                    open = c.response(r.method == "HEAD", &mut out).await;
                } else {
                    out.extend_from_slice(b"<<NO RESPONSE>>");
                }
                responses.push(out);
            }
        }
        Mode::Sequential => {
            let mut open = true;
            for r in reqs {
                let mut out = Vec::new();
                if open && c.write(&r.bytes).await {
                    open = c.response(r.method == "HEAD", &mut out).await;
                } else {
                    open = false;
                    out.extend_from_slice(b"<<NOT SENT: closed>>");
                }
                responses.push(out);
            }
        }
    }
    let mut extra = Vec::new();
    let closed = !c.probe(&mut extra).await;
    if c.ended == Some("TIMEOUT") {
        extra.extend_from_slice(b"<<TIMEOUT>>");
    }
    drop(c);
    let mask = side.upstream.to_string();
    let upstream = side.received.lock().unwrap()[before..]
        .iter()
        // A partial request is logged when its connection ends, which may be after the case:
        // those are compared once, at the end.
        .filter(|r| !r.starts_with(b"GET /__probe ") && !r.starts_with(b"PARTIAL "))
        .map(|r| {
            // A forwarded CONNECT names the upstream's own address, which differs between
            // the two proxies' upstreams: the only upstream bytes that must be masked.
            String::from_utf8_lossy(r)
                .replace(&mask, "<upstream>")
                .into_bytes()
        })
        .collect();
    Outcome {
        responses: responses.into_iter().map(|r| normalize(&r)).collect(),
        extra: normalize(&extra),
        closed,
        upstream,
    }
}

async fn start(fast: bool) -> (support::Proxy, Side, tempfile::TempDir) {
    let (up, received, open) = raw_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let text = support::render(CONFIG, up, dir.path()).replace("FAST", &fast.to_string());
    let proxy = support::proxy(&text, dir.path()).await;
    let side = Side {
        addr: proxy.addr,
        received,
        open,
        upstream: up,
        peers: Mutex::default(),
    };
    (proxy, side, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_data_paths_behave_alike() {
    // Two proxies and over a thousand cases: alone among the binary's timing tests
    // (`support::serial`).
    let _serial = support::serial().await;
    let started = Instant::now();
    let (fast_proxy, fast, _d1) = start(true).await;
    let (hyper_proxy, hyper, _d2) = start(false).await;
    // `DIFF_SEED=<n>` explores another corpus; the committed test runs SEED.
    let seed = std::env::var("DIFF_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s| *s != 0) // xorshift's one fixed point
        .unwrap_or(SEED);
    let mut gen = Gen {
        rng: Rng(seed),
        hi: 10,
    };
    // (mode, case index, requests)
    let mut plan: Vec<(&str, usize, Vec<Case>)> = Vec::new();
    for i in 0..FRESH_CASES {
        plan.push(("fresh", i, vec![gen.case(false)]));
        if i % (FRESH_CASES / KEEPALIVE_GROUPS) == 0 {
            let group = (0..GROUP).map(|_| gen.case(true)).collect();
            plan.push(("keep-alive", i, group));
        }
        if i % (FRESH_CASES / PIPELINED_GROUPS) == 0 {
            let group = (0..GROUP).map(|_| gen.case(true)).collect();
            plan.push(("pipelined", i, group));
        }
    }
    let mut findings = Vec::new();
    let mut excluded = observe::Excluded::default();
    let mut accepted: std::collections::BTreeMap<&str, usize> = Default::default();
    for (mode, index, reqs) in &plan {
        let m = if *mode == "pipelined" {
            Mode::Pipelined
        } else {
            Mode::Sequential
        };
        // A case whose difference may be accepted: its effect on the metrics and access logs
        // is left out of their comparison (`observe::Excluded`).
        let before = if observe::may_be_accepted(reqs) {
            let b = observe::before([&fast_proxy, &hyper_proxy], [&fast, &hyper]).await;
            Some((b, accepted.clone()))
        } else {
            None
        };
        // Both proxies at once: their states are independent, each sees the same order.
        let (mut a, mut b) = tokio::join!(run(&fast, reqs, m), run(&hyper, reqs, m));
        let was = before.as_ref().map(|(_, acc)| acc.clone());
        compare(
            mode,
            *index,
            reqs,
            &mut a,
            &mut b,
            &mut findings,
            &mut accepted,
        );
        if let (Some((snap, _)), Some(was)) = (before, was) {
            if was != accepted {
                excluded
                    .add(snap, [&fast_proxy, &hyper_proxy], [&fast, &hyper])
                    .await;
            }
        }
    }
    let proxies = [&fast_proxy, &hyper_proxy];
    observe::compare_state("after the seeded corpus", proxies, &excluded, &mut findings).await;
    // The fixed corpus of upstream failures, large bodies and Expect, on fresh connections.
    let fixed = failures::corpus();
    for (name, reqs, expect) in &fixed {
        let snap = observe::before([&fast_proxy, &hyper_proxy], [&fast, &hyper]).await;
        let was = accepted.clone();
        let (mut a, mut b) = tokio::join!(
            run_fixed(&fast, reqs, *expect),
            run_fixed(&hyper, reqs, *expect)
        );
        let before = findings.len();
        compare(
            "fixed",
            0,
            reqs,
            &mut a,
            &mut b,
            &mut findings,
            &mut accepted,
        );
        if let Some(f) = findings.get_mut(before) {
            *f = f.replacen("fixed case 0", &format!("fixed case {name:?}"), 1);
        }
        if was != accepted {
            excluded
                .add(snap, [&fast_proxy, &hyper_proxy], [&fast, &hyper])
                .await;
        }
    }
    observe::compare_state("after the fixed corpus", proxies, &excluded, &mut findings).await;
    println!("accepted differences (normalized): {accepted:?}");
    let cases: usize = plan.iter().map(|(_, _, r)| r.len()).sum();
    println!("seed {seed:#x}");
    println!(
        "differential: {} requests in {} cases, {} differing, {:.1?}",
        cases,
        plan.len(),
        findings.len(),
        started.elapsed()
    );
    let shown = std::env::var("DIFF_ALL").map_or(20, |_| usize::MAX);
    for f in findings.iter().take(shown) {
        println!("{f}");
    }
    fast_proxy.shutdown().await;
    hyper_proxy.shutdown().await;
    // Shutdown wrote every buffered access log line.
    observe::access_log_diff(
        [
            &_d1.path().join("access.log"),
            &_d2.path().join("access.log"),
        ],
        &excluded,
        &mut findings,
    );
    // Requests the upstreams got only part of: logged as their connections end, which the
    // proxies' shutdown brings about.
    let mut partial = Vec::new();
    for side in [&fast, &hyper] {
        let mut open = side.open.subscribe();
        let ended = tokio::time::timeout(Duration::from_secs(5), open.wait_for(|n| *n == 0)).await;
        assert!(
            ended.is_ok(),
            "upstream connections still open after the shutdown"
        );
        let mut p: Vec<Vec<u8>> = side
            .received
            .lock()
            .unwrap()
            .iter()
            // `early-answer` (compare.rs): the fast path may stop sending a body the
            // upstream answered early.
            .filter(|r| r.starts_with(b"PARTIAL ") && find(r, b"x-resp: early").is_none())
            .map(|r| {
                String::from_utf8_lossy(r)
                    .replace(&side.upstream.to_string(), "<upstream>")
                    .into_bytes()
            })
            .collect();
        p.sort();
        partial.push(p);
    }
    println!(
        "partial requests at the upstreams: fast {}, hyper {}",
        partial[0].len(),
        partial[1].len()
    );
    if partial[0] != partial[1] {
        let mut s = String::from("partial requests differ:\n  fast path:\n");
        for p in &partial[0] {
            let _ = writeln!(s, "    {}", show(p));
        }
        s.push_str("  hyper path:\n");
        for p in &partial[1] {
            let _ = writeln!(s, "    {}", show(p));
        }
        println!("{s}");
        findings.push(s);
    }
    assert!(
        findings.is_empty(),
        "{} differences (first ones above)",
        findings.len()
    );
}
