//! An owner as the resources it writes see it: its token, and the way back when one of them
//! refuses that token as stale.
//!
//! A resource that refuses a token (palisade's 409 / gRPC ABORTED with `x-fencing-mark`)
//! proves that a newer owner exists. [`Owner::fenced`] turns that proof into the owner's
//! own state at once: its grant's [`LossSignal`](crate::client::session::LossSignal) fires with
//! [`Loss::Fenced`](crate::client::session::Loss::Fenced), [`Session::lead`](crate::client::session::Session)
//! cancels its work, and the grant lets go of its queue entry instead of holding what it no
//! longer owns. [`crate::client::transport`] reads refusals and calls it (its client layer does so for
//! every answer).

use std::sync::Arc;

use tokio::sync::watch;

use crate::token::FencingToken;

/// A grant's token and its fenced feedback; cheap to clone, and the same for every clone.
#[derive(Clone)]
pub struct Owner {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    token: FencingToken,
    /// The mark that refused this owner, once one did.
    fenced: watch::Sender<Option<u64>>,
    /// Lets go of what the grant holds (its queue entry), once fenced.
    let_go: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner")
            .field("name", &self.inner.name)
            .field("token", &self.inner.token)
            .field("fenced", &*self.inner.fenced.borrow())
            .finish()
    }
}

impl Owner {
    pub(crate) fn new(
        name: String,
        token: FencingToken,
        let_go: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name,
                token,
                fenced: watch::channel(None).0,
                let_go: Box::new(let_go),
            }),
        }
    }

    /// The primitive's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The token to stamp on every request.
    pub fn token(&self) -> FencingToken {
        self.inner.token
    }

    /// A resource refused this owner's token below `mark`: ownership is over. The grant's
    /// loss signal fires, `lead` cancels its work, and the grant's queue entry is let go in
    /// the background (a later `unlock`/`resign` of the grant then says
    /// [`Error::LostBeforeRelease`](crate::client::error::Error::LostBeforeRelease): ownership had
    /// ended before it). `false` (and nothing changes) when `mark` is not above the token (no
    /// newer owner is proven), or when the owner was already fenced.
    pub fn fenced(&self, mark: u64) -> bool {
        if mark <= self.inner.token.get() {
            return false;
        }
        let first = self.inner.fenced.send_if_modified(|m| {
            if m.is_some() {
                return false;
            }
            *m = Some(mark);
            true
        });
        if first {
            tracing::warn!(
                name = %self.inner.name,
                token = self.inner.token.get(),
                mark,
                "a resource refused this owner's token: a newer owner exists; ownership is lost"
            );
            (self.inner.let_go)();
        }
        first
    }

    /// The mark that fenced this owner, if one did.
    pub fn fenced_by(&self) -> Option<u64> {
        *self.inner.fenced.borrow()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Option<u64>> {
        self.inner.fenced.subscribe()
    }
}

/// Resolves with the mark once the owner followed by `rx` is fenced (never if it is not).
pub(crate) async fn fenced(rx: &mut watch::Receiver<Option<u64>>) -> u64 {
    let mark = rx.wait_for(Option::is_some).await.ok().and_then(|m| *m);
    match mark {
        Some(m) => m,
        None => std::future::pending().await,
    }
}
