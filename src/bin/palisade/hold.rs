//! `palisade lock NAME -- CMD...` and `palisade elect NAME -- CMD...` (feature `etcd`): run a
//! command while holding a lock (or leading an election) on etcd, with its fencing token.
//!
//! `etcdctl lock` and `etcdctl elect` do the same without a token, and a command they run
//! keeps running after their lease is gone. Here:
//!
//! - CMD starts only once the lock is held (the leadership won) and gets, in its environment,
//!   `PALISADE_FENCING_TOKEN` (decimal: attach it to every request to the resource),
//!   `PALISADE_LEASE_ID` (hex, as `etcdctl lease` prints it), `PALISADE_NAME`, and
//!   `PALISADE_KEY` / `PALISADE_KEY_REVISION` (the queue entry and its create revision: the
//!   compare `c("KEY") = "REV"` in an `etcdctl txn` commits only while the lock is held, see
//!   [`crate::fenced_txn`]).
//! - With `--fence URL` (repeatable), a fence request with the new token goes to each URL
//!   first (see [`palisade::client::transport::fence`]): CMD starts only once every one was admitted, so
//!   the previous owner is refused before CMD does anything.
//! - CMD runs in its own process group. SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to
//!   palisade are forwarded to that group (so `sh -c 'a | b'` gets them whole, as from a
//!   terminal). A CMD that reads the terminal is stopped by SIGTTIN: use it for jobs, not
//!   interactive programs.
//! - When the lease or the queue entry is lost (the session's local deadline passed, etcd
//!   expired or revoked the lease, someone deleted the entry), the group gets SIGTERM, and
//!   SIGKILL `--grace` later if CMD has not exited. After a loss, the rest of the group is
//!   killed as soon as CMD exits.
//! - palisade exits with CMD's status, 128+N when CMD was killed by signal N (as shells
//!   report it). Its own failures use the codes of `env` and `timeout`: 125 (etcd unreachable,
//!   session or acquisition failed), 126 (CMD not executable), 127 (CMD not found); a signal
//!   that arrives while it still waits for the lock ends the wait with 128+N.
//! - After CMD exits, whatever is left of its group is killed (nothing may go on writing with
//!   the token once the lock is released), the lock is released (the leadership resigned) and
//!   the lease revoked.
//! - CMD never outlives palisade: a watchdog process ([`watchdog`]) kills CMD's group when
//!   palisade dies, `kill -9` and the OOM killer included.
//! - With `--metrics-addr ADDR`, the owner metrics of the client library (feature `metrics`:
//!   held, leader, acquisitions, losses by reason, renew failures, lease left) are served as
//!   Prometheus text on `GET /metrics` (`src/bin/palisade/hold/metrics.rs`). Without
//!   `--recampaign` palisade exits soon after a loss, so a scrape sees the loss only if it
//!   comes during the grace.
//! - With `--recampaign`, a loss is not the end: once CMD is stopped, palisade starts a new
//!   session (waiting for etcd to come back, with backoff), campaigns (or locks) again and
//!   runs CMD again under the new token. SIGINT or SIGTERM ends it; SIGHUP, SIGUSR1 and
//!   SIGUSR2 that come while no CMD runs are ignored (a log rotation must not end a standby).
//!
//! The fencing token is what keeps the resource safe; the SIGTERM only stops a job that can
//! no longer write anyway, and it can come late (palisade itself frozen, for example).

mod metrics;
mod signals;
pub(crate) mod watchdog;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use signals::{Signal, Signals};
use tokio::process::{Child, Command};

use palisade::client::election::ElectionService;
use palisade::client::lock::LockService;
use palisade::client::provider::etcd::EtcdProvider;
use palisade::client::provider::Provider;
use palisade::client::session::{LossSignal, Session, SessionOptions, DEFAULT_NAMESPACE};
use palisade::token::FencingToken;

