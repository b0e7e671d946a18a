//! The embedded default: every mark in one local SQLite database, advanced in place.
//!
//! An advance updates one row in a B-tree, O(log n) in the number of marks with every inner
//! page cached, so it costs the same with one mark or millions. Advances go to one writer
//! thread that commits all those waiting in one transaction, with one fsync of the write-ahead
//! log (group commit, `src/fence/marks/file/writer.rs`); a commit returns only once durable (`synchronous = FULL`),
//! so a reported advance survives `kill -9` and power loss. A file that is not a complete
//! marks database (SQLite's `quick_check` runs at every open) is a startup error, never an
//! empty store. Reads (an entity's mark on first use, `/marks`, `palisade marks list`) go
//! through their own connection and never wait for a commit.
//!
//! Why SQLite: its WAL mode is decades old and gives exactly the three promises with one
//! writer and readers in other processes (`palisade marks list` reads a live store). redb,
//! the pure-Rust alternative, only allows another process to read a database held by a
//! writer since 4.5 (an experimental mode until then), and a log with compaction written here
//! would repeat what SQLite's WAL does. rusqlite builds SQLite from source (`bundled`), so
//! nothing is needed on the machine.
//!
//! One process at a time: an open store holds an exclusive advisory lock on `<path>.lock` for
//! its lifetime. A second proxy, or `palisade marks set`, on the same file is refused instead
//! of silently interleaving with the other's advances. The kernel drops the lock when the
//! process dies, `kill -9` included.
//!
//! Marks files of the JSON format (`palisade-marks/1`, before 0.2) are migrated on first open:
//! at `path` itself (the JSON kept as `<path>.v1.json`), or from `marks.json` beside a missing
//! `marks.db`, under the JSON file's own lock; that `marks.json` is kept as
//! `marks.json.migrated` and replaced by a file an older palisade refuses to start on.
//!
//! The store is `<path>` and SQLite's `<path>-wal` beside it (acknowledged advances live in
//! the log until a checkpoint folds them into the file; a clean stop does): copy or remove
//! them together, or back up with `sqlite3 <path> ".backup <copy>"`. A log left without its
//! file is removed before a new database takes the path.
//!
//! Readiness is a real write: [`MarkStore::ready`] creates, writes, fsyncs and removes
//! `<path>.probe`, at most once per [`PROBE_INTERVAL`].

mod db;
mod legacy;
mod reader;
mod writer;

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{BoxFuture, MarkStore, Marks, StoreError};
use db::{db_err, io_err, Found};
use writer::{Counters, Live, Op, Writer};

/// How long a readiness probe's result is reused. `/readyz` may be polled by several
/// orchestrators at once; one fsync per second is a negligible load on the disk, one per poll
/// need not be.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// How long `/readyz` waits for a probe before reporting the store as not ready. A probe still
/// running then (a hung disk or network mount) is not abandoned: the next check waits for the
/// same one instead of piling another blocked thread on top.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Marks in a local database file (see the module docs for the writes and the lock).
#[derive(Debug, Clone)]
pub struct FileStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    dir: PathBuf,
    probe_path: PathBuf,
    // Dropping it waits for the writer to finish (checkpoint, close) and unlock; `Drop`
    // closes the reader first, so that the writer's connection is the last one.
    writer: Writer,
    reader: Arc<Mutex<Option<Connection>>>,
    reads: reader::Reader,
    counters: Arc<Counters>,
    // An async mutex: concurrent `/readyz` callers queue behind the one probe in flight and
    // then reuse its result rather than each starting a probe.
    probe: tokio::sync::Mutex<ProbeState>,
    #[cfg(test)]
    probes_started: std::sync::atomic::AtomicUsize,
    #[cfg(test)]
    gate: Arc<Mutex<()>>,
}

/// What a store has written since it opened (for benchmarks and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStats {
    /// Changes (advances and sets) committed.
    pub changes: u64,
    /// Transactions committed: each is one fsync of the log.
    pub commits: u64,
}

#[derive(Debug, Default)]
struct ProbeState {
    /// When the last probe ended, and how.
    last: Option<(Instant, Result<(), ProbeFailure>)>,
    /// A probe that outlived [`PROBE_TIMEOUT`] (or whose caller went away), still running.
    running: Option<JoinHandle<Result<(), ProbeFailure>>>,
}

/// A failed probe, kept so it can be reported again within [`PROBE_INTERVAL`] (`io::Error` is
/// not `Clone`).
#[derive(Debug, Clone)]
struct ProbeFailure {
    path: PathBuf,
    op: &'static str,
    kind: io::ErrorKind,
    message: String,
}

