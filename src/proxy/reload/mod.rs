//! Configuration reload without dropping connections (SIGHUP, admin `POST /reload`).
//!
//! The configuration in force is one `Proxy` (the routes and upstreams, built from it) behind an [`ArcSwap`]: each request loads it
//! once and keeps its `Arc` until its response is over, so a request always finishes on the
//! configuration it started with, and the data path takes no lock to get it.
//!
//! A reload, one at a time:
//! 1. reads, parses and validates the file the configuration came from; an invalid file
//!    changes nothing (the error, with file:line:column, is logged and returned);
//! 2. keeps the running value of every key that applies only at start ([`KeptKey`]: listen
//!    addresses, the mark store, workers, connection limits) and warns about each;
//! 3. never lets a reload drop protection ([`protection`]): where the running routes guard
//!    requests with a mark above 0, the new routes must still guard them. Requests that now
//!    reach a guarded route of another resource carry the old mark over (raised and
//!    persisted before the new routes serve); requests that would reach an unguarded route
//!    refuse the reload ([`ReloadError::Unprotected`]) unless `[marks] retired` lists the
//!    resource, the operator's explicit and logged decision;
//! 4. opens the resources that are new to the configuration, each with its mark loaded
//!    from the store ([`Admission::open_resources`]), before any route uses them; known
//!    resources keep their marks (marks are state, not configuration);
//! 5. builds the new `Proxy`, carrying over unchanged upstreams with their connections and
//!    an unchanged access log (`Proxy::build`), and swaps it in.
//!
//! Counted in `palisade_config_reloads_total{result="ok"|"error"}`. The file in force is
//! `palisade_config_info{digest}` (the SHA-256 of its text, [`Config::digest`]): one series,
//! replaced when a reload succeeds.

mod kept_keys;
pub mod protection;

use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts};

pub use kept_keys::KeptKey;

