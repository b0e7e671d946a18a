//! The embedded default: every mark in one local JSON file, replaced atomically on each advance.
//!
//! An advance writes the whole map to `<path>.tmp`, fsyncs it, renames it over `<path>` and
//! fsyncs the directory, so after a crash the file holds either the old or the new map, never a
//! mix, and a reported success survives power loss. A file that does not parse is a startup
//! error, never an empty map.
//!
//! One process at a time: an open store holds an exclusive advisory lock on `<path>.lock` for
//! its lifetime (a sidecar, because `<path>` itself is replaced on every write and a lock on a
//! replaced inode protects nothing). A second proxy, or `palisade marks set`, on the same file
//! is refused instead of silently overwriting the other's advances. The kernel drops the lock
//! when the process dies, `kill -9` included.
//!
//! Readiness is a real write: [`MarkStore::ready`] creates, writes, fsyncs and removes
//! `<path>.probe`, at most once per [`PROBE_INTERVAL`].

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{BoxFuture, MarkStore, Marks, StoreError};

const FORMAT: &str = "palisade-marks/1";

/// How long a readiness probe's result is reused. `/readyz` may be polled by several
/// orchestrators at once; one fsync per second is a negligible load on the disk, one per poll
/// need not be.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// How long `/readyz` waits for a probe before reporting the store as not ready. A probe still
/// running then (a hung disk or network mount) is not abandoned: the next check waits for the
/// same one instead of piling another blocked thread on top.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    format: String,
    marks: Marks,
}

/// Marks in a local file (see the module docs for the write protocol and the lock).
#[derive(Debug, Clone)]
pub struct FileStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    probe_path: PathBuf,
    // What the file holds now. Held across the write so file writes never interleave.
    marks: Mutex<Marks>,
    // Holds the exclusive lock on `<path>.lock`; closing it (drop) releases the lock.
    _lock: File,
    // An async mutex: concurrent `/readyz` callers queue behind the one probe in flight and
    // then reuse its result rather than each starting a probe.
    probe: tokio::sync::Mutex<ProbeState>,
    #[cfg(test)]
    probes_started: std::sync::atomic::AtomicUsize,
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

/// `<path><suffix>`, e.g. `marks.json` -> `marks.json.lock`.
fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    p.into()
}

/// The lock file that a running proxy (or `palisade marks set`) holds for the marks file `path`.
pub fn lock_path(path: &Path) -> PathBuf {
    sidecar(path, ".lock")
}

impl FileStore {
    /// Opens (or creates) the marks file at `path` and locks it for this process.
    ///
    /// A missing file starts empty and is created at once, which also proves the directory is
    /// writable; a file that exists must parse completely.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another process (a running proxy, `palisade marks set`)
    /// holds the file, [`StoreError::Corrupt`] for a file that is not a complete marks file,
    /// and [`StoreError::Io`] when it cannot be read or the initial write fails.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let path = path.into();
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // The lock comes first: reading the file before holding it could load a map that the
        // holder replaces a moment later.
        let lock = take_lock(&path, &dir)?;
        let marks = match fs::read(&path) {
            Ok(bytes) => parse(&path, &bytes)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Fine on a first start; after a moved config or an unmounted volume it means
                // every mark starts again at 0, so say it loudly.
                tracing::warn!(
                    path = %path.display(),
                    "marks file does not exist: creating it, every resource starts with no mark"
                );
                Marks::new()
            }
            Err(e) => return Err(io_err(&path, "read")(e)),
        };
        let inner = Inner {
            tmp: sidecar(&path, ".tmp"),
            probe_path: sidecar(&path, ".probe"),
            path,
            dir,
            marks: Mutex::new(marks),
            _lock: lock,
            probe: tokio::sync::Mutex::default(),
            #[cfg(test)]
            probes_started: std::sync::atomic::AtomicUsize::new(0),
        };
        {
            let marks = inner.marks.lock().unwrap_or_else(|e| e.into_inner());
            inner.write(&marks)?;
        }
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The marks file's path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Every mark the file holds now.
    pub fn marks(&self) -> Marks {
        self.inner
            .marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets `resource`'s mark to `value`, lower or higher; 0 removes it. Returns the previous
    /// mark (0 when there was none). Same durable write as an advance.
    ///
    /// Only for the operator's recovery (`palisade marks set`): lowering a mark re-admits every
    /// holder of a token at or above `value`, zombies included. The proxy itself only ever
    /// calls [`MarkStore::persist`], which never lowers.
    #[cfg_attr(not(feature = "proxy"), allow(dead_code))] // used by `palisade marks set`
    pub(crate) fn overwrite(&self, resource: &str, value: u64) -> Result<u64, StoreError> {
        let mut current = self.inner.marks.lock().unwrap_or_else(|e| e.into_inner());
        let old = current.get(resource).copied().unwrap_or(0);
        let mut next = current.clone();
        if value == 0 {
            next.remove(resource);
        } else {
            next.insert(resource.to_owned(), value);
        }
        self.inner.write(&next)?;
        *current = next;
        Ok(old)
    }
}

