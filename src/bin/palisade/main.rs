//! `palisade`: the fencing reverse proxy and the operator's commands. Only the command line
//! lives here (it is no part of the library's API); everything it runs is the library's.
//!
//! `palisade run --config FILE` serves until SIGTERM/SIGINT, reloads its configuration on
//! SIGHUP and reopens its access log file on SIGUSR1; `palisade check --config FILE`
//! validates a configuration, lists every error it finds and exits 2 if there was one;
//! `palisade marks list|set` shows and repairs stored marks (see `marks.rs`);
//! with the `etcd` feature (in the default build), `palisade lock|elect NAME -- CMD...` runs a
//! command while holding a lock or leading an election, with its fencing token (see
//! `hold.rs`). `palisade --version` lists the features built in.

#[cfg(feature = "etcd")]
mod hold;
mod marks;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use palisade::proxy::config::Config;

// The proxy allocates small, short-lived buffers and header maps per request; mimalloc's
// thread-local free lists serve those markedly faster than glibc malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for an invalid configuration (distinct from runtime failures).
const EXIT_CONFIG: u8 = 2;
/// Exit code for a failure to start or run.
const EXIT_RUNTIME: u8 = 1;

/// The features this binary was built with, for `--version` and the missing-feature errors.
fn features() -> Vec<&'static str> {
    let all = [
        ("proxy", cfg!(feature = "proxy")),
        ("etcd", cfg!(feature = "etcd")),
        ("etcd-tls", cfg!(feature = "etcd-tls")),
        ("grpc", cfg!(feature = "grpc")),
        ("layer", cfg!(feature = "layer")),
        ("metrics", cfg!(feature = "metrics")),
        ("object-store", cfg!(feature = "object-store")),
        ("object-store-aws", cfg!(feature = "object-store-aws")),
    ];
    all.iter().filter(|(_, on)| *on).map(|(f, _)| *f).collect()
}

/// `palisade --version`: the version and, on a second line, the features built in.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}\nfeatures: {}",
        env!("CARGO_PKG_VERSION"),
        features().join(", ")
    )
});

#[derive(Parser)]
#[command(
    name = "palisade",
    version = VERSION.as_str(),
    about = "Fencing-token reverse proxy: stale owners cannot write"
)]
struct Cli {
    /// Log format on stderr (filter with RUST_LOG, default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy until SIGTERM or SIGINT (SIGHUP reloads the configuration, SIGUSR1
    /// reopens the access log file).
    Run {
        /// The TOML configuration file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a configuration file: print every error found (a TOML syntax error stops
    /// the reading at its line), or the routes it sets up and its warnings; exit 2 on errors.
    Check {
        /// The TOML configuration file.
        #[arg(long, short)]
        config: PathBuf,
        /// The configuration in force now: also print what a reload from it to CONFIG would
        /// do with marks (carry them over, retire them, or refuse the reload).
        #[arg(long)]
        previous: Option<PathBuf>,
    },
    /// Show stored marks, or set one (audited recovery from a forged or runaway token).
    #[command(subcommand)]
    Marks(marks::MarksCommand),
    /// Ask a running palisade's admin endpoint whether it is alive (exit 0) or not (exit 1):
    /// a container health check that needs no curl in the image.
    Health {
        /// The admin address.
        #[arg(long, default_value = "127.0.0.1:9901")]
        admin: std::net::SocketAddr,
        /// The path to ask: `/livez` (process up) or `/readyz` (marks loaded, store usable).
        #[arg(long, default_value = "/livez")]
        path: String,
    },
    /// Hold a lock on etcd while CMD runs; CMD gets the token in PALISADE_FENCING_TOKEN and is
    /// stopped (SIGTERM, then SIGKILL after --grace) if the lease is lost. Exits with CMD's
    /// status.
    #[cfg(feature = "etcd")]
    Lock(hold::HoldArgs),
    /// Lead an election on etcd while CMD runs; CMD gets the leader's token in
    /// PALISADE_FENCING_TOKEN and is stopped (SIGTERM, then SIGKILL after --grace) if the
    /// leadership is lost. Exits with CMD's status.
    #[cfg(feature = "etcd")]
    #[command(
        mut_arg("ttl", |a| a.help(
            "Lease TTL in seconds: how long etcd keeps the leadership after palisade stops \
             renewing it")),
        mut_arg("namespace", |a| a.help(
            "Key namespace of the election (the same for every candidate)")),
        mut_arg("grace", |a| a.help(
            "Time between SIGTERM and SIGKILL after the leadership is lost: `10`, `2.5`, \
             `10s`, `500ms`")),
    )]
    Elect {
        /// The candidate's value, what observers see (default `<hostname>:<pid>`).
        #[arg(long)]
        value: Option<String>,
        #[command(flatten)]
        args: hold::HoldArgs,
    },
    /// Internal: the watchdog of `palisade lock|elect` (kills the job if palisade dies).
    #[cfg(feature = "etcd")]
    #[command(name = hold::watchdog::SUBCOMMAND, hide = true)]
    Watchdog,
    /// Needs the `etcd` feature, which this binary was built without.
    #[cfg(not(feature = "etcd"))]
    Lock {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        rest: Vec<std::ffi::OsString>,
    },
    /// Needs the `etcd` feature, which this binary was built without.
    #[cfg(not(feature = "etcd"))]
    Elect {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        rest: Vec<std::ffi::OsString>,
    },
}