/// Exit code when palisade itself fails (as `env`, `timeout` and `docker run` use it).
pub(crate) const EXIT_FAILED: u8 = 125;
/// Exit code when CMD cannot be executed.
pub(crate) const EXIT_NOT_EXECUTABLE: u8 = 126;
/// Exit code when CMD is not found.
pub(crate) const EXIT_NOT_FOUND: u8 = 127;
/// Bound on connecting to etcd.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Options shared by `palisade lock` and `palisade elect`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct HoldArgs {
    /// The name: every job sharing it (the same namespace too) takes turns.
    pub(crate) name: String,
    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub(crate) endpoints: Vec<String>,
    /// Lease TTL in seconds: how long etcd keeps the lock after palisade stops renewing it.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) ttl: u64,
    /// Key namespace of the lock (the same for every job sharing it).
    #[arg(long, default_value = DEFAULT_NAMESPACE)]
    pub(crate) namespace: String,
    /// Time between SIGTERM and SIGKILL after the lease is lost: `10`, `2.5`, `10s`, `500ms`.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) grace: Duration,
    /// After the lease is lost (etcd unreachable past the TTL, the key deleted), stop CMD,
    /// then wait for etcd, acquire again and rerun CMD with the new token, until SIGINT or
    /// SIGTERM. Without it palisade exits after a loss. A CMD that exits on its own ends
    /// palisade either way.
    #[arg(long, alias = "reacquire")]
    pub(crate) recampaign: bool,
    /// Before CMD starts, send a fence request (`x-fencing-fence: 1`, POST, the new token) to
    /// this URL of a guarded route (`http://` only), so that the previous owner is refused
    /// from then on, even before CMD writes anything. Repeatable. CMD starts only when every
    /// fence was admitted (204): a stale fence means a newer owner exists, and palisade lets
    /// go; any other answer, or none within 5 s, stops palisade before CMD runs.
    #[arg(long = "fence", value_name = "URL", value_parser = parse_fence_url)]
    pub(crate) fence: Vec<http::Uri>,
    /// Serve this process's owner metrics as Prometheus text on `GET /metrics` at this
    /// address (e.g. `127.0.0.1:9902`), from start to exit: palisade_owner_held, _leader,
    /// _acquisitions_total, _losses_total{reason}, _acquire_seconds and
    /// palisade_session_renew_failures_total, _lease_remaining_seconds.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true, num_args = 1..)]
    pub(crate) command: Vec<OsString>,
}

/// Longest wait between two attempts with `--recampaign`.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// `palisade lock` or `palisade elect`.
#[derive(Debug, Clone)]
pub(crate) enum Hold {
    /// Hold the lock `name` while CMD runs.
    Lock(HoldArgs),
    /// Lead the election `name` with `value` while CMD runs.
    Elect {
        /// Shared options.
        args: HoldArgs,
        /// The candidate's value (what observers and `leader()` see).
        value: Option<String>,
    },
}

fn parse_fence_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(_)) => Ok(uri),
        (Some("https"), _) => {
            Err("https is not supported here yet: fence through an http:// listener".to_owned())
        }
        _ => Err("must be an absolute http:// URL".to_owned()),
    }
}

/// Bound on one fence request's answer.
const FENCE_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends the fence requests of `--fence`, in order: `Ok` once every one was admitted; the
/// round to end with otherwise (said on stderr).
async fn fence_all(args: &HoldArgs, token: FencingToken) -> Result<(), Round> {
    use palisade::client::transport::FenceError;
    if args.fence.is_empty() {
        return Ok(());
    }
    let mut client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<http_body_util::Empty<bytes::Bytes>>();
    for url in &args.fence {
        let req =
            palisade::client::transport::fence_request(http::Method::POST, url.clone(), token);
        let answer = tokio::time::timeout(
            FENCE_TIMEOUT,
            palisade::client::transport::fence(&mut client, req),
        )
        .await;
        match answer {
            Ok(Ok(mark)) => {
                tracing::info!(name = %args.name, %token, %url, mark, "fenced the previous owner");
            }
            Ok(Err(FenceError::Fenced(f))) => {
                eprintln!(
                    "palisade: {}: fence at {url} refused: the resource's mark {} is above                      token {token}; a newer owner exists, the command is not started",
                    args.name, f.mark
                );
                // Failed, not Lost: with --recampaign the next round waits its backoff (a
                // mark far above this etcd's revisions would otherwise be retried at once).
                return Err(Round::Failed(EXIT_FAILED));
            }
            Ok(Err(e)) => {
                eprintln!(
                    "palisade: {}: fence at {url}: {e}; the command is not started",
                    args.name
                );
                return Err(Round::Failed(EXIT_FAILED));
            }
            Err(_) => {
                eprintln!(
                    "palisade: {}: fence at {url}: no answer within {FENCE_TIMEOUT:?}; the                      command is not started",
                    args.name
                );
                return Err(Round::Failed(EXIT_FAILED));
            }
        }
    }
    Ok(())
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, scale) = if let Some(ms) = s.strip_suffix("ms") {
        (ms, 1e-3)
    } else if let Some(secs) = s.strip_suffix('s') {
        (secs, 1.0)
    } else {
        (s, 1.0)
    };
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: expected seconds (`10`, `2.5`, `10s`) or `500ms`"))?;
    Duration::try_from_secs_f64(n * scale).map_err(|e| format!("{s:?}: {e}"))
}