/// Creates the directory if needed and takes the exclusive lock on `<path>.lock`.
fn take_lock(path: &Path, dir: &Path) -> Result<File, StoreError> {
    fs::create_dir_all(dir).map_err(io_err(dir, "create directory"))?;
    let lock_path = lock_path(path);
    // Never truncated and never removed: removing it would let a second process lock a new
    // inode while the first still holds the old one.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(io_err(&lock_path, "open lock file"))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
            path: path.to_path_buf(),
            lock: lock_path,
        }),
        Err(TryLockError::Error(e)) => Err(io_err(&lock_path, "lock")(e)),
    }
}

/// Reads the marks file at `path` without locking it: `None` when it does not exist.
///
/// A consistent snapshot even while a proxy writes it, since every write replaces the file
/// by rename.
///
/// # Errors
/// [`StoreError::Io`] when it cannot be read, [`StoreError::Corrupt`] when it is not a
/// marks file.
pub fn read(path: &Path) -> Result<Option<Marks>, StoreError> {
    match fs::read(path) {
        Ok(bytes) => parse(path, &bytes).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, "read")(e)),
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Marks, StoreError> {
    let corrupt = |source: serde_json::Error| StoreError::Corrupt {
        path: path.to_path_buf(),
        line: source.line(),
        column: source.column(),
        source,
    };
    let on_disk: OnDisk = serde_json::from_slice(bytes).map_err(corrupt)?;
    if on_disk.format != FORMAT {
        return Err(corrupt(serde::de::Error::custom(format!(
            "unknown format {:?}, expected {FORMAT:?}",
            on_disk.format
        ))));
    }
    Ok(on_disk.marks)
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// fsyncs a directory, making a create, rename or remove in it durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

impl Inner {
    fn write(&self, marks: &Marks) -> Result<(), StoreError> {
        let doc = OnDisk {
            format: FORMAT.to_owned(),
            marks: marks.clone(),
        };
        let mut bytes = serde_json::to_vec_pretty(&doc).expect("a map of integers serializes");
        bytes.push(b'\n');
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.tmp)
            .map_err(io_err(&self.tmp, "create"))?;
        f.write_all(&bytes).map_err(io_err(&self.tmp, "write"))?;
        f.sync_all().map_err(io_err(&self.tmp, "fsync"))?;
        drop(f);
        fs::rename(&self.tmp, &self.path).map_err(io_err(&self.path, "rename"))?;
        // The rename is durable only once the directory entry is.
        sync_dir(&self.dir).map_err(io_err(&self.dir, "fsync directory"))
    }

    fn persist(&self, resource: &str, mark: u64) -> Result<u64, StoreError> {
        let mut current = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&m) = current.get(resource).filter(|&&m| m >= mark) {
            return Ok(m);
        }
        let mut next = current.clone();
        next.insert(resource.to_owned(), mark);
        self.write(&next)?;
        *current = next;
        Ok(mark)
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

impl MarkStore for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
        let marks = self.marks();
        Box::pin(async move { Ok(marks) })
    }

    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        let inner = Arc::clone(&self.inner);
        let resource = resource.to_owned();
        // spawn_blocking runs to completion even if the caller goes away, so a write is never
        // abandoned half-way and the in-memory copy always matches the file.
        let task = tokio::task::spawn_blocking(move || inner.persist(&resource, mark));
        Box::pin(async move { task.await.map_err(StoreError::TaskLost)? })
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
