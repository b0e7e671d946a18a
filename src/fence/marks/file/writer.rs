//! The store's one writer: a thread that owns the write connection and commits advances in
//! groups.
//!
//! Advances queue on a channel. The thread takes every advance waiting (up to
//! [`MAX_GROUP`]) into one transaction and commits it with one fsync of the log, then answers
//! each. While it waits for that fsync, the next advances queue, so under load one fsync
//! serves as many advances as arrived during the last one (group commit), and an idle store
//! answers a lone advance after a single fsync.
//!
//! Before each commit the thread checks that the path still names the file it has open. A
//! file removed while open (an `rm -rf` of the data directory) would otherwise take writes
//! that vanish at the next start: the thread writes the database it still has open back to
//! the path once the directory exists again, and refuses advances until then. A path that
//! names another file now is never overwritten: advances fail until a restart.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::oneshot;

use super::super::StoreError;
use super::db::{self, db_err, io_err};

/// The most advances one transaction takes; more wait for the next.
pub(super) const MAX_GROUP: usize = 4096;

/// A change for the writer, answered with the resulting or previous mark.
pub(super) enum Op {
    /// Raise to at least `mark`; answered with the stored mark afterwards.
    Advance {
        resource: String,
        mark: u64,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    /// Set to `value` (0 removes); answered with the previous mark.
    Set {
        resource: String,
        value: u64,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
}

/// Commits and advances so far: commits are fsyncs of the log (checkpoints, one per ~4 MiB
/// of log, add two more).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) commits: AtomicU64,
    pub(super) changes: AtomicU64,
}

/// The writing thread's state.
pub(super) struct Live {
    pub(super) path: PathBuf,
    pub(super) dir: PathBuf,
    /// `None` once a write-back closed it and could not open the restored file: every
    /// commit is refused until a restart.
    pub(super) conn: Option<Connection>,
    /// The read connection the store's reads use; replaced with this one's file.
    pub(super) reader: Arc<Mutex<Option<Connection>>>,
    /// `(device, inode)` of the file the connections have open.
    pub(super) identity: (u64, u64),
    /// The exclusive lock on `<path>.lock`, released when the thread ends.
    pub(super) lock: File,
    pub(super) counters: Arc<Counters>,
    /// Held by a test to keep the writer from committing while advances queue.
    #[cfg(test)]
    pub(super) gate: Arc<Mutex<()>>,
}

/// The handle: sends changes, and on drop lets the thread finish the queue and waits for it,
/// so the lock is free again when the store is gone.
pub(super) struct Writer {
    tx: Option<mpsc::Sender<Op>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer").finish_non_exhaustive()
    }
}

impl Writer {
    pub(super) fn start(live: Live) -> Result<Self, StoreError> {
        let (tx, rx) = mpsc::channel();
        let path = live.path.clone();
        let thread = std::thread::Builder::new()
            .name("palisade-marks".to_owned())
            .spawn(move || run(live, &rx))
            .map_err(|e| io_err(&path, "start writer thread", e))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `op`. Fails only once the thread is gone, which its answer channel also tells.
    pub(super) fn send(&self, op: Op) {
        if let Some(tx) = &self.tx {
            // A send error drops `op` and with it the reply sender: the caller sees that.
            let _ = tx.send(op);
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut live: Live, rx: &mpsc::Receiver<Op>) {
    live.serve(rx);
    // The store is gone (its reader closed first): fold the log into the file, so that the
    // file alone holds every mark and SQLite removes `-wal` when this last connection closes.
    if let Some(conn) = &live.conn {
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())) {
            tracing::warn!(path = %live.path.display(), error = %e, "marks checkpoint at close failed");
        }
    }
}

impl Live {
    fn serve(&mut self, rx: &mpsc::Receiver<Op>) {
        while let Ok(first) = rx.recv() {
            let mut group = Vec::with_capacity(8);
            group.push(first);
            group.extend(rx.try_iter().take(MAX_GROUP - 1));
            match self.commit(&group) {
                Ok(results) => {
                    for (op, result) in group.into_iter().zip(results) {
                        op.answer(Ok(result));
                    }
                }
                Err(e) if group.len() == 1 => {
                    if let Some(op) = group.pop() {
                        op.answer(Err(e));
                    }
                }
                Err(e) => {
                    let shared = Arc::new(e);
                    for op in group {
                        op.answer(Err(StoreError::Shared(Arc::clone(&shared))));
                    }
                }
            }
        }
    }
}

impl Op {
    fn answer(self, result: Result<u64, StoreError>) {
        let (Op::Advance { reply, .. } | Op::Set { reply, .. }) = self;
        let _ = reply.send(result);
    }
}

impl Live {
    /// One transaction for the whole group, committed durably: every result, or one error
    /// for all (nothing of the group written).
    fn commit(&mut self, group: &[Op]) -> Result<Vec<u64>, StoreError> {
        #[cfg(test)]
        let gate = Arc::clone(&self.gate);
        #[cfg(test)]
        let _gate = gate.lock().unwrap_or_else(|e| e.into_inner());
        self.check_file()?;
        let path = &self.path;
        let conn = self.conn.as_mut().ok_or_else(|| lost(path))?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err(path, "begin"))?;
        let mut results = Vec::with_capacity(group.len());
        for op in group {
            results.push(
                match op {
                    Op::Advance { resource, mark, .. } => db::advance(&tx, resource, *mark),
                    Op::Set {
                        resource, value, ..
                    } => db::set(&tx, resource, *value),
                }
                .map_err(db_err(path, "write"))?,
            );
        }
        tx.commit().map_err(db_err(path, "commit"))?;
        self.counters.commits.fetch_add(1, Relaxed);
        self.counters.changes.fetch_add(group.len() as u64, Relaxed);
        Ok(results)
    }

