//! Many owners at random body speeds, on fresh connections and on kept-alive ones: at the
//! upstream, no request with a lower token completes after one with a higher token started.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;

use super::harness::{
    drain_metrics, every_request_ended_in_token_order, read_response, setup, KeptConn, Raw,
};
use super::recorder::Kind;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug)]
struct Sent {
    id: String,
    token: u64,
    outcome: Result<u16, String>,
}

/// Eight clients for 5 s: tokens from a shared counter (a fifth of the requests take a new,
/// higher token; most reuse the newest; some use an older one), bodies instant or slow
/// (Content-Length or chunked, 2-5 pieces 10-120 ms apart), HTTP/1.1 or h2c to the upstream,
/// a 150 ms drain time. At the upstream, no request completes after a request with a higher
/// token started.
async fn stress_no_lower_token_completes_after_a_higher_one_started() {
    // Five seconds of load: alone among the binary's timing tests (`support::serial`).
    let _serial = support::serial().await;
    let (up, proxy, _dir) = setup(150, None).await;
    let seed = std::env::var("DRAIN_STRESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("stress seed {seed} (DRAIN_STRESS_SEED)");
    let newest = Arc::new(AtomicU64::new(1));
    let deadline = Instant::now() + Duration::from_secs(5);
    let addr = proxy.addr;
    let mut tasks = Vec::new();
    for task in 0..8u64 {
        let newest = newest.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(task * 2 + 1).wrapping_add(task) | 1);
            let mut sent = Vec::new();
            let mut i = 0;
            while Instant::now() < deadline {
                i += 1;
                let id = format!("{task}-{i}");
                let token = match rng.below(100) {
                    0..=19 => newest.fetch_add(1, SeqCst) + 1,
                    20..=84 => newest.load(SeqCst),
                    _ => newest.load(SeqCst).saturating_sub(1 + rng.below(3)).max(1),
                };
                let path = if rng.below(2) == 0 {
                    "/orders/w"
                } else {
                    "/h2/orders/w"
                };
                let speed = rng.below(10);
                let pieces = 2 + rng.below(4) as usize;
                let len = pieces * 50;
                let mut c = Raw::open(
                    addr,
                    path,
                    token,
                    &id,
                    if speed < 8 { Some(len) } else { None },
                )
                .await;
                let mut write_failed = false;
                if speed < 4 {
                    write_failed = c.send(&vec![b'x'; len]).await.is_err();
                } else {
                    for p in 0..pieces {
                        if c.send(&[b'x'; 50]).await.is_err() {
                            write_failed = true;
                            break;
                        }
                        if p + 1 < pieces {
                            // The slowness under test.
                            let pause = 10 + rng.below(111);
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                        }
                    }
                }
                if !write_failed {
                    let _ = c.end().await;
                }
                let outcome = c
                    .response(Duration::from_secs(10))
                    .await
                    .map(|(status, _)| status);
                sent.push(Sent { id, token, outcome });
            }
            sent
        }));
    }
    let mut sent = Vec::new();
    for t in tasks {
        sent.extend(t.await.unwrap());
    }
    let events = every_request_ended_in_token_order(&up, seed).await;

    let by_id: HashMap<&str, Vec<Kind>> = events.iter().fold(HashMap::new(), |mut m, e| {
        m.entry(e.id.as_str()).or_default().push(e.kind);
        m
    });
    let (mut ok, mut stale, mut aborted, mut other) = (0, 0, 0, Vec::new());
    for s in &sent {
        let at_upstream = by_id.get(s.id.as_str());
        let completed = at_upstream.is_some_and(|k| k.contains(&Kind::Complete));
        match (&s.outcome, at_upstream) {
            (Ok(200), _) => {
                assert!(
                    completed,
                    "{} answered 200 but never completed upstream",
                    s.id
                );
                ok += 1;
            }
            (Ok(409), None) => stale += 1,
            (_, Some(_)) if !completed => aborted += 1,
            _ => other.push((s, at_upstream.cloned().unwrap_or_default())),
        }
    }
    let m = drain_metrics(&proxy, "orders").await;
    let top = sent.iter().map(|s| s.token).max().unwrap_or(0);
    println!(
        "stress: {} requests, tokens up to {top} ({} handed out), {ok} admitted and applied, {stale} refused \
         stale, {aborted} aborted mid-body, {} other {:?}; {} upstream events; drains {} \
         (timed out {}, aborted requests {}, total drain time {:.2}s)",
        sent.len(),
        newest.load(SeqCst),
        other.len(),
        other.iter().take(5).collect::<Vec<_>>(),
        events.len(),
        m.count,
        m.timeouts,
        m.aborted,
        m.sum
    );
    assert!(ok > 20, "{ok} admitted");
    assert!(stale > 5, "{stale} stale");
    assert!(aborted > 2, "{aborted} aborted");
    assert!(m.timeouts >= 1.0 && m.aborted >= aborted as f64);
    // Every aborted request counted in the metric came from a request the upstream saw
    // without its end, or from one aborted before its head left the proxy.
    assert!(
        other.len() * 20 <= sent.len(),
        "too many unexplained outcomes: {other:?}"
    );
}

