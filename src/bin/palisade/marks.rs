//! `palisade marks list|set`: the operator's view of stored marks and the audited way out of a
//! forged or runaway token.
//!
//! One request with token 18446744073709551615 raises a mark for good: it is persisted before
//! the request is forwarded and survives restarts, and from then on the real owner is refused.
//! `set` is the recovery. It lowers (or raises, or with 0 removes) a mark in the configured
//! store, but only
//! - with `--force`, because a lowered mark re-admits every holder of a token at or above it,
//!   stale owners (zombies) included;
//! - while no proxy holds the store, because a running proxy keeps its marks in memory and
//!   would neither see the change nor keep it (for the `file` store: the lock on
//!   `<path>.lock`, see [`palisade::fence::marks::FileStore`]);
//! - after appending who, where, when, the old and the new value to `<path>.audit.log`
//!   (fsynced, before the change) and logging the same at `warn`.
//!
//! `list` only reads: a marks file is replaced by rename on every write, so it is a consistent
//! snapshot even while a proxy runs, and it takes no lock, so it can never make a proxy that is
//! starting at that moment fail.
//!
//! With `store = "etcd"` (feature `etcd`) both work on the shared marks: `list` is one range
//! read (values that are not 8-byte marks, such as one written by `etcdctl put`, which drops
//! NUL bytes, are shown as corrupt), and `set` writes the mark and its audit record (the same
//! JSON as the file store's audit line) in one etcd transaction, under
//! `/palisade-audit<prefix>` (`etcdctl get --prefix /palisade-audit/palisade/marks/` reads
//! the trail), and logs it at `warn`. Replicas keep running: a raised mark reaches them
//! through their watch at once, but a lowered one only when each replica restarts (a
//! running proxy never lowers a mark it knows), which `set` says.

mod audit;
#[cfg(feature = "etcd")]
mod etcd;

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::SystemTime;

use palisade::proxy::config::{Config, ConfigError, MarksSettings};

use self::audit::Who;
use palisade::fence::marks::file::{self, FileStore};
use palisade::fence::marks::{Marks, StoreError};

/// Exit code for an invalid configuration, as `palisade check` uses.
const EXIT_CONFIG: u8 = 2;
/// Exit code for every other failure, refusals included.
const EXIT_FAILURE: u8 = 1;

/// `palisade marks ...`.
#[derive(Debug, Clone, clap::Subcommand)]
pub(crate) enum MarksCommand {
    /// Print stored marks (resource and value), noting resources no route guards.
    List {
        /// The TOML configuration file (its `[marks]` names the store).
        #[arg(long, short)]
        config: PathBuf,
        /// Only resources whose names start with this (e.g. `warehouse/`).
        #[arg(long, default_value = "")]
        prefix: String,
        /// At most this many, in name order (default: all).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        limit: Option<u64>,
    },
    /// Set RESOURCE's mark to VALUE, lower or higher (0 removes it). Needs --force (and, for
    /// the file store, its proxy stopped); audited.
    Set {
        /// The resource (a route's `resource`).
        resource: String,
        /// The new mark. Every token below it is refused; every token at or above it, stale
        /// ones included, is admitted again.
        value: u64,
        /// Confirm that the forged or runaway token's source is gone and the current owner's
        /// token is known (it must be >= VALUE).
        #[arg(long)]
        force: bool,
        /// The TOML configuration file (its `[marks]` names the store).
        #[arg(long, short)]
        config: PathBuf,
    },
}

