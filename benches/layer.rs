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
//! `cargo bench --features layer --bench layer`

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use http::Request;
use palisade::admission::Admission;
use palisade::{FenceLayer, FencingToken, MemoryStore, Metrics};
use tower::ServiceExt;

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
    let request = || {
        Request::post("/orders/7")
            .header("x-fencing-token", "51")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let mut g = c.benchmark_group("axum_hello");
    g.bench_function("without_layer", |b| {
        b.iter_custom(|n| run(&rt, n, || plain.clone().oneshot(request())))
    });
    g.bench_function("identity_layer", |b| {
        b.iter_custom(|n| run(&rt, n, || identity.clone().oneshot(request())))
    });
    g.bench_function("with_layer", |b| {
        b.iter_custom(|n| run(&rt, n, || fenced.clone().oneshot(request())))
    });
    g.bench_function("around_router", |b| {
        b.iter_custom(|n| run(&rt, n, || around.clone().oneshot(request())))
    });
    g.finish();

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
    let resource = admission.resource("orders").unwrap();
    let token = FencingToken::new(51).unwrap();
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

/// Runs `n` requests made by `call` to completion; every response must be 200.
fn run<F, B, E>(rt: &tokio::runtime::Runtime, n: u64, call: impl Fn() -> F) -> Duration
where
    F: std::future::Future<Output = Result<http::Response<B>, E>>,
    E: std::fmt::Debug,
{
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..n {
            let resp = call().await.unwrap();
            assert_eq!(resp.status(), 200);
        }
        start.elapsed()
    })
}

criterion_group!(benches, bench);
criterion_main!(benches);
