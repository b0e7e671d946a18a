//! A client connection's place in `max_connections`, in the open-connections gauge and in the
//! shutdown's wait, held until the connection's task ends (or whatever still uses its socket
//! lets go).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

/// A client connection's place in `max_connections` and in the shutdown's wait, held by
/// whatever still uses the connection's socket after hyper let it go (a WebSocket tunnel):
/// the connection counts until the last holder drops it.
#[derive(Clone)]
pub(crate) struct ConnCount(#[allow(dead_code)] pub(super) Arc<Counting>);

impl std::fmt::Debug for ConnCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnCount").finish_non_exhaustive()
    }
}

/// One open client connection, counted (`max_connections`, the open gauge, shutdown's wait)
/// until its task ends or is dropped.
pub(super) struct Counting {
    open: Arc<AtomicUsize>,
    gauge: Option<prometheus::IntGauge>,
    _alive: mpsc::Sender<Infallible>,
}

impl Counting {
    /// The caller already counted the connection in `open`.
    pub(super) fn new(
        open: &Arc<AtomicUsize>,
        gauge: Option<prometheus::IntGauge>,
        alive: &mpsc::Sender<Infallible>,
    ) -> Self {
        if let Some(g) = &gauge {
            g.inc();
        }
        Self {
            open: Arc::clone(open),
            gauge,
            _alive: alive.clone(),
        }
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        if let Some(g) = &self.gauge {
            g.dec();
        }
    }
}
