//! The body of every response the server sends: it keeps its request counted as active (for
//! idle timeouts, drains of the connection and shutdown) until it ends or is dropped.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::state::Active;

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted as in progress until it ends or is
    /// dropped.
    pub(crate) struct ActiveBody<B> {
        // `None`: an empty body of the server's own (see `head::refused`).
        #[pin]
        inner: Option<B>,
        active: Option<Active>,
    }
}

impl<B> ActiveBody<B> {
    pub(super) fn new(inner: B, active: Active) -> Self {
        Self {
            inner: Some(inner),
            active: Some(active),
        }
    }

    /// An empty body for an answer the server gives itself.
    pub(super) fn empty() -> Self {
        Self {
            inner: None,
            active: None,
        }
    }
}

impl<B> std::fmt::Debug for ActiveBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveBody").finish_non_exhaustive()
    }
}

impl<B> Body for ActiveBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut() else {
            return Poll::Ready(None);
        };
        let r = inner.poll_frame(cx);
        if matches!(r, Poll::Ready(None | Some(Err(_)))) {
            *this.active = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}
