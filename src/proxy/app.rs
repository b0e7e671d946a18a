//! Wiring: config -> mark store -> admission -> proxy and admin servers, and the
//! [`Reloader`] that swaps in a new configuration while they serve.

use std::future::Future;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;

use crate::fence::admission::Admission;
use crate::fence::marks::{FileStore, MarkStore, MemoryStore, StoreError};
use crate::fence::metrics::Metrics;
use crate::proxy::access_log::{AccessLogError, AccessLogs};
use crate::proxy::admin::{Admin, AdminMetrics};
use crate::proxy::config::{AdminToken, Config, MarksSettings};
use crate::proxy::pipeline::{Affinity, Proxy};
use crate::proxy::reload::Reloader;
use crate::proxy::server;

/// Listeners for [`run`], bound by the caller (tests bind port 0).
#[derive(Debug)]
pub struct Listeners {
    /// The data path.
    pub proxy: TcpListener,
    /// The admin endpoints; `None` to serve none.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses `config` names.
    ///
    /// # Errors
    /// The bind error, with the address in the message.
    pub async fn bind(config: &Config) -> std::io::Result<Self> {
        let bind = |addr: std::net::SocketAddr| async move {
            listen(addr)
                .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
        };
        let proxy = bind(config.proxy.listen).await?;
        let admin = match &config.admin {
            Some(a) => Some(bind(a.listen).await?),
            None => None,
        };
        Ok(Self { proxy, admin })
    }
}

/// How many finished handshakes the kernel may queue for `accept`. tokio's own `bind` asks
/// for 128, which a burst of new clients overflows (their handshakes then stall for a second
/// or more); the kernel caps this at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // A restarted proxy must be able to bind while old connections sit in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Why palisade could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The mark store could not be opened or loaded.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Metric registration failed.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The access log could not be opened.
    #[error(transparent)]
    AccessLog(#[from] AccessLogError),
}

/// Opens the mark store `config` asks for.
///
/// # Errors
/// [`StoreError`] when the store cannot be opened (for `file`: unreadable, corrupt, or its
/// directory is not writable).
pub async fn open_store(config: &Config) -> Result<Arc<dyn MarkStore>, StoreError> {
    Ok(match &config.marks {
        MarksSettings::Memory => Arc::new(MemoryStore::new()),
        MarksSettings::File { path } => Arc::new(FileStore::open(path)?),
        #[cfg(feature = "etcd")]
        MarksSettings::Etcd(settings) => {
            Arc::new(crate::fence::marks::etcd::EtcdStore::connect(settings).await?)
        }
        #[cfg(not(feature = "etcd"))]
        MarksSettings::Etcd(_) => {
            return Err(StoreError::Etcd(
                "this palisade was built without the `etcd` feature".to_owned(),
            ))
        }
    })
}

/// palisade started on its listeners, not serving yet: the mark store is open, the marks
/// are loaded and the first configuration is built. [`App::reloader`] hands out what
/// reloads it (SIGHUP in the binary, `POST /reload`, tests); [`App::serve`] serves.
#[derive(Debug)]
pub struct App {
    listeners: Listeners,
    current: Arc<ArcSwap<Proxy>>,
    admission: Arc<Admission>,
    metrics: Metrics,
    reloader: Reloader,
    access_logs: AccessLogs,
    limits: server::Limits,
    routes: usize,
    /// `[proxy] http1_fast_path`.
    fast_path: bool,
    admin: AdminParts,
}

/// What the admin listener is served with.
#[derive(Debug)]
struct AdminParts {
    metrics: AdminMetrics,
    token: Option<AdminToken>,
    /// `[admin.tls]`, replaced by reloads like the proxy listener's.
    tls: Option<server::TlsConfig>,
}

