//! The access log (`[access_log]`): one line per request, refusals included, as JSON or
//! `key=value` text, to stderr or to a file reopened on SIGUSR1 (for logrotate).
//!
//! Off unless configured. When on, a request formats its line into a buffer of its thread's
//! own and appends it to the writer's shared buffer (module `writer`): no allocation, no I/O
//! and no waiting on the request path. What the writer could not keep up with is dropped and
//! counted, never waited for.
//!
//! Metrics: `palisade_access_log_lines_total` (written),
//! `palisade_access_log_dropped_lines_total{reason="full"|"write_error"}` and
//! `palisade_access_log_write_errors_total` (failed writes and reopens).

mod format;
mod writer;

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::SystemTime;

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

pub(crate) use format::rfc3339_millis;
pub(crate) use format::Line;

use self::writer::{Shared, Sink};
use crate::proxy::config::{AccessLogSettings, AccessLogTarget};

/// Counters of every access log of one process (registered once; a reload that changes the
/// access log keeps counting in the same series).
#[derive(Debug, Clone)]
struct AccessLogMetrics {
    lines: IntCounter,
    dropped_full: IntCounter,
    dropped_write_error: IntCounter,
    write_errors: IntCounter,
}

/// Writer threads of logs that are no longer in use, still flushing their last lines.
type Retired = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// Every access log of one process: they share their metrics, and shutdown waits for the
/// writers of logs that a reload replaced as well as the one in force.
#[derive(Debug, Clone)]
pub(crate) struct AccessLogs {
    metrics: AccessLogMetrics,
    retired: Retired,
}

impl AccessLogs {
    /// Registers the access log's metric families in `registry`.
    ///
    /// # Errors
    /// Fails only if a family with one of these names is already registered there.
    pub(crate) fn new(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            metrics: AccessLogMetrics::new(registry)?,
            retired: Retired::default(),
        })
    }

    /// Opens the target (a file is created if missing) and starts its writer thread.
    ///
    /// # Errors
    /// [`AccessLogError`] when the file cannot be opened or the thread cannot start.
    pub(crate) fn open(
        &self,
        settings: &AccessLogSettings,
    ) -> Result<Arc<AccessLog>, AccessLogError> {
        let sink = Sink::open(&settings.target).map_err(|source| AccessLogError::Open {
            path: match &settings.target {
                AccessLogTarget::File(p) => p.clone(),
                AccessLogTarget::Stderr => "-".into(),
            },
            source,
        })?;
        let shared = Arc::new(Shared::new(self.metrics.clone()));
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("palisade-access-log".to_owned())
            .spawn(move || writer::run(&s, sink))
            .map_err(AccessLogError::Spawn)?;
        Ok(Arc::new(AccessLog {
            settings: settings.clone(),
            shared,
            thread: Mutex::new(Some(thread)),
            retired: Arc::clone(&self.retired),
        }))
    }

    /// Waits until the writers of logs no longer in use have written their last lines.
    pub(crate) async fn wait_retired(&self) {
        let threads =
            std::mem::take(&mut *self.retired.lock().unwrap_or_else(PoisonError::into_inner));
        if threads.is_empty() {
            return;
        }
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }
}

impl AccessLogMetrics {
    fn new(registry: &Registry) -> prometheus::Result<Self> {
        let lines = IntCounter::new(
            "palisade_access_log_lines_total",
            "Access log lines written.",
        )?;
        let dropped = IntCounterVec::new(
            Opts::new(
                "palisade_access_log_dropped_lines_total",
                "Access log lines lost: the writer fell behind (full) or a write failed.",
            ),
            &["reason"],
        )?;
        let write_errors = IntCounter::new(
            "palisade_access_log_write_errors_total",
            "Access log writes and reopens that failed.",
        )?;
        registry.register(Box::new(lines.clone()))?;
        registry.register(Box::new(dropped.clone()))?;
        registry.register(Box::new(write_errors.clone()))?;
        Ok(Self {
            lines,
            dropped_full: dropped.with_label_values(&["full"]),
            dropped_write_error: dropped.with_label_values(&["write_error"]),
            write_errors,
        })
    }
}

/// Why an access log could not be started.
#[derive(Debug, thiserror::Error)]
pub enum AccessLogError {
    /// The file could not be opened for appending.
    #[error("cannot open the access log {}: {source}", path.display())]
    Open {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The writer thread could not be started.
    #[error("cannot start the access log writer: {0}")]
    Spawn(#[source] std::io::Error),
}

/// A running access log: the shared buffer and its writer thread. Dropping the last handle
/// makes the thread write what is buffered and stop (without waiting for it);
/// [`AccessLog::close`] does the same and waits.
pub(crate) struct AccessLog {
    settings: AccessLogSettings,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    retired: Retired,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// Each thread formats into its own buffer, reused from line to line.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(512));
}

impl AccessLog {
    /// The settings it was opened with (a reload that keeps them keeps this log).
    pub(crate) fn settings(&self) -> &AccessLogSettings {
        &self.settings
    }

    /// Formats `line` and queues it for the writer. Never blocks on I/O: when the writer is
    /// too far behind, the line is dropped and counted.
    pub(crate) fn record(&self, line: &Line<'_>) {
        let format = self.settings.format;
        SCRATCH.with(|scratch| {
            // A re-entrant call (none today) would find the buffer taken: it gets a fresh one.
            let mut own = Vec::new();
            let mut guard = scratch.try_borrow_mut();
            let buf = guard.as_deref_mut().unwrap_or(&mut own);
            buf.clear();
            line.write(format, SystemTime::now(), buf);
            self.shared.push(buf);
        });
    }

    /// Asks the writer to reopen its file (SIGUSR1, after logrotate renamed it); lines
    /// buffered before go to the old file. No effect on stderr.
    pub(crate) fn reopen(&self) {
        self.shared.reopen();
    }

    /// Writes what is buffered and stops the writer, waiting for it (shutdown).
    pub(crate) async fn close(&self) {
        self.shared.close();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.shared.close();
        // Not joined here: the last handle may go with a request's task, which must not wait
        // for a write. Shutdown waits for it ([`AccessLogs::wait_retired`]).
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            self.retired
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(t);
        }
    }
}
