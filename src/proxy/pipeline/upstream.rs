//! Upstream connection pools: one pooled client per `[[upstream]]`, dialing its address.

use std::task::{Context as TaskContext, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::body::RequestBody;
use crate::config::{Protocol, UpstreamSettings};

/// One configured upstream and its pooled client.
pub(super) struct Upstream {
    pub(super) settings: UpstreamSettings,
    pub(super) client: Client<Dial, RequestBody>,
}

impl Upstream {
    pub(super) fn new(settings: &UpstreamSettings) -> Self {
        Self {
            settings: settings.clone(),
            client: client_for(settings),
        }
    }
}

/// Dials the upstream's address whatever authority the request URI carries (which, for h2c,
/// is the client's, sent on as :authority).
#[derive(Clone)]
pub(super) struct Dial {
    inner: HttpConnector,
    target: Uri,
}

impl tower_service::Service<Uri> for Dial {
    type Response = <HttpConnector as tower_service::Service<Uri>>::Response;
    type Error = <HttpConnector as tower_service::Service<Uri>>::Error;
    type Future = <HttpConnector as tower_service::Service<Uri>>::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        self.inner.call(self.target.clone())
    }
}

fn client_for(u: &UpstreamSettings) -> Client<Dial, RequestBody> {
    let mut inner = HttpConnector::new();
    inner.set_nodelay(true);
    inner.set_connect_timeout(Some(u.connect_timeout));
    let target = Uri::builder()
        .scheme(u.scheme.clone())
        .authority(u.authority.clone())
        .path_and_query("/")
        .build()
        .expect("scheme and authority were validated");
    let connector = Dial { inner, target };
    let mut b = Client::builder(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        // An admitted request is sent at most once, even when hyper could tell it was not
        // written before the pooled connection closed.
        .retry_canceled_requests(false)
        .pool_max_idle_per_host(usize::MAX)
        .http2_only(u.protocol == Protocol::H2c);
    b.build(connector)
}
