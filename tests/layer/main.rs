//! The guard in-process: `FenceLayer` on an axum app (driven with `oneshot`) and on a gRPC
//! service served over loopback, against the same admission table as the proxy
//! (`tests/support/cases.rs`).

#[path = "../support/mod.rs"]
mod support;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use palisade::fence::admission::Admission;
use palisade::fence::layer::FenceLayer;
use palisade::fence::marks::FileStore;
use palisade::fence::metrics::Metrics;
use palisade::FencingToken;
use support::cases::{seed, stored, Case, Seen, CASES, MARK};
use support::grpc::{EchoClient, Msg, SAY};
use tower::{Layer, ServiceExt};

struct Env {
    dir: tempfile::TempDir,
    marks: PathBuf,
    admission: Arc<Admission>,
    seen: Seen,
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("m/marks.json");
    seed(&marks);
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(FileStore::open(&marks).unwrap());
    let admission = Arc::new(Admission::open(store, ["orders"], &metrics).await.unwrap());
    Env {
        dir,
        marks,
        admission,
        seen: Seen::default(),
    }
}

impl Env {
    fn store_down(&self) {
        std::fs::remove_dir_all(self.dir.path().join("m")).unwrap();
    }

    fn check(&self, case: &Case, status_ok: bool) {
        let seen = self.seen.lock().unwrap().clone();
        assert!(status_ok, "{}", case.name);
        assert_eq!(
            seen.len(),
            usize::from(case.reaches),
            "{}: {seen:?}",
            case.name
        );
        if let (Some(&(token, stored_then)), Some(t)) = (seen.first(), case.token) {
            let t: u64 = t.parse().unwrap();
            assert_eq!(
                token,
                Some(t),
                "{}: the token is in the extensions",
                case.name
            );
            if !case.store_down {
                assert_eq!(
                    stored_then, t,
                    "{}: durable before the service ran",
                    case.name
                );
            }
        }
        let mark = self.admission.resource("orders").unwrap().mark();
        assert_eq!(mark, case.mark_after, "{}", case.name);
    }
}

#[tokio::test]
async fn the_layer_passes_the_admission_table_over_http() {
    for case in CASES {
        let e = env().await;
        let (seen, marks) = (e.seen.clone(), e.marks.clone());
        let app = Router::new()
            .route(
                "/orders/{id}",
                post(move |req: Request<axum::body::Body>| {
                    let (seen, marks) = (seen.clone(), marks.clone());
                    async move {
                        let token = req.extensions().get::<FencingToken>().map(|t| t.get());
                        seen.lock().unwrap().push((token, stored(&marks)));
                        "written"
                    }
                }),
            )
            .layer(FenceLayer::new(Arc::clone(&e.admission), "orders"));
        if case.store_down {
            e.store_down();
        }
        let mut req = Request::post("/orders/7");
        if let Some(t) = case.token {
            req = req.header("x-fencing-token", t);
        }
        let resp = app
            .oneshot(req.body(axum::body::Body::from("payload")).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        if case.http == 409 {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"], "stale_token");
            assert_eq!(v["mark"], MARK);
        }
        e.check(case, status == StatusCode::from_u16(case.http).unwrap());
    }
}

/// A unary `test.Echo/Say` behind the fence, served by palisade's own server over h2c.
async fn grpc_server(e: &Env) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let layer = FenceLayer::new(Arc::clone(&e.admission), "orders");
    let (seen, marks) = (e.seen.clone(), e.marks.clone());
    tokio::spawn(palisade::proxy::server::serve(
        listener,
        move |req: Request<hyper::body::Incoming>, _| {
            let inner = tower::service_fn({
                let (seen, marks) = (seen.clone(), marks.clone());
                move |req: Request<
                    palisade::fence::layer::FenceRequestBody<hyper::body::Incoming>,
                >| {
                    let (seen, marks) = (seen.clone(), marks.clone());
                    async move {
                        let token = req.extensions().get::<FencingToken>().map(|t| t.get());
                        let req = req.map(tonic::body::Body::new);
                        let mut grpc = tonic::server::Grpc::new(
                            tonic_prost::ProstCodec::<Msg, Msg>::default(),
                        );
                        let say = Say(seen, marks, token);
                        Ok::<_, std::convert::Infallible>(grpc.unary(say, req).await)
                    }
                }
            });
            let svc = layer.layer(inner);
            async move { svc.oneshot(req).await.unwrap() }
        },
        std::future::pending::<()>(),
        Duration::from_secs(1),
    ));
    addr
}

