//! palisade's own answers on the fast path to requests it did not relay an upstream answer
//! for: refused before they were sent, or failed on the way. Whether the connection can carry
//! the next request depends on whether the request was taken off it whole.

use tokio::io::AsyncWriteExt;

use super::exchange::BODY_CHUNK;
use super::shared::Logged;
use super::{write, After, ClientConn};

impl ClientConn {
    /// Skips the body of a request answered without sending it upstream; `false` when it is
    /// not all here. A small rest already in the socket is read first, as hyper's larger reads
    /// would have it in its buffer: whether a refused request keeps its connection does not
    /// depend on where the client's bytes fell between two reads.
    pub(super) fn skip_unsent(&mut self, body: u64) -> bool {
        let mut here = (self.buf.len() - self.start) as u64;
        while here < body && body - here <= BODY_CHUNK as u64 {
            self.buf
                .reserve(usize::try_from(body - here).unwrap_or(BODY_CHUNK));
            match self.client.try_read_buf(&mut self.buf) {
                Ok(n) if n > 0 => here += n as u64,
                _ => break,
            }
        }
        if body > here {
            return false;
        }
        self.start += usize::try_from(body).unwrap_or(usize::MAX);
        true
    }

    /// Writes the response in `out` for a request none of whose body went upstream (and
    /// whose body [`ClientConn::skip_unsent`] skipped unless `closing`).
    pub(super) async fn answer_unsent(&mut self, closing: bool) -> After {
        if self.client.write_all(&self.out).await.is_err() || closing {
            return After::Close;
        }
        After::KeepAlive
    }

    /// Writes palisade's answer to a request whose exchange failed. `keep`: the whole request
    /// was taken from the client (it had no body, or its body went out whole), so the
    /// connection can carry the next one, as on hyper's path; otherwise part of its body may
    /// still be on its way, and the connection is closed.
    pub(super) async fn answer_failed(
        &mut self,
        refused: http::Response<http_body_util::Full<bytes::Bytes>>,
        head_request: bool,
        logged: Option<Logged<'_>>,
        keep: bool,
    ) -> After {
        let status = refused.status();
        let closing = !keep || self.activity.stopping();
        self.out.clear();
        write::refusal(&mut self.out, refused, head_request, closing);
        let written = self.client.write_all(&self.out).await.is_ok();
        if let Some(l) = logged {
            l.answered(status);
        }
        if written && !closing {
            After::KeepAlive
        } else {
            After::Close
        }
    }
}
