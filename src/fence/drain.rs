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
//! Each resource has a current [`Cohort`]: the requests admitted under one mark, counted in a
//! few cache-line-sized shards (a fixed resource, [`Drain::new`]) or in one count kept in the
//! generation itself (an entity of a resource template, [`Drain::single`]: a fraction of the
//! memory, for the millions of entities that are each seldom admitted by two threads at once),
//! and their [`Generation`] (the mark, a `ready` flag, and the `superseded` and `aborted`
//! signals). An equal-token request enters the current cohort and holds a [`Ticket`] until it
//! is dropped, which the proxy does once the upstream exchange is over (request body sent or
//! abandoned, response ended).
//!
//! An advance to `t` (serialized per resource, after the mark is durable) installs a new
//! cohort for `t` that is not yet ready, marks the old one superseded, publishes the mark, and
//! then waits until the old cohort's count reaches 0, at most `drain_timeout`. Then it aborts
//! what is left: the old generation's abort signal makes every body of those requests fail at
//! their next poll (so an upstream never receives the rest of a body) and their pending
//! responses end. Only then is the new generation ready: the advancing request and every
//! equal-token request that arrived meanwhile go upstream after the drain.
//!
//! # The equal-token path, and why the drainer never misses a request
//!
//! On a sharded drain, entering costs two uncontended atomic read-modify-writes and leaving two
//! more, all on cache lines of the entering thread's shard: no lock, no shared reference
//! count, no `arc-swap` load. Each thread keeps, in a thread-local cache, a strong reference to
//! its shard of the cohort it last entered. A one-count drain has no shards and skips that
//! cache: each request loads the current generation (one `arc-swap` load, no cohort in
//! between), clones it and counts in its own count; the order argument below is the same,
//! with that count in place of the shard's. A request:
//!
//! 1. clones that reference (the ticket's own, so the shard outlives the request),
//! 2. adds 1 to the shard's count (`SeqCst`),
//! 3. loads the generation's `superseded` flag (`SeqCst`): if set, it takes its count back
//!    and judges the request again against the current cohort (which is newer: stale).
//!
//! An advance stores `superseded` (`SeqCst`) and only then sums the old cohort's shards
//! (`SeqCst` loads). All four kinds of access are `SeqCst`, so they fall in one total order
//! consistent with each thread's program order. If the request's load in 3 read `false`, it
//! precedes the advance's store in that order, so its increment in 2 does too, and so does
//! every sum the advance takes afterwards: the advance counts the request and waits for its
//! ticket. Otherwise the request saw `superseded` and was never admitted under the old mark.
//! That is the store-buffer (Dekker) pattern; both sides need the store-then-load order, which
//! `SeqCst` on all four (and nothing weaker) gives. A sum of 0 is final in the same way: a
//! request counting in after it sees `superseded` and backs out.
//!
//! Leaving takes the count back (`SeqCst`) and then loads `superseded` (`SeqCst`): if set, it
//! wakes the drainer, which sums again. The drainer creates its wake-up before each sum, so a
//! leave its sum missed comes after the sum in the same total order, sees `superseded`, and
//! wakes it (tokio's `Notify::notify_waiters` reaches every `Notified` created before it).
//!
//! The cache is keyed by the drain's unique id and holds the shard of one cohort: the cohort's
//! token tells whether it is the request's own (equal), a newer one (the request is stale), or
//! an older one (the cache is refreshed from the current cohort, the slow path, which also
//! runs on a thread's first request and after every advance).

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use tokio::time::Instant;

mod ticket;
mod watch;

pub use self::ticket::{AbortSignal, AbortWait, Ticket};
use self::ticket::{Counter, Shard, SHARDS};
pub use self::watch::{AbortBoard, AbortWatch};

/// After an abort, how long the aborted requests get to notice it and end.
pub const ABORT_GRACE: Duration = Duration::from_secs(1);

/// The signals of the requests admitted under one mark, shared by their tickets.
#[derive(Debug)]
pub struct Generation {
    token: u64,
    /// The weight in flight of a one-shard cohort ([`Drain::single`]), counted here rather
    /// than in a shard of its own; 0 in a sharded cohort.
    count: AtomicU64,
    /// Set once the previous generation has drained (or was aborted).
    ready: AtomicBool,
    /// Set once a newer generation replaced this one: leaving then wakes the drainer.
    superseded: AtomicBool,
    aborted: AtomicBool,
    /// Made by the first task that has to wait on this generation and let go with the
    /// last: most generations (every idle entity's) have nobody waiting and pay 16 bytes.
    waiters: std::sync::Mutex<Option<Arc<Waiters>>>,
    /// The board a one-count drain's connections watch instead of each generation
    /// ([`AbortBoard`]): its abort wakes them too.
    board: Option<Arc<AbortBoard>>,
}

