//! The marks file format before the database (`palisade-marks/1`): one JSON document holding
//! every mark, rewritten whole on each advance. Read to migrate it (on a store's first start)
//! and by `palisade marks` on files not migrated yet; never written any more.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::super::{Marks, StoreError};

const FORMAT: &str = "palisade-marks/1";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    format: String,
    marks: Marks,
}

/// The marks of a `palisade-marks/1` document; anything else (empty and truncated files
/// included) is [`StoreError::Corrupt`], never an empty map.
pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Marks, StoreError> {
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

/// Replaces the JSON marks file `json` (durably, by rename) with one that names `db`, in a
/// format no palisade reads: an older palisade started on it refuses to run, saying where
/// the marks went.
pub(super) fn write_moved(json: &Path, db: &Path) -> Result<(), StoreError> {
    use std::io::Write;
    let name = db.file_name().map_or_else(
        || db.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let doc = serde_json::json!({
        "format": format!("{FORMAT} moved to the database {name} by palisade 0.2: do not use this file"),
        "marks": {},
    });
    let tmp = super::db::sidecar(json, ".tmp");
    let io = |p: &Path, op| {
        let p = p.to_path_buf();
        move |source| StoreError::Io {
            path: p,
            op,
            source,
        }
    };
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp, "create"))?;
    f.write_all(format!("{doc}\n").as_bytes())
        .map_err(io(&tmp, "write"))?;
    f.sync_all().map_err(io(&tmp, "fsync"))?;
    std::fs::rename(&tmp, json).map_err(io(json, "rename"))
}

/// The JSON file a database at `path` replaces when the database is missing: `marks.json`
/// for `marks.db` (the default path before and after the database).
pub(super) fn sibling(path: &Path) -> Option<PathBuf> {
    (path.extension()? == "db").then(|| path.with_extension("json"))
}

/// Where a migrated JSON file is kept: `<path>.v1.json` in place, `<path>.migrated` beside
/// (the moved notice takes its name).
pub(super) fn kept(path: &Path, in_place: bool) -> PathBuf {
    super::db::sidecar(path, if in_place { ".v1.json" } else { ".migrated" })
}