    /// The path still names the open file, or it was written back to it.
    fn check_file(&mut self) -> Result<(), StoreError> {
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.identity => Ok(()),
            Ok(_) => Err(io_err(
                &self.path,
                "check",
                std::io::Error::other(
                    "another file replaced the marks file while palisade had it open; \
                     advances are refused until palisade is restarted on the file it should use",
                ),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.write_back(),
            Err(e) => Err(io_err(&self.path, "check", e)),
        }
    }

    /// The file was removed while open; the open database still holds every mark. Copies it
    /// aside, closes both connections (their `-wal` and `-shm` are named after the path and
    /// would be read as the new file's), removes those, links the copy into place and opens
    /// it. A failure after the close leaves the store refusing advances until a restart,
    /// which finds the copy at `<path>.restore` if it was not linked yet.
    fn write_back(&mut self) -> Result<(), StoreError> {
        let Some(conn) = &self.conn else {
            return Err(lost(&self.path));
        };
        if let Err(e) = std::fs::metadata(&self.dir) {
            return Err(io_err(&self.dir, "check directory", e));
        }
        tracing::warn!(
            path = %self.path.display(),
            "the marks file was removed while open: writing the open database back to it"
        );
        // Our lock's file may be gone with the directory: lock the one at the path now.
        let held = self.lock.metadata().map(|m| (m.dev(), m.ino())).ok();
        let at_path = identity(&super::lock_path(&self.path)).ok();
        let lock = if held.is_some() && held == at_path {
            None
        } else {
            Some(super::take_lock(&self.path)?)
        };
        let tmp = db::sidecar(&self.path, RESTORE);
        db::copy_into(conn, &tmp)?;
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        *reader = None;
        self.conn = None;
        if let Some(lock) = lock {
            self.lock = lock;
        }
        db::remove_sidecars(&self.path)?;
        std::fs::hard_link(&tmp, &self.path).map_err(|e| io_err(&self.path, "link", e))?;
        std::fs::remove_file(&tmp).map_err(|e| io_err(&tmp, "remove", e))?;
        super::sync_dir(&self.dir).map_err(|e| io_err(&self.dir, "fsync directory", e))?;
        self.identity = identity(&self.path)?;
        self.conn = Some(db::open_writer(&self.path)?);
        *reader = Some(db::open_reader(&self.path)?);
        Ok(())
    }
}

/// The suffix of the copy a write-back links into place.
pub(super) const RESTORE: &str = ".restore";

/// The error of a store whose database could not be opened again after a write-back.
pub(super) fn lost(path: &Path) -> StoreError {
    io_err(
        path,
        "reopen",
        std::io::Error::other(
            "the marks database could not be opened again after it was written back; \
             advances are refused until palisade is restarted",
        ),
    )
}

/// `(device, inode)` of `path`.
pub(super) fn identity(path: &Path) -> Result<(u64, u64), StoreError> {
    let m = std::fs::metadata(path).map_err(|e| io_err(path, "stat", e))?;
    Ok((m.dev(), m.ino()))
}
