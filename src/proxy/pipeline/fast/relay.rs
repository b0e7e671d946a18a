//! The upstream's response relayed to the client: its head with hop-by-hop headers removed
//! (by hyper's path's own [`strip_hop_by_hop`]), then its body bytes as they are, up to where
//! its framing says it ends.

use tokio::io::AsyncWriteExt;

use super::exchange::{Relay, BODY_CHUNK};
use super::response::{Chunks, Framing, ResponseHead};
use super::shared::rewrite::strip_hop_by_hop;
use super::shared::{socket, Fields, FieldsMut, Proxy};
use super::{write, After, ClientConn};

/// The response could not be relayed whole (the upstream or the client failed, or the body's
/// framing was invalid): the client connection must be closed.
pub(super) struct Cut;

impl ClientConn {
    /// Relays the response of `answer`; the upstream socket is kept for the next request when
    /// the exchange ended cleanly (`close_upstream`: the request asked it closed).
    pub(super) async fn relay(
        &mut self,
        proxy: &Proxy,
        answer: Relay,
        close_upstream: bool,
        closing: bool,
        head_request: bool,
    ) -> Result<After, Cut> {
        let Relay {
            head,
            mut sock,
            sent_whole,
        } = answer;
        let ResponseHead {
            len,
            status,
            reason,
            framing,
            close,
        } = head;
        let ClientConn {
            client,
            out,
            ubuf,
            fields,
            ..
        } = self;
        let mut headers = fields.list(&ubuf[..len]);
        strip_hop_by_hop(&mut headers, &proxy.header);
        let no_body_status =
            status == http::StatusCode::NO_CONTENT || status == http::StatusCode::NOT_MODIFIED;
        // The length fields as hyper's server writes them for hyper's path, whose response body
        // from the upstream ends at once when there is none: to HEAD, the upstream's
        // Content-Length where it was; otherwise it is dropped from its place and
        // `content-length: 0` written after the other fields, except on 204 and 304. A 204
        // never says a length (RFC 9110 8.6): a hop that honoured an upstream's stray one would
        // read the next response as this one's body.
        let bodyless = framing == Framing::Empty && !head_request;
        if bodyless || status == http::StatusCode::NO_CONTENT {
            headers.remove(&http::header::CONTENT_LENGTH);
        }
        // `Trailer` announces fields after a chunked body: none can follow to HEAD, 204 or 304.
        if head_request || no_body_status {
            headers.remove(&http::header::TRAILER);
        }
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(&ubuf[reason]);
        out.extend_from_slice(b"\r\n");
        headers.write(out);
        // The client learns where a close-delimited body ends from the connection's close.
        // hyper's server says `connection: close` where it will close, after the headers.
        if closing || framing == Framing::Close || !sent_whole {
            out.extend_from_slice(b"connection: close\r\n");
        }
        if framing == Framing::Chunked {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        if bodyless && !no_body_status {
            out.extend_from_slice(b"content-length: 0\r\n");
        }
        if !headers.contains(&http::header::DATE) {
            write::date(out);
        }
        out.extend_from_slice(b"\r\n");
        let rest = &ubuf[len..];
        // `clean`: the upstream sent nothing after the response.
        let clean = match framing {
            Framing::Empty => {
                client.write_all(out).await.map_err(|_| Cut)?;
                rest.is_empty()
            }
            Framing::Length(n) => {
                let take = usize::try_from(n).unwrap_or(usize::MAX).min(rest.len());
                let mut extra = rest.len() > take;
                out.extend_from_slice(&rest[..take]);
                client.write_all(out).await.map_err(|_| Cut)?;
                let mut left = n - take as u64;
                while left > 0 {
                    ubuf.clear();
                    ubuf.reserve(BODY_CHUNK);
                    match socket::read_more(&sock.tcp, ubuf).await {
                        Ok(0) | Err(_) => return Err(Cut),
                        Ok(_) => {}
                    }
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(ubuf.len());
                    extra = ubuf.len() > take;
                    client.write_all(&ubuf[..take]).await.map_err(|_| Cut)?;
                    left -= take as u64;
                }
                !extra
            }
            Framing::Chunked => {
                let mut chunks = Chunks::default();
                // Bytes are written only once the framing check passed them.
                let (n, valid) = chunks.feed(rest);
                let mut extra = rest.len() > n;
                out.extend_from_slice(&rest[..n]);
                client.write_all(out).await.map_err(|_| Cut)?;
                valid.map_err(|_| Cut)?;
                while !chunks.done() {
                    ubuf.clear();
                    ubuf.reserve(BODY_CHUNK);
                    match socket::read_more(&sock.tcp, ubuf).await {
                        Ok(0) | Err(_) => return Err(Cut),
                        Ok(_) => {}
                    }
                    let (n, valid) = chunks.feed(ubuf);
                    extra = ubuf.len() > n;
                    client.write_all(&ubuf[..n]).await.map_err(|_| Cut)?;
                    valid.map_err(|_| Cut)?;
                }
                !extra
            }
            Framing::Close => {
                out.extend_from_slice(rest);
                client.write_all(out).await.map_err(|_| Cut)?;
                loop {
                    ubuf.clear();
                    ubuf.reserve(BODY_CHUNK);
                    match socket::read_more(&sock.tcp, ubuf).await {
                        Ok(0) => break,
                        Err(_) => return Err(Cut),
                        Ok(_) => client.write_all(ubuf).await.map_err(|_| Cut)?,
                    }
                }
                false
            }
        };
        if clean && sent_whole && !close && !close_upstream {
            sock.idle_since = tokio::time::Instant::now();
            self.up.0 = Some(sock);
        }
        // A body the upstream did not wait for is still on its way from the client: the
        // connection cannot carry another request.
        if framing == Framing::Close || !sent_whole {
            return Ok(After::Close);
        }
        Ok(After::KeepAlive)
    }
}