/// A subcommand of a feature this binary lacks: say which, and how to get it.
#[cfg(not(feature = "etcd"))]
fn missing_feature(command: &str, feature: &str) -> ExitCode {
    eprintln!(
        "error: `palisade {command}` needs the `{feature}` feature, which this binary was built \
         without (features: {}); rebuild with `cargo build --release --features {feature}` \
         (the default build has it)",
        features().join(", ")
    );
    ExitCode::from(EXIT_CONFIG)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Marks(command) => marks::run(command),
        Command::Health { admin, path } => health(admin, &path),
        #[cfg(feature = "etcd")]
        Command::Lock(args) => hold::run(hold::Hold::Lock(args)),
        #[cfg(feature = "etcd")]
        Command::Elect { value, args } => hold::run(hold::Hold::Elect { args, value }),
        #[cfg(feature = "etcd")]
        Command::Watchdog => hold::watchdog::run(),
        #[cfg(not(feature = "etcd"))]
        Command::Lock { .. } => missing_feature("lock", "etcd"),
        #[cfg(not(feature = "etcd"))]
        Command::Elect { .. } => missing_feature("elect", "etcd"),
        Command::Check { config, previous } => match Config::load(&config) {
            Ok(c) => {
                for w in &c.warnings {
                    eprintln!("warning: {w}");
                }
                println!(
                    "{}: ok ({} upstreams, {} routes, {} warnings)",
                    config.display(),
                    c.upstreams.len(),
                    c.routes.len(),
                    c.warnings.len()
                );
                for line in c.describe() {
                    println!("  {line}");
                }
                for r in &c.retired {
                    println!("  marks.retired: {r:?} is not guarded on purpose; its mark stays in the store");
                }
                match previous.map(|p| reload_plan(&p, &c)) {
                    None => ExitCode::SUCCESS,
                    Some(Ok(plan)) => {
                        println!("{plan}");
                        if plan.unprotected.is_empty() {
                            ExitCode::SUCCESS
                        } else {
                            ExitCode::from(EXIT_CONFIG)
                        }
                    }
                    Some(Err(e)) => {
                        eprintln!("error: --previous: {e}");
                        ExitCode::from(EXIT_CONFIG)
                    }
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Run { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            raise_fd_limit(config.proxy.max_connections);
            // One worker: a current-thread runtime skips the work-stealing machinery entirely.
            let mut rt = match config.proxy.workers {
                Some(1) => tokio::runtime::Builder::new_current_thread(),
                Some(n) => {
                    let mut b = tokio::runtime::Builder::new_multi_thread();
                    b.worker_threads(n);
                    b
                }
                None => tokio::runtime::Builder::new_multi_thread(),
            };
            let rt = match rt.enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return ExitCode::from(EXIT_RUNTIME);
                }
            };
            rt.block_on(async move {
                // First of all: a SIGHUP or SIGUSR1 (logrotate) that comes while palisade
                // starts must wait for the handler, not end the process (their default).
                let early = match Early::listen() {
                    Ok(e) => e,
                    Err(e) => {
                        eprintln!("error: cannot listen for SIGHUP/SIGUSR1: {e}");
                        return ExitCode::from(EXIT_RUNTIME);
                    }
                };
                let listeners = match palisade::Listeners::bind(&config).await {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::from(EXIT_RUNTIME);
                    }
                };
                let app = match palisade::App::start(config, listeners).await {
                    Ok(app) => app,
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::from(EXIT_RUNTIME);
                    }
                };
                let signals = reload_on_signals(app.reloader(), early);
                app.serve(shutdown_signal()).await;
                signals.abort();
                ExitCode::SUCCESS
            })
        }
    }
}

