//! The layer's response future: a named type, so that a request admitted at once (an equal
//! token, an unguarded request) costs no allocation of its own.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;

use super::FenceResponseBody;
use crate::fence::drain::Ticket;

/// A boxed future: the rare paths only (see [`ResponseFuture`]).
pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project_lite::pin_project! {
    /// The response future of a [`Fence`](super::Fence).
    pub struct ResponseFuture<F, RB, E> {
        #[pin]
        state: State<F, RB, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, RB, E> {
        /// Admitted (or unguarded) without waiting: the inner service's future, and the half
        /// of the request's ticket that its response body will hold.
        Called {
            #[pin]
            call: F,
            ticket: Option<Ticket>,
        },
        /// Admission has to wait (an advance and its drain, a resource's first use, a shared
        /// store's confirmation), then the inner service runs; or a refusal: boxed, these are
        /// rare.
        Waiting {
            future: BoxFuture<Result<Response<FenceResponseBody<RB>>, E>>,
        },
    }
}

impl<F, RB, E> ResponseFuture<F, RB, E> {
    pub(super) fn called(call: F, ticket: Option<Ticket>) -> Self {
        Self {
            state: State::Called { call, ticket },
        }
    }

    /// A refusal, boxed: keeps the common future small (a response is large), and a refused
    /// request has just built a JSON body anyway.
    pub(super) fn refused(response: Response<FenceResponseBody<RB>>) -> Self
    where
        RB: Send + 'static,
        E: Send + 'static,
    {
        Self::waiting(Box::pin(std::future::ready(Ok(response))))
    }

    pub(super) fn waiting(future: BoxFuture<Result<Response<FenceResponseBody<RB>>, E>>) -> Self {
        Self {
            state: State::Waiting { future },
        }
    }
}

impl<F, RB, E> std::fmt::Debug for ResponseFuture<F, RB, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, RB, E> Future for ResponseFuture<F, RB, E>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<FenceResponseBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { call, ticket } => {
                let response = ready!(call.poll(cx))?;
                Poll::Ready(Ok(
                    response.map(|b| FenceResponseBody::inner(b, ticket.take()))
                ))
            }
            StateProj::Waiting { future } => future.as_mut().poll(cx),
        }
    }
}
