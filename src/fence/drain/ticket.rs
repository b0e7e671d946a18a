//! The equal-token side of a drain: a request's [`Ticket`], the shard it counts in, and each
//! thread's cache of the shard it last entered (see the module docs of [`crate::fence::drain`] for
//! the ordering argument).

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};

use super::Generation;

/// How many shards a cohort's in-flight count is spread over.
pub(super) const SHARDS: usize = 8;

/// One shard of a cohort's count. Aligned to a cache line so that its allocation (reference
/// counts on one line, the count on the next) shares no line with another shard's.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct Shard {
    /// Weight in flight that counted in here: [`WHOLE`] per request, or [`HALF`] for each of
    /// the two halves still held of a split one. A ticket gives its weight back to the shard it
    /// took it from, so every shard stays non-negative and their sum is 0 exactly when no
    /// request is in flight.
    count: AtomicU64,
    generation: Arc<Generation>,
}

impl Shard {
    pub(super) fn new(generation: Arc<Generation>) -> Self {
        Self {
            count: AtomicU64::new(0),
            generation,
        }
    }

    /// The weight in flight (see [`requests`] for a count of requests). `SeqCst`: the
    /// advance's half of the store-buffer pattern reads these after `superseded`.
    pub(super) fn in_flight(&self) -> u64 {
        self.count.load(SeqCst)
    }
}

/// A whole request's weight in a shard's count.
const WHOLE: u64 = 2;
/// The weight of each half of a split request: splitting changes no count (and allocates
/// nothing), and the request stays counted until both halves are given back.
const HALF: u64 = 1;

/// The number of requests a summed weight stands for: a request of which one half is left
/// counts as one, two such requests in one sum as one too (an approximation of the abort
/// metric only; a drain waits for a sum of 0, which is exact).
pub(super) fn requests(weight: u64) -> u64 {
    weight.div_ceil(WHOLE)
}

/// How many cohorts' shards a thread keeps (one per resource it admits for, the oldest
/// replaced first).
const WAYS: usize = 4;

/// A thread's shard index and the shards it last entered, by drain id.
struct Cache {
    shard: usize,
    entries: [Option<(u64, Arc<Shard>)>; WAYS],
    next: usize,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache {
        shard: {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            // Relaxed: any spread of threads over shards is correct, this only spreads them.
            NEXT.fetch_add(1, Relaxed) % SHARDS
        },
        entries: Default::default(),
        next: 0,
    });
}

/// The shard this thread counts in.
pub(super) fn shard_index() -> usize {
    // A thread being torn down counts in shard 0: correct, only less spread.
    CACHE.try_with(|c| c.borrow().shard).unwrap_or(0)
}

/// A new reference to the shard this thread last cached for drain `id`.
#[inline]
pub(super) fn cached(id: u64) -> Option<Arc<Shard>> {
    CACHE
        .try_with(|c| {
            c.borrow()
                .entries
                .iter()
                .flatten()
                .find(|(i, _)| *i == id)
                .map(|(_, s)| Arc::clone(s))
        })
        .ok()
        .flatten()
}

/// Caches `shard` as this thread's shard of drain `id`.
pub(super) fn cache(id: u64, shard: &Arc<Shard>) {
    let _ = CACHE.try_with(|c| {
        let replaced = {
            let mut c = c.borrow_mut();
            let at = match c
                .entries
                .iter()
                .position(|e| e.as_ref().is_some_and(|(i, _)| *i == id))
            {
                Some(at) => at,
                None => {
                    let at = c.next;
                    c.next = (at + 1) % WAYS;
                    at
                }
            };
            c.entries[at].replace((id, Arc::clone(shard)))
        };
        // Dropped outside the borrow: it may be the last reference to an old generation.
        drop(replaced);
    });
}

/// Where a request's weight is counted: a shard of its cohort, or the generation of a
/// one-count cohort (a new reference to either: the counter outlives the request).
#[derive(Debug, Clone)]
pub(super) enum Counter {
    Shard(Arc<Shard>),
    Lone(Arc<Generation>),
}

impl Counter {
    #[inline(always)]
    fn count(&self) -> &AtomicU64 {
        match self {
            Counter::Shard(s) => &s.count,
            Counter::Lone(g) => &g.count,
        }
    }

    #[inline(always)]
    pub(super) fn generation(&self) -> &Arc<Generation> {
        match self {
            Counter::Shard(s) => &s.generation,
            Counter::Lone(g) => g,
        }
    }
}

/// Where a request's weight is counted and how much of it: a whole request's or half of one
/// ([`Ticket::split`]), told by the variant. The whole is two words with a tag written once,
/// so that a ticket is returned in registers, not through memory (with the weight as a field
/// of its own, the equal path paid a failed store-to-load forward: about 7 ns of 37 in
/// `benches/admission.rs`).
#[derive(Debug)]
enum CohortCount {
    Shard(Arc<Shard>),
    HalfShard(Arc<Shard>),
    Lone(Arc<Generation>),
    HalfLone(Arc<Generation>),
    /// Moved into the halves of a split: nothing to give back.
    Moved,
}