/// What a reload from the configuration at `previous` to `next` does with marks. Marks are
/// read from a file store (without its lock); for other stores every guarded resource is
/// taken to have a mark, which is what a running proxy may find.
fn reload_plan(
    previous: &std::path::Path,
    next: &Config,
) -> Result<palisade::proxy::reload::protection::Plan, Box<dyn std::error::Error>> {
    let running = Config::load(previous)?;
    let stored = match &running.marks {
        palisade::proxy::config::MarksSettings::File { path } => {
            Some(palisade::fence::marks::file::read(path)?.unwrap_or_default())
        }
        _ => None,
    };
    Ok(palisade::proxy::reload::protection::plan(
        &running,
        next,
        |r| {
            stored
                .as_ref()
                .map_or(1, |m| m.get(r).copied().unwrap_or(0))
        },
    ))
}

/// One `GET` to the admin listener with a 2 s budget; success is a `200` status line.
fn health(admin: std::net::SocketAddr, path: &str) -> ExitCode {
    use std::io::{Read, Write};
    let limit = std::time::Duration::from_secs(2);
    let attempt = || -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect_timeout(&admin, limit)?;
        s.set_read_timeout(Some(limit))?;
        s.set_write_timeout(Some(limit))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {admin}\r\n\r\n")?;
        let mut head = [0u8; 64];
        let n = s.read(&mut head)?;
        Ok(String::from_utf8_lossy(&head[..n]).into_owned())
    };
    match attempt() {
        Ok(head) if head.split(' ').nth(1) == Some("200") => ExitCode::SUCCESS,
        Ok(head) => {
            eprintln!("unhealthy: {}", head.lines().next().unwrap_or(""));
            ExitCode::from(EXIT_RUNTIME)
        }
        Err(e) => {
            eprintln!("unhealthy: {admin}{path}: {e}");
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}

/// Raises the soft limit on open files to the hard limit: the default soft limit (often 1024)
/// is far below what `max_connections` plus upstream connections need, and running out makes
/// every new client fail.
fn raise_fd_limit(max_connections: usize) {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => {
            // Each client may need an upstream connection too, plus files and listeners.
            let needed = (max_connections as u64)
                .saturating_mul(2)
                .saturating_add(64);
            if limit < needed {
                tracing::warn!(
                    limit,
                    needed,
                    max_connections,
                    "the open-files limit is below what max_connections needs (two files per \
                     connection plus 64 for listeners, the store and logs); raise the hard \
                     limit (ulimit -Hn, LimitNOFILE=) or lower max_connections"
                );
            } else {
                tracing::debug!(limit, "open-files limit");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-files limit"),
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: `docker logs` and log files get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.with_writer(|| OneLine(std::io::stderr())).init(),
        LogFormat::Json => builder.with_writer(std::io::stderr).json().init(),
    }
}

/// A text log writer that keeps one record per line: a line break inside a record (an error
/// listing several problems) is written as `\n`, so that `grep` and log shippers never see
/// the rest of a record as records of their own. The formatter hands over one whole record
/// per `write`.
struct OneLine<W>(W);

impl<W: std::io::Write> std::io::Write for OneLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.contains(&b'\n') {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut out = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => {}
                b => out.push(b),
            }
        }
        if body.len() < buf.len() {
            out.push(b'\n');
        }
        self.0.write_all(&out)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// SIGHUP and SIGUSR1, listened to from the start (one that comes early waits in its stream).
struct Early {
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Early {
    fn listen() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

/// SIGHUP reloads the configuration (the outcome is logged by the reloader), SIGUSR1
/// reopens the access log file (after logrotate renamed it).
fn reload_on_signals(
    reloader: palisade::proxy::reload::Reloader,
    Early { mut hup, mut usr1 }: Early,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(()) = hup.recv() => {
                    tracing::info!("SIGHUP: reloading the configuration");
                    let _ = reloader.reload().await;
                }
                Some(()) = usr1.recv() => {
                    if !reloader.reopen_access_log() {
                        tracing::info!("SIGUSR1: no access log to reopen");
                    }
                }
                else => return,
            }
        }
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT stops palisade");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}