impl ProbeFailure {
    fn new(path: &Path, op: &'static str, e: &io::Error) -> Self {
        Self {
            path: path.to_path_buf(),
            op,
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    fn to_error(&self) -> StoreError {
        StoreError::Io {
            path: self.path.clone(),
            op: self.op,
            source: io::Error::new(self.kind, self.message.clone()),
        }
    }
}

/// The lock file that a running proxy (or `palisade marks set`) holds for the marks file `path`.
pub fn lock_path(path: &Path) -> PathBuf {
    db::sidecar(path, ".lock")
}

/// The directory `path` is in (`.` for a bare name).
fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

impl FileStore {
    /// Opens (or creates) the marks database at `path` and locks it for this process.
    ///
    /// A missing file starts empty and is created at once, which also proves the directory is
    /// writable; a JSON marks file is migrated (module docs); a database must be complete.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another process (a running proxy, `palisade marks set`)
    /// holds the file, [`StoreError::Corrupt`] or [`StoreError::CorruptDatabase`] for a file
    /// that is not a complete marks file, and [`StoreError::Io`] or [`StoreError::Database`]
    /// when it cannot be read or created.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let path = path.into();
        let dir = dir_of(&path);
        fs::create_dir_all(&dir).map_err(|e| io_err(&dir, "create directory", e))?;
        // The lock comes first: reading the file before holding it could read marks that the
        // holder changes a moment later.
        let lock = take_lock(&path)?;
        prepare(&path, &dir)?;
        let conn = db::open_writer(&path)?;
        let reader = Arc::new(Mutex::new(Some(db::open_reader(&path)?)));
        let counters = Arc::new(Counters::default());
        #[cfg(test)]
        let gate = Arc::new(Mutex::new(()));
        let writer = Writer::start(Live {
            identity: writer::identity(&path)?,
            path: path.clone(),
            dir: dir.clone(),
            conn: Some(conn),
            reader: Arc::clone(&reader),
            lock,
            counters: Arc::clone(&counters),
            #[cfg(test)]
            gate: Arc::clone(&gate),
        })?;
        let reads = reader::Reader::start(path.clone(), Arc::clone(&reader))?;
        Ok(Self {
            inner: Arc::new(Inner {
                probe_path: db::sidecar(&path, ".probe"),
                path,
                dir,
                writer,
                reads,
                reader,
                counters,
                probe: tokio::sync::Mutex::default(),
                #[cfg(test)]
                probes_started: std::sync::atomic::AtomicUsize::new(0),
                #[cfg(test)]
                gate,
            }),
        })
    }

    /// The marks file's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Changes and commits since the store opened.
    pub fn stats(&self) -> FileStats {
        FileStats {
            changes: self.inner.counters.changes.load(Relaxed),
            commits: self.inner.counters.commits.load(Relaxed),
        }
    }

    /// The stored mark of `resource` (0 when none), read now.
    ///
    /// # Errors
    /// [`StoreError::Database`] when the file cannot be read.
    pub fn mark(&self, resource: &str) -> Result<u64, StoreError> {
        self.inner
            .read(|c| db::get(c, resource))
            .map(|m| m.unwrap_or(0))
    }

    /// Sets `resource`'s mark to `value`, lower or higher; 0 removes it. Returns the previous
    /// mark (0 when there was none). Same durable write as an advance. Blocks: not for async
    /// code.
    ///
    /// Only for the operator's recovery (`palisade marks set`): lowering a mark re-admits every
    /// holder of a token at or above `value`, zombies included. The proxy itself only ever
    /// calls [`MarkStore::persist`], which never lowers.
    pub fn overwrite(&self, resource: &str, value: u64) -> Result<u64, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.inner.writer.send(Op::Set {
            resource: resource.to_owned(),
            value,
            reply,
        });
        answer
            .blocking_recv()
            .map_err(|_| self.inner.writer_gone())?
    }

    /// Advances `resource` to `mark` (never lowering) and waits: [`MarkStore::persist`]
    /// without a runtime.
    #[cfg(test)]
    fn persist_blocking(&self, resource: &str, mark: u64) -> Result<u64, StoreError> {
        self.inner
            .advance(resource.to_owned(), mark)
            .blocking_recv()
            .map_err(|_| self.inner.writer_gone())?
    }
}

