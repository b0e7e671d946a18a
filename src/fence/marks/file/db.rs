//! The marks database: one SQLite file in WAL mode, one row per resource.
//!
//! `marks(resource TEXT PRIMARY KEY, mark INTEGER)`, a B-tree keyed by the name, so a read or
//! an advance costs O(log n) page reads, all cached, whatever the number of marks. A mark is
//! a `u64` stored as the `i64` with the same bits (tokens above 2^63 - 1 read as negative in
//! the `sqlite3` shell; palisade reads them back exactly). `meta(key, value)` holds the
//! format name, checked on every open.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags, OptionalExtension, ToSql};

use super::super::{Marks, StoreError};

/// The value of `meta.format` in a marks database.
pub(super) const FORMAT: &str = "palisade-marks/2";

/// The first bytes of every SQLite database file.
const MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Page cache of each connection, in KiB (SQLite's negative `cache_size`): several times the
/// inner pages of a 10^6-mark tree (about 40 pages of 4 KiB), bounded whatever the file's
/// size; leaves come from the kernel's page cache.
const CACHE_KIB: i64 = 2 * 1024;

/// What a marks path holds.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// Nothing: no file.
    Missing,
    /// A SQLite database (a marks database, or corrupt: opening it tells).
    Database,
    /// Anything else: a marks file of the JSON format (`palisade-marks/1`), or garbage.
    Other,
}

/// Looks at the first bytes of `path`.
pub(super) fn found(path: &Path) -> Result<Found, StoreError> {
    let mut head = [0u8; 16];
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Found::Missing),
        Err(e) => return Err(io_err(path, "read", e)),
    };
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path, "read", e)),
        }
    }
    Ok(if n == head.len() && &head == MAGIC {
        Found::Database
    } else {
        Found::Other
    })
}

pub(super) fn io_err(path: &Path, op: &'static str, source: io::Error) -> StoreError {
    StoreError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// A SQLite failure on `path`: corruption is [`StoreError::CorruptDatabase`], never a
/// retryable I/O error.
pub(super) fn db_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl Fn(rusqlite::Error) -> StoreError + 'a {
    move |source| {
        use rusqlite::ErrorCode::{DatabaseCorrupt, NotADatabase};
        match source.sqlite_error_code() {
            Some(DatabaseCorrupt | NotADatabase) => StoreError::CorruptDatabase {
                path: path.to_path_buf(),
                problem: source.to_string(),
            },
            _ => StoreError::Database {
                path: path.to_path_buf(),
                op,
                source: Box::new(source),
            },
        }
    }
}

fn corrupt(path: &Path, problem: impl Into<String>) -> StoreError {
    StoreError::CorruptDatabase {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Writes a new marks database holding `marks` at `path` through `<path>.<suffix>`: built
/// aside, fsynced, then linked into place (never over an existing file) and the directory
/// fsynced. A crash at any point leaves `path` as it was.
pub(super) fn create(
    path: &Path,
    dir: &Path,
    suffix: &str,
    marks: &Marks,
) -> Result<(), StoreError> {
    let tmp = sidecar(path, suffix);
    remove_with_sidecars(&tmp)?;
    {
        let mut conn = Connection::open(&tmp).map_err(db_err(&tmp, "create"))?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(db_err(&tmp, "create"))?;
        let tx = conn.transaction().map_err(db_err(&tmp, "create"))?;
        tx.execute_batch(SCHEMA).map_err(db_err(&tmp, "create"))?;
        tx.execute(
            "INSERT INTO meta (key, value) VALUES ('format', ?1)",
            [FORMAT],
        )
        .map_err(db_err(&tmp, "create"))?;
        {
            let mut put = tx
                .prepare("INSERT INTO marks (resource, mark) VALUES (?1, ?2)")
                .map_err(db_err(&tmp, "create"))?;
            for (resource, mark) in marks {
                put.execute((resource, Stored(*mark)))
                    .map_err(db_err(&tmp, "write"))?;
            }
        }
        tx.commit().map_err(db_err(&tmp, "commit"))?;
        conn.close().map_err(|(_, e)| db_err(&tmp, "close")(e))?;
    }
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err(&tmp, "fsync", e))?;
    fs::hard_link(&tmp, path).map_err(|e| io_err(path, "link", e))?;
    fs::remove_file(&tmp).map_err(|e| io_err(&tmp, "remove", e))?;
    super::sync_dir(dir).map_err(|e| io_err(dir, "fsync directory", e))
}

/// Removes `path` and SQLite's files beside it, where they exist.
pub(super) fn remove_with_sidecars(path: &Path) -> Result<(), StoreError> {
    remove(path)?;
    remove_sidecars(path)
}

/// Removes SQLite's `-wal`, `-shm` and `-journal` files of `path`, where they exist: before a
/// new database takes the path, since SQLite would apply a log left there to it.
pub(super) fn remove_sidecars(path: &Path) -> Result<(), StoreError> {
    for suffix in ["-wal", "-shm", "-journal"] {
        remove(&sidecar(path, suffix))?;
    }
    Ok(())
}

/// Removes `path` if it exists.
pub(super) fn remove(path: &Path) -> Result<(), StoreError> {
    {
        let p = path;
        match fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(p, "remove", e)),
        }
    }
    Ok(())
}

