//! One request on the fast path: judged by [`Proxy::admit`] (hyper's path's own checks),
//! sent upstream at most once, and answered by relaying the upstream's response as is.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use super::head::{Head, View};
use super::response::ResponseHead;
use super::shared::{rewrite, Logged, Note, Passed, Proxy, UpSock};
use super::{upstream_head, write, After, ClientConn};
use crate::fence::reject::Rejection;

/// Request body bytes are moved in pieces of at most this size.
pub(super) const BODY_CHUNK: usize = 16 * 1024;

/// Why an admitted request got no response head.
pub(super) enum Failed {
    /// Answered 502/504 from the table.
    Upstream(Rejection),
    /// The client went away (or failed) while its body was being relayed.
    ClientGone,
}

/// A response head and the socket its body comes on.
pub(super) struct Relay {
    pub(super) head: ResponseHead,
    pub(super) sock: UpSock,
    /// The request body reached the upstream whole (it may answer before reading it all).
    pub(super) sent_whole: bool,
}

impl ClientConn {
    /// Serves the request whose head is `head` (at the start of the buffer).
    pub(super) async fn exchange(&mut self, proxy: &Proxy, head: Head) -> After {
        let started = Instant::now();
        let (at, body, close) = (self.start, head.body, head.close);
        self.start += head.len;
        let mut view = View::new(&head, &self.buf[at..], &mut self.fields);
        // Exactly `HEAD`, as hyper frames it: methods are case-sensitive (RFC 9110 9.1), and
        // an upstream that follows that answers `head` with a body, which must be relayed, not
        // left on the connection to be read as the next request's response.
        let head_request = view.method == "HEAD";
        let mut plain = Note::default();
        let mut logged = proxy.access_log.as_deref().map(|log| {
            // Only with an access log: the line keeps the method and the target.
            let method = http::Method::from_bytes(view.method.as_bytes()).unwrap_or_default();
            let uri = http::Uri::try_from(view.target).unwrap_or_default();
            Logged::new(log, (method, uri), self.peer.addr, started)
        });
        let note = match &mut logged {
            Some(l) => &mut l.note,
            None => &mut plain,
        };
        let admitted = match proxy.admit(&view, self.peer.addr, started, note).await {
            Ok(a) => a,
            Err(refused) => {
                let status = refused.status();
                let close = close || refused.headers().contains_key(http::header::CONNECTION);
                // A body that is not all here cannot be skipped: the connection closes after
                // the answer, which says so.
                let closing = close || !self.skip_unsent(body) || self.activity.stopping();
                self.out.clear();
                write::refusal(&mut self.out, refused, head_request, closing);
                let after = self.answer_unsent(closing).await;
                if let Some(l) = logged {
                    l.answered(status);
                }
                return after;
            }
        };
        let Passed {
            route,
            upstream,
            outcome,
            token,
            ticket,
            rewritten,
            normalized_host,
            close_upstream,
            limit: _,
            inflight,
            grpc,
        } = admitted;
        let rules = rewrite::UpstreamHead {
            route: &route.settings,
            token_header: &proxy.header,
            upstream,
            rewritten_path: None,
            normalized_host,
            peer: self.peer.addr,
            close: close_upstream,
            https: false,
        };
        self.out.clear();
        upstream_head::write(&mut self.out, &mut view, rewritten, &rules);
        // The drain ticket is held until the exchange is over: a newer owner's drain waits for
        // it, or aborts it. An abort drops the upstream socket (closing it) before the body
        // went out whole, so the upstream never sees the request's end.
        // Once the request went out whole, an abort no longer closes the socket: the upstream
        // may apply the request whatever palisade does now, so its answer is waited for (the
        // drain waits for it at most its abort grace) and relayed in full.
        let mut ticket = ticket;
        let aborted = ticket.as_ref().map(|t| Arc::clone(t.generation()));
        // Atomic only to keep the future `Send`: one task reads and writes it.
        let delivered = AtomicBool::new(false);
        // One wait for the abort over the whole exchange, the upstream's answer and the relay,
        // through the connection's standing registration (registered once per connection and
        // mark, not per request). `fired`: it completed (it is not polled again).
        let mut watch = std::mem::take(&mut self.abort_watch);
        let abort = std::future::poll_fn(|cx| match &aborted {
            Some(generation) => watch.poll(generation, cx),
            None => std::task::Poll::Pending,
        });
        tokio::pin!(abort);
        let mut fired = false;
        let limit = route.settings.response_timeout;
        // Set when the client hung up after its request went out whole: the exchange still
        // waits for the upstream's answer (the upstream may apply the request, so a newer
        // owner's drain must wait for it too), then ends without answering.
        let gone = AtomicBool::new(false);
        let sent = {
            let sent = async {
                let send = self.send(
                    upstream,
                    route.settings.connect_timeout,
                    body,
                    head_request,
                    (&delivered, &gone, ticket.is_some()),
                    &mut logged,
                );
                match limit {
                    Some(limit) => tokio::time::timeout(limit, send)
                        .await
                        .unwrap_or(Err(Failed::Upstream(Rejection::UpstreamTimeout(limit)))),
                    None => send.await,
                }
            };
            tokio::pin!(sent);
            match tokio::select! {
                biased;
                () = &mut abort => None,
                r = &mut sent => Some(r),
            } {
                None if delivered.load(Relaxed) => {
                    fired = true;
                    Some(sent.await)
                }
                r => r,
            }
        };
        if gone.into_inner() {
            return After::Close;
        }
        let note = match &mut logged {
            Some(l) => &mut l.note,
            None => &mut plain,
        };
        let grpc2 = grpc.clone();
        let answer = match sent {
            // In both failures the upstream socket is closed (the exchange is dropped, or it
            // failed): nothing more of this request can reach the upstream, so its ticket goes
            // back before the answer is written, and a drain does not wait on a client that
            // does not read it.
            None => {
                drop(ticket.take());
                drop(inflight);
                let refused = proxy.aborted(route, token, grpc, self.peer.addr, started, note);
                let keep = !close && (body == 0 || delivered.load(Relaxed));
                return self
                    .answer_failed(refused, head_request, logged, keep)
                    .await;
            }
            Some(Err(Failed::ClientGone)) => return After::Close,
            Some(Err(Failed::Upstream(rejection))) => {
                drop(ticket.take());
                drop(inflight);
                let m = &route.metrics;
                m.duration.observe(started.elapsed().as_secs_f64());
                let refused = proxy.upstream_failed(
                    route,
                    upstream,
                    rejection,
                    token,
                    grpc2,
                    self.peer.addr,
                    note,
                );
                let keep = !close && (body == 0 || delivered.load(Relaxed));
                return self
                    .answer_failed(refused, head_request, logged, keep)
                    .await;
            }
            Some(Ok(a)) => a,
        };
        let m = &route.metrics;
        m.duration.observe(started.elapsed().as_secs_f64());
        m.count(outcome);
        note.set(outcome, token);
        let status = answer.head.status;
        let closing = close || self.activity.stopping();
        let delivered = delivered.into_inner();
        let relayed = {
            let relay = self.relay(proxy, answer, close_upstream, closing, head_request);
            tokio::pin!(relay);
            let r = if fired {
                None
            } else {
                tokio::select! {
                    biased;
                    () = &mut abort => None,
                    r = &mut relay => Some(r),
                }
            };
            match r {
                // Went out whole and answered: the ticket goes back, the answer goes on.
                None if delivered => {
                    drop(ticket.take());
                    Some(relay.await)
                }
                r => r,
            }
        };
        drop(ticket);
        drop(inflight);
        self.abort_watch = watch;
        // A mark already replaced will not be aborted again for this connection's requests:
        // its registration (and the generation it keeps) is let go now, not at the next one.
        self.abort_watch.release_if_superseded();
        if let Some(l) = logged {
            l.answered(status);
        }
        match relayed {
            Some(Ok(after)) if !close => after,
            Some(Ok(_)) => After::Close,
            // Aborted by a newer owner's drain mid-response, or cut (the upstream failed or
            // broke its framing): the client's connection is reset, so that the client cannot
            // take a cut response for a whole one.
            None | Some(Err(_)) => {
                let _ = self.client.set_zero_linger();
                After::Reset
            }
        }
    }
}