// Two words, as the type's docs require.
const _: () = assert!(std::mem::size_of::<CohortCount>() == 2 * std::mem::size_of::<usize>());

/// One request in flight under a generation (or one half of it: see [`Ticket::split`]): its
/// weight, given back to the counter it was taken from when dropped.
#[derive(Debug)]
pub struct Ticket(CohortCount);

impl Drop for Ticket {
    #[inline]
    fn drop(&mut self) {
        let (count, weight, generation) = match &self.0 {
            CohortCount::Shard(s) => (&s.count, WHOLE, &s.generation),
            CohortCount::HalfShard(s) => (&s.count, HALF, &s.generation),
            CohortCount::Lone(g) => (&g.count, WHOLE, g),
            CohortCount::HalfLone(g) => (&g.count, HALF, g),
            CohortCount::Moved => return,
        };
        count.fetch_sub(weight, SeqCst);
        // After the count (both `SeqCst`): a drainer whose sum missed this leave is woken.
        if generation.superseded.load(SeqCst) {
            generation.notify_changed();
        }
    }
}

impl Ticket {
    /// Counts a whole request in `counter` (`SeqCst`: the request's half of the store-buffer
    /// pattern).
    #[inline(always)]
    pub(super) fn take(counter: Counter) -> Self {
        counter.count().fetch_add(WHOLE, SeqCst);
        Ticket(match counter {
            Counter::Shard(s) => CohortCount::Shard(s),
            Counter::Lone(g) => CohortCount::Lone(g),
        })
    }

    /// The generation this ticket counts in.
    pub fn generation(&self) -> &Arc<Generation> {
        match &self.0 {
            CohortCount::Shard(s) | CohortCount::HalfShard(s) => &s.generation,
            CohortCount::Lone(g) | CohortCount::HalfLone(g) => g,
            CohortCount::Moved => unreachable!("a split ticket is consumed"),
        }
    }

    /// Two tickets for the same request, so that the request body and the response body
    /// (which end at different times, in different tasks) each hold one. The request leaves
    /// its generation when both are dropped. A whole request's weight is shared out between
    /// the halves: no allocation and no atomic count, one more reference to the counter. (A
    /// half split again adds one more half's weight while it still holds its own, so the sum
    /// cannot have reached 0: still exact for the drain.)
    #[inline]
    pub fn split(mut self) -> (Ticket, Ticket) {
        let halves = match std::mem::replace(&mut self.0, CohortCount::Moved) {
            CohortCount::Shard(s) => (
                CohortCount::HalfShard(Arc::clone(&s)),
                CohortCount::HalfShard(s),
            ),
            CohortCount::Lone(g) => (
                CohortCount::HalfLone(Arc::clone(&g)),
                CohortCount::HalfLone(g),
            ),
            CohortCount::HalfShard(s) => {
                s.count.fetch_add(HALF, SeqCst);
                (
                    CohortCount::HalfShard(Arc::clone(&s)),
                    CohortCount::HalfShard(s),
                )
            }
            CohortCount::HalfLone(g) => {
                g.count.fetch_add(HALF, SeqCst);
                (
                    CohortCount::HalfLone(Arc::clone(&g)),
                    CohortCount::HalfLone(g),
                )
            }
            CohortCount::Moved => unreachable!("a split ticket is consumed"),
        };
        (Ticket(halves.0), Ticket(halves.1))
    }

    /// A future that resolves when this ticket's generation is aborted, owned so that a body
    /// can keep it across polls.
    pub fn abort_signal(&self) -> AbortSignal {
        AbortSignal {
            generation: Arc::clone(self.generation()),
            wait: AbortWait::default(),
        }
    }
}

/// The waiting part of an abort signal, for a holder that keeps the [`Ticket`] beside it (no
/// reference of its own to the generation until it first has to wait).
#[derive(Default)]
pub struct AbortWait(Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>);

impl std::fmt::Debug for AbortWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortWait")
            .field("waiting", &self.0.is_some())
            .finish()
    }
}

impl AbortWait {
    /// Ready once `generation` is aborted; registers the waker otherwise. The waiting future
    /// is allocated on the first pending poll only, so bodies that never wait pay nothing.
    pub fn poll(&mut self, generation: &Arc<Generation>, cx: &mut Context<'_>) -> Poll<()> {
        if generation.is_aborted() {
            return Poll::Ready(());
        }
        self.0
            .get_or_insert_with(|| {
                let g = Arc::clone(generation);
                Box::pin(async move { g.aborted().await })
            })
            .as_mut()
            .poll(cx)
    }
}

/// Polled by a body that waits on its peer, so that an abort wakes it.
pub struct AbortSignal {
    generation: Arc<Generation>,
    wait: AbortWait,
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

    /// Ready once aborted; registers the waker otherwise.
    pub fn poll_aborted(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.wait.poll(&self.generation, cx)
    }
}
