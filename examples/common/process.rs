//! Owners as "processes": each runs on its own OS thread with its own single-threaded tokio
//! runtime, so freezing one (a GC pause, `kill -STOP`, a suspended VM) is blocking its thread.
//! Its session's keepalive lives on that runtime and stops with it, exactly as in a frozen
//! process: the lease expires in the store, the next owner takes over, and when the thread
//! is thawed the owner carries on from where it stopped, still believing it owns the lock.
//!
//! The coordination store is `MemoryProvider` (etcd's model in-process) on the main
//! runtime. Its lease reaper runs on the runtime that granted the store's first lease, so
//! the main runtime must grant one (start the next owner's session) before any owner
//! freezes; otherwise nothing would ever expire.

use std::future::Future;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

/// Lease TTL of every session in the examples (the smallest the store allows).
pub(crate) const TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the resource's fence is disabled (`PALISADE_EXAMPLE_UNFENCED=1`): how
/// tests/examples/main.rs shows that the fence is what refuses the zombie.
pub(crate) fn unfenced() -> bool {
    std::env::var_os("PALISADE_EXAMPLE_UNFENCED").is_some_and(|v| v == "1")
}

/// Handed to a process's body: how it freezes itself.
pub(crate) struct Freezer {
    frozen: Option<oneshot::Sender<()>>,
    thaw: mpsc::Receiver<()>,
}

impl Freezer {
    /// Blocks this process's thread, runtime and keepalive included, until it is thawed.
    pub(crate) fn freeze(&mut self) {
        if let Some(frozen) = self.frozen.take() {
            let _ = frozen.send(());
        }
        let _ = self.thaw.recv();
    }
}

/// A process started by [`spawn`].
pub(crate) struct Process<T> {
    frozen: Option<oneshot::Receiver<()>>,
    thaw: mpsc::Sender<()>,
    thread: JoinHandle<T>,
}

/// Starts `body` as a process named `name`.
pub(crate) fn spawn<F, Fut, T>(name: &str, body: F) -> Process<T>
where
    F: FnOnce(Freezer) -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let (frozen_tx, frozen_rx) = oneshot::channel();
    let (thaw_tx, thaw_rx) = mpsc::channel();
    let freezer = Freezer {
        frozen: Some(frozen_tx),
        thaw: thaw_rx,
    };
    let thread = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(body(freezer))
        })
        .expect("a thread");
    Process {
        frozen: Some(frozen_rx),
        thaw: thaw_tx,
        thread,
    }
}

impl<T: Send + 'static> Process<T> {
    /// Waits until the process has frozen; `false` if it ended without freezing.
    pub(crate) async fn frozen(&mut self) -> bool {
        match self.frozen.take() {
            Some(rx) => rx.await.is_ok(),
            None => true,
        }
    }

    /// Lets it run again.
    pub(crate) fn thaw(&self) {
        let _ = self.thaw.send(());
    }

    /// Thaws it and waits for its body to return.
    pub(crate) async fn join(self) -> T {
        self.thaw();
        let thread = self.thread;
        let joined = tokio::task::spawn_blocking(move || thread.join())
            .await
            .expect("the joining task runs");
        // A panic in the process is the example's failure: pass it on.
        joined.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}
