//! The access log's buffer and its writer thread.
//!
//! Requests append finished lines to one shared buffer under a mutex held for a copy of a
//! few hundred bytes; they never wait for I/O. A thread of its own (not a runtime task: a
//! write to a full pipe or a stalled disk would block a runtime worker, and with
//! `workers = 1` the whole proxy) swaps the buffer out and writes it:
//! every [`FLUSH_EVERY`], as soon as [`FLUSH_AT`] bytes are waiting, on a reopen and at close.
//! When the writer falls behind and [`MAX_BUFFERED`] bytes are waiting, new lines are dropped
//! and counted instead of stalling requests or growing without bound.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use prometheus::IntCounter;

use super::AccessLogMetrics;
use crate::proxy::config::AccessLogTarget;

/// Lines wait at most this long before they are written.
pub(super) const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// The writer is woken early when this many bytes are waiting.
pub(super) const FLUSH_AT: usize = 64 * 1024;
/// Past this many bytes waiting, lines are dropped (`reason="full"`).
pub(super) const MAX_BUFFERED: usize = 8 * 1024 * 1024;

#[derive(Default)]
struct State {
    buf: Vec<u8>,
    lines: u64,
    reopen: bool,
    closing: bool,
}

/// What requests and the writer thread share.
pub(super) struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    metrics: AccessLogMetrics,
}

impl Shared {
    pub(super) fn new(metrics: AccessLogMetrics) -> Self {
        Self {
            state: Mutex::default(),
            wake: Condvar::new(),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues one finished line; never blocks on I/O.
    pub(super) fn push(&self, line: &[u8]) {
        let mut s = self.lock();
        let before = s.buf.len();
        if before + line.len() > MAX_BUFFERED || s.closing {
            drop(s);
            self.metrics.dropped_full.inc();
            return;
        }
        s.buf.extend_from_slice(line);
        s.lines += 1;
        drop(s);
        // Only the line that crosses the threshold wakes the writer: one wake-up per
        // FLUSH_AT bytes under load, none at all at low rates (the timer flushes those).
        if before < FLUSH_AT && before + line.len() >= FLUSH_AT {
            self.wake.notify_one();
        }
    }

    /// Asks the writer to reopen its file after writing what is buffered.
    pub(super) fn reopen(&self) {
        self.lock().reopen = true;
        self.wake.notify_one();
    }

    /// Asks the writer to write what is buffered and stop.
    pub(super) fn close(&self) {
        self.lock().closing = true;
        self.wake.notify_one();
    }
}

/// Where the writer writes.
pub(super) enum Sink {
    Stderr,
    File { path: PathBuf, file: File },
}

impl Sink {
    /// Opens `target` (a file is created if missing and appended to).
    pub(super) fn open(target: &AccessLogTarget) -> std::io::Result<Self> {
        Ok(match target {
            AccessLogTarget::Stderr => Sink::Stderr,
            AccessLogTarget::File(path) => Sink::File {
                file: open_append(path)?,
                path: path.clone(),
            },
        })
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Stderr => std::io::stderr().lock().write_all(bytes),
            Sink::File { file, .. } => file.write_all(bytes),
        }
    }

    /// After a rename by logrotate: the same path, a new file. A file that cannot be opened
    /// leaves the old one in use (its lines are not lost, only misplaced).
    fn reopen(&mut self, errors: &IntCounter) {
        let Sink::File { path, file } = self else {
            return;
        };
        match open_append(path) {
            Ok(f) => {
                *file = f;
                tracing::info!(path = %path.display(), "access log reopened");
            }
            Err(e) => {
                errors.inc();
                tracing::error!(path = %path.display(), error = %e, "cannot reopen the access log; still writing to the old file");
            }
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The writer thread's loop: runs until [`Shared::close`].
pub(super) fn run(shared: &Shared, mut sink: Sink) {
    let m = &shared.metrics;
    let mut spare: Vec<u8> = Vec::with_capacity(FLUSH_AT * 2);
    let mut failing = false;
    loop {
        let (reopen, closing, lines) = {
            let mut s = shared.lock();
            let deadline = Instant::now() + FLUSH_EVERY;
            while s.buf.len() < FLUSH_AT && !s.reopen && !s.closing {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                s = shared
                    .wake
                    .wait_timeout(s, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            // The two buffers trade places: requests fill one while this thread writes the
            // other, and neither is reallocated once grown.
            std::mem::swap(&mut s.buf, &mut spare);
            (
                std::mem::take(&mut s.reopen),
                s.closing,
                std::mem::take(&mut s.lines),
            )
        };
        if !spare.is_empty() {
            match sink.write_all(&spare) {
                Ok(()) => {
                    m.lines.inc_by(lines);
                    if failing {
                        failing = false;
                        tracing::info!("access log writes succeed again");
                    }
                }
                Err(e) => {
                    m.write_errors.inc();
                    m.dropped_write_error.inc_by(lines);
                    // Once per run of failures: a full disk must not flood the log too.
                    if !failing {
                        failing = true;
                        tracing::error!(error = %e, lines, "cannot write the access log; dropping lines");
                    }
                }
            }
            spare.clear();
        }
        if reopen {
            sink.reopen(&m.write_errors);
        }
        if closing {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn metrics() -> AccessLogMetrics {
        AccessLogMetrics::new(&prometheus::Registry::new()).unwrap()
    }

    #[test]
    fn lines_past_the_bound_are_dropped_and_counted_never_queued() {
        let m = metrics();
        let shared = Shared::new(m.clone());
        let line = [b'x'; 1000];
        let fit = MAX_BUFFERED / line.len();
        for _ in 0..fit + 10 {
            shared.push(&line);
        }
        assert_eq!(m.dropped_full.get(), 10);
        assert_eq!(shared.lock().buf.len(), fit * line.len());
        assert_eq!(shared.lock().lines, fit as u64);
    }

    #[test]
    fn the_writer_writes_every_line_in_order_and_stops_on_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.log");
        let m = metrics();
        let shared = Arc::new(Shared::new(m.clone()));
        let sink = Sink::open(&AccessLogTarget::File(path.clone())).unwrap();
        let s = Arc::clone(&shared);
        let writer = std::thread::spawn(move || run(&s, sink));
        for i in 0..10_000 {
            shared.push(format!("line {i}\n").as_bytes());
        }
        shared.close();
        writer.join().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let want: String = (0..10_000).map(|i| format!("line {i}\n")).collect();
        assert!(text == want, "lines lost or out of order");
        assert_eq!(m.lines.get(), 10_000);
        assert_eq!(m.dropped_full.get(), 0);
    }
}