/// Runs `palisade lock|elect` to completion on its own runtime and returns the exit code.
pub(crate) fn run(hold: Hold) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("palisade: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    ExitCode::from(rt.block_on(hold_and_run(hold)))
}

/// What the queue gave: the token, the entry, and how to release it.
enum Holding {
    Lock(palisade::client::lock::LockGrant),
    Lead(palisade::client::election::Leadership),
}

impl Holding {
    fn token(&self) -> FencingToken {
        match self {
            Holding::Lock(g) => g.token(),
            Holding::Lead(l) => l.token(),
        }
    }

    fn incarnation(&self) -> &palisade::client::session::Incarnation {
        match self {
            Holding::Lock(g) => g.incarnation(),
            Holding::Lead(l) => l.incarnation(),
        }
    }

    fn loss_signal(&self) -> LossSignal {
        match self {
            Holding::Lock(g) => g.loss_signal(),
            Holding::Lead(l) => l.loss_signal(),
        }
    }

    async fn release(&self) -> Result<(), palisade::client::error::Error> {
        match self {
            Holding::Lock(g) => g.unlock().await,
            Holding::Lead(l) => l.resign().await,
        }
    }
}

async fn hold_and_run(hold: Hold) -> u8 {
    // Listen before anything else: a SIGTERM while connecting or waiting must end the wait
    // with the entry cleaned up, not kill palisade with its entry left for the TTL.
    let mut signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("palisade: cannot listen for signals: {e}");
            return EXIT_FAILED;
        }
    };
    let (args, value) = match hold {
        Hold::Lock(args) => (args, None),
        Hold::Elect { args, value } => {
            let value = value.unwrap_or_else(default_value);
            (args, Some(value))
        }
    };
    // Before the first session, so that a scrape sees the whole life of this process, the
    // wait for the lock included.
    if let Some(addr) = args.metrics_addr {
        if let Err(e) = metrics::serve(addr).await {
            eprintln!("palisade: {e}");
            return EXIT_FAILED;
        }
    }
    let mut backoff = Duration::from_millis(250);
    loop {
        let round = hold_once(&args, value.as_deref(), &mut signals).await;
        let again = match round {
            Round::Done(code) => return code,
            // A new owner could be elected meanwhile; that is what the token is for.
            Round::Lost(code) | Round::Failed(code) if !args.recampaign => return code,
            Round::Lost(_) => {
                backoff = Duration::from_millis(250);
                Duration::ZERO
            }
            Round::Failed(_) => backoff,
        };
        tracing::warn!(
            name = %args.name,
            wait = ?again,
            "--recampaign: starting over with a new session"
        );
        tokio::select! {
            () = tokio::time::sleep(again) => {}
            sig = signals.stop(args.recampaign) => return signals::exit_code(sig),
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// How one session's round ended.
enum Round {
    /// CMD exited on its own, or palisade was told to stop: exit with this code.
    Done(u8),
    /// The lease or the entry was lost while CMD ran; CMD was stopped (its code).
    Lost(u8),
    /// etcd could not be reached, or the session or acquisition failed.
    Failed(u8),
}

async fn hold_once(args: &HoldArgs, value: Option<&str>, signals: &mut Signals) -> Round {
    let session = tokio::select! {
        s = start_session(args) => match s {
            Ok(s) => s,
            Err(e) => {
                eprintln!("palisade: {e}");
                return Round::Failed(EXIT_FAILED);
            }
        },
        sig = signals.stop(args.recampaign) => return Round::Done(signals::exit_code(sig)),
    };
    let acquire = async {
        match value {
            None => session.lock(&args.name).await.map(Holding::Lock),
            Some(v) => session
                .campaign(&args.name, v.as_bytes().to_vec())
                .await
                .map(Holding::Lead),
        }
    };
    let held = tokio::select! {
        h = acquire => match h {
            Ok(h) => h,
            Err(e) => {
                eprintln!("palisade: {}: {e}", args.name);
                let _ = session.close().await;
                return Round::Failed(EXIT_FAILED);
            }
        },
        sig = signals.stop(args.recampaign) => {
            // The acquisition future is dropped; closing revokes the lease, which deletes
            // the entry whatever state the acquisition was in.
            let _ = session.close().await;
            return Round::Done(signals::exit_code(sig));
        }
    };
    let ended = supervise(args, &session, &held, signals).await;
    if !held.loss_signal().is_lost() {
        if let Err(e) = held.release().await {
            tracing::warn!(name = %args.name, error = %e, "release after the command failed");
        }
    }
    // A lost lease has nothing left to revoke (and etcd may not answer: do not wait for it).
    if session.state() != palisade::client::session::SessionState::Lost {
        if let Err(e) = session.close().await {
            tracing::debug!(error = %e, "lease revoke failed; it expires by its TTL");
        }
    }
    ended
}

async fn start_session(args: &HoldArgs) -> Result<Session, String> {
    let endpoints = &args.endpoints;
    let options = etcd_client::ConnectOptions::new().with_connect_timeout(CONNECT_TIMEOUT);
    let client = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        etcd_client::Client::connect(endpoints, Some(options)),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("cannot connect to etcd at {endpoints:?}: {e}")),
        Err(_) => {
            return Err(format!(
                "cannot connect to etcd at {endpoints:?} within {CONNECT_TIMEOUT:?}"
            ))
        }
    };
    let options = SessionOptions::new()
        .with_ttl(Duration::from_secs(args.ttl))
        .with_namespace(args.namespace.clone());
    EtcdProvider::new(&client)
        .session(options)
        .await
        .map_err(|e| format!("cannot start a session: {e}"))
}

