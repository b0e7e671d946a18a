//! The fast path's upstream sockets: one per client connection, kept between its requests,
//! and the upstream's shared idle cache for sockets whose client connection ended.
//!
//! As in [`super::http1`], a request goes client -> guard -> upstream -> client inside
//! the client connection's task, with no pool lock and no channel on the common path; here the
//! fast path speaks HTTP/1.1 on the socket itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::dial::{DialError, Dialer};
use super::pool::IdlePool;
use super::socket;
use super::tls::UpIo;

/// An upstream socket and the idle cache it goes back to.
pub(crate) struct UpSock {
    pub(crate) tcp: TcpStream,
    pub(crate) pool: Arc<IdlePool<TcpStream>>,
    /// Taken from a cache or kept from an earlier request (not newly dialed).
    pub(crate) reused: bool,
    /// When its last exchange ended: a socket idle longer than the upstream's
    /// `idle_timeout_ms` is closed, not reused, wherever it waited (as on hyper's path).
    pub(crate) idle_since: Instant,
}

impl UpSock {
    /// Gives a socket whose last exchange ended cleanly back to its upstream's cache.
    pub(crate) fn release(self) {
        self.pool.put(self.idle_since, self.tcp);
    }
}

/// Why no socket could be had.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpError {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error("the fast path dialed a TLS upstream")]
    NotPlain,
}

/// A socket to the upstream of `pool`: `kept` (the client connection's own) if it belongs to
/// that upstream and is still open, else a cached one, else a new one.
pub(crate) async fn checkout(
    kept: Option<UpSock>,
    pool: &Arc<IdlePool<TcpStream>>,
    dialer: &Dialer,
    timeout: Duration,
) -> Result<UpSock, UpError> {
    if let Some(k) = kept {
        if Arc::ptr_eq(&k.pool, pool) {
            // Idle too long (closed when dropped here), or closed by the upstream.
            if pool.fresh(k.idle_since) && open(&k.tcp) {
                return Ok(k);
            }
        } else {
            k.release(); // another upstream's: back to its own cache
        }
    }
    while let Some(tcp) = pool.take() {
        if open(&tcp) {
            return Ok(UpSock {
                tcp,
                pool: Arc::clone(pool),
                reused: true,
                idle_since: Instant::now(),
            });
        }
    }
    dial(pool, dialer, timeout).await
}

/// A new socket through the upstream's dialer (round robin, ejection, health).
pub(crate) async fn dial(
    pool: &Arc<IdlePool<TcpStream>>,
    dialer: &Dialer,
    timeout: Duration,
) -> Result<UpSock, UpError> {
    match dialer.connect(timeout).await? {
        UpIo::Plain(tcp) => Ok(UpSock {
            tcp: tcp.into_stream(),
            pool: Arc::clone(pool),
            reused: false,
            idle_since: Instant::now(),
        }),
        UpIo::Tls(_) => Err(UpError::NotPlain),
    }
}

/// Whether an idle socket is still open with nothing to read, asked of the kernel: an
/// upstream that closed it (FIN or RST) or sent bytes nobody asked for must not get a request.
fn open(tcp: &TcpStream) -> bool {
    socket::idle_and_open(tcp)
}
