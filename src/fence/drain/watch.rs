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
//!
//! The entities of a resource template change generation with every request (each request
//! names another entity): registering per generation would cost each of them an allocation,
//! two locks and a removal. Their generations share one [`AbortBoard`] instead (one per
//! template): a connection registers there once, for every entity it serves, and an entity's
//! abort wakes every connection on the board; each checks its own request's generation and
//! sleeps again. Aborts are rare (a drain that ran out of `drain_timeout`), requests are not.

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

/// The tasks watching the aborts of many generations at once: those of the entities of one
/// resource template (see the module's doc).
#[derive(Debug, Default)]
pub struct AbortBoard(Watchers);

impl AbortBoard {
    pub(super) fn wake_all(&self) {
        self.0.wake_all();
    }
}

/// A task's registration for the abort of one generation, kept across the requests it
/// serves under that generation, or on its board (see the module's doc). Dropping it
/// unregisters.
#[derive(Debug, Default)]
pub struct AbortWatch(Option<Registration>);

#[derive(Debug)]
enum Registration {
    Generation(Registered),
    Board(OnBoard),
}

/// A registration on an [`AbortBoard`].
#[derive(Debug)]
struct OnBoard {
    board: Arc<AbortBoard>,
    key: usize,
    waker: Waker,
}

impl Drop for OnBoard {
    fn drop(&mut self) {
        self.board.0.remove(self.key);
    }
}

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
    /// A board's registration holds no generation: it stays.
    pub fn release_if_superseded(&mut self) {
        if let Some(Registration::Generation(r)) = &self.0 {
            if r.generation
                .superseded
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                self.0 = None;
            }
        }
    }

    /// Ready once `generation` is aborted. Otherwise makes sure this task is registered with
    /// `generation`, or with its board (a new registration only for a new generation or
    /// board, or a new waker).
    ///
    /// The abort stores the flag before it wakes the registered tasks, under the same lock
    /// a registration takes; a registration reads the flag again after it, and a request
    /// whose task was registered earlier reads it after that registration: either the abort
    /// wakes the task, or the task sees the flag. None is missed.
    pub fn poll(&mut self, generation: &Arc<Generation>, cx: &mut Context<'_>) -> Poll<()> {
        if generation.is_aborted() {
            return Poll::Ready(());
        }
        let current = match (&self.0, &generation.board) {
            (Some(Registration::Board(r)), Some(board)) => {
                Arc::ptr_eq(&r.board, board) && r.waker.will_wake(cx.waker())
            }
            (Some(Registration::Generation(r)), None) => {
                Arc::ptr_eq(&r.generation, generation) && r.waker.will_wake(cx.waker())
            }
            _ => false,
        };
        if current {
            return Poll::Pending;
        }
        self.0 = None; // the old registration goes first
        let waker = cx.waker().clone();
        self.0 = Some(match &generation.board {
            Some(board) => Registration::Board(OnBoard {
                key: board.0.insert(waker.clone()),
                board: Arc::clone(board),
                waker,
            }),
            None => {
                let waiters = generation.waiters();
                Registration::Generation(Registered {
                    key: waiters.watchers.insert(waker.clone()),
                    generation: Arc::clone(generation),
                    waiters: Some(waiters),
                    waker,
                })
            }
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

    use super::{AbortBoard, AbortWatch, Generation};

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
            Arc::new(Generation::new(1, true, None)),
            Arc::new(Generation::new(2, true, None)),
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

    #[test]
    fn a_board_keeps_one_registration_across_its_generations_and_every_abort_wakes_it() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let board = Arc::new(AbortBoard::default());
        let on_board = |token| Arc::new(Generation::new(token, true, Some(Arc::clone(&board))));
        let (a, b, c) = (on_board(1), on_board(7), on_board(9));
        let mut watch = AbortWatch::default();
        for g in [&a, &b, &a, &c] {
            assert_eq!(watch.poll(g, &mut cx), Poll::Pending);
        }
        let on = |b: &AbortBoard| b.0 .0.lock().unwrap().len();
        assert_eq!(
            on(&board),
            1,
            "one registration for all the board's generations"
        );
        assert!(
            [&a, &b, &c]
                .iter()
                .all(|g| g.waiters.lock().unwrap().is_none()),
            "no generation made wake-ups"
        );
        // Another entity's abort wakes the task, which finds its own generation not aborted.
        b.abort();
        assert_eq!(count.0.load(SeqCst), 1, "woken by the board");
        assert_eq!(watch.poll(&a, &mut cx), Poll::Pending);
        a.abort();
        assert_eq!(count.0.load(SeqCst), 2);
        assert_eq!(watch.poll(&a, &mut cx), Poll::Ready(()));
        // A generation without a board moves the registration off it.
        let lone = Arc::new(Generation::new(3, true, None));
        assert_eq!(watch.poll(&lone, &mut cx), Poll::Pending);
        assert_eq!(on(&board), 0);
        assert_eq!(watch.poll(&c, &mut cx), Poll::Pending);
        assert_eq!(on(&board), 1);
        drop(watch);
        assert_eq!(on(&board), 0, "dropping unregisters");
        // Registering after the abort sees it at once.
        assert_eq!(AbortWatch::default().poll(&b, &mut cx), Poll::Ready(()));
    }
}
