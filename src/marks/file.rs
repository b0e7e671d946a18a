//! The embedded default: every mark in one local JSON file, replaced atomically on each advance.
//!
//! An advance writes the whole map to `<path>.tmp`, fsyncs it, renames it over `<path>` and
//! fsyncs the directory, so after a crash the file holds either the old or the new map, never a
//! mix, and a reported success survives power loss. A file that does not parse is a startup
//! error, never an empty map.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{BoxFuture, MarkStore, Marks, StoreError};

const FORMAT: &str = "palisade-marks/1";

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    format: String,
    marks: Marks,
}

/// Marks in a local file (see the module docs for the write protocol).
#[derive(Debug, Clone)]
pub struct FileStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    // What the file holds now. Held across the write so file writes never interleave.
    marks: Mutex<Marks>,
}

impl FileStore {
    /// Opens (or creates) the marks file at `path`.
    ///
    /// A missing file starts empty and is created at once, which also proves the directory is
    /// writable; a file that exists must parse completely.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for a file that is not a complete marks file, and
    /// [`StoreError::Io`] when it cannot be read or the initial write fails.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let path = path.into();
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let marks = match fs::read(&path) {
            Ok(bytes) => parse(&path, &bytes)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(&dir).map_err(io_err(&dir, "create directory"))?;
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
            path,
            tmp: tmp.into(),
            dir,
            marks: Mutex::new(marks),
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
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&self.dir, "fsync directory"))
    }

    fn persist(&self, resource: &str, mark: u64) -> Result<(), StoreError> {
        let mut current = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        if current.get(resource).is_some_and(|&m| m >= mark) {
            return Ok(());
        }
        let mut next = current.clone();
        next.insert(resource.to_owned(), mark);
        self.write(&next)?;
        *current = next;
        Ok(())
    }
}

impl MarkStore for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
        let marks = self
            .inner
            .marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Box::pin(async move { Ok(marks) })
    }

    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let inner = Arc::clone(&self.inner);
        let resource = resource.to_owned();
        // spawn_blocking runs to completion even if the caller goes away, so a write is never
        // abandoned half-way and the in-memory copy always matches the file.
        let task = tokio::task::spawn_blocking(move || inner.persist(&resource, mark));
        Box::pin(async move { task.await.map_err(StoreError::TaskLost)? })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        let dir = self.inner.dir.clone();
        Box::pin(async move {
            match tokio::fs::metadata(&dir).await {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(_) => Err(StoreError::Io {
                    path: dir,
                    op: "stat directory",
                    source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
                }),
                Err(source) => Err(StoreError::Io {
                    path: dir,
                    op: "stat directory",
                    source,
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advances_survive_reopen_and_never_go_down() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("marks.json");
        let store = FileStore::open(&path).unwrap();
        store.inner.persist("orders", 51).unwrap();
        store.inner.persist("orders", 34).unwrap();
        store.inner.persist("billing", 7).unwrap();
        let again = FileStore::open(&path).unwrap();
        let marks = again.inner.marks.lock().unwrap().clone();
        assert_eq!(marks.get("orders"), Some(&51));
        assert_eq!(marks.get("billing"), Some(&7));
    }

    #[test]
    fn truncated_or_corrupt_files_refuse_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("marks.json");
        FileStore::open(&path)
            .unwrap()
            .inner
            .persist("orders", 51)
            .unwrap();
        let full = fs::read(&path).unwrap();
        for cut in [0, 1, full.len() / 2, full.len() - 3] {
            fs::write(&path, &full[..cut]).unwrap();
            let err = FileStore::open(&path).unwrap_err();
            assert!(
                matches!(err, StoreError::Corrupt { .. }),
                "cut at {cut}: {err}"
            );
        }
        fs::write(
            &path,
            br#"{"format":"palisade-marks/1","marks":{"orders":-1}}"#,
        )
        .unwrap();
        assert!(matches!(
            FileStore::open(&path),
            Err(StoreError::Corrupt { .. })
        ));
        fs::write(&path, br#"{"format":"other","marks":{}}"#).unwrap();
        assert!(matches!(
            FileStore::open(&path),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_failed_write_keeps_the_previous_state() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("d");
        let path = sub.join("marks.json");
        let store = FileStore::open(&path).unwrap();
        store.inner.persist("orders", 5).unwrap();
        fs::remove_dir_all(&sub).unwrap();
        assert!(store.inner.persist("orders", 9).is_err());
        assert_eq!(store.inner.marks.lock().unwrap().get("orders"), Some(&5));
    }
}