/// `<hostname>:<pid>`, what `etcdctl elect` users usually pass by hand.
fn default_value() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".to_owned());
    format!("{host}:{}", std::process::id())
}

/// Starts the watchdog: `palisade __watchdog` in a process group of its own, reading a pipe
/// that closes when this process dies (see [`watchdog`]).
async fn start_watchdog() -> std::io::Result<(Child, tokio::process::ChildStdin, i32)> {
    use tokio::io::AsyncReadExt;
    // /proc/self/exe: this very binary, even when the file was replaced by an upgrade since.
    let mut child = Command::new("/proc/self/exe")
        .arg(watchdog::SUBCOMMAND)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .process_group(0)
        .spawn()?;
    let pipe = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("the watchdog has no stdin pipe"))?;
    let group = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .ok_or_else(|| std::io::Error::other("the watchdog exited at once"))?;
    // Until it says READY, a forwarded signal would kill it: CMD waits for that.
    let mut ready = [0u8; 1];
    let mut out = child
        .stdout
        .take()
        .ok_or_else(|| std::io::Error::other("the watchdog has no stdout pipe"))?;
    match tokio::time::timeout(Duration::from_secs(10), out.read(&mut ready)).await {
        Ok(Ok(1)) if ready[0] == watchdog::READY => Ok((child, pipe, group)),
        _ => {
            let _ = child.kill().await;
            Err(std::io::Error::other("the watchdog did not start"))
        }
    }
}

