//! A connection's standing registration for the abort of the generation its requests are
//! admitted under ([`AbortWatch`]).
//!
//! Why: waiting on the generation's `Notify` costs every request a lock, an insertion into a
//! waiter list shared by all requests of the resource and a removal from it (touching the
//! neighbouring waiters: other connections' memory, cold when hundreds of connections take
//! turns). A connection that serves request after request under the same mark registers its
//! task once instead, when its first request under that mark waits, and keeps the
//! registration until a newer mark or the end of the connection; each request then only
//! reads the generation's `aborted` flag.

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use slab::Slab;

use super::{Generation, Waiters};

/// The tasks registered for one generation's abort.
#[derive(Debug, Default)]
pub(super) struct Watchers(Mutex<Slab<Waker>>);

impl Watchers {
    /// Wakes every registered task (the registrations stay: each is removed by its owner).
    /// The wakers are woken after the lock is let go: a woken task that ends at once on
    /// another thread removes its registration without waiting for the others' wake-ups.
    pub(super) fn wake_all(&self) {
        let all: Vec<Waker> = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(_, w)| w.clone())
            .collect();
        for w in all {
            w.wake();
        }
    }

    fn insert(&self, w: Waker) -> usize {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(w)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    fn remove(&self, key: usize) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .try_remove(key);
    }
}

/// A task's registration for the abort of one generation, kept across the requests it
/// serves under that generation (see the module's doc). Dropping it unregisters.
#[derive(Debug, Default)]
pub struct AbortWatch(Option<Registered>);

#[derive(Debug)]
struct Registered {
    generation: Arc<Generation>,
    /// The generation's wake-ups, held while registered (`None` only while dropping).
    waiters: Option<Arc<Waiters>>,
    key: usize,
    waker: Waker,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(w) = self.waiters.take() {
            w.watchers.remove(self.key);
            self.generation.let_go(w);
        }
    }
}

impl AbortWatch {
    /// Lets go of the registration if its generation was replaced by a newer one (whose own
    /// requests register afresh): an idle connection does not keep an old generation alive.
    pub fn release_if_superseded(&mut self) {
        if self.0.as_ref().is_some_and(|r| {
            r.generation
                .superseded
                .load(std::sync::atomic::Ordering::Relaxed)
        }) {
            self.0 = None;
        }
    }

    /// Ready once `generation` is aborted. Otherwise makes sure this task is registered with
    /// `generation` (a new registration only for a new generation or a new waker).
    ///
    /// The abort stores the flag before it wakes the registered tasks, under the same lock
    /// a registration takes; a registration reads the flag again after it: either the abort
    /// wakes the task, or the task sees the flag. None is missed.
    pub fn poll(&mut self, generation: &Arc<Generation>, cx: &mut Context<'_>) -> Poll<()> {
        if generation.is_aborted() {
            return Poll::Ready(());
        }
        let current = self.0.as_ref().is_some_and(|r| {
            Arc::ptr_eq(&r.generation, generation) && r.waker.will_wake(cx.waker())
        });
        if current {
            return Poll::Pending;
        }
        self.0 = None; // the old registration goes first
        let waiters = generation.waiters();
        let key = waiters.watchers.insert(cx.waker().clone());
        self.0 = Some(Registered {
            generation: Arc::clone(generation),
            waiters: Some(waiters),
            key,
            waker: cx.waker().clone(),
        });
        if generation.is_aborted() {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use super::{AbortWatch, Generation};

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    fn registered(g: &Generation) -> usize {
        g.waiters
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |w| w.watchers.0.lock().unwrap().len())
    }

    #[test]
    fn one_registration_per_generation_woken_by_the_abort_and_removed_when_dropped() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let (old, new) = (
            Arc::new(Generation::new(1, true)),
            Arc::new(Generation::new(2, true)),
        );
        let mut watch = AbortWatch::default();
        for _ in 0..3 {
            assert_eq!(watch.poll(&old, &mut cx), Poll::Pending);
        }
        assert_eq!(registered(&old), 1, "registered once for all its requests");
        assert_eq!(watch.poll(&new, &mut cx), Poll::Pending);
        assert_eq!(
            (registered(&old), registered(&new)),
            (0, 1),
            "moved to the new mark"
        );
        // Another waker (the task moved): registered again, the old one removed.
        let other = Waker::from(Arc::new(Count::default()));
        assert_eq!(
            watch.poll(&new, &mut Context::from_waker(&other)),
            Poll::Pending
        );
        assert_eq!(registered(&new), 1);
        assert_eq!(watch.poll(&new, &mut cx), Poll::Pending);
        new.abort();
        assert_eq!(
            count.0.load(SeqCst),
            1,
            "the abort woke the registered task"
        );
        assert_eq!(watch.poll(&new, &mut cx), Poll::Ready(()));
        drop(watch);
        assert_eq!(registered(&new), 0, "dropping unregisters");
        assert!(
            new.waiters.lock().unwrap().is_none(),
            "the wake-ups go with the last registration"
        );
        // Registering after the abort sees it at once.
        assert_eq!(AbortWatch::default().poll(&new, &mut cx), Poll::Ready(()));
    }
}