use crate::fence::admission::Admission;
use crate::fence::marks::StoreError;
use crate::fence::metrics::Metrics;
use crate::proxy::access_log::{AccessLogError, AccessLogs};
use crate::proxy::config::{Config, ConfigError};
pub use crate::proxy::pipeline::CarriedOver;
use crate::proxy::pipeline::Proxy;

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file could not be read or is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The mark of a resource new to the configuration could not be loaded.
    #[error("cannot load the marks of the new resources: {0}")]
    Store(#[from] StoreError),
    /// The access log's new target could not be opened.
    #[error(transparent)]
    AccessLog(#[from] AccessLogError),
    /// The task reading the file failed.
    #[error("reading the configuration failed: {0}")]
    TaskLost(#[source] tokio::task::JoinError),
    /// The new configuration stops guarding resources that have marks.
    #[error("{}", protection::explain(.0))]
    Unprotected(Vec<protection::Dropped>),
    /// A mark could not be carried over to a renamed resource.
    #[error("cannot carry the mark {mark} of {from:?} over to {to:?}: {source}")]
    Carry {
        /// The old resource.
        from: String,
        /// The new resource.
        to: String,
        /// The mark carried.
        mark: u64,
        /// Why it failed.
        #[source]
        source: crate::fence::admission::Refused,
    },
}

/// What a successful reload changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// Routes now in force.
    pub routes: usize,
    /// Upstreams kept with their connections, and new ones.
    pub carried: CarriedOver,
    /// Resources new to the configuration, with marks loaded from the store.
    pub new_resources: Vec<String>,
    /// Marks carried over to renamed resources.
    pub carried_marks: Vec<protection::Carried>,
    /// Resources with marks that are no longer guarded because `[marks] retired` lists them.
    pub retired: Vec<protection::Dropped>,
    /// Keys whose new values take a restart (their running values stay).
    pub kept: Vec<KeptKey>,
}

/// Reloads the configuration of a running palisade; cheap to clone.
#[derive(Clone)]
pub struct Reloader {
    inner: Arc<Inner>,
}

struct Inner {
    current: Arc<ArcSwap<Proxy>>,
    /// The configuration in force, and the guarded routes of earlier ones whose requests
    /// reach no route (see [`protection::Plan::ghosts`]); the lock makes reloads take turns.
    config: tokio::sync::Mutex<(Config, Vec<protection::Ghost>)>,
    admission: Arc<Admission>,
    metrics: Metrics,
    access_logs: AccessLogs,
    /// The listener's TLS configuration: a reload puts the re-read certificates in force.
    tls: Option<crate::proxy::server::TlsConfig>,
    /// The admin listener's, likewise.
    admin_tls: Option<crate::proxy::server::TlsConfig>,
    ok: IntCounter,
    error: IntCounter,
    /// `palisade_config_info{digest}`.
    info: IntGaugeVec,
    /// A copy of the configuration in force, read without waiting for a reload (the admin's
    /// status page).
    shown: ArcSwap<Config>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

impl Reloader {
    /// A reloader for the proxy in `current`, built from `config`; `tls` and `admin_tls` are
    /// the listeners' TLS configurations, which a reload replaces with re-read certificates.
    ///
    /// # Errors
    /// When `palisade_config_reloads_total` or `palisade_config_info` is already registered
    /// in `metrics`' registry.
    pub(crate) fn new(
        current: Arc<ArcSwap<Proxy>>,
        config: Config,
        admission: Arc<Admission>,
        metrics: Metrics,
        access_logs: AccessLogs,
        tls: Option<crate::proxy::server::TlsConfig>,
        admin_tls: Option<crate::proxy::server::TlsConfig>,
    ) -> prometheus::Result<Self> {
        let reloads = IntCounterVec::new(
            Opts::new(
                "palisade_config_reloads_total",
                "Configuration reloads, by result (ok, or error: the previous one stayed).",
            ),
            &["result"],
        )?;
        let info = IntGaugeVec::new(
            Opts::new(
                "palisade_config_info",
                "The configuration file in force: 1, labelled with the SHA-256 of its text.",
            ),
            &["digest"],
        )?;
        metrics.registry().register(Box::new(reloads.clone()))?;
        metrics.registry().register(Box::new(info.clone()))?;
        info.with_label_values(&[config.digest.as_str()]).set(1);
        Ok(Self {
            inner: Arc::new(Inner {
                current,
                shown: ArcSwap::from_pointee(config.clone()),
                config: tokio::sync::Mutex::new((config, Vec::new())),
                ok: reloads.with_label_values(&["ok"]),
                error: reloads.with_label_values(&["error"]),
                info,
                admission,
                metrics,
                access_logs,
                tls,
                admin_tls,
            }),
        })
    }

    /// Reads the configuration file again and, if it is valid, puts it in force (see the
    /// module docs). Logs and counts the result either way.
    ///
    /// # Errors
    /// [`ReloadError`]: nothing changed, the previous configuration still serves.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let mut guard = self.inner.config.lock().await;
        let (in_force, ghosts) = &mut *guard;
        let result = self.apply(in_force, ghosts).await;
        match &result {
            Ok(r) => {
                self.inner.ok.inc();
                for k in &r.kept {
                    tracing::warn!("config reload: {k}");
                }
                for c in &r.carried_marks {
                    tracing::warn!(
                        route = %c.route, from = %c.from, to = %c.to, mark = c.mark,
                        "config reload: the route's requests now go to another resource; the old \
                         mark was carried over (persisted before the new routes serve)"
                    );
                }
                for d in &r.retired {
                    tracing::warn!(
                        resource = %d.resource, mark = d.mark, route = %d.route, why = %d.why,
                        "config reload: resource no longer guarded, as [marks] retired says; \
                         its mark stays in the store (audit: operator's decision in {})",
                        in_force.file.display()
                    );
                }
                tracing::info!(
                    file = %in_force.file.display(),
                    routes = r.routes,
                    upstreams_kept = r.carried.upstreams_kept,
                    upstreams_new = r.carried.upstreams_new,
                    new_resources = ?r.new_resources,
                    "config reloaded"
                );
            }
            Err(e) => {
                self.inner.error.inc();
                tracing::error!(error = %e, "config reload failed; the previous configuration stays in force");
            }
        }
        result
    }

    async fn apply(
        &self,
        in_force: &mut Config,
        ghosts: &mut Vec<protection::Ghost>,
    ) -> Result<Reloaded, ReloadError> {
        let i = &self.inner;
        let path = in_force.file.clone();
        let mut next = tokio::task::spawn_blocking(move || Config::load(path))
            .await
            .map_err(ReloadError::TaskLost)??;
        let kept = kept_keys::keep(in_force, &mut next);
        let plan = protection::plan_with(in_force, ghosts, &next, |r| {
            i.admission.resource(r).map_or(0, |r| r.mark())
        });
        if !plan.unprotected.is_empty() {
            return Err(ReloadError::Unprotected(plan.unprotected));
        }
        // Before the new routes serve, and before their new resources are opened: the
        // resources that take over a guarded route's requests start from its mark (a new
        // name becomes another name of the same resource, see `Admission::carry`). What this
        // did stays if a later step fails: two names sharing a mark, or a raised mark, only
        // refuse more.
        for c in &plan.carried {
            i.admission
                .carry(&c.from, &c.to)
                .await
                .map_err(|source| ReloadError::Carry {
                    from: c.from.clone(),
                    to: c.to.clone(),
                    mark: c.mark,
                    source,
                })?;
        }
        let new_resources = i
            .admission
            .open_resources(
                next.routes
                    .iter()
                    .filter(|r| r.guard && r.template.is_none())
                    .map(|r| r.resource.as_str()),
            )
            .await?;
        let previous = i.current.load_full();
        let access_log = match &next.access_log {
            None => None,
            Some(s) => match previous.access_log().filter(|l| l.settings() == s) {
                Some(same) => Some(Arc::clone(same)),
                None => Some(i.access_logs.open(s)?),
            },
        };
        let (proxy, carried) = Proxy::build(
            &next,
            Arc::clone(&i.admission),
            &i.metrics,
            Some(&previous),
            access_log,
        );
        i.admission.set_max_cached(next.max_cached);
        i.current.store(Arc::new(proxy));
        // The locks that feed routes may have changed: every fed resource reads its epoch
        // again before it judges on its local mark.
        i.admission.unsettle_epochs();
        if let (Some(listener), Some(tls)) = (&i.tls, &next.proxy.tls) {
            listener.store(Arc::clone(&tls.server));
        }
        let admin_tls = next.admin.as_ref().and_then(|a| a.tls.as_ref());
        if let (Some(listener), Some(tls)) = (&i.admin_tls, admin_tls) {
            listener.store(Arc::clone(&tls.server));
        }
        // One series: the file in force.
        if in_force.digest != next.digest {
            let _ = i.info.remove_label_values(&[in_force.digest.as_str()]);
            i.info.with_label_values(&[next.digest.as_str()]).set(1);
        }
        for w in &next.warnings {
            tracing::warn!("config: {w}");
        }
        let reloaded = Reloaded {
            routes: next.routes.len(),
            carried,
            new_resources,
            carried_marks: plan.carried,
            retired: plan.retired,
            kept,
        };
        i.shown.store(Arc::new(next.clone()));
        *in_force = next;
        *ghosts = plan.ghosts.clone();
        Ok(reloaded)
    }

    /// Asks the access log in force to reopen its file (SIGUSR1, after logrotate renamed
    /// it). `false` when there is no access log.
    pub fn reopen_access_log(&self) -> bool {
        match self.inner.current.load().access_log() {
            Some(log) => {
                log.reopen();
                true
            }
            None => false,
        }
    }

    /// The configuration in force.
    pub(crate) fn proxy(&self) -> Arc<Proxy> {
        self.inner.current.load_full()
    }

    /// The validated file in force (the one the last successful reload, or the start, read).
    pub fn config(&self) -> Arc<Config> {
        self.inner.shown.load_full()
    }

    /// Reloads so far: `(succeeded, failed)`, as `palisade_config_reloads_total` counts them.
    pub fn reloads(&self) -> (u64, u64) {
        (self.inner.ok.get(), self.inner.error.get())
    }
}
