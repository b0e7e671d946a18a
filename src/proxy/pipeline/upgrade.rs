//! WebSocket upgrades on routes with `websocket = true`.
//!
//! The upgrade request is guarded like any request (a stale token gets 409 and never reaches
//! the upstream), then sent on an upstream connection of its own: an upgraded connection is
//! never reused. When the upstream answers 101, both connections are handed over and bytes are
//! copied both ways until either side closes.
//!
//! The tunnel keeps the upgrade request's drain ticket: a WebSocket opened under an older mark
//! is an older owner still writing, so when a newer owner's token advances the mark, its
//! request waits for the tunnel for at most the route's `drain_timeout_ms`, then the tunnel is
//! closed (both connections dropped).

use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Version};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::forward::{abortable, Forwarded};
use super::request_body::RequestBody;
use super::response_body::InflightCount;
use super::upstream::Upstream;
use crate::fence::drain::{Generation, Ticket};
use crate::fence::reject::Rejection;
use crate::proxy::config::RouteSettings;
use crate::proxy::error_chain::error_chain;
use crate::proxy::server::ConnCount;

/// Whether `req` asks for a WebSocket: HTTP/1.1 GET with `Connection: upgrade` and
/// `Upgrade: websocket` (RFC 6455 4.1).
pub(super) fn is_websocket<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.method() == Method::GET
        && has_token(req.headers(), header::CONNECTION, "upgrade")
        && has_token(req.headers(), header::UPGRADE, "websocket")
}

fn has_token(h: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',').any(|t| {
                t.trim()
                    .split('/')
                    .next()
                    .is_some_and(|p| p.eq_ignore_ascii_case(token))
            })
        })
    })
}

/// Puts back the two hop-by-hop headers an upgrade needs (removed with the others).
pub(super) fn upgrade_headers(h: &mut HeaderMap) {
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
}

/// Sends the upgrade request on a new connection to the upstream, at most once.
pub(super) async fn forward(
    upstream: &Upstream,
    route: &RouteSettings,
    req: Request<RequestBody>,
    aborted: Option<&Arc<Generation>>,
) -> Forwarded {
    let call = async {
        let failed =
            |e: &(dyn std::error::Error + 'static)| Rejection::UpstreamFailed(error_chain(e));
        let tcp = upstream
            .dialer
            .connect(route.connect_timeout)
            .await
            .map_err(|e| failed(&e))?;
        let (mut sender, conn) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| failed(&e))?;
        // The connection lives in its own task until it is upgraded (or the exchange ends).
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upgrade connection ended with an error");
            }
        });
        let sent = sender.send_request(req);
        let resp = match route.response_timeout {
            Some(limit) => tokio::time::timeout(limit, sent)
                .await
                .map_err(|_| Rejection::UpstreamTimeout(limit))?,
            None => sent.await,
        };
        resp.map(|r| (r, None)).map_err(|e| failed(&e))
    };
    let abort = aborted.map(|generation| super::forward::Abort {
        generation: Arc::clone(generation),
        delivered: None,
    });
    match abortable(call, abort).await {
        Some(answer) => Forwarded::Answered(answer),
        None => Forwarded::Aborted,
    }
}

/// Copies bytes between the client's and the upstream's upgraded connections until one side
/// closes, or a newer owner's drain aborts the tunnel.
pub(super) fn tunnel(
    client: OnUpgrade,
    upstream: &mut Response<Incoming>,
    ticket: Option<Ticket>,
    inflight: InflightCount,
    hold: Option<ConnCount>,
) {
    let upstream = hyper::upgrade::on(upstream);
    tokio::spawn(async move {
        let (c, u) = match tokio::try_join!(client, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!(error = %e, "websocket upgrade did not complete");
                return;
            }
        };
        let (mut c, mut u) = (TokioIo::new(c), TokioIo::new(u));
        let copy = tokio::io::copy_bidirectional(&mut c, &mut u);
        match ticket.as_ref().map(|t| Arc::clone(t.generation())) {
            Some(generation) => tokio::select! {
                () = generation.aborted() => tracing::info!("websocket closed: a newer owner's token advanced the mark"),
                r = copy => if let Err(e) = r { tracing::debug!(error = %e, "websocket ended with an error") },
            },
            None => {
                if let Err(e) = copy.await {
                    tracing::debug!(error = %e, "websocket ended with an error");
                }
            }
        }
        drop(ticket);
        drop(inflight);
        // The client's connection stops counting toward `max_connections` only now.
        drop(hold);
    });
}
