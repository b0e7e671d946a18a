//! A waker that remembers it was used: lets a task poll some of its futures only when they
//! woke it.
//!
//! Why: a connection's task drives the connection and its watchdog (a timer and the server's
//! stop signal). With `select!` every wake-up of the task, two or three per request, polls all
//! three, although the watchdog's futures nearly never have anything to say: at hundreds of
//! connections that is a timer entry, a watch channel's lock and their cache lines touched per
//! wake-up for nothing. Polled with a [`Flag`]'s waker instead, they are polled again only
//! after they (or a fresh start) raised the flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};

/// Raised when a future polled with its waker wakes; then wakes the task.
#[derive(Debug)]
pub(super) struct Flag {
    raised: AtomicBool,
    /// The task to wake.
    task: Mutex<Option<Waker>>,
}

impl Flag {
    /// A raised flag (so that the futures are polled the first time) and its waker.
    pub(super) fn new() -> (Arc<Self>, Waker) {
        let flag = Arc::new(Self {
            raised: AtomicBool::new(true),
            task: Mutex::new(None),
        });
        let waker = Waker::from(Arc::clone(&flag));
        (flag, waker)
    }

    /// Notes the task to wake (the one polling now).
    pub(super) fn register(&self, task: &Waker) {
        let mut t = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*t {
            Some(w) if w.will_wake(task) => {}
            _ => *t = Some(task.clone()),
        }
    }

    /// Raises the flag: the futures must be polled (they are new, or were reset).
    pub(super) fn raise(&self) {
        self.raised.store(true, Ordering::Release);
    }

    /// Whether the flag was raised since the last call; lowers it.
    pub(super) fn take(&self) -> bool {
        // Acquire pairs with the Release in `wake`: what the waking side did before waking is
        // seen by the poll that follows.
        self.raised.swap(false, Ordering::Acquire)
    }
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.raised.store(true, Ordering::Release);
        let task = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(t) = task {
            t.wake();
        }
    }
}
