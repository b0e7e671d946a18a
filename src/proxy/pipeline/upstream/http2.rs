//! h2c and h2 upstreams: one hyper-util client per upstream, multiplexing every request over
//! its pooled connections.

use std::sync::Arc;

use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::dial::{Dial, Dialer};
use crate::proxy::config::UpstreamSettings;
use crate::proxy::pipeline::request_body::RequestBody;

/// The upstream's HTTP/2 client.
pub(super) fn client(u: &UpstreamSettings, dialer: &Arc<Dialer>) -> Client<Dial, RequestBody> {
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
