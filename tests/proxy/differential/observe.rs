//! What the two proxies report about the requests they served: their Prometheus metrics,
//! their access logs, their marks. The two data paths must count, log and fence alike.

#[allow(clippy::wildcard_imports)]
use super::*;

use std::collections::BTreeMap;

/// Whether a series is left out of the comparison, and why (`None`: compared).
///
/// Every `palisade_*` series that counts something is compared: requests by route and
/// outcome, stale rejections, marks and advances, the number of observations of the request
/// duration and store operation histograms (`_count`: one per request or store operation),
/// in-flight requests (0 at rest), connection gauges and closes by reason, drains, access log
/// drops and write errors, configuration reloads.
pub(crate) fn excluded(series: &str) -> Option<&'static str> {
    let name = series.split('{').next().unwrap_or(series);
    if name.ends_with("_bucket") || name.ends_with("_sum") {
        // Histogram buckets and sums are durations: they differ between any two runs. Their
        // `_count` (how many were observed) is compared.
        return Some("duration");
    }
    if series.contains("listener=\"admin\"") {
        // The admin listener serves the test's own /metrics and /marks fetches (one pooled
        // client connection each, closed whenever the client drops it): harness traffic, not
        // the data paths under test.
        return Some("admin listener");
    }
    if name == "palisade_config_info" {
        // A digest of the configuration text, which differs in its `http1_fast_path` line.
        return Some("configuration digest");
    }
    if name == "palisade_access_log_lines_total" {
        // Lines *written* so far: the writer thread flushes every 100 ms, so a snapshot counts
        // a time-dependent share of the lines. The lines themselves are compared after the
        // shutdown flushed them all (`access_log_diff`); drops and write errors are compared.
        return Some("flush timing");
    }
    None
}

/// The compared `palisade_*` samples of an exposition, `series -> value`.
pub(crate) fn samples(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| l.starts_with("palisade_"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            excluded(series)
                .is_none()
                .then(|| (series.to_owned(), value.to_owned()))
        })
        .collect()
}