/// Why a `marks` command failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CliError {
    /// The configuration is invalid (exit code 2, as `palisade check`).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `store = "memory"`: there is nothing stored outside a running proxy.
    #[error(
        "{config}: store = \"memory\" keeps marks only inside a running proxy and forgets them \
         when it exits; there are no stored marks to list or set (the running proxy shows its \
         marks at the admin endpoint /marks; restarting it clears them)"
    )]
    MemoryStore {
        /// The configuration file.
        config: PathBuf,
    },
    /// `store = "etcd"` in a binary built without the `etcd` feature.
    #[error(
        "{config}: store = \"etcd\" needs the `etcd` feature, which this palisade was built \
         without (cargo build --release --features etcd; the default build has it)"
    )]
    EtcdStore {
        /// The configuration file.
        config: PathBuf,
    },
    /// `set` without `--force`; nothing was changed.
    #[error(
        "refusing to set {resource} to {value} without --force (its mark is {}): a lower mark \
         re-admits every holder of a token >= {value}, stale owners (zombies) included, and a \
         higher one refuses the current owner if its token is below {value}. Stop the proxy, \
         make sure the source of the forged or runaway token is gone and that the current \
         owner's token is >= {value}, then rerun with --force",
        current.map_or_else(|| "unknown".to_owned(), |m| m.to_string())
    )]
    NotForced {
        /// The resource.
        resource: String,
        /// The value asked for.
        value: u64,
        /// Its current mark (0 = none), if the store could be read.
        current: Option<u64>,
    },
    /// The store could not be read, locked or written.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The audit line could not be written; the mark was not changed.
    #[error("audit log {path}: {source}; the mark was not changed")]
    Audit {
        /// The audit log.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Writing the command's output failed.
    #[error("cannot write the output: {0}")]
    Output(#[source] io::Error),
}

impl CliError {
    /// The process exit code: 2 for a configuration error, 1 otherwise.
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) => EXIT_CONFIG,
            _ => EXIT_FAILURE,
        }
    }
}

/// Runs `command`, printing results on stdout and a one-line `error: ...` on stderr.
pub(crate) fn run(command: MarksCommand) -> ExitCode {
    match execute(command, &mut io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Runs `command`, writing its results to `out`.
///
/// # Errors
/// [`CliError`]: the configuration is invalid, the store is `memory`, `set` lacks `--force`,
/// a proxy holds the store, or the store or the audit log cannot be read or written.
pub(crate) fn execute(command: MarksCommand, out: &mut impl Write) -> Result<(), CliError> {
    #[cfg(feature = "etcd")]
    if let Some(done) = etcd::execute(&command, out) {
        return done;
    }
    match command {
        MarksCommand::List {
            config,
            prefix,
            limit,
        } => list(&config, &prefix, limit_of(limit), out),
        MarksCommand::Set {
            resource,
            value,
            force,
            config,
        } => set(&config, &resource, value, force, out),
    }
}

/// The store a command works on: a small enum so that `etcd` can join as a variant (its
/// `list` a range read, its `set` an unconditional put, its lock a lease) without changing
/// the commands.
#[derive(Debug)]
enum Target {
    File(PathBuf),
}

impl Target {
    fn of(config: &Config) -> Result<Self, CliError> {
        match &config.marks {
            MarksSettings::File { path } => Ok(Target::File(path.clone())),
            MarksSettings::Memory => Err(CliError::MemoryStore {
                config: config.file.clone(),
            }),
            MarksSettings::Etcd(_) => Err(CliError::EtcdStore {
                config: config.file.clone(),
            }),
        }
    }

    fn describe(&self) -> String {
        match self {
            // Absolute, so that the audit log names the file wherever the command ran.
            Target::File(path) => format!(
                "marks file {}",
                std::path::absolute(path)
                    .as_deref()
                    .unwrap_or(path)
                    .display()
            ),
        }
    }

    /// The first `limit` stored marks under `prefix`, without locking; `None` when the
    /// store holds nothing yet.
    fn read(&self, prefix: &str, limit: usize) -> Result<Option<Marks>, StoreError> {
        match self {
            Target::File(path) => file::read_list(path, prefix, limit),
        }
    }

    /// Exclusive access for a change, refused while a proxy holds the store.
    fn lock(&self) -> Result<Locked, StoreError> {
        match self {
            Target::File(path) => FileStore::open(path).map(Locked::File),
        }
    }

    fn audit_log(&self) -> PathBuf {
        match self {
            Target::File(path) => audit::log_path(path),
        }
    }
}

/// A store held exclusively until dropped.
enum Locked {
    File(FileStore),
}

impl Locked {
    fn get(&self, resource: &str) -> Result<u64, StoreError> {
        match self {
            Locked::File(s) => s.mark(resource),
        }
    }

    /// Same durable write as an advance; returns the previous value.
    fn overwrite(&self, resource: &str, value: u64) -> Result<u64, StoreError> {
        match self {
            Locked::File(s) => s.overwrite(resource, value),
        }
    }
}

pub(super) fn guarded(config: &Config, resource: &str) -> bool {
    config.routes.iter().any(|r| {
        r.guard
            && match &r.template {
                None => r.resource == resource,
                Some(t) => t.could_produce(resource),
            }
    })
}

/// `--limit` as a count (absent: all).
pub(super) fn limit_of(limit: Option<u64>) -> usize {
    limit.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX))
}

