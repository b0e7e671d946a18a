//! The audit trail of operator changes to marks (`palisade marks set`).
//!
//! A lowered mark re-admits stale owners, so every change says who made it, where and when: one
//! JSON line appended to `<marks file>.audit.log` and fsynced before the change is made, so no
//! change exists without its line. The user name comes from the environment and can be
//! spoofed; the numeric uid is the kernel's.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// `<marks file>.audit.log`.
pub(crate) fn log_path(marks: &Path) -> PathBuf {
    let mut p = marks.as_os_str().to_owned();
    p.push(".audit.log");
    p.into()
}

/// Who runs this process, as far as it can tell.
#[derive(Debug, Clone)]
pub(crate) struct Who {
    /// `SUDO_USER` (the person behind `sudo`), else `USER`, else `LOGNAME`.
    pub(crate) user: Option<String>,
    /// The effective uid (owner of `/proc/self`).
    pub(crate) uid: Option<u32>,
    /// `/proc/sys/kernel/hostname`.
    pub(crate) host: Option<String>,
}

impl Who {
    /// Reads the environment and `/proc`; a part that cannot be read is `None`, never an error
    /// (the audit line is still worth writing).
    pub(crate) fn current() -> Self {
        let user = ["SUDO_USER", "USER", "LOGNAME"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
        let uid = std::fs::metadata("/proc/self").ok().map(|m| m.uid());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty());
        Self { user, uid, host }
    }
}

/// Appends `line` (one JSON object) to the audit log at `path` and fsyncs it (and, on
/// creation, its directory).
pub(crate) fn append(path: &Path, line: &serde_json::Value) -> io::Result<()> {
    let existed = path.exists();
    let mut f = OpenOptions::new().append(true).create(true).open(path)?;
    let mut bytes = serde_json::to_vec(line).expect("a JSON value serializes");
    bytes.push(b'\n');
    // One write call on an O_APPEND file: concurrent appenders cannot interleave inside it.
    f.write_all(&bytes)?;
    f.sync_all()?;
    if !existed {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        // fsync the directory: the new file's name is durable too.
        std::fs::File::open(dir).and_then(|d| d.sync_all())?;
    }
    Ok(())
}

/// `t` as RFC 3339 in UTC with milliseconds, e.g. `2026-11-30T09:59:04.123Z`.
pub(crate) fn rfc3339_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (y, m, day) = civil_from_days(secs / 86_400);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Days since 1970-01-01 -> (year, month, day) in the proleptic Gregorian calendar
/// (H. Hinnant's `civil_from_days`, for days >= 0).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z % 146_097; // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365], from March 1st
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let at = |s: u64, ms: u64| {
            rfc3339_utc(UNIX_EPOCH + Duration::from_secs(s) + Duration::from_millis(ms))
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(at(1_709_251_199, 999), "2024-02-29T23:59:59.999Z");
        assert_eq!(at(1_798_675_199, 0), "2026-12-30T23:59:59.000Z");
        assert_eq!(at(4_102_444_799, 0), "2099-12-31T23:59:59.000Z");
    }

    #[test]
    fn lines_are_appended_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = log_path(&dir.path().join("marks.json"));
        append(&path, &serde_json::json!({"n": 1})).unwrap();
        append(&path, &serde_json::json!({"n": 2})).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":2}\n"
        );
    }
}