struct Say(Seen, PathBuf, Option<u64>);

impl tonic::server::UnaryService<Msg> for Say {
    type Response = Msg;
    type Future = Pin<Box<dyn Future<Output = Result<tonic::Response<Msg>, tonic::Status>> + Send>>;

    fn call(&mut self, req: tonic::Request<Msg>) -> Self::Future {
        self.0.lock().unwrap().push((self.2, stored(&self.1)));
        let m = req.into_inner();
        Box::pin(async move { Ok(tonic::Response::new(m)) })
    }
}

#[tokio::test]
async fn the_layer_passes_the_admission_table_over_grpc() {
    assert_eq!(SAY, "/test.Echo/Say");
    for case in CASES {
        let e = env().await;
        let addr = grpc_server(&e).await;
        if case.store_down {
            e.store_down();
        }
        let mut client = EchoClient::connect(addr).await;
        let got = client.say("hi", case.token).await;
        let code = match &got {
            Ok(_) => 0,
            Err(status) => status.code() as u8,
        };
        e.check(case, code == case.grpc);
    }
}

/// `layer` over a service that answers every request 200, and a POST to it: its status.
fn posts_through(
    layer: FenceLayer,
) -> impl Fn(&str, Option<&str>) -> Pin<Box<dyn Future<Output = u16>>> {
    let svc = layer.layer(tower::service_fn(
        |_: Request<palisade::fence::layer::FenceRequestBody<Full<Bytes>>>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("ok"))))
        },
    ));
    move |path: &str, token: Option<&str>| {
        let mut req = Request::post(path.to_owned());
        if let Some(t) = token {
            req = req.header("x-fencing-token", t);
        }
        let call = svc
            .clone()
            .oneshot(req.body(Full::new(Bytes::new())).unwrap());
        Box::pin(async move { call.await.unwrap().status().as_u16() })
    }
}

#[tokio::test]
async fn a_derived_resource_loads_its_mark_and_unguarded_requests_pass() {
    let e = env().await;
    let layer = FenceLayer::new(Arc::clone(&e.admission), "unused").with_resource_fn(|parts| {
        parts
            .uri
            .path()
            .strip_prefix("/r/")
            .map(|rest| rest.split('/').next().unwrap_or_default().to_owned())
    });
    let send = posts_through(layer);
    // "orders" is known to the store with mark 51: reached through the derived name.
    assert_eq!(send("/r/orders/1", Some("34")).await, 409);
    assert_eq!(send("/r/orders/1", Some("51")).await, 200);
    // A resource seen for the first time starts from its stored mark (none: 0).
    assert_eq!(send("/r/fresh/1", Some("5")).await, 200);
    assert_eq!(send("/r/fresh/1", Some("4")).await, 409);
    assert_eq!(e.admission.marks().get("fresh"), Some(&5));
    // No resource for this path: not guarded, no token needed.
    assert_eq!(send("/health", None).await, 200);
}

#[tokio::test]
async fn a_layer_resource_picked_by_path_prefix_stops_at_a_segment_boundary() {
    use palisade::PathPrefix;
    let e = env().await;
    let warehouses = [
        (PathPrefix::new("/warehouses/1"), "warehouse-1"),
        (PathPrefix::new("/warehouses/12"), "warehouse-12"),
    ];
    let layer = FenceLayer::new(Arc::clone(&e.admission), "unused").with_resource_fn(move |p| {
        warehouses
            .iter()
            .find(|(prefix, _)| prefix.matches(p.uri.path()))
            .map(|(_, r)| (*r).to_owned())
    });
    let send = posts_through(layer);
    assert_eq!(send("/warehouses/1/stock", Some("51")).await, 200);
    // The first prefix does not take warehouse 12's requests: its owner's 40 is its own.
    assert_eq!(send("/warehouses/12/stock", Some("40")).await, 200);
    assert_eq!(send("/warehouses/12", Some("39")).await, 409);
    assert_eq!(send("/warehouses/1.json", Some("50")).await, 409);
    let marks = e.admission.marks();
    assert_eq!((marks["warehouse-1"], marks["warehouse-12"]), (51, 40));
}