/// Makes `path` a marks database: created empty when nothing is there, migrated from a JSON
/// marks file (module docs). Every step leaves `path` as it was or complete.
fn prepare(path: &Path, dir: &Path) -> Result<(), StoreError> {
    let fsync_dir = || sync_dir(dir).map_err(|e| io_err(dir, "fsync directory", e));
    match db::found(path)? {
        Found::Database => {
            // Second names of this database, or partial copies, that a crash can leave.
            for suffix in [
                ".creating",
                ".migrating",
                ".migrating.build",
                writer::RESTORE,
            ] {
                db::remove_with_sidecars(&db::sidecar(path, suffix))?;
            }
            Ok(())
        }
        Found::Other => {
            let bytes = fs::read(path).map_err(|e| io_err(path, "read", e))?;
            let marks = legacy::parse(path, &bytes)?;
            let kept = legacy::kept(path, true);
            // The JSON stays reachable under a second name, then the database replaces it
            // in one rename: `path` is the JSON or the database at every moment.
            db::remove(&kept)?;
            fs::hard_link(path, &kept).map_err(|e| io_err(&kept, "link", e))?;
            let tmp = db::sidecar(path, ".migrating");
            db::remove(&tmp)?; // left by a migration that crashed
            db::create(&tmp, dir, ".build", &marks)?;
            db::remove_sidecars(path)?;
            fs::rename(&tmp, path).map_err(|e| io_err(path, "rename", e))?;
            fsync_dir()?;
            tracing::info!(
                path = %path.display(),
                marks = marks.len(),
                kept = %kept.display(),
                "migrated the JSON marks file to a marks database in place"
            );
            Ok(())
        }
        Found::Missing => {
            // A log without its database (removed while no proxy ran) is of no use, and
            // SQLite would apply it to the new database.
            db::remove_sidecars(path)?;
            let restore = db::sidecar(path, writer::RESTORE);
            if db::found(&restore)? == Found::Database {
                // A write-back closed the old database and crashed before linking its copy.
                fs::hard_link(&restore, path).map_err(|e| io_err(path, "link", e))?;
                db::remove(&restore)?;
                fsync_dir()?;
                tracing::warn!(
                    path = %path.display(),
                    "the marks file was missing; using the copy an interrupted write-back left"
                );
                return Ok(());
            }
            match legacy::sibling(path).filter(|s| s.exists()) {
                Some(json) => {
                    // Under the JSON file's lock: an older palisade still running on it is
                    // refused, instead of advancing marks this migration would not see.
                    let _old = take_lock(&json)?;
                    let bytes = fs::read(&json).map_err(|e| io_err(&json, "read", e))?;
                    let marks = legacy::parse(&json, &bytes)?;
                    db::create(path, dir, ".migrating", &marks)?;
                    let kept = legacy::kept(&json, false);
                    db::remove(&kept)?;
                    fs::hard_link(&json, &kept).map_err(|e| io_err(&kept, "link", e))?;
                    // An older palisade started on `marks.json` again must refuse to run, not
                    // start from the marks of the day of the migration (or from none).
                    legacy::write_moved(&json, path)?;
                    fsync_dir()?;
                    tracing::info!(
                        path = %path.display(),
                        from = %json.display(),
                        kept = %kept.display(),
                        marks = marks.len(),
                        "migrated the JSON marks file to a marks database"
                    );
                    Ok(())
                }
                None => {
                    // Fine on a first start; after a moved config or an unmounted volume it
                    // means every mark starts again at 0, so say it loudly.
                    tracing::warn!(
                        path = %path.display(),
                        "marks file does not exist: creating it, every resource starts with no mark"
                    );
                    db::create(path, dir, ".creating", &Marks::new())
                }
            }
        }
    }
}

/// Takes the exclusive lock on `<path>.lock` (the directory exists).
fn take_lock(path: &Path) -> Result<File, StoreError> {
    let lock_path = lock_path(path);
    // Never truncated and never removed: removing it would let a second process lock a new
    // inode while the first still holds the old one.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| io_err(&lock_path, "open lock file", e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
            path: path.to_path_buf(),
            lock: lock_path,
        }),
        Err(TryLockError::Error(e)) => Err(io_err(&lock_path, "lock", e)),
    }
}

/// Reads the marks at `path` without locking it: `None` when there is no marks file.
///
/// A consistent snapshot even while a proxy writes it. Reads a database, a JSON marks file
/// not migrated yet, or the `marks.json` a missing `marks.db` would be migrated from.
///
/// # Errors
/// [`StoreError::Io`] or [`StoreError::Database`] when it cannot be read,
/// [`StoreError::Corrupt`] or [`StoreError::CorruptDatabase`] when it is not a marks file.
pub fn read(path: &Path) -> Result<Option<Marks>, StoreError> {
    read_list(path, "", usize::MAX)
}

/// Like [`read`], only the first `limit` marks of names starting with `prefix`.
///
/// # Errors
/// As [`read`].
pub fn read_list(path: &Path, prefix: &str, limit: usize) -> Result<Option<Marks>, StoreError> {
    let from_json = |p: &Path| -> Result<Option<Marks>, StoreError> {
        let bytes = fs::read(p).map_err(|e| io_err(p, "read", e))?;
        let marks = legacy::parse(p, &bytes)?;
        Ok(Some(
            marks
                .into_iter()
                .filter(|(n, _)| n.starts_with(prefix))
                .take(limit)
                .collect(),
        ))
    };
    match db::found(path)? {
        Found::Database => {
            let conn = db::open_reader(path)?;
            db::list(&conn, prefix, limit)
                .map(Some)
                .map_err(db_err(path, "read"))
        }
        Found::Other => from_json(path),
        Found::Missing => match legacy::sibling(path).filter(|s| s.exists()) {
            Some(json) => from_json(&json),
            None => Ok(None),
        },
    }
}

