//! Building a [`Proxy`] from a configuration, at start and on every reload.
//!
//! A reload builds a whole new `Proxy` and swaps it in; requests in flight keep the one they
//! started with. What must outlive the swap is carried over from the previous `Proxy`, never
//! rebuilt:
//! - upstreams whose settings did not change keep their [`Upstream`] (the same `Arc`), so
//!   their idle pools, the h2c client's connection, and every client connection's affine
//!   upstream connection (its slot compares pools by pointer) stay in use;
//! - resources are the [`Admission`]'s, shared by every configuration, so marks, advance
//!   locks and drains are never reset;
//! - the access log, when its settings did not change.

use std::sync::Arc;

use http::header::HeaderValue;
use http::Method;

use super::upstream::Upstream;
use super::{Proxy, Route};
use crate::fence::admission::Admission;
use crate::fence::metrics::Metrics;
use crate::proxy::access_log::AccessLog;
use crate::proxy::config::Config;

/// What a reload carried over from the previous configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CarriedOver {
    /// Upstreams whose settings did not change: their connections stay open.
    pub upstreams_kept: usize,
    /// Upstreams that are new or changed: they start without connections.
    pub upstreams_new: usize,
}

impl Proxy {
    /// Builds the proxy for `config`, with no access log and nothing carried over. Every
    /// guarded route's resource must be in `admission`.
    ///
    /// # Panics
    /// If a guarded route's resource is missing from `admission` (a wiring bug, not bad input).
    #[cfg(test)]
    pub(crate) fn new(config: &Config, admission: Arc<Admission>, metrics: &Metrics) -> Self {
        Self::build(config, admission, metrics, None, None).0
    }

    /// Builds the proxy for `config`, reusing from `previous` every upstream whose settings
    /// are unchanged (see the module docs), and writing to `access_log`.
    ///
    /// # Panics
    /// If a guarded route's resource is missing from `admission` (open it first with
    /// [`Admission::open_resources`]).
    pub(crate) fn build(
        config: &Config,
        admission: Arc<Admission>,
        metrics: &Metrics,
        previous: Option<&Proxy>,
        access_log: Option<Arc<AccessLog>>,
    ) -> (Self, CarriedOver) {
        let mut carried = CarriedOver::default();
        let upstreams: Vec<Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|s| {
                let same = previous.and_then(|p| p.upstreams.iter().find(|u| u.settings == *s));
                match same {
                    Some(u) => {
                        carried.upstreams_kept += 1;
                        Arc::clone(u)
                    }
                    None => {
                        carried.upstreams_new += 1;
                        Arc::new(Upstream::new(s))
                    }
                }
            })
            .collect();
        let routes: Vec<Route> = config
            .routes
            .iter()
            .map(|r| Route {
                settings: r.clone(),
                // A templated route opens its resources per request.
                resource: (r.guard && r.template.is_none()).then(|| {
                    admission
                        .resource(&r.resource)
                        .expect("every guarded fixed resource is loaded")
                }),
                metrics: metrics.route(&r.name, r.guard.then_some(r.resource.as_str())),
                allow: r.methods.as_ref().and_then(|ms| {
                    let list: Vec<&str> = ms.iter().map(Method::as_str).collect();
                    HeaderValue::from_str(&list.join(", ")).ok()
                }),
            })
            .collect();
        let all_fast = routes.iter().all(|r| Proxy::fast_route(r, &upstreams));
        let proxy = Self {
            all_fast,
            routes,
            upstreams,
            header: config.fencing.header.clone(),
            require_nfkc_paths: config.proxy.require_nfkc_paths,
            admission,
            unrouted: metrics.outcomes(""),
            access_log,
            stale_log: previous.map_or_else(super::stale_log::StaleLog::new, |p| {
                Arc::clone(&p.stale_log)
            }),
        };
        (proxy, carried)
    }

    /// Whether a route of this configuration guards `resource` (a fixed one, or one its
    /// template can fill in).
    pub(crate) fn guards(&self, resource: &str) -> bool {
        self.routes.iter().any(|r| {
            r.resource.as_ref().is_some_and(|x| x.name() == resource)
                || (r.settings.guard
                    && r.settings
                        .template
                        .as_ref()
                        .is_some_and(|t| t.could_produce(resource)))
        })
    }

    /// The access log this configuration writes to, if any.
    pub(crate) fn access_log(&self) -> Option<&Arc<AccessLog>> {
        self.access_log.as_ref()
    }
}