/// `<path><suffix>`.
pub(super) fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    p.into()
}

const SCHEMA: &str = "
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
    CREATE TABLE marks (resource TEXT PRIMARY KEY, mark INTEGER NOT NULL) WITHOUT ROWID;
";

/// Opens the database at `path` for the one writer: WAL, a durable commit (`synchronous =
/// FULL`: the log is fsynced before a commit returns), its format checked and its pages
/// verified (`PRAGMA quick_check`), so a damaged file is a startup error.
pub(super) fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    // Checked on a read-only connection first: a damaged file is left exactly as it was.
    {
        let conn = open_reader(path)?;
        let problems: Vec<String> = conn
            .prepare("PRAGMA quick_check")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
            .map_err(db_err(path, "check"))?;
        if problems != ["ok"] {
            return Err(corrupt(path, problems.join("; ")));
        }
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(db_err(path, "open"))?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(db_err(path, "open"))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Database {
            path: path.to_path_buf(),
            op: "open",
            source: Box::new(rusqlite::Error::InvalidParameterName(format!(
                "journal_mode is {mode}, WAL could not be set"
            ))),
        });
    }
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(db_err(path, "open"))?;
    conn.pragma_update(None, "cache_size", -CACHE_KIB)
        .map_err(db_err(path, "open"))?;
    check(path, &conn)?;
    Ok(conn)
}

/// Opens the database at `path` for reading only (the writer may be another process).
pub(super) fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(db_err(path, "open"))?;
    conn.pragma_update(None, "cache_size", -CACHE_KIB)
        .map_err(db_err(path, "open"))?;
    check(path, &conn)?;
    Ok(conn)
}

/// The file is a marks database of the format this build writes.
fn check(path: &Path, conn: &Connection) -> Result<(), StoreError> {
    let format: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = 'format'", [], |r| {
            r.get(0)
        })
        .optional()
        .map_err(|e| match e {
            rusqlite::Error::SqliteFailure(_, Some(ref m)) if m.starts_with("no such table") => {
                corrupt(path, "a SQLite database without palisade's tables")
            }
            e => db_err(path, "read")(e),
        })?;
    match format.as_deref() {
        Some(FORMAT) => Ok(()),
        Some(other) => Err(corrupt(
            path,
            format!("unknown format {other:?}, expected {FORMAT:?}"),
        )),
        None => Err(corrupt(path, "no format recorded")),
    }
}

/// A mark as SQLite holds it: the `i64` with the same bits.
pub(super) struct Stored(pub(super) u64);

impl ToSql for Stored {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.0.cast_signed()))
    }
}

fn mark_at(row: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<u64> {
    Ok(row.get::<_, i64>(i)?.cast_unsigned())
}

/// `text` bound as SQLite text, raw bytes (not necessarily UTF-8) included.
struct Text<'a>(&'a [u8]);

impl ToSql for Text<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.0)))
    }
}