/// fsyncs a directory, making a create, rename or remove in it durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

impl Inner {
    fn advance(&self, resource: String, mark: u64) -> oneshot::Receiver<Result<u64, StoreError>> {
        let (reply, answer) = oneshot::channel();
        self.writer.send(Op::Advance {
            resource,
            mark,
            reply,
        });
        answer
    }

    fn writer_gone(&self) -> StoreError {
        io_err(
            &self.path,
            "write",
            io::Error::other("the marks writer thread has stopped"),
        )
    }

    /// Runs `f` on the read connection.
    fn read<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        let conn = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        let conn = conn.as_ref().ok_or_else(|| writer::lost(&self.path))?;
        f(conn).map_err(db_err(&self.path, "read"))
    }

    /// Runs `f` on the read connection, on the reading thread.
    fn read_async<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let inner = Arc::clone(self);
        Box::pin(async move { inner.reads.read(f).await })
    }

    /// One readiness probe: the same system calls as an advance (create, write, fsync, a
    /// directory change, fsync of the directory), on a file of its own.
    fn probe(&self) -> Result<(), ProbeFailure> {
        #[cfg(test)]
        self.probes_started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = &self.probe_path;
        let fail = |op| move |e: io::Error| ProbeFailure::new(p, op, &e);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(p)
            .map_err(fail("probe create"))?;
        f.write_all(b"palisade readiness probe\n")
            .map_err(fail("probe write"))?;
        f.sync_all().map_err(fail("probe fsync"))?;
        drop(f);
        fs::remove_file(p).map_err(fail("probe remove"))?;
        sync_dir(&self.dir).map_err(|e| ProbeFailure::new(&self.dir, "probe fsync directory", &e))
    }

    async fn ready(self: Arc<Self>) -> Result<(), StoreError> {
        let mut state = self.probe.lock().await;
        if let Some((at, result)) = &state.last {
            if at.elapsed() < PROBE_INTERVAL {
                return result.clone().map_err(|f| f.to_error());
            }
        }
        // Kept in the state while awaited, so a caller that goes away (or times out) leaves
        // the probe for the next caller to wait on instead of starting a second one.
        let running = state.running.get_or_insert_with(|| {
            let inner = Arc::clone(&self);
            tokio::task::spawn_blocking(move || inner.probe())
        });
        let result = match tokio::time::timeout(PROBE_TIMEOUT, running).await {
            Ok(joined) => {
                state.running = None;
                joined.map_err(StoreError::TaskLost)?
            }
            Err(_) => {
                // Cached like any failure: callers queued behind this one answer at once.
                state.last = Some((
                    Instant::now(),
                    Err(ProbeFailure {
                        path: self.probe_path.clone(),
                        op: "probe",
                        kind: io::ErrorKind::TimedOut,
                        message: format!("no answer within {PROBE_TIMEOUT:?}"),
                    }),
                ));
                return Err(StoreError::Timeout(PROBE_TIMEOUT));
            }
        };
        state.last = Some((Instant::now(), result.clone()));
        result.map_err(|f| f.to_error())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Before the writer (a field, dropped after this): its close then checkpoints.
        self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl MarkStore for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
        self.inner.read_async(|c| db::list(c, "", usize::MAX))
    }

    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        // Queued at once: the writer commits it even if the caller goes away.
        let answer = self.inner.advance(resource.to_owned(), mark);
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { answer.await.map_err(|_| inner.writer_gone())? })
    }

    fn load_named<'a>(&'a self, names: &'a [String]) -> BoxFuture<'a, Result<Marks, StoreError>> {
        let names = names.to_vec();
        self.inner.read_async(move |c| db::get_many(c, &names))
    }

    fn count<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        let prefix = prefix.to_owned();
        self.inner.read_async(move |c| db::count(c, &prefix))
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Marks, StoreError>> {
        let prefix = prefix.to_owned();
        self.inner.read_async(move |c| db::list(c, &prefix, limit))
    }

    /// A real write in the marks directory (create, write, fsync, remove `<path>.probe`,
    /// fsync the directory), its result reused for
    /// [`PROBE_INTERVAL`]; it runs on the blocking pool, never on the async workers.
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(Arc::clone(&self.inner).ready())
    }
}

#[cfg(test)]
mod tests;
