#![allow(missing_docs)]
use axum::routing::post;
use axum::Router;
use http::Request;
use palisade::admission::Admission;
use palisade::{FenceLayer, MemoryStore, Metrics};
use std::sync::Arc;
use tower::ServiceExt;
fn main() {
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
    let layer = FenceLayer::new(admission, "orders");
    let fenced = plain.clone().layer(layer.clone());
    let around = tower::Layer::layer(&layer, plain.clone());
    let identity = plain.clone().layer(tower::layer::util::Identity::new());
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
    rt.block_on(async {
        let i: u32 = std::env::args().nth(1).unwrap().parse().unwrap();
        if i == 9 {
            use tower::Service;
            let mut p = plain.clone();
            let mut a = around.clone();
            let mut f = fenced.clone();
            let fp = p.call(request());
            let fa = a.call(request());
            let ff = f.call(request());
            println!(
                "req {} plainfut {} aroundfut {} fencedfut {} oneshot_around {}",
                std::mem::size_of_val(&request()),
                std::mem::size_of_val(&fp),
                std::mem::size_of_val(&fa),
                std::mem::size_of_val(&ff),
                std::mem::size_of_val(&around.clone().oneshot(request()))
            );
            return;
        }
        let name = "x";
        {
            for _ in 0..2000000 {
                let req = request();
                let r = match i {
                    0 => plain.clone().oneshot(req).await.unwrap().status(),
                    1 => fenced.clone().oneshot(req).await.unwrap().status(),
                    3 => identity.clone().oneshot(req).await.unwrap().status(),
                    _ => around.clone().oneshot(req).await.unwrap().status(),
                };
                assert_eq!(r, 200, "{name}");
            }
        }
    });
}
