//! Wiring: config -> mark store -> admission -> proxy and admin servers.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::admin::Admin;
use crate::admission::Admission;
use crate::config::{Config, MarksSettings};
use crate::marks::{FileStore, MarkStore, MemoryStore, StoreError};
use crate::metrics::Metrics;
use crate::proxy::{Affinity, Proxy};
use crate::server;

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
            Arc::new(crate::marks::etcd::EtcdStore::connect(settings).await?)
        }
        #[cfg(not(feature = "etcd"))]
        MarksSettings::Etcd(_) => {
            return Err(StoreError::Etcd(
                "this palisade was built without the `etcd` feature".to_owned(),
            ))
        }
    })
}

/// Runs palisade on `listeners` until `shutdown` resolves, then drains in-flight requests for
/// at most `proxy.shutdown_grace_ms`.
///
/// # Errors
/// [`StartError`] before anything is served; once serving, it only returns at shutdown.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let metrics = Metrics::new(prometheus::Registry::new())?;
    let store = open_store(&config).await?;
    let mut resources: Vec<&str> = config
        .routes
        .iter()
        .filter(|r| r.guard)
        .map(|r| r.resource.as_str())
        .collect();
    resources.sort_unstable();
    resources.dedup();
    let admission = Arc::new(Admission::open(store, resources, &metrics).await?);
    let proxy = Arc::new(Proxy::new(&config, Arc::clone(&admission), &metrics));
    let grace = config.proxy.shutdown_grace;
    for w in &config.warnings {
        tracing::warn!("config: {w}");
    }
    let p = &config.proxy;
    let limits = server::Limits {
        max_connections: p.max_connections,
        header_read_timeout: p.header_read_timeout,
        idle_timeout: p.idle_timeout,
        http2_keepalive_interval: p.http2_keepalive_interval,
        grace,
        max_header_bytes: p.max_header_bytes,
        tls: p
            .tls
            .as_ref()
            .map(|t| Arc::new(arc_swap::ArcSwap::new(Arc::clone(&t.server)))),
    };
    // The admin listener is for operators and scrapers: a few connections are plenty, and its
    // own budget means a flood of connections on the data path does not lock operators out
    // (both still share the process's file descriptors).
    let admin_limits = server::Limits {
        max_connections: 64,
        tls: None,
        ..limits.clone()
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let admin_task = listeners.admin.map(|listener| {
        let admin = Admin::new(Arc::clone(&admission), metrics.clone());
        let mut stop = stop_rx.clone();
        tracing::info!(addr = %display_addr(&listener), "admin listening");
        tokio::spawn(server::serve_with(
            listener,
            move |req, _peer: server::Peer, _: &Arc<()>| {
                let admin = admin.clone();
                async move { admin.handle(req).await }
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
        routes = config.routes.len(),
        store = admission.store().kind(),
        marks = ?admission.marks(),
        "palisade listening"
    );
    server::serve_with(
        listeners.proxy,
        move |req, peer: server::Peer, affinity: &Arc<Affinity>| {
            let proxy = Arc::clone(&proxy);
            let affinity = Arc::clone(affinity);
            async move { proxy.handle(req, peer, &affinity).await }
        },
        shutdown,
        limits,
        Some(metrics.connections("proxy")),
    )
    .await;
    drop(stop_tx);
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    tracing::info!("palisade stopped");
    Ok(())
}

fn display_addr(l: &TcpListener) -> String {
    l.local_addr()
        .map_or_else(|e| format!("(unknown: {e})"), |a| a.to_string())
}
