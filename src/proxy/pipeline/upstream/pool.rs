//! An upstream's shared cache of idle connections: where a connection waits when its client
//! connection's own slot ([`super::http1::Affinity`]) is taken or gone.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// At most this many idle connections are kept per upstream.
const MAX_IDLE: usize = 1024;

/// The upstream's shared cache of idle connections, most recently used last: hyper's
/// connections for hyper's path, raw sockets for the HTTP/1.1 fast path.
pub(crate) struct IdlePool<T> {
    idle: Mutex<Vec<(Instant, T)>>,
    /// An idle connection older than this is closed rather than reused (`idle_timeout_ms`).
    pub(crate) timeout: Duration,
}

impl<T> IdlePool<T> {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            timeout,
        }
    }

    /// Keeps `c`, idle since `since`, unless the pool is full or `c` idled too long.
    pub(crate) fn put(&self, since: Instant, c: T) {
        let now = Instant::now();
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        idle.retain(|(since, _)| now.duration_since(*since) < self.timeout);
        if idle.len() < MAX_IDLE && now.duration_since(since) < self.timeout {
            idle.push((since, c));
        }
    }

    /// Whether a connection idle since `since` may still be used (`idle_timeout_ms`).
    pub(crate) fn fresh(&self, since: Instant) -> bool {
        since.elapsed() < self.timeout
    }

    /// The most recently used connection that has not idled too long.
    pub(crate) fn take(&self) -> Option<T> {
        let now = Instant::now();
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some((since, c)) = idle.pop() {
            if now.duration_since(since) < self.timeout {
                return Some(c);
            }
        }
        None
    }
}