impl App {
    /// Opens the store, loads the marks, opens the access log and builds the proxy.
    ///
    /// # Errors
    /// [`StartError`] when any of those fails; nothing is served then.
    pub async fn start(config: Config, listeners: Listeners) -> Result<Self, StartError> {
        let metrics = Metrics::new(prometheus::Registry::new())?;
        let admin_metrics = AdminMetrics::register(metrics.registry())?;
        let access_logs = AccessLogs::new(metrics.registry())?;
        let store = open_store(&config).await?;
        let mut resources: Vec<&str> = config
            .routes
            .iter()
            .filter(|r| r.guard && r.template.is_none())
            .map(|r| r.resource.as_str())
            .collect();
        resources.sort_unstable();
        resources.dedup();
        let admission = Arc::new(Admission::open(store, resources, &metrics).await?);
        admission.set_max_cached(config.max_cached);
        let access_log = config
            .access_log
            .as_ref()
            .map(|s| access_logs.open(s))
            .transpose()?;
        let (proxy, _) = Proxy::build(&config, Arc::clone(&admission), &metrics, None, access_log);
        let current = Arc::new(ArcSwap::from_pointee(proxy));
        for w in &config.warnings {
            tracing::warn!("config: {w}");
        }
        let p = &config.proxy;
        let limits = server::Limits {
            max_connections: p.max_connections,
            header_read_timeout: p.header_read_timeout,
            idle_timeout: p.idle_timeout,
            http2_keepalive_interval: p.http2_keepalive_interval,
            grace: p.shutdown_grace,
            max_header_bytes: p.max_header_bytes,
            tls: p
                .tls
                .as_ref()
                .map(|t| Arc::new(ArcSwap::new(Arc::clone(&t.server)))),
        };
        let routes = config.routes.len();
        let fast_path = p.http1_fast_path;
        let admin = AdminParts {
            metrics: admin_metrics,
            token: config.admin.as_ref().and_then(|a| a.token.clone()),
            tls: config
                .admin
                .as_ref()
                .and_then(|a| a.tls.as_ref())
                .map(|t| Arc::new(ArcSwap::new(Arc::clone(&t.server)))),
        };
        let reloader = Reloader::new(
            Arc::clone(&current),
            config,
            Arc::clone(&admission),
            metrics.clone(),
            access_logs.clone(),
            limits.tls.clone(),
            admin.tls.clone(),
        )?;
        Ok(Self {
            listeners,
            current,
            admission,
            metrics,
            reloader,
            access_logs,
            limits,
            routes,
            fast_path,
            admin,
        })
    }

    /// What reloads this palisade's configuration (and reopens its access log).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// Serves until `shutdown` resolves, then drains in-flight requests for at most
    /// `proxy.shutdown_grace_ms` and flushes the access log.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let Self {
            listeners,
            current,
            admission,
            metrics,
            reloader,
            access_logs,
            limits,
            routes,
            fast_path,
            admin: admin_parts,
        } = self;
        // The admin listener is for operators and scrapers: a few connections are plenty, and
        // its own budget means a flood of connections on the data path does not lock
        // operators out (both still share the process's file descriptors).
        let admin_limits = server::Limits {
            max_connections: 64,
            tls: admin_parts.tls,
            ..limits.clone()
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
        let admin_task = listeners.admin.map(|listener| {
            let token = admin_parts.token;
            tracing::info!(
                addr = %display_addr(&listener),
                tls = admin_limits.tls.is_some(),
                token_env = token.as_ref().map(AdminToken::env),
                "admin listening"
            );
            let admin = Admin::new(Arc::clone(&admission), metrics.clone(), admin_parts.metrics)
                .with_reloader(reloader)
                .with_token(token);
            let mut stop = stop_rx.clone();
            tokio::spawn(server::serve_with(
                listener,
                move |req, peer: server::Peer, _: &Arc<()>| {
                    let admin = admin.clone();
                    async move { admin.handle(req, peer.addr).await }
                },
                async move {
                    let _ = stop.changed().await;
                },
                admin_limits,
                Some(metrics.connections("admin")),
            ))
        });
        tracing::info!(
            addr = %display_addr(&listeners.proxy),
            routes,
            store = admission.store().kind(),
            marks = ?admission.marks(),
            "palisade listening"
        );
        let serving = Arc::clone(&current);
        let first = fast_path.then(|| {
            let current = Arc::clone(&current);
            Arc::new(move |conn| crate::proxy::pipeline::fast::serve(Arc::clone(&current), conn))
                as server::FirstHandler
        });
        server::serve_first(
            listeners.proxy,
            move |req, peer: server::Peer, affinity: &Arc<Affinity>| {
                // The one load per request: the request keeps this configuration to its end,
                // whatever a reload swaps in meanwhile.
                let proxy = serving.load_full();
                let affinity = Arc::clone(affinity);
                async move { proxy.handle(req, peer, &affinity).await }
            },
            shutdown,
            limits,
            Some(metrics.connections("proxy")),
            first,
        )
        .await;
        drop(stop_tx);
        if let Some(t) = admin_task {
            let _ = t.await;
        }
        if let Some(log) = current.load().access_log() {
            log.close().await;
        }
        access_logs.wait_retired().await;
        tracing::info!("palisade stopped");
    }
}

/// Runs palisade on `listeners` until `shutdown` resolves, then drains in-flight requests for
/// at most `proxy.shutdown_grace_ms` ([`App::start`], then [`App::serve`]).
///
/// # Errors
/// [`StartError`] before anything is served; once serving, it only returns at shutdown.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    App::start(config, listeners).await?.serve(shutdown).await;
    Ok(())
}

fn display_addr(l: &TcpListener) -> String {
    l.local_addr()
        .map_or_else(|e| format!("(unknown: {e})"), |a| a.to_string())
}