/// The wake-ups of a generation (see [`Generation::waiters`] for why a waiter that makes
/// them and a signal that finds none never miss each other).
#[derive(Debug, Default)]
struct Waiters {
    /// Wakes those waiting for `ready` and the drainer waiting for this generation to empty:
    /// one `Notify` for both, since a generation is waited on for the one (requests admitted
    /// under it, before it is ready) and then the other (after it is superseded, when it is
    /// ready), and every waiter checks its own condition again when woken.
    changed: Notify,
    abort: Notify,
    /// Tasks registered through [`AbortWatch`]: woken by the abort too.
    watchers: watch::Watchers,
}

/// A waiter's hold on a generation's wake-ups; dropping it lets them go once nobody else
/// holds them.
struct Held<'g> {
    generation: &'g Generation,
    waiters: Option<Arc<Waiters>>,
}

impl std::ops::Deref for Held<'_> {
    type Target = Waiters;
    fn deref(&self) -> &Waiters {
        self.waiters.as_deref().expect("held until dropped")
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.waiters.take() {
            self.generation.let_go(w);
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Generation {
    fn new(token: u64, ready: bool, board: Option<Arc<AbortBoard>>) -> Self {
        Self {
            token,
            count: AtomicU64::new(0),
            ready: AtomicBool::new(ready),
            superseded: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            waiters: std::sync::Mutex::new(None),
            board,
        }
    }

    /// The wake-ups, made if nobody holds them; take them before registering (a `Notified`
    /// or a watcher) and then reading the condition waited for.
    ///
    /// Why nothing is missed: a signal stores its condition (`SeqCst`) and then looks for
    /// the wake-ups under the same lock. If it found none, the waiter's lock came after the
    /// signal's, so the waiter reads the condition set. If it found them, it wakes every
    /// `Notified` made before its `notify_waiters` and every registered watcher, and a
    /// waiter that registers after that reads the condition set (both `SeqCst`, as before
    /// this lock).
    fn waiters(&self) -> Arc<Waiters> {
        Arc::clone(lock(&self.waiters).get_or_insert_with(Arc::default))
    }

    fn hold(&self) -> Held<'_> {
        Held {
            generation: self,
            waiters: Some(self.waiters()),
        }
    }

    /// Gives back what [`Generation::waiters`] returned: the wake-ups go when nobody holds
    /// them and no watcher is registered.
    fn let_go(&self, held: Arc<Waiters>) {
        let mut slot = lock(&self.waiters);
        drop(held);
        if slot
            .as_ref()
            .is_some_and(|w| Arc::strong_count(w) == 1 && w.watchers.is_empty())
        {
            *slot = None;
        }
    }

    /// The wake-ups if someone waits; call after storing the condition that wakes.
    fn signal(&self) -> Option<Arc<Waiters>> {
        lock(&self.waiters).clone()
    }

    /// Wakes whoever waits for `ready` or for this generation to empty.
    fn notify_changed(&self) {
        if let Some(w) = self.signal() {
            w.changed.notify_waiters();
            // Through `let_go`: a woken waiter may have let go meanwhile, leaving this the last.
            self.let_go(w);
        }
    }

    /// Whether this generation's requests were aborted.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(SeqCst)
    }

    /// Aborts this generation's requests: the flag, then every wake-up of its abort (its
    /// board's included).
    fn abort(&self) {
        self.aborted.store(true, SeqCst);
        if let Some(w) = self.signal() {
            w.abort.notify_waiters();
            w.watchers.wake_all();
            self.let_go(w);
        }
        if let Some(board) = &self.board {
            board.wake_all();
        }
    }

    /// Resolves once this generation's requests are aborted.
    pub async fn aborted(&self) {
        if self.is_aborted() {
            return;
        }
        let waiters = self.hold();
        loop {
            let n = waiters.abort.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_aborted() {
                return;
            }
            n.await;
        }
    }

    async fn wait_ready(&self) {
        if self.ready.load(SeqCst) {
            return;
        }
        let waiters = self.hold();
        loop {
            let n = waiters.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.ready.load(SeqCst) {
                return;
            }
            n.await;
        }
    }
}

/// The requests admitted under one mark: their [`Generation`] and their count, spread over
/// shards so that threads admitting equal tokens do not contend on one cache line, or kept
/// in the generation itself for a one-shard drain ([`Drain::single`]).
#[derive(Debug)]
pub struct Cohort {
    generation: Arc<Generation>,
    /// [`SHARDS`] of them (a power of two), or none: the count is the generation's.
    shards: Box<[Arc<Shard>]>,
}

