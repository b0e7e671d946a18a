//! Upstreams: HTTP/1.1 upstreams are connection-affine (see [`super::affine`]); h2c upstreams
//! share one pooled, multiplexing client. Both dial through the upstream's [`Dialer`].

use std::sync::Arc;

use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::affine::IdlePool;
use super::body::RequestBody;
use super::dial::{spawn_health_checks, Dial, Dialer};
use crate::config::{Protocol, UpstreamSettings};

/// One configured upstream and how palisade reaches it.
pub(super) struct Upstream {
    pub(super) settings: UpstreamSettings,
    pub(super) dialer: Arc<Dialer>,
    pub(super) via: Via,
    /// Plain `http://` HTTP/1.1 upstreams: idle sockets of the HTTP/1.1 fast path (`fast`),
    /// which speaks HTTP/1.1 on them itself. `None` for upstreams the fast path never takes.
    pub(super) raw_idle: Option<Arc<IdlePool<tokio::net::TcpStream>>>,
}

/// How requests reach an upstream.
pub(super) enum Via {
    /// HTTP/1.1: the client connection's own upstream connection, or one from the idle pool.
    Affine(Arc<IdlePool>),
    /// h2c or h2: one shared client; HTTP/2 multiplexes every request over its connection.
    Pooled(Box<Client<Dial, RequestBody>>),
}

impl Upstream {
    pub(super) fn new(settings: &UpstreamSettings) -> Self {
        let dialer = Arc::new(Dialer::new(settings));
        if let Some(check) = &settings.health_check {
            spawn_health_checks(&dialer, check.clone(), settings.connect_timeout);
        }
        let via = match settings.protocol {
            Protocol::Http1 => Via::Affine(Arc::new(IdlePool::new(settings.idle_timeout))),
            Protocol::H2c | Protocol::H2 => Via::Pooled(Box::new(h2c_client(settings, &dialer))),
        };
        let plain_http1 =
            settings.protocol == Protocol::Http1 && settings.scheme == http::uri::Scheme::HTTP;
        Self {
            settings: settings.clone(),
            dialer,
            via,
            raw_idle: plain_http1.then(|| Arc::new(IdlePool::new(settings.idle_timeout))),
        }
    }
}

fn h2c_client(u: &UpstreamSettings, dialer: &Arc<Dialer>) -> Client<Dial, RequestBody> {
    let connector = Dial {
        dialer: Arc::clone(dialer),
        timeout: u.connect_timeout,
    };
    let mut b = Client::builder(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(u.idle_timeout)
        // A request hyper never started to write (its pooled connection closed first, after
        // the upstream's GOAWAY, say) is sent on another: hyper gives it back whole, so it is
        // still sent at most once. A stream the upstream refused is sent again in `forward`.
        .retry_canceled_requests(true)
        .pool_max_idle_per_host(usize::MAX)
        .http2_only(true);
    b.build(connector)
}
