//! The store's reads on a thread of their own: one thread and one connection, whatever the
//! number of concurrent readers (reads on tokio's blocking pool grew a thread, and its
//! allocator's memory, per concurrent first use of an entity). Reads never wait for a
//! commit: SQLite's WAL lets them see the last one.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};

use rusqlite::Connection;

use super::super::StoreError;
use super::db::db_err;

type Job = Box<dyn FnOnce(Option<&Connection>) + Send>;

/// Sends reads to the reading thread; the thread ends when this is dropped.
#[derive(Debug)]
pub(super) struct Reader {
    tx: Mutex<mpsc::Sender<Job>>,
    path: PathBuf,
}

impl Reader {
    fn failed(&self) -> StoreError {
        super::db::io_err(
            &self.path,
            "read",
            std::io::Error::other("the marks read ended without an answer"),
        )
    }

    /// Starts the thread, reading through `conn` (which a write-back may replace).
    pub(super) fn start(
        path: PathBuf,
        conn: Arc<Mutex<Option<Connection>>>,
    ) -> Result<Self, StoreError> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("palisade-marks-read".to_owned())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                    // A job that panics fails its own read (its answer is dropped), not the
                    // reads after it.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        job(conn.as_ref());
                    }));
                    if ran.is_err() {
                        tracing::error!("a marks read panicked");
                    }
                }
            })
            .map_err(|e| super::db::io_err(&path, "start reader thread", e))?;
        Ok(Self {
            tx: Mutex::new(tx),
            path,
        })
    }

    /// Runs `f` on the reading thread.
    pub(super) async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let path = self.path.clone();
        let job: Job = Box::new(move |conn| {
            let result = match conn {
                Some(c) => f(c).map_err(db_err(&path, "read")),
                None => Err(super::writer::lost(&path)),
            };
            let _ = reply.send(result);
        });
        let sent = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .is_ok();
        match sent {
            true => answer.await.unwrap_or_else(|_| Err(self.failed())),
            false => Err(self.failed()),
        }
    }
}