fn list(
    config_path: &Path,
    prefix: &str,
    limit: usize,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let config = Config::load(config_path)?;
    let target = Target::of(&config)?;
    let Some(marks) = target.read(prefix, limit)? else {
        writeln!(
            out,
            "no marks: {} does not exist (no mark stored yet)",
            target.describe()
        )
        .map_err(CliError::Output)?;
        return Ok(());
    };
    if marks.is_empty() {
        writeln!(out, "no marks in {}", target.describe()).map_err(CliError::Output)?;
        return Ok(());
    }
    let width = marks.keys().map(String::len).max().unwrap_or(0).max(8);
    let mut text = format!("{:<width$}  {:<20}  NOTE\n", "RESOURCE", "MARK");
    for (resource, mark) in &marks {
        let note = if guarded(&config, resource) {
            ""
        } else {
            "no route guards it"
        };
        text.push_str(format!("{resource:<width$}  {mark:<20}  {note}").trim_end());
        text.push('\n');
    }
    out.write_all(text.as_bytes()).map_err(CliError::Output)
}

fn set(
    config_path: &Path,
    resource: &str,
    value: u64,
    force: bool,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let config = Config::load(config_path)?;
    let target = Target::of(&config)?;
    if !force {
        // Only to make the refusal informative; nothing is locked or written.
        // (The name itself sorts first among the names it starts.)
        let current = target
            .read(resource, 1)
            .ok()
            .map(|m| m.and_then(|m| m.get(resource).copied()).unwrap_or(0));
        return Err(CliError::NotForced {
            resource: resource.to_owned(),
            value,
            current,
        });
    }
    let store = target.lock()?;
    let old = store.get(resource)?;
    let who = Who::current();
    let log = target.audit_log();
    let line = serde_json::json!({
        "time": audit::rfc3339_utc(SystemTime::now()),
        "event": "marks.set",
        "resource": resource,
        "old": old,
        "new": value,
        "user": who.user,
        "uid": who.uid,
        "host": who.host,
        "pid": std::process::id(),
        "store": target.describe(),
        "config": std::path::absolute(&config.file)
            .as_deref()
            .unwrap_or(&config.file)
            .display()
            .to_string(),
    });
    // Before the change: a change whose line could not be written must not happen.
    audit::append(&log, &line).map_err(|source| CliError::Audit {
        path: log.clone(),
        source,
    })?;
    if let Err(e) = store.overwrite(resource, value) {
        // Best effort: the line above says what was attempted, this one that it failed.
        let _ = audit::append(
            &log,
            &serde_json::json!({
                "time": audit::rfc3339_utc(SystemTime::now()),
                "event": "marks.set.failed",
                "resource": resource,
                "new": value,
                "error": e.to_string(),
            }),
        );
        return Err(e.into());
    }
    tracing::warn!(
        resource,
        old,
        new = value,
        user = who.user.as_deref().unwrap_or("?"),
        uid = %who.uid.map_or_else(|| "?".to_owned(), |u| u.to_string()),
        host = who.host.as_deref().unwrap_or("?"),
        store = %target.describe(),
        audit_log = %log.display(),
        "mark set by an operator"
    );
    let mut text = format!(
        "{resource}: {old} -> {value} (audited in {})\n",
        log.display()
    );
    if !guarded(&config, resource) {
        text.push_str(&format!(
            "note: no route of {} guards {resource:?}; check the resource name\n",
            config.file.display()
        ));
    }
    out.write_all(text.as_bytes()).map_err(CliError::Output)
}
