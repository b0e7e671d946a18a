//! In-flight tracking per mark, so that an advance can wait for (or abort) the requests that
//! older tokens still have in flight before the new owner's first request is forwarded.
//!
//! # Why
//!
//! The guard checks a token when a request arrives. Without this module a request admitted
//! under token 34 could still be streaming its body to the upstream when token 51 advances the
//! mark and is forwarded: the upstream would then apply the old owner's write after the new
//! owner's. With it, palisade's guarantee reads: once a request with token t has been
//! forwarded, no request with a token below t is still being delivered to the upstream.
//!
//! # How
//!
//! Each resource has a current [`Generation`]: the mark it was created for, a count of the
//! requests admitted under it that are still in flight, and a `ready` flag. An equal-token
//! request enters the current generation (one `SeqCst` increment on this thread's shard of
//! its count, then a check that it was not superseded); its [`Ticket`] leaves it when dropped, which the proxy does
//! once the upstream exchange is over (request body sent or abandoned, response ended).
//!
//! An advance to `t` (serialized per resource, after the mark is durable) installs a new
//! generation for `t` that is not yet ready, publishes the mark, and then waits until the old
//! generation's count reaches 0, at most `drain_timeout`. Then it aborts what is left: the
//! old generation's abort signal makes every body of those requests fail at their next poll
//! (so an upstream never receives the rest of a body) and their pending responses end. Only
//! then is the new generation ready: the advancing request and every equal-token request that
//! arrived meanwhile go upstream after the drain.
//!
//! The count-then-check-`superseded` on the request side and the set-`superseded`-then-sum
//! on the advance side are the two halves of a store-buffer (Dekker) pattern: with `SeqCst`
//! on both, either the advance sees the request's count and waits for it, or the request sees
//! that its generation was superseded and is judged again (stale). A shard read as 0 after
//! `superseded` was set stays 0 for good: a later count on it backs out at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use tokio::time::Instant;

/// After an abort, how long the aborted requests get to notice it and end.
pub const ABORT_GRACE: Duration = Duration::from_secs(1);

/// The requests admitted under one mark.
#[derive(Debug)]
pub struct Generation {
    token: u64,
    /// Requests in flight, spread over shards so that threads admitting equal tokens do not
    /// all contend on one cache line; a ticket gives its count back to the shard it took it
    /// from, so every shard stays non-negative and their sum is the number in flight.
    inflight: [Shard; SHARDS],
    /// Set once the previous generation has drained (or was aborted).
    ready: AtomicBool,
    ready_notify: Notify,
    /// Set once a newer generation replaced this one: leaving then wakes the drainer.
    superseded: AtomicBool,
    drained: Notify,
    aborted: AtomicBool,
    abort_notify: Notify,
}

impl Generation {
    fn new(token: u64, ready: bool) -> Self {
        Self {
            token,
            inflight: Default::default(),
            ready: AtomicBool::new(ready),
            ready_notify: Notify::new(),
            superseded: AtomicBool::new(false),
            drained: Notify::new(),
            aborted: AtomicBool::new(false),
            abort_notify: Notify::new(),
        }
    }

    /// How many requests are in flight (a snapshot; see the module docs for why a zero read
    /// after `superseded` is set stays zero).
    fn in_flight(&self) -> u64 {
        self.inflight.iter().map(|s| s.0.load(SeqCst)).sum()
    }

    /// Whether this generation's requests were aborted.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(SeqCst)
    }

    /// Resolves once this generation's requests are aborted.
    pub async fn aborted(&self) {
        loop {
            let n = self.abort_notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_aborted() {
                return;
            }
            n.await;
        }
    }

    async fn wait_ready(&self) {
        loop {
            let n = self.ready_notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.ready.load(SeqCst) {
                return;
            }
            n.await;
        }
    }

    /// Waits until no request of this generation is in flight, or `deadline`; true if drained.
    async fn wait_drained(&self, deadline: Instant) -> bool {
        loop {
            let n = self.drained.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }
}

/// One request in flight under a generation (or one half of it: see [`Ticket::split`]).
#[derive(Debug)]
pub struct Ticket(Hold);

#[derive(Debug)]
enum Hold {
    /// The whole request.
    Whole(Counted),
    /// One of the two halves of a request, which share its one count.
    Half(Arc<Counted>),
}

/// How many shards a generation's in-flight count is spread over.
const SHARDS: usize = 8;

/// One shard, alone on its cache line.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Shard(AtomicU64);

