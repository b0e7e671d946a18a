//! The layer's bodies: the request body the inner service reads and the response body it
//! returns, each holding half of the request's drain ticket (see [`crate::fence::drain`]).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};

use crate::fence::drain::Ticket;
use crate::fence::flight::{poll_fenced, BodyError as BoxError, Flight};

pin_project_lite::pin_project! {
    /// The request body an inner service reads behind the fence. It fails with [`Aborted`] if
    /// the request is aborted by a newer owner's drain, so the handler never sees the end of a
    /// zombie's body.
    pub struct FenceRequestBody<B> {
        #[pin]
        inner: B,
        flight: Option<Flight>,
    }
}

impl<B> FenceRequestBody<B> {
    pub(super) fn new(inner: B, ticket: Option<Ticket>) -> Self {
        Self {
            inner,
            flight: Flight::of(ticket),
        }
    }
}

impl<B> std::fmt::Debug for FenceRequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceRequestBody").finish_non_exhaustive()
    }
}

impl<B> Body for FenceRequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        poll_fenced(this.inner, this.flight, cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// The response of a fenced service: the inner service's body (the request counts as in
    /// flight until it ends), or palisade's rejection.
    pub struct FenceResponseBody<B> {
        #[pin]
        body: Either<B, Full<Bytes>>,
        flight: Option<Flight>,
    }
}

impl<B> FenceResponseBody<B> {
    pub(super) fn inner(body: B, ticket: Option<Ticket>) -> Self {
        Self {
            body: Either::Left(body),
            flight: Flight::of(ticket),
        }
    }

    pub(super) fn rejected(body: Full<Bytes>) -> Self {
        Self {
            body: Either::Right(body),
            flight: None,
        }
    }
}

impl<B> std::fmt::Debug for FenceResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceResponseBody").finish_non_exhaustive()
    }
}

impl<B> Body for FenceResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        poll_fenced(this.body, this.flight, cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