impl Cohort {
    fn new(token: u64, ready: bool, shards: usize, board: Option<Arc<AbortBoard>>) -> Self {
        let generation = Arc::new(Generation::new(token, ready, board));
        Self {
            shards: (0..shards)
                .map(|_| Arc::new(Shard::new(Arc::clone(&generation))))
                .collect(),
            generation,
        }
    }

    /// The cohort of a one-count drain's `generation` (its count is the generation's).
    fn lone(generation: Arc<Generation>) -> Self {
        Self {
            generation,
            shards: Box::default(),
        }
    }

    /// The counter the calling thread counts in (a new reference to it).
    fn counter(&self) -> Counter {
        if self.shards.is_empty() {
            return Counter::Lone(Arc::clone(&self.generation));
        }
        let shard = &self.shards[ticket::shard_index() & (self.shards.len() - 1)];
        Counter::Shard(Arc::clone(shard))
    }

    /// The generation of these requests.
    pub fn generation(&self) -> &Arc<Generation> {
        &self.generation
    }

    /// The weight in flight ([`ticket::requests`] turns it into requests); a snapshot (see
    /// the module docs for why a zero read after `superseded` is set is final).
    fn in_flight(&self) -> u64 {
        self.generation.count.load(SeqCst) + self.shards.iter().map(|s| s.in_flight()).sum::<u64>()
    }

