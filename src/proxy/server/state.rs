//! What the watchdog knows of one connection ([`State`]): its requests in progress, when it
//! last became idle, and, for a connection served by a first handler, the phase that its
//! watchdog_task and the handler hand between them (see [`super::watchdog_task`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Limits;

/// What the watchdog knows of one connection. Shared by the I/O wrapper, the service and the
/// watchdog; every field is an independent fact, so `Relaxed` orderings suffice (the
/// watchdog re-reads them whenever its timer fires), except `phase` and `stop`, see
/// [`State::end`].
#[derive(Debug)]
pub(super) struct State {
    accepted: Instant,
    /// Requests in progress (hyper's path).
    active: AtomicUsize,
    /// Whether any request head completed, or the HTTP/2 preface arrived.
    started: AtomicBool,
    /// Nanoseconds after `accepted` at which the connection last became idle.
    idle_since: AtomicU64,
    /// A first handler's connection: [`WAITING`], [`BUSY`], [`CLOSING`] or [`HANDED`].
    phase: AtomicU8,
    /// A first handler's connection was asked to finish after its current request.
    stop: AtomicBool,
    /// A request asked for an upgrade: the socket may go on as a tunnel, whose shutdown
    /// must not linger (a lingering read would take bytes the tunnel forwards).
    tunnel: AtomicBool,
    /// The index of the first HTTP/1.x head on hyper's path whose framing is ambiguous
    /// (`u64::MAX`: none), and how many heads the service was handed so far
    /// ([`super::framing`]).
    ambiguous: AtomicU64,
    handed: AtomicU64,
}

/// A first handler's connection waits for a request with nothing of it read: its watchdog_task may
/// close it for any reason.
pub(super) const WAITING: u8 = 0;
/// Part of a request head is read: the watchdog_task closes the connection when a timeout passes,
/// but a stop lets the head complete and its request be served (within `grace`), as hyper
/// does.
pub(super) const PARTIAL: u8 = 1;
/// A request head is complete and its exchange not over: the watchdog_task leaves the connection be.
pub(super) const BUSY: u8 = 2;
/// The watchdog_task is closing the connection: it serves nothing more.
pub(super) const CLOSING: u8 = 3;
/// The connection went to hyper, under [`Watch::drive`].
pub(super) const HANDED: u8 = 4;

