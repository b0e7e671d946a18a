//! Object-store leader election against a real S3-compatible server: moto's server
//! (tests/support/moto.rs), through object_store's S3 client.
//!
//! `processes.rs`: five candidate processes with SIGSTOPped leaders for 60 s; `checks.rs`:
//! the claims their reports and the resource's log are checked against.

mod checks;
mod processes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::{moto, support};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use palisade::client::objstore::{Elector, ElectorOptions, Error, Event};
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
    Arc<dyn palisade::client::objstore::object_store::ObjectStore>,
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
    tokio::spawn(palisade::proxy::server::serve(
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