    /// Waits until no request of this cohort is in flight, or `deadline`; true if drained.
    async fn wait_drained(&self, deadline: Instant) -> bool {
        // Most advances find nothing in flight: they make no wake-ups.
        if self.in_flight() == 0 {
            return true;
        }
        let waiters = self.generation.hold();
        loop {
            // Created (and so reachable by `notify_waiters`) before the sum: see the module docs.
            let n = waiters.changed.notified();
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
pub struct Drain(Current);

/// The requests a drain counts now: a sharded cohort, or for a one-count drain its
/// generation itself (no cohort in between: one dependent load less per request on entities,
/// whose lines are cold, each request naming another entity).
// 16 bytes: a lone drain needs no id (it is never cached), so the id's zero tells the two
// apart.
#[derive(Debug)]
enum Current {
    Sharded {
        /// Tells this drain's entries in the threads' caches from other drains'.
        id: NonZeroU64,
        cohort: ArcSwap<Cohort>,
    },
    Lone(ArcSwap<Generation>),
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
    /// Accounting for a resource whose mark is `mark` (nothing in flight), its count spread
    /// over eight shards: for a resource many threads admit at once.
    pub fn new(mark: u64) -> Self {
        Self::with_shards(mark, SHARDS, None)
    }

    /// The same with one count, kept in the generation (no shards): a fraction of the
    /// memory, for the many entities of a resource template (each seldom admitted by two
    /// threads at the same moment). Its requests skip the threads' caches, and connections
    /// watch `board` (shared by the template's entities) for their aborts.
    pub fn single(mark: u64, board: Arc<AbortBoard>) -> Self {
        Self::with_shards(mark, 0, Some(board))
    }

    fn with_shards(mark: u64, shards: usize, board: Option<Arc<AbortBoard>>) -> Self {
        debug_assert!(shards == 0 || shards.is_power_of_two());
        // Relaxed: only uniqueness matters.
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self(if shards == 0 {
            Current::Lone(ArcSwap::from_pointee(Generation::new(mark, true, board)))
        } else {
            Current::Sharded {
                id: NonZeroU64::new(NEXT_ID.fetch_add(1, Relaxed)).expect("2^64 drains"),
                cohort: ArcSwap::from_pointee(Cohort::new(mark, true, shards, board)),
            }
        })
    }

    /// Requests admitted under the current mark and still in flight (a snapshot).
    pub fn in_flight(&self) -> u64 {
        ticket::requests(match &self.0 {
            Current::Sharded { cohort, .. } => cohort.load().in_flight(),
            Current::Lone(g) => g.load().count.load(SeqCst),
        })
    }

    /// The token of an advance waiting for older owners' requests (its generation is not
    /// ready yet), if one is: a snapshot, for the admin's status page.
    pub fn draining(&self) -> Option<u64> {
        // SeqCst like every other access of `ready`; a stale answer only shows late.
        let waiting = |g: &Generation| (!g.ready.load(SeqCst)).then_some(g.token);
        match &self.0 {
            Current::Sharded { cohort, .. } => waiting(&cohort.load().generation),
            Current::Lone(g) => waiting(&g.load()),
        }
    }

    /// Enters the current generation with `token`, which the caller found equal to the mark.
    // Always inlined, the thread's cached shard first: see `enter_counter` for why an `Entry`
    // must not be returned through memory on the hot path.
    #[inline(always)]
    pub fn enter(&self, token: u64) -> Entry {
        if let Current::Sharded { id, .. } = &self.0 {
            if let Some(shard) = ticket::cached(id.get()) {
                if let Some(entry) = Self::enter_counter(Counter::Shard(shard), token) {
                    return entry;
                }
            }
        }
        self.enter_uncached(token)
    }

    /// This thread's first request, or its cached cohort is older or superseded, or a
    /// one-count drain (never cached).
    #[cold]
    #[inline(never)]
    fn enter_uncached(&self, token: u64) -> Entry {
        let counter = match &self.0 {
            Current::Sharded { id, cohort } => {
                let counter = cohort.load().counter();
                if let Counter::Shard(shard) = &counter {
                    ticket::cache(id.get(), shard);
                }
                counter
            }
            Current::Lone(g) => Counter::Lone(g.load_full()),
        };
        // `None` here: the current cohort is older than the mark (cannot happen, cohorts are
        // installed before the mark is published) or was superseded meanwhile. Judging again
        // is always safe.
        Self::enter_counter(counter, token).unwrap_or(Entry::Retry)
    }

    /// Counts a request in `counter` (see the module docs); `None` when its cohort is older
    /// than `token` or superseded.
    // Always inlined: returned through memory, an `Entry` costs a failed store-to-load forward
    // right after the count's locked instruction (measured: about 7 ns of the path's 23).
    #[inline(always)]
    fn enter_counter(counter: Counter, token: u64) -> Option<Entry> {
        let mark = counter.generation().token;
        if mark > token {
            return Some(Entry::Stale { mark });
        }
        if mark < token {
            return None;
        }
        // The count, then `superseded`: the request's half of the store-buffer pattern.
        let counted = Ticket::take(counter);
        let g = counted.generation();
        if g.superseded.load(SeqCst) {
            return None;
        }
        if !g.ready.load(SeqCst) {
            let g = Arc::clone(g);
            drop(counted);
            return Some(Entry::NotReady(g));
        }
        Some(Entry::Entered(counted))
    }

    /// Waits until `generation` is ready (its predecessor drained).
    pub async fn wait_ready(generation: &Generation) {
        generation.wait_ready().await;
    }

    /// Installs the generation for `token` (entered once, for the advancing request) and
    /// returns it with the cohort it replaces. Call with the resource's advance lock held,
    /// after `token` is durable and before it is published.
    pub fn install(&self, token: u64) -> (Ticket, Arc<Cohort>) {
        let (counted, old) = match &self.0 {
            Current::Sharded { cohort, .. } => {
                let next = {
                    let current = cohort.load();
                    let board = current.generation.board.clone();
                    Arc::new(Cohort::new(token, false, current.shards.len(), board))
                };
                let counted = Ticket::take(next.counter());
                (counted, cohort.swap(next))
            }
            Current::Lone(g) => {
                let next = Arc::new(Generation::new(token, false, g.load().board.clone()));
                let counted = Ticket::take(Counter::Lone(Arc::clone(&next)));
                // Wrapped for `finish`, which waits on it like on any cohort.
                let old = Arc::new(Cohort::lone(g.swap(next)));
                (counted, old)
            }
        };
        // `superseded`, then the count (read by `finish`): the advance's half of the
        // store-buffer pattern.
        old.generation.superseded.store(true, SeqCst);
        (counted, old)
    }

    /// Waits for `old`'s requests for at most `timeout`, aborts the rest, and then makes the
    /// generation of `ticket` ready. Call with the advance lock still held.
    pub async fn finish(&self, ticket: &Ticket, old: &Cohort, timeout: Duration) -> Drained {
        let started = Instant::now();
        let mut aborted = 0;
        if !old.wait_drained(started + timeout).await {
            aborted = ticket::requests(old.in_flight());
            old.generation.abort();
            if !old.wait_drained(Instant::now() + ABORT_GRACE).await {
                tracing::error!(
                    left = ticket::requests(old.in_flight()),
                    "aborted requests did not end within the abort grace; going on: none of \
                     them can send more body bytes"
                );
            }
        }
        let g = ticket.generation();
        g.ready.store(true, SeqCst);
        g.notify_changed();
        Drained {
            waited: started.elapsed(),
            aborted,
        }
    }
}

#[cfg(test)]
mod tests;
