//! A gate for futures a task rarely hears from: they are polled only after they woke the task.
//!
//! Why: a connection's task waits on its sockets and, beside them, on things that nearly never
//! happen: the watchdog's timer, the server's stop signal, a drain's abort. With `select!`
//! every wake-up of the task, two or three per request, polls all of them, and each such poll
//! takes a lock (tokio's `Notify`, the watch channel) or touches a timer entry, and their
//! cache lines, for nothing. Polled through a [`Gate`], they get the gate's own waker, which
//! raises a flag and then wakes the task; the gate polls them again only when the flag is up.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// Polls the futures given to it only when one of them woke the task, or after [`Gate::open`].
#[derive(Debug, Clone)]
pub(crate) struct Gate {
    flag: Arc<Flag>,
    /// Wakes through `flag`.
    waker: Waker,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// An open gate (the first poll goes through).
    pub(crate) fn new() -> Self {
        let flag = Arc::new(Flag {
            raised: AtomicBool::new(true),
            task: Mutex::new(None),
            task_key: [AtomicUsize::new(0), AtomicUsize::new(0)],
        });
        let waker = Waker::from(Arc::clone(&flag));
        Self { flag, waker }
    }

    /// Lets the next poll through: for a future that is new or was reset, which must be polled
    /// to register its wake-up.
    pub(crate) fn open(&self) {
        self.flag.raised.store(true, Ordering::Relaxed);
    }

    /// Polls `fut` if the gate is open (then closes it), with the gate's waker; `Pending`
    /// otherwise. A gate serves one task, and the futures it polls must be polled only through
    /// it.
    pub(crate) fn poll<F: Future + ?Sized>(
        &self,
        fut: Pin<&mut F>,
        cx: &mut Context<'_>,
    ) -> Poll<F::Output> {
        self.flag.register(cx.waker());
        // Acquire pairs with the Release in `wake_by_ref`: what the waking side did before
        // waking is seen by the poll below.
        if !self.flag.raised.swap(false, Ordering::Acquire) {
            return Poll::Pending;
        }
        fut.poll(&mut Context::from_waker(&self.waker))
    }
}

/// Raised when a future polled through the gate wakes; then wakes the task.
#[derive(Debug)]
struct Flag {
    raised: AtomicBool,
    /// The task to wake.
    task: Mutex<Option<Waker>>,
    /// Which waker `task` holds (its data and vtable pointers, what `Waker::will_wake`
    /// compares): registering the same task again, at every poll, then takes no lock.
    task_key: [AtomicUsize; 2],
}

impl Flag {
    fn register(&self, task: &Waker) {
        let key = [
            task.data() as usize,
            std::ptr::from_ref(task.vtable()) as usize,
        ];
        // Relaxed: only the polling task writes them (below), and only it reads them.
        if self.task_key[0].load(Ordering::Relaxed) == key[0]
            && self.task_key[1].load(Ordering::Relaxed) == key[1]
        {
            return;
        }
        let mut t = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *t = Some(task.clone());
        self.task_key[0].store(key[0], Ordering::Relaxed);
        self.task_key[1].store(key[1], Ordering::Relaxed);
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