/// The smallest byte string above every string starting with `prefix` (none for ""): the
/// last byte of UTF-8 text is never 0xFF, so adding one to it cannot overflow.
fn prefix_end(prefix: &str) -> Option<Vec<u8>> {
    let mut end = prefix.as_bytes().to_vec();
    let last = end.last_mut()?;
    *last += 1;
    Some(end)
}

/// The stored mark of `resource`.
pub(super) fn get(conn: &Connection, resource: &str) -> rusqlite::Result<Option<u64>> {
    conn.prepare_cached("SELECT mark FROM marks WHERE resource = ?1")?
        .query_row([resource], |r| mark_at(r, 0))
        .optional()
}

/// The stored marks of those of `names` that have one.
pub(super) fn get_many(conn: &Connection, names: &[String]) -> rusqlite::Result<Marks> {
    let mut out = Marks::new();
    for n in names {
        if let Some(m) = get(conn, n)? {
            out.insert(n.clone(), m);
        }
    }
    Ok(out)
}

/// At most `limit` marks of names starting with `prefix`, in name order.
pub(super) fn list(conn: &Connection, prefix: &str, limit: usize) -> rusqlite::Result<Marks> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let row = |r: &rusqlite::Row<'_>| Ok((r.get::<_, String>(0)?, mark_at(r, 1)?));
    match prefix_end(prefix) {
        None => conn
            .prepare_cached("SELECT resource, mark FROM marks ORDER BY resource LIMIT ?1")?
            .query_map([limit], row)?
            .collect(),
        Some(end) => conn
            .prepare_cached(
                "SELECT resource, mark FROM marks WHERE resource >= ?1 AND resource < ?2 \
                 ORDER BY resource LIMIT ?3",
            )?
            .query_map((prefix, Text(&end), limit), row)?
            .collect(),
    }
}

/// How many marks there are of names starting with `prefix`.
pub(super) fn count(conn: &Connection, prefix: &str) -> rusqlite::Result<u64> {
    let n: i64 = match prefix_end(prefix) {
        None => conn.query_row("SELECT count(*) FROM marks", [], |r| r.get(0))?,
        Some(end) => conn
            .prepare_cached("SELECT count(*) FROM marks WHERE resource >= ?1 AND resource < ?2")?
            .query_row((prefix, Text(&end)), |r| r.get(0))?,
    };
    Ok(n.cast_unsigned())
}

/// Raises `resource`'s mark to `mark` unless the stored one is at least as high; the stored
/// mark afterwards.
pub(super) fn advance(conn: &Connection, resource: &str, mark: u64) -> rusqlite::Result<u64> {
    match get(conn, resource)? {
        Some(m) if m >= mark => Ok(m),
        _ => {
            put(conn, resource, mark)?;
            Ok(mark)
        }
    }
}

/// Sets `resource`'s mark to `value` (0 removes it); the previous mark (0 when none).
pub(super) fn set(conn: &Connection, resource: &str, value: u64) -> rusqlite::Result<u64> {
    let old = get(conn, resource)?.unwrap_or(0);
    if value == 0 {
        conn.prepare_cached("DELETE FROM marks WHERE resource = ?1")?
            .execute([resource])?;
    } else {
        put(conn, resource, value)?;
    }
    Ok(old)
}

fn put(conn: &Connection, resource: &str, mark: u64) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO marks (resource, mark) VALUES (?1, ?2) \
         ON CONFLICT (resource) DO UPDATE SET mark = excluded.mark",
    )?
    .execute((resource, Stored(mark)))?;
    Ok(())
}

/// Copies the whole database as `conn` sees it into the new file `to` (`VACUUM INTO`), then
/// fsyncs it.
pub(super) fn copy_into(conn: &Connection, to: &Path) -> Result<(), StoreError> {
    remove_with_sidecars(to)?;
    let target = to
        .to_str()
        .ok_or_else(|| io_err(to, "copy", io::Error::other("the path is not valid UTF-8")))?;
    conn.execute("VACUUM INTO ?1", [target])
        .map_err(db_err(to, "copy"))?;
    OpenOptions::new()
        .read(true)
        .open(to)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err(to, "fsync", e))
}