/// Starts CMD and waits for it, forwarding signals and stopping it after a loss.
async fn supervise(
    args: &HoldArgs,
    session: &Session,
    held: &Holding,
    signals: &mut Signals,
) -> Round {
    let token = held.token();
    let entry = held.incarnation();
    // Acquiring can take long enough for the lease to run out behind it (palisade frozen, a
    // slow etcd): a command started now could only be stopped again at once.
    if held.loss_signal().is_lost() {
        eprintln!(
            "palisade: {}: ownership lost before the command started",
            args.name
        );
        return Round::Lost(EXIT_FAILED);
    }
    // A stop asked while fencing ends the round before CMD starts, as one asked while
    // waiting for the lock does.
    tokio::select! {
        fenced = fence_all(args, token) => if let Err(round) = fenced {
            return round;
        },
        sig = signals.stop(args.recampaign) => return Round::Done(signals::exit_code(sig)),
    }
    if held.loss_signal().is_lost() {
        eprintln!(
            "palisade: {}: ownership lost while fencing; the command is not started",
            args.name
        );
        return Round::Lost(EXIT_FAILED);
    }
    let (mut watchdog, pipe, group) = match start_watchdog().await {
        Ok(w) => w,
        Err(e) => {
            eprintln!("palisade: cannot start the watchdog process: {e}");
            return Round::Done(EXIT_FAILED);
        }
    };
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("PALISADE_FENCING_TOKEN", token.to_string())
        .env("PALISADE_LEASE_ID", format!("{:x}", session.lease_id()))
        .env("PALISADE_NAME", &args.name)
        .env("PALISADE_KEY", entry.key())
        .env("PALISADE_KEY_REVISION", entry.create_revision().to_string())
        // The watchdog's group, so that signals reach every process of the job (a pipeline,
        // a shell's children), not only its first process, and so that the watchdog can take
        // them all down if palisade dies.
        .process_group(group);
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "palisade: cannot run {}: {e}",
                args.command[0].to_string_lossy()
            );
            end_group(group, pipe, &mut watchdog).await;
            // Not something a new session would change: no retry.
            return Round::Done(match e.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => EXIT_NOT_EXECUTABLE,
                _ => EXIT_FAILED,
            });
        }
    };
    tracing::debug!(name = %args.name, %token, pid = child.id(), "holding; command started");
    let mut lost = held.loss_signal();
    let mut is_lost = false;
    let mut stop_asked = false;
    let kill_at = tokio::time::sleep(Duration::MAX);
    tokio::pin!(kill_at);
    // The group's id is the watchdog's pid, and the watchdog is reaped only in `end_group`,
    // after the last signal to the group: until then (alive, or dead but not reaped) its pid
    // is taken, so the kernel cannot give the group's id to another process.
    let status = loop {
        tokio::select! {
            biased;
            status = child.wait() => break status,
            sig = signals.recv() => {
                stop_asked |= sig == Signal::INT || sig == Signal::TERM;
                signal_group(group, sig);
            }
            loss = lost.wait(), if !is_lost => {
                tracing::warn!(
                    name = %args.name, %token, ?loss, grace = ?args.grace,
                    "ownership lost: sending SIGTERM to the command, SIGKILL after the grace"
                );
                signal_group(group, Signal::TERM);
                is_lost = true;
                kill_at.as_mut().reset(tokio::time::Instant::now() + args.grace);
            }
            () = &mut kill_at, if is_lost => {
                tracing::warn!(name = %args.name, "the command outlived the grace: SIGKILL");
                signal_group(group, Signal::KILL);
                kill_at.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(3600));
            }
        }
    };
    // Nothing of the job may go on writing with the token once palisade lets go of the lock:
    // the rest of its group (children that ignored SIGTERM, background processes) goes now.
    end_group(group, pipe, &mut watchdog).await;
    let code = match status {
        Ok(s) => exit_code(s),
        Err(e) => {
            eprintln!("palisade: waiting for the command failed: {e}");
            EXIT_FAILED
        }
    };
    if is_lost && !stop_asked {
        Round::Lost(code)
    } else {
        Round::Done(code)
    }
}

/// Kills what is left of the job's group, the watchdog included, and reaps the watchdog.
async fn end_group(group: i32, mut pipe: tokio::process::ChildStdin, watchdog: &mut Child) {
    use tokio::io::AsyncWriteExt;
    // The watchdog exits quietly on this byte; SIGKILL below ends it either way.
    let _ = pipe.write_all(&[watchdog::DONE]).await;
    let _ = signals::kill_group(group, Signal::KILL);
    drop(pipe);
    let _ = watchdog.wait().await;
}

/// Sends `sig` to CMD's process group.
fn signal_group(group: i32, sig: Signal) {
    if let Err(e) = signals::kill_group(group, sig) {
        tracing::debug!(group, ?sig, error = %e, "signal not delivered");
    }
}

/// The shells' convention: the exit code, or 128+N for a death by signal N.
fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => (128 + sig) as u8,
        (None, None) => EXIT_FAILED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_accepts_seconds_and_milliseconds() {
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("2.5").unwrap(), Duration::from_millis(2500));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("-1").is_err());
    }
}