#[tokio::test]
async fn a_layer_with_a_resource_template_keeps_one_mark_per_entity() {
    use palisade::fence::template::{PathPattern, ResourceTemplate};
    let e = env().await;
    let pattern = PathPattern::parse("/warehouses/{id}/stock").unwrap();
    let template = ResourceTemplate::parse("warehouse/{id}", pattern.names()).unwrap();
    let layer =
        FenceLayer::new(Arc::clone(&e.admission), "unused").with_template(pattern, template);
    let send = posts_through(layer);
    assert_eq!(send("/warehouses/7/stock", Some("51")).await, 200);
    assert_eq!(send("/warehouses/8/stock", Some("40")).await, 200);
    assert_eq!(send("/warehouses/7/stock", Some("50")).await, 409);
    // Another spelling of warehouse 7 is the same entity, or refused: never a fresh mark.
    assert_eq!(send("/warehouses/7/stock/", Some("50")).await, 409);
    assert_eq!(send("/warehouses/%37/stock", Some("50")).await, 400);
    // Paths the pattern does not match are not guarded.
    assert_eq!(send("/health", None).await, 200);
    let marks = e.admission.marks();
    assert_eq!((marks["warehouse/7"], marks["warehouse/8"]), (51, 40));
}

/// A fence request through the layer: admitted like any request and answered 204 (gRPC: OK)
/// with the mark; the service never runs for it. Stale, malformed, token-less and unguarded
/// fences are refused.
#[tokio::test]
async fn a_fence_request_is_answered_by_the_layer_and_never_reaches_the_service() {
    let e = env().await; // "orders" at MARK (51)
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&ran);
    let layer = FenceLayer::new(Arc::clone(&e.admission), "unused").with_resource_fn(|parts| {
        parts
            .uri
            .path()
            .strip_prefix("/r/")
            .map(|rest| rest.split('/').next().unwrap_or_default().to_owned())
    });
    let svc = layer.layer(tower::service_fn(
        move |_: Request<palisade::fence::layer::FenceRequestBody<Full<Bytes>>>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("ok"))))
            }
        },
    ));
    let call = |path: &str, headers: &[(&str, &str)]| {
        let mut req = Request::post(path.to_owned());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let call = svc
            .clone()
            .oneshot(req.body(Full::new(Bytes::from("body"))).unwrap());
        async move {
            let resp = call.await.unwrap();
            let (parts, body) = resp.into_parts();
            (parts, body.collect().await.unwrap().to_bytes())
        }
    };
    let fence = |t: &'static str| [("x-fencing-token", t), ("x-fencing-fence", "1")];
    let (resp, body) = call("/r/orders/1", &fence("60")).await;
    assert_eq!(resp.status, StatusCode::NO_CONTENT);
    assert_eq!(resp.headers["x-fencing-mark"], "60");
    assert!(body.is_empty());
    assert_eq!(stored(&e.marks), 60, "persisted before the answer");
    // The old owner is refused from now on, before the new owner wrote anything.
    assert_eq!(
        call("/r/orders/1", &[("x-fencing-token", "51")])
            .await
            .0
            .status,
        409
    );
    let (resp, _) = call("/r/orders/1", &fence("59")).await;
    assert_eq!(resp.status, StatusCode::CONFLICT, "a stale fence");
    let (resp, body) = call(
        "/r/orders/1",
        &[("x-fencing-token", "61"), ("x-fencing-fence", "true")],
    )
    .await;
    assert_eq!(resp.status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("malformed_fence"));
    let (resp, _) = call("/r/orders/1", &[("x-fencing-fence", "1")]).await;
    assert_eq!(
        resp.status,
        StatusCode::PRECONDITION_REQUIRED,
        "a fence needs a token"
    );
    let (resp, body) = call("/health", &fence("61")).await;
    assert_eq!(resp.status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("nothing_to_fence"));
    // gRPC: trailers-only OK with the mark.
    let (resp, _) = call(
        "/r/orders/1",
        &[
            ("x-fencing-token", "61"),
            ("x-fencing-fence", "1"),
            ("content-type", "application/grpc"),
        ],
    )
    .await;
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.headers["grpc-status"], "0");
    assert_eq!(resp.headers["x-fencing-mark"], "61");
    assert_eq!(e.admission.marks()["orders"], 61);
    assert_eq!(
        ran.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the service never ran"
    );
    // The same request without the fence header reaches the service.
    let (resp, _) = call("/r/orders/1", &[("x-fencing-token", "61")]).await;
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
}
