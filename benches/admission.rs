#![allow(missing_docs)]
//! Admission cost: palisade's guard and admission path beside a naive `Mutex<HashMap>` guard,
//! on one and two threads, in the same run.
//!
//! - `equal`: the token equals the mark (every request of a steady owner): palisade does one
//!   atomic load; the baseline locks a map.
//! - `advance`: every token is higher (worst case, a new owner per request). `watermark` is the
//!   pure check + publish; `admission` adds the per-resource advance lock, the spawned advance
//!   task and the memory store's write; the baseline locks, compares and inserts.
//!
//! Run: `cargo bench --bench admission`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use palisade::fence::admission::Admission;
use palisade::fence::marks::MemoryStore;
use palisade::fence::metrics::Metrics;
use palisade::{FencingToken, Verdict, Watermark};

/// The drain time of the benchmarked resource (no request is in flight, so never waited).
const DRAIN: Duration = Duration::from_secs(2);

/// The baseline a first implementation would write: one map of marks behind one mutex.
#[derive(Default)]
struct NaiveGuard(Mutex<HashMap<String, u64>>);

impl NaiveGuard {
    fn admit(&self, resource: &str, token: u64) -> bool {
        let mut marks = self.0.lock().unwrap();
        let mark = marks.entry(resource.to_owned()).or_insert(0);
        if token < *mark {
            return false;
        }
        *mark = token;
        true
    }
}

fn t(v: u64) -> FencingToken {
    FencingToken::new(v).unwrap()
}

/// Runs `op(i)` `iters` times split over `threads` threads and returns the wall time.
fn threaded(threads: u64, iters: u64, op: Arc<dyn Fn(u64) + Send + Sync>) -> Duration {
    let barrier = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (op, barrier) = (op.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..iters / threads {
                    op(i);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    start.elapsed()
}

fn admission(
    resource: &str,
) -> (
    Arc<Admission>,
    Arc<palisade::fence::admission::Resource>,
    tokio::runtime::Runtime,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let adm = rt.block_on(async {
        let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
        Admission::open(Arc::new(MemoryStore::new()), [resource], &metrics)
            .await
            .unwrap()
    });
    let res = adm.resource(resource).unwrap().clone();
    (Arc::new(adm), res, rt)
}

fn equal(c: &mut Criterion) {
    let mut g = c.benchmark_group("equal");
    for threads in [1u64, 2] {
        let w = Arc::new(Watermark::new(51));
        g.bench_function(BenchmarkId::new("watermark", threads), |b| {
            let w = w.clone();
            b.iter_custom(|n| {
                let w = w.clone();
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| assert_eq!(w.check(t(51)), Verdict::Admit)),
                )
            })
        });
        let (adm, res, rt) = admission("orders");
        rt.block_on(adm.admit(&res, t(51), DRAIN)).unwrap();
        g.bench_function(BenchmarkId::new("admission", threads), |b| {
            b.iter_custom(|n| {
                let (adm, res) = (adm.clone(), res.clone());
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| {
                        // The equal path never awaits: one poll with a no-op waker completes
                        // it, so no runtime entry is measured.
                        let mut fut = std::pin::pin!(adm.admit(&res, t(51), DRAIN));
                        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                        match fut.as_mut().poll(&mut cx) {
                            std::task::Poll::Ready(r) => assert!(r.is_ok()),
                            std::task::Poll::Pending => panic!("the equal path awaited"),
                        }
                    }),
                )
            })
        });
        let naive = Arc::new(NaiveGuard::default());
        naive.admit("orders", 51);
        g.bench_function(BenchmarkId::new("mutex_hashmap", threads), |b| {
            let naive = naive.clone();
            b.iter_custom(|n| {
                let naive = naive.clone();
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| assert!(naive.admit("orders", 51))),
                )
            })
        });
    }
    g.finish();
}

fn advance(c: &mut Criterion) {
    let mut g = c.benchmark_group("advance");
    for threads in [1u64, 2] {
        let w = Arc::new(Watermark::new(0));
        let next = Arc::new(AtomicU64::new(1));
        g.bench_function(BenchmarkId::new("watermark", threads), |b| {
            b.iter_custom(|n| {
                let (w, next) = (w.clone(), next.clone());
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| {
                        let tok = t(next.fetch_add(1, Ordering::Relaxed));
                        if let Verdict::Advance { .. } = w.check(tok) {
                            w.publish(tok);
                        }
                    }),
                )
            })
        });
        let (adm, res, rt) = admission("orders");
        let next = Arc::new(AtomicU64::new(1));
        g.bench_function(BenchmarkId::new("admission", threads), |b| {
            b.iter_custom(|n| {
                let (adm, res, next, handle) =
                    (adm.clone(), res.clone(), next.clone(), rt.handle().clone());
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| {
                        let tok = t(next.fetch_add(1, Ordering::Relaxed));
                        // With two threads a token can lose to a higher one: stale is a valid answer.
                        let _ = handle.block_on(adm.admit(&res, tok, DRAIN));
                    }),
                )
            })
        });
        let naive = Arc::new(NaiveGuard::default());
        let next = Arc::new(AtomicU64::new(1));
        g.bench_function(BenchmarkId::new("mutex_hashmap", threads), |b| {
            b.iter_custom(|n| {
                let (naive, next) = (naive.clone(), next.clone());
                threaded(
                    threads,
                    n,
                    Arc::new(move |_| {
                        naive.admit("orders", next.fetch_add(1, Ordering::Relaxed));
                    }),
                )
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = equal, advance
}
criterion_main!(benches);