impl State {
    /// When the connection was accepted: a TLS handshake must end by then plus
    /// `header_read_timeout`.
    pub(super) fn accepted(&self) -> Instant {
        self.accepted
    }

    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            accepted: Instant::now(),
            active: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
            phase: AtomicU8::new(WAITING),
            stop: AtomicBool::new(false),
            tunnel: AtomicBool::new(false),
            ambiguous: AtomicU64::new(u64::MAX),
            handed: AtomicU64::new(0),
        })
    }

    /// The connection's head number `index` (from 0) frames its body ambiguously.
    pub(super) fn ambiguous_head(&self, index: u64) {
        self.ambiguous.fetch_min(index, Ordering::Relaxed);
    }

    /// Called by the service for each HTTP/1.x request, in order: whether its head (or an
    /// earlier one) was ambiguous, so that it is refused rather than served. hyper reads a
    /// head through the connection's I/O before it hands the request over, so the verdict is
    /// there by then.
    pub(super) fn next_head_is_ambiguous(&self) -> bool {
        self.handed.fetch_add(1, Ordering::Relaxed) >= self.ambiguous.load(Ordering::Relaxed)
    }

    /// A request asked for an upgrade (see [`State::may_tunnel`]).
    pub(super) fn set_may_tunnel(&self) {
        self.tunnel.store(true, Ordering::Relaxed);
    }

    /// Whether the socket may be a tunnel's: its shutdown is a plain one, with no lingering
    /// close ([`super::linger`]).
    pub(super) fn may_tunnel(&self) -> bool {
        self.tunnel.load(Ordering::Relaxed)
    }

    /// Called by the service for each request; the guard ends it.
    pub(super) fn request_started(self: &Arc<Self>) -> Active {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.started.store(true, Ordering::Relaxed);
        Active(Arc::clone(self))
    }

    /// Moves the phase from `from` to `to`; `false` when it was not `from`.
    fn swap(&self, from: u8, to: u8) -> bool {
        self.phase
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::Relaxed)
            .is_ok()
    }

    /// Moves a first handler's connection from `WAITING` or `PARTIAL` to `to`: the phase it
    /// left, `None` when it was in neither (being closed, serving, or gone to hyper).
    fn leave_waiting(&self, to: u8) -> Option<u8> {
        [WAITING, PARTIAL]
            .into_iter()
            .find(|&from| self.swap(from, to))
    }

    /// A first handler's request head is complete: `false` when the watchdog_task is closing the
    /// connection (nothing may be served then).
    pub(super) fn begin(&self) -> bool {
        let begun = self.leave_waiting(BUSY).is_some();
        if begun {
            self.started.store(true, Ordering::Relaxed);
        }
        begun
    }

    /// Part of a first handler's next request head is read: `false` when the watchdog_task is
    /// closing the connection.
    pub(super) fn partial(&self) -> bool {
        self.phase.load(Ordering::Relaxed) == PARTIAL || self.swap(WAITING, PARTIAL)
    }

    /// A first handler's request is over: `true` when the connection must finish now.
    ///
    /// `phase` is written before `stop` is read, and the watchdog_task writes `stop` before it tries
    /// to move `phase` from `WAITING` (all `SeqCst`): either this sees the request to stop, or
    /// the watchdog_task sees the connection waiting and closes it. A stop is never missed.
    pub(super) fn end(&self) -> bool {
        self.mark_idle();
        self.phase.store(WAITING, Ordering::SeqCst);
        self.stop.load(Ordering::SeqCst)
    }

    /// The first handler hands the connection to hyper: `false` when the watchdog_task is closing it.
    pub(super) fn hand_over(&self) -> bool {
        self.leave_waiting(HANDED).is_some()
    }

    /// Whether a first handler's connection was asked to finish.
    pub(super) fn stop_asked(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// The watchdog_task asks the connection to finish after its current request, and closes it at
    /// once if it waits with nothing of a request read: `true` then.
    pub(super) fn stop_or_close(&self) -> bool {
        self.stop.store(true, Ordering::SeqCst);
        self.swap(WAITING, CLOSING)
    }

    /// The watchdog_task takes a connection that waits for a request head (none or part of it read)
    /// for closing: the phase it was in, `None` while a request is served (or the connection
    /// went to hyper).
    pub(super) fn try_close(&self) -> Option<u8> {
        self.leave_waiting(CLOSING)
    }

    /// The HTTP/2 preface arrived: the fresh phase is over, and the connection idle.
    pub(super) fn preface_arrived(&self) {
        self.started.store(true, Ordering::Relaxed);
        self.mark_idle();
    }

    /// The watchdog_task gives back a connection it took for closing, in the phase it took it from
    /// (`try_close`'s): `false` if it is not closing.
    pub(super) fn reopen(&self, phase: u8) -> bool {
        self.swap(CLOSING, phase)
    }

    fn mark_idle(&self) {
        let nanos = u64::try_from(self.accepted.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.idle_since.store(nanos, Ordering::Relaxed);
    }

    /// When the connection must be closed if nothing changes, and why; `None` while busy.
    pub(super) fn deadline(&self, limits: &Limits) -> Option<(Instant, Reason)> {
        if !self.started.load(Ordering::Relaxed) {
            return Some((
                self.accepted + limits.header_read_timeout,
                Reason::HeaderRead,
            ));
        }
        if self.active.load(Ordering::Relaxed) > 0 || self.phase.load(Ordering::Relaxed) == BUSY {
            return None;
        }
        let since = Duration::from_nanos(self.idle_since.load(Ordering::Relaxed));
        Some((self.accepted + since + limits.idle_timeout, Reason::Idle))
    }
}

/// One request in progress; dropping it ends the request for the watchdog.
#[derive(Debug)]
pub(super) struct Active(Arc<State>);

impl Drop for Active {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.mark_idle();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    HeaderRead,
    Idle,
}
