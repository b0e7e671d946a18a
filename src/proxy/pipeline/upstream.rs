//! Upstreams: HTTP/1.1 upstreams are connection-affine (see [`super::affine`]); h2c upstreams
//! share one pooled, multiplexing client.

use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::affine::{Dialer, IdlePool};
use super::body::RequestBody;
use crate::config::{Protocol, UpstreamSettings};

/// One configured upstream and how palisade reaches it.
pub(super) struct Upstream {
    pub(super) settings: UpstreamSettings,
    pub(super) via: Via,
}

/// How requests reach an upstream.
pub(super) enum Via {
    /// HTTP/1.1: the client connection's own upstream connection, or one from the idle pool.
    Affine { pool: Arc<IdlePool>, dialer: Dialer },
    /// h2c: one shared client; HTTP/2 multiplexes every request over its connection.
    Pooled(Box<Client<Dial, RequestBody>>),
}

impl Upstream {
    pub(super) fn new(settings: &UpstreamSettings) -> Self {
        let via = match settings.protocol {
            Protocol::Http1 => Via::Affine {
                pool: Arc::default(),
                dialer: Dialer {
                    host: settings
                        .authority
                        .host()
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_owned(),
                    port: settings.authority.port_u16().unwrap_or(80),
                    connect_timeout: settings.connect_timeout,
                },
            },
            Protocol::H2c => Via::Pooled(Box::new(client_for(settings))),
        };
        Self {
            settings: settings.clone(),
            via,
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
        .http2_only(true);
    b.build(connector)
}