/// Eight kept-alive clients for 4 s, each sending request after request on one connection
/// (a new one only when the proxy closed it): tokens from a shared counter (a fifth advance),
/// bodies in 2-4 pieces 5-40 ms apart (a few with a 1.3 s pause), a 30 ms drain time. At the upstream, no request
/// completes after a request with a higher token started; every request is answered.
async fn stress_kept_connections_no_lower_token_completes_after_a_higher_one_started() {
    // Four seconds of load: alone among the binary's timing tests (`support::serial`).
    let _serial = support::serial().await;
    let (up, proxy, _dir) = setup(30, None).await;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("kept stress seed {seed}");
    let newest = Arc::new(AtomicU64::new(1));
    let deadline = Instant::now() + Duration::from_secs(4);
    let addr = proxy.addr;
    let mut tasks = Vec::new();
    for task in 0..8u64 {
        let newest = newest.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_mul(task * 2 + 1).wrapping_add(task) | 1);
            let (mut n, mut answered, mut reconnects) = (0u64, 0u64, 0u64);
            let mut c = KeptConn::open(addr).await;
            while Instant::now() < deadline {
                n += 1;
                let id = format!("{task}-{n}");
                let token = match rng.below(100) {
                    0..=19 => newest.fetch_add(1, SeqCst) + 1,
                    _ => newest.load(SeqCst),
                };
                let pieces = 2 + rng.below(3) as usize;
                // A few zombies: a pause longer than the drain time and the abort grace
                // together, so that an abort that does not reach them lets them complete
                // after a newer owner's request started.
                let zombie = rng.below(100) < 8;
                c.start("/orders/s", token, &id, pieces * 20, 0).await;
                let mut failed = false;
                for p in 0..pieces {
                    if c.s.write_all(&[b'x'; 20]).await.is_err() {
                        failed = true;
                        break;
                    }
                    if p + 1 < pieces {
                        let pause = if zombie && p == 0 {
                            1300
                        } else {
                            5 + rng.below(36)
                        };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                    }
                }
                let r = tokio::time::timeout(Duration::from_secs(5), read_response(&mut c.s)).await;
                let r = r.unwrap_or_else(|_| {
                    panic!("{id} (token {token}) got no answer in 5 s (write failed: {failed})")
                });
                answered += 1;
                if r.map(|r| r.0) != Ok(200) {
                    c = KeptConn::open(addr).await;
                    reconnects += 1;
                }
            }
            (answered, reconnects)
        }));
    }
    let (mut answered, mut reconnects) = (0, 0);
    for t in tasks {
        let (a, r) = t.await.unwrap();
        answered += a;
        reconnects += r;
    }
    every_request_ended_in_token_order(&up, seed).await;
    let m = drain_metrics(&proxy, "orders").await;
    println!(
        "kept stress: {answered} answered, {reconnects} reconnects, drains {} (timed out {}, \
         aborted {})",
        m.count, m.timeouts, m.aborted
    );
    assert!(
        m.aborted >= 1.0,
        "nothing was aborted: the stress did not stress"
    );
    // An abort that reached every aborted request ends its drain at once: none waits out the
    // abort grace (1 s) for a request that did not notice it.
    let text = proxy.metrics().await;
    let within_1s = text
        .lines()
        .find(|l| {
            l.starts_with("palisade_drain_duration_seconds_bucket{")
                && l.contains("resource=\"orders\"")
                && l.contains("le=\"1\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .expect("the drain duration histogram");
    assert_eq!(
        within_1s,
        m.count,
        "{} of {} drains waited out the abort grace: an abort did not reach its request",
        m.count - within_1s,
        m.count
    );
}

support::on_both_paths!(
    #[flavor = "multi_thread", worker_threads = 2]
    stress_no_lower_token_completes_after_a_higher_one_started,
    stress_kept_connections_no_lower_token_completes_after_a_higher_one_started,
);
