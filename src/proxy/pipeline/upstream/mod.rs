//! The upstream side: how palisade reaches a configured upstream. Below the pipeline, which
//! calls into it; nothing here calls back up.
//!
//! - [`dial`]: connecting to one of the upstream's addresses, with health checks;
//! - [`tls`]: `https://` upstreams; [`socket`]: the upstream TCP socket (quick ACKs, asking
//!   the kernel whether an idle connection is still clean);
//! - [`pool`]: the upstream's shared cache of idle connections;
//! - [`http1`]: HTTP/1.1 upstreams, one connection per client connection, driven in that
//!   client connection's task; [`raw`]: the plain sockets the HTTP/1.1 fast path speaks on;
//! - [`http2`]: h2c and h2 upstreams, one pooled, multiplexing client.

pub(crate) mod dial;
pub(crate) mod http1;
mod http2;
pub(crate) mod pool;
pub(crate) mod raw;
pub(crate) mod socket;
pub(crate) mod tls;

use std::sync::Arc;

use hyper_util::client::legacy::Client;

use self::dial::{spawn_health_checks, Dial, Dialer};
use self::http1::UpConn;
use self::pool::IdlePool;
use super::request_body::RequestBody;
use crate::proxy::config::{Protocol, UpstreamSettings};

/// One configured upstream and how palisade reaches it.
pub(crate) struct Upstream {
    pub(crate) settings: UpstreamSettings,
    pub(crate) dialer: Arc<Dialer>,
    pub(crate) via: Via,
    /// Plain `http://` HTTP/1.1 upstreams: idle sockets of the HTTP/1.1 fast path (`fast`),
    /// which speaks HTTP/1.1 on them itself. `None` for upstreams the fast path never takes.
    pub(crate) raw_idle: Option<Arc<IdlePool<tokio::net::TcpStream>>>,
}

/// How requests reach an upstream.
pub(crate) enum Via {
    /// HTTP/1.1: the client connection's own upstream connection, or one from the idle pool.
    Affine(Arc<IdlePool<UpConn>>),
    /// h2c or h2: one shared client; HTTP/2 multiplexes every request over its connection.
    Pooled(Box<Client<Dial, RequestBody>>),
}

impl Upstream {
    pub(crate) fn new(settings: &UpstreamSettings) -> Self {
        let dialer = Arc::new(Dialer::new(settings));
        if let Some(check) = &settings.health_check {
            spawn_health_checks(&dialer, check.clone(), settings.connect_timeout);
        }
        let via = match settings.protocol {
            Protocol::Http1 => Via::Affine(Arc::new(IdlePool::new(settings.idle_timeout))),
            Protocol::H2c | Protocol::H2 => Via::Pooled(Box::new(http2::client(settings, &dialer))),
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
