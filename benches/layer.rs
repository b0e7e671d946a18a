#![allow(missing_docs)]

//! The guard layer's cost per request: an axum hello-world with and without `FenceLayer`, on
//! the equal-token fast path (the mark equals the request's token, nothing to persist).
//!
//! The services are driven the same way, in-process with `oneshot` on a current-thread
//! runtime, so the difference between them is what the layer adds (token parsing, the
//! admission check, the drain ticket, the token in the extensions, the body wrappers).
//! `identity_layer` is the baseline for that difference that no layer can go below: axum's
//! `Router::layer` wraps each route in a boxed service of its own and boxes both bodies
//! (`tower::layer::util::Identity`, which adds nothing itself). `around_router` wraps the whole
//! router instead (`FenceLayer::layer(router)`): no per-route box, only the layer's own cost.
//!
//! `cargo bench --features layer --bench layer` (mimalloc, as in the proxy: see below)

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use http::Request;
use palisade::fence::admission::Admission;
use palisade::{FenceLayer, FencingToken, MemoryStore, Metrics};
use tower::ServiceExt;

// glibc's malloc carries one benchmark's batches of requests into the next (its consolidation
// and free-list walks moved later benchmarks by up to 25 % depending on their order); mimalloc
// (the proxy's own allocator) keeps each benchmark's cost its own.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let admission = rt.block_on(async {
        let store = Arc::new(MemoryStore::with_marks([("orders".to_owned(), 51)].into()));
        Arc::new(Admission::open(store, ["orders"], &metrics).await.unwrap())
    });
    let plain = Router::new().route("/orders/{id}", post(|| async { "ok" }));
    let identity = plain.clone().layer(tower::layer::util::Identity::new());
    let layer = FenceLayer::new(Arc::clone(&admission), "orders");
    let fenced = plain.clone().layer(layer.clone());
    let around = tower::Layer::layer(&layer, plain.clone());
    // The head of a typical API client's write: a few standard fields and the token.
    let request = || {
        Request::post("/orders/7")
            .header("host", "orders.internal")
            .header("user-agent", "billing/2.3")
            .header("accept", "application/json")
            .header("content-type", "application/json")
            .header("content-length", "0")
            .header("x-fencing-token", "51")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    // What any layer around the router pays for the two things the fence has to do besides
    // admission: a value in the request's extensions, and a wrapped request body (axum's
    // router boxes a body that is not its own).
    let token = FencingToken::new(51).unwrap();
    let extension_only = tower::Layer::layer(
        &tower::util::MapRequestLayer::new(move |mut r: Request<axum::body::Body>| {
            r.extensions_mut().insert(token);
            r
        }),
        plain.clone(),
    );
    let body_only = tower::Layer::layer(
        &tower::util::MapRequestLayer::new(|r: Request<axum::body::Body>| {
            r.map(|b| http_body_util::BodyExt::map_err(b, |e| e))
        }),
        plain.clone(),
    );
    let mut g = c.benchmark_group("axum_hello");
    g.bench_function("without_layer", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| plain.clone().oneshot(r)))
    });
    g.bench_function("identity_layer", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| identity.clone().oneshot(r)))
    });
    g.bench_function("with_layer", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| fenced.clone().oneshot(r)))
    });
    g.bench_function("extension_only", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| extension_only.clone().oneshot(r)))
    });
    g.bench_function("body_wrap_only", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| body_only.clone().oneshot(r)))
    });
    g.bench_function("around_router", |b| {
        b.iter_custom(|n| run(&rt, n, request, |r| around.clone().oneshot(r)))
    });
    g.finish();

    // The differences between the medians above come from runs seconds apart, and on a shared
    // two-core machine those drift by more than the layer costs. Here each variant and the
    // plain router take turns, one batch each (which goes first alternates), and a variant's
    // cost is the median over rounds of its batch's time minus the plain batch's beside it.
    if std::env::args().any(|a| a == "--bench") {
        type Call<'a> = Box<dyn Fn(u64) -> Duration + 'a>;
        let variants: [(&str, Call<'_>); 5] = [
            (
                "identity_layer",
                Box::new(|n| run(&rt, n, request, |r| identity.clone().oneshot(r))),
            ),
            (
                "with_layer",
                Box::new(|n| run(&rt, n, request, |r| fenced.clone().oneshot(r))),
            ),
            (
                "around_router",
                Box::new(|n| run(&rt, n, request, |r| around.clone().oneshot(r))),
            ),
            (
                "extension_only",
                Box::new(|n| run(&rt, n, request, |r| extension_only.clone().oneshot(r))),
            ),
            (
                "body_wrap_only",
                Box::new(|n| run(&rt, n, request, |r| body_only.clone().oneshot(r))),
            ),
        ];
        let plain_batch = |n| run(&rt, n, request, |r| plain.clone().oneshot(r));
        const N: u64 = 1024;
        let per_request = |d: Duration| d.as_nanos() as f64 / N as f64;
        let mut base = Vec::new();
        let mut added = vec![Vec::new(); variants.len()];
        for round in 0..300 {
            for (i, (_, call)) in variants.iter().enumerate() {
                let (b, v) = if round % 2 == 0 {
                    let b = plain_batch(N);
                    (b, call(N))
                } else {
                    let v = call(N);
                    (plain_batch(N), v)
                };
                base.push(per_request(b));
                added[i].push(per_request(v) - per_request(b));
            }
        }
        println!(
            "interleaved, 300 rounds of {N} requests, medians: without_layer {:.0} ns",
            median(&mut base)
        );
        for ((name, _), mut a) in variants.iter().zip(added) {
            println!("  {name}: +{:.0} ns per request", median(&mut a));
        }
    }

    // Where the layer's time goes, piece by piece, on the same request.
    let mut g = c.benchmark_group("layer_parts");
    let header = http::HeaderName::from_static("x-fencing-token");
    let req = request();
    g.bench_function("token_from_headers", |b| {
        b.iter(|| palisade::token::from_headers(std::hint::black_box(req.headers()), &header))
    });
    g.bench_function("token_in_extensions", |b| {
        b.iter(|| {
            let mut ext = http::Extensions::new();
            ext.insert(FencingToken::new(51).unwrap());
            std::hint::black_box(ext)
        })
    });
    // What a request's extensions cost by themselves: axum's router puts three values in them
    // on this route (`OriginalUri`, `MatchedPath`, the path parameters), and a fourth (the
    // token) makes the map grow from 4 to 8 buckets.
    #[derive(Clone)]
    struct Three(#[allow(dead_code)] [u64; 3]);
    #[derive(Clone)]
    struct Matched(#[allow(dead_code)] Arc<str>);
    #[derive(Clone)]
    struct Params(#[allow(dead_code)] u64);
    let matched: Arc<str> = Arc::from("/orders/{id}");
    let axum_three = |ext: &mut http::Extensions| {
        ext.insert(Three([1, 2, 3]));
        ext.insert(Matched(Arc::clone(&matched)));
        ext.insert(Params(7));
    };
    g.bench_function("extensions_axum_three", |b| {
        b.iter(|| {
            let mut ext = http::Extensions::new();
            axum_three(&mut ext);
            std::hint::black_box(ext)
        })
    });
    g.bench_function("extensions_token_and_axum_three", |b| {
        b.iter(|| {
            let mut ext = http::Extensions::new();
            ext.insert(FencingToken::new(51).unwrap());
            axum_three(&mut ext);
            std::hint::black_box(ext)
        })
    });
    let resource = admission.resource("orders").unwrap();
    g.bench_function("admit_now_and_drop", |b| {
        b.iter(|| admission.admit_now(&resource, std::hint::black_box(token)))
    });
    g.bench_function("admit_split_and_drop", |b| {
        b.iter(
            || match admission.admit_now(&resource, std::hint::black_box(token)) {
                Some(Ok(t)) => std::hint::black_box(t.split()),
                _ => unreachable!(),
            },
        )
    });
    g.finish();
}

/// Runs `n` requests made by `make` through `call`, to completion; every response must be
/// 200. Only the calls are timed: requests are built beforehand, a batch at a time, so that
/// building them (which costs more than the layer) adds no noise to the difference.
fn run<R, F, B, E>(
    rt: &tokio::runtime::Runtime,
    n: u64,
    make: impl Fn() -> R,
    call: impl Fn(R) -> F,
) -> Duration
where
    F: std::future::Future<Output = Result<http::Response<B>, E>>,
    E: std::fmt::Debug,
{
    const BATCH: u64 = 1024;
    rt.block_on(async {
        let mut timed = Duration::ZERO;
        let mut left = n;
        while left > 0 {
            let batch: Vec<R> = (0..left.min(BATCH)).map(|_| make()).collect();
            left -= batch.len() as u64;
            let start = Instant::now();
            for r in batch {
                let resp = call(r).await.unwrap();
                assert_eq!(resp.status(), 200);
            }
            timed += start.elapsed();
        }
        timed
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

criterion_group!(benches, bench);
criterion_main!(benches);