/// Waits until both proxies are at rest: no client connection open on the proxy listener, no
/// request in flight. A client's close is noticed by the proxy's connection task after the
/// client dropped its socket, and only then counted: there is no event to await from outside
/// the process, so the metrics are polled (every 5 ms, at most 5 s) for that condition, never
/// slept on for a guessed time.
pub(crate) async fn at_rest(p: &support::Proxy) -> String {
    let limit = Instant::now() + Duration::from_secs(5);
    loop {
        let text = p.metrics().await;
        let busy = text.lines().any(|l| {
            (l.starts_with("palisade_connections_open{listener=\"proxy\"}")
                || l.starts_with("palisade_inflight_requests{"))
                && !l.ends_with(" 0")
        });
        if !busy || Instant::now() > limit {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The compared samples of one proxy, as numbers.
pub(crate) type Snapshot = BTreeMap<String, f64>;

/// A snapshot, and how many client connections each side had made so far.
pub(crate) async fn before(
    proxies: [&support::Proxy; 2],
    sides: [&Side; 2],
) -> ([Snapshot; 2], [usize; 2]) {
    let snap = snapshot(proxies[0], proxies[1]).await;
    let n = |i: usize| sides[i].peers.lock().unwrap().len();
    (snap, [n(0), n(1)])
}

pub(crate) async fn snapshot(fast: &support::Proxy, hyper: &support::Proxy) -> [Snapshot; 2] {
    let (a, b) = tokio::join!(at_rest(fast), at_rest(hyper));
    let num = |t: &str| {
        samples(t)
            .into_iter()
            .map(|(k, v)| (k, v.parse().unwrap_or(f64::NAN)))
            .collect()
    };
    [num(&a), num(&b)]
}

/// Whether a seeded case may end in a difference that `normalize_pair` accepts and that
/// changes what the proxies count and log: `close-delimited` (the fast path closes, so the
/// probe after it reaches hyper's proxy only).
pub(crate) fn may_be_accepted(reqs: &[Case]) -> bool {
    reqs.len() == 1 && {
        let head_end = find(&reqs[0].bytes, b"\r\n\r\n").map_or(reqs[0].bytes.len(), |e| e + 4);
        let head = String::from_utf8_lossy(&reqs[0].bytes[..head_end]);
        head.contains("x-resp: close\r\n")
    }
}

/// What the comparison of metrics and access logs leaves out: the seeded cases whose
/// differences were accepted (see `may_be_accepted`). Their handling differs by design, so
/// their counts differ too: the change of every series during such a case (and the marks'
/// re-synchronisation after it) is subtracted on each side, and the access log lines of its
/// connections are dropped.
#[derive(Default)]
pub(crate) struct Excluded {
    delta: [Snapshot; 2],
    peers: [std::collections::BTreeSet<std::net::IpAddr>; 2],
}

impl Excluded {
    /// Records a case that just ran (and was accepted) since `before`: first brings the marks
    /// together again (a request hyper's proxy forwarded and the fast path refused may have
    /// advanced a mark on one side only; every later token would be judged differently), by
    /// sending the side behind the other's mark, then subtracts what changed.
    pub(crate) async fn add(
        &mut self,
        before: ([Snapshot; 2], [usize; 2]),
        proxies: [&support::Proxy; 2],
        sides: [&Side; 2],
    ) {
        let (ma, mb) = tokio::join!(proxies[0].marks(), proxies[1].marks());
        let marks = [ma, mb];
        for (resource, path) in [
            ("orders", "/orders/sync"),
            ("acct", "/acct"),
            ("ex", "/exact"),
        ] {
            let m = |i: usize| marks[i].get(resource).and_then(serde_json::Value::as_u64);
            let (a, b) = (m(0).unwrap_or(0), m(1).unwrap_or(0));
            if a == b {
                continue;
            }
            let (behind, to) = if a < b { (0, b) } else { (1, a) };
            let sync = format!(
                "POST {path} HTTP/1.1\r\nhost: a.test\r\nx-fencing-token: {to}\r\ncontent-length: 0\r\n\r\n"
            );
            let mut c = Client::connect_aside(sides[behind].addr).await;
            sides[behind].peers.lock().unwrap().push(c.id());
            let mut out = Vec::new();
            assert!(c.write(sync.as_bytes()).await && c.response(false, &mut out).await);
            assert!(out.starts_with(b"HTTP/1.1 200 "), "resync: {}", show(&out));
        }
        let after = snapshot(proxies[0], proxies[1]).await;
        for i in 0..2 {
            for (k, v) in &after[i] {
                let d = v - before.0[i].get(k).copied().unwrap_or(0.0);
                *self.delta[i].entry(k.clone()).or_default() += d;
            }
            // The case's connection(s), and the resync's.
            let peers = sides[i].peers.lock().unwrap();
            self.peers[i].extend(&peers[before.1[i]..]);
        }
    }
}

/// Compares both proxies' metrics (less what [`Excluded`] leaves out) and marks; every
/// difference is a finding.
pub(crate) async fn compare_state(
    when: &str,
    proxies: [&support::Proxy; 2],
    excluded: &Excluded,
    findings: &mut Vec<String>,
) {
    let [a, b] = snapshot(proxies[0], proxies[1]).await;
    let less = |x: &Snapshot, d: &Snapshot| -> Snapshot {
        x.iter()
            .map(|(k, v)| (k.clone(), v - d.get(k).copied().unwrap_or(0.0)))
            .collect()
    };
    let (a, b) = (less(&a, &excluded.delta[0]), less(&b, &excluded.delta[1]));
    let mut s = String::new();
    for k in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
        let (va, vb) = (a.get(k), b.get(k));
        if va != vb {
            let f = |v: Option<&f64>| v.map_or("(absent)".to_owned(), f64::to_string);
            let _ = writeln!(s, "    {k}: fast {} hyper {}", f(va), f(vb));
        }
    }
    println!("{when}: {} metric series compared", a.len().max(b.len()));
    if !s.is_empty() {
        findings.push(format!("metrics differ {when}:\n{s}"));
    }
    let (ma, mb) = tokio::join!(proxies[0].marks(), proxies[1].marks());
    if ma != mb {
        findings.push(format!(
            "marks differ {when}:\n    fast {ma}\n    hyper {mb}"
        ));
    }
}

/// The client address of an access log line: each of the test's connections has its own.
fn peer(l: &str) -> Option<std::net::IpAddr> {
    serde_json::from_str::<serde_json::Value>(l)
        .ok()
        .and_then(|v| v.get("peer")?.as_str()?.rsplit_once(':')?.0.parse().ok())
}

/// An access log line with what differs between any two runs masked: the time, the client's
/// port (each connection has its own) and the latency.
pub(crate) fn mask_line(l: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(l) else {
        return format!("<<not JSON>> {l}");
    };
    if let Some(o) = v.as_object_mut() {
        for k in ["time", "latency_us"] {
            if o.contains_key(k) {
                o.insert(k.to_owned(), "<masked>".into());
            }
        }
        if let Some(p) = o.get("peer").and_then(|p| p.as_str()) {
            let ip = p.rsplit_once(':').map_or(p, |(ip, _)| ip).to_owned();
            o.insert("peer".to_owned(), format!("{ip}:<port>").into());
        }
    }
    v.to_string()
}

/// Compares the two access logs (read after both proxies shut down, so every line is
/// written). Lines are compared in order where they agree, and the difference is reported as
/// the lines only one side has (a multiset difference): a client-closed request's line is
/// written when the proxy notices the close, which may come after the next case's line, so
/// the order of such lines is not the test's to fix; their number and content are.
pub(crate) fn access_log_diff(paths: [&Path; 2], excluded: &Excluded, findings: &mut Vec<String>) {
    let read = |i: usize| -> Vec<String> {
        std::fs::read_to_string(paths[i])
            .unwrap_or_default()
            .lines()
            .filter(|l| !peer(l).is_some_and(|p| excluded.peers[i].contains(&p)))
            .map(mask_line)
            .collect()
    };
    let (a, b) = (read(0), read(1));
    println!(
        "access log: fast {} lines, hyper {} lines",
        a.len(),
        b.len()
    );
    let mut count: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for l in &a {
        count.entry(l).or_default().0 += 1;
    }
    for l in &b {
        count.entry(l).or_default().1 += 1;
    }
    let mut s = String::new();
    let mut n = 0;
    for (l, (x, y)) in &count {
        if x != y {
            n += 1;
            if n <= 40 || std::env::var("DIFF_ALL").is_ok() {
                let _ = writeln!(s, "    fast {x} hyper {y}: {l}");
            }
        }
    }
    if n > 0 {
        let f = format!("access log lines differ ({n} distinct lines, count on each side):\n{s}");
        println!("{f}");
        findings.push(f);
    }
}

use std::path::Path;