/// The shard this thread counts in.
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        // Relaxed: any spread of threads over shards is correct, this only spreads them.
        static SHARD: usize = NEXT.fetch_add(1, Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

/// One count in a generation's in-flight requests, given back when dropped.
#[derive(Debug)]
struct Counted {
    generation: Arc<Generation>,
    shard: usize,
}

impl Counted {
    /// Takes a count in `generation` on this thread's shard.
    fn take(generation: Arc<Generation>) -> Self {
        let shard = shard_index();
        generation.inflight[shard].0.fetch_add(1, SeqCst);
        Self { generation, shard }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let g = &self.generation;
        g.inflight[self.shard].0.fetch_sub(1, SeqCst);
        // Only a drain waits; summing the shards is for that rare case.
        if g.superseded.load(SeqCst) && g.in_flight() == 0 {
            g.drained.notify_waiters();
        }
    }
}

impl Ticket {
    fn whole(counted: Counted) -> Self {
        Ticket(Hold::Whole(counted))
    }

    /// The generation this ticket counts in.
    pub fn generation(&self) -> &Arc<Generation> {
        match &self.0 {
            Hold::Whole(c) => &c.generation,
            Hold::Half(c) => &c.generation,
        }
    }

    /// Two tickets for the same request, so that the request body and the response body
    /// (which end at different times, in different tasks) each hold one. The request still
    /// counts once (a drain's abort reports requests, not halves) and leaves its generation
    /// when both halves are dropped.
    pub fn split(self) -> (Ticket, Ticket) {
        let shared = match self.0 {
            Hold::Whole(c) => Arc::new(c),
            Hold::Half(c) => c,
        };
        (
            Ticket(Hold::Half(Arc::clone(&shared))),
            Ticket(Hold::Half(shared)),
        )
    }

    /// A future that resolves when this ticket's generation is aborted, owned so that a body
    /// can keep it across polls.
    pub fn abort_signal(&self) -> AbortSignal {
        AbortSignal {
            generation: Arc::clone(self.generation()),
            wait: None,
        }
    }
}

/// Polled by a body that waits on its peer, so that an abort wakes it.
pub struct AbortSignal {
    generation: Arc<Generation>,
    wait: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
}

impl std::fmt::Debug for AbortSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortSignal")
            .field("aborted", &self.generation.is_aborted())
            .finish()
    }
}

impl AbortSignal {
    /// Whether the abort happened; the flag alone, no registration.
    pub fn is_aborted(&self) -> bool {
        self.generation.is_aborted()
    }

    /// Ready once aborted; registers the waker otherwise. The waiting future is allocated on
    /// the first pending poll only, so bodies that never wait pay nothing.
    pub fn poll_aborted(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.generation.is_aborted() {
            return Poll::Ready(());
        }
        let g = Arc::clone(&self.generation);
        self.wait
            .get_or_insert_with(|| Box::pin(async move { g.aborted().await }))
            .as_mut()
            .poll(cx)
    }
}

/// What entering the current generation found.
#[derive(Debug)]
pub enum Entry {
    /// Admitted and counted.
    Entered(Ticket),
    /// The current generation is for a higher token: the request is stale.
    Stale {
        /// That token (the mark, or the mark about to be published).
        mark: u64,
    },
    /// The generation for this token is still draining its predecessor: wait, then retry.
    NotReady(Arc<Generation>),
    /// The generation changed under the request: judge it again.
    Retry,
}

/// Per-resource in-flight accounting.
#[derive(Debug)]
pub struct Drain {
    current: ArcSwap<Generation>,
}

/// How an advance's drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// How long the advance waited.
    pub waited: Duration,
    /// Requests still in flight when `drain_timeout` ran out (0: drained in time).
    pub aborted: u64,
}

impl Drain {
    /// Accounting for a resource whose mark is `mark` (nothing in flight).
    pub fn new(mark: u64) -> Self {
        Self {
            current: ArcSwap::from_pointee(Generation::new(mark, true)),
        }
    }

    /// Enters the current generation with `token`, which the caller found equal to the mark.
    pub fn enter(&self, token: u64) -> Entry {
        let g = self.current.load_full();
        if g.token > token {
            return Entry::Stale { mark: g.token };
        }
        if g.token < token {
            // The mark moved to `token` but the generation is not installed yet: cannot
            // happen (generations are installed before the mark is published), but judging
            // again is always safe.
            return Entry::Retry;
        }
        // The count, then `superseded`: the other half of `install`'s store-then-count.
        let counted = Counted::take(g);
        let g = &counted.generation;
        if g.superseded.load(SeqCst) {
            return Entry::Retry;
        }
        if !g.ready.load(SeqCst) {
            let g = Arc::clone(g);
            drop(counted);
            return Entry::NotReady(g);
        }
        Entry::Entered(Ticket::whole(counted))
    }

    /// Waits until `generation` is ready (its predecessor drained).
    pub async fn wait_ready(generation: &Generation) {
        generation.wait_ready().await;
    }

    /// Installs the generation for `token` (entered once, for the advancing request) and
    /// returns it with the generation it replaces. Call with the resource's advance lock held,
    /// after `token` is durable and before it is published.
    pub fn install(&self, token: u64) -> (Ticket, Arc<Generation>) {
        let next = Arc::new(Generation::new(token, false));
        let counted = Counted::take(Arc::clone(&next));
        let old = self.current.swap(next);
        // `superseded`, then the count (read by `finish`): with `enter`'s count-then-
        // `superseded`, every request either sees this flag or is counted below.
        old.superseded.store(true, SeqCst);
        (Ticket::whole(counted), old)
    }

    /// Waits for `old`'s requests for at most `timeout`, aborts the rest, and then makes the
    /// generation of `ticket` ready. Call with the advance lock still held.
    pub async fn finish(&self, ticket: &Ticket, old: &Generation, timeout: Duration) -> Drained {
        let started = Instant::now();
        let mut aborted = 0;
        if !old.wait_drained(started + timeout).await {
            aborted = old.in_flight();
            old.aborted.store(true, SeqCst);
            old.abort_notify.notify_waiters();
            if !old.wait_drained(Instant::now() + ABORT_GRACE).await {
                tracing::error!(
                    left = old.in_flight(),
                    "aborted requests did not end within the abort grace; going on: none of \
                     them can send more body bytes"
                );
            }
        }
        let g = ticket.generation();
        g.ready.store(true, SeqCst);
        g.ready_notify.notify_waiters();
        Drained {
            waited: started.elapsed(),
            aborted,
        }
    }
}

#[cfg(test)]
mod tests;
