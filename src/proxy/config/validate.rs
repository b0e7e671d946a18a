//! Raw settings in, typed settings out, every error naming its key and place.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use http::Method;
use toml::Spanned;

use super::*;

impl Validator<'_> {
    /// Validates every section, collecting every error found (each with its place and key)
    /// rather than stopping at the first, so an operator can fix a file in one pass. A route
    /// whose upstream is itself invalid is skipped: its upstream's error says what to fix.
    pub(super) fn validate(&self, mut raw: raw::File) -> Result<Config, ConfigError> {
        let mut errors = Vec::new();
        let proxy = keep(&mut errors, self.proxy(raw.proxy));
        let (admin, admin_warnings) = match keep(&mut errors, self.admin(raw.admin)) {
            Some((a, w)) => (Some(a), w),
            None => (None, Vec::new()),
        };
        let header = keep(&mut errors, self.header(raw.fencing));
        let mut retired = Vec::new();
        for (i, r) in std::mem::take(&mut raw.marks.retired)
            .into_iter()
            .enumerate()
        {
            if r.get_ref().is_empty() {
                errors.push(self.at(&r, format!("marks.retired[{i}]"), "must not be empty"));
            } else if !retired.contains(r.get_ref()) {
                retired.push(r.into_inner());
            }
        }
        let max_cached = keep(
            &mut errors,
            self.positive(
                raw.marks.max_cached.take(),
                "marks.max_cached",
                crate::fence::admission::DEFAULT_MAX_CACHED,
            ),
        )
        .unwrap_or(crate::fence::admission::DEFAULT_MAX_CACHED);
        let marks = keep(&mut errors, self.marks(raw.marks));

        let mut upstreams: Vec<UpstreamSettings> = Vec::with_capacity(raw.upstream.len());
        let mut broken = HashSet::new();
        for (i, u) in raw.upstream.into_iter().enumerate() {
            let name = u.name.get_ref().clone();
            match self.upstream(i, u, &upstreams) {
                Ok(u) => upstreams.push(u),
                Err(e) => {
                    errors.push(e);
                    broken.insert(name);
                }
            }
        }

        let mut routes: Vec<RouteSettings> = Vec::with_capacity(raw.route.len());
        let mut names = HashSet::new();
        let mut spans = Vec::with_capacity(raw.route.len());
        // The file's index of each valid route, for messages.
        let mut indices = Vec::with_capacity(raw.route.len());
        for (i, r) in raw.route.into_iter().enumerate() {
            let span = r.name.span().start;
            if let Some(Some(route)) = keep(
                &mut errors,
                self.route(i, r, &upstreams, &broken, &mut names, marks.as_ref()),
            ) {
                spans.push(span);
                indices.push(i);
                routes.push(route);
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if r.allow_unguarded_tunnel {
                continue;
            }
            if let Some(guarded) = tunnel_around(&routes, &upstreams, i) {
                errors.push(self.error(
                    spans[i],
                    format!("route[{}].websocket", indices[i]),
                    format_args!(
                        "{}; guard this route with their resource and missing_token = \
                         \"reject\" (the upgrade then needs a current token), give it an \
                         upstream that serves no guarded route, or set allow_unguarded_tunnel = \
                         true to accept the risk",
                        tunnel_risk(r, &guarded)
                    ),
                ));
            }
        }
        // One resource, one feed: a mark judged against two locks' epochs (or against one on
        // one route and none on another) would follow whichever route a request took.
        let mut feeds: std::collections::HashMap<&str, (usize, Option<&str>)> =
            std::collections::HashMap::new();
        for (i, r) in routes.iter().enumerate() {
            if !r.guard || r.template.is_some() {
                continue;
            }
            let key = r.epoch.as_ref().and_then(|e| e.fixed_key.as_deref());
            match feeds.get(r.resource.as_str()) {
                None => {
                    feeds.insert(&r.resource, (i, key));
                }
                Some(&(first, other)) if other != key => {
                    let feed = |k: Option<&str>| {
                        k.map_or("no lock".to_owned(), |k| format!("the lock of {k}"))
                    };
                    errors.push(self.error(
                        spans[i],
                        format!("route[{}].lock", indices[i]),
                        format_args!(
                            "resource {:?} is fed by {} here and by {} on route {:?}: every \
                             route of one resource names the same lock, or none",
                            r.resource,
                            feed(key),
                            feed(other),
                            routes[first].name
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        let access_log = keep(
            &mut errors,
            raw.access_log.map(|a| self.access_log(a)).transpose(),
        );
        let (Some(proxy), Some(admin), Some(header), Some(marks), Some(access_log), true) =
            (proxy, admin, header, marks, access_log, errors.is_empty())
        else {
            return Err(ConfigError::collected(errors));
        };
        let mut warnings = admin_warnings;
        warnings.extend(self.method_warnings(&routes, &upstreams, &spans));
        Ok(Config {
            file: self.file.to_path_buf(),
            digest: super::digest(self.text),
            proxy,
            admin,
            fencing: FencingSettings { header },
            marks,
            retired,
            max_cached,
            upstreams,
            routes,
            access_log,
            warnings,
        })
    }

    fn proxy(&self, p: raw::RawProxy) -> Result<ProxySettings, ConfigError> {
        Ok(ProxySettings {
            listen: self.listen(&p.listen, "proxy.listen")?,
            workers: match p.workers {
                Some(w) if *w.get_ref() == 0 => {
                    return Err(self.at(&w, "proxy.workers", "must be at least 1"))
                }
                w => w.map(Spanned::into_inner),
            },
            shutdown_grace: Duration::from_millis(p.shutdown_grace_ms),
            max_connections: self.positive(p.max_connections, "proxy.max_connections", 10_000)?,
            header_read_timeout: Duration::from_millis(self.positive(
                p.header_read_timeout_ms,
                "proxy.header_read_timeout_ms",
                10_000,
            )?),
            idle_timeout: Duration::from_millis(self.positive(
                p.idle_timeout_ms,
                "proxy.idle_timeout_ms",
                60_000,
            )?),
            http2_keepalive_interval: (p.http2_keepalive_interval_ms > 0)
                .then(|| Duration::from_millis(p.http2_keepalive_interval_ms)),
            require_nfkc_paths: p.require_nfkc_paths,
            http1_fast_path: p.http1_fast_path,
            tls: match p.tls {
                None => None,
                Some(t) => Some(self.tls(t, "proxy.tls")?),
            },
            max_header_bytes: match p.max_header_bytes {
                None => DEFAULT_MAX_HEADER_BYTES,
                Some(m) if *m.get_ref() < MIN_HEADER_BYTES => {
                    return Err(self.at(
                        &m,
                        "proxy.max_header_bytes",
                        format_args!("must be at least {MIN_HEADER_BYTES}"),
                    ))
                }
                Some(m) => m.into_inner(),
            },
        })
    }

    fn header(&self, f: raw::Fencing) -> Result<HeaderName, ConfigError> {
        Ok(match f.header {
            None => HeaderName::from_static(crate::token::DEFAULT_HEADER),
            Some(h) => HeaderName::from_bytes(h.get_ref().as_bytes())
                .ok()
                .filter(|n| n.as_str() == h.get_ref())
                .ok_or_else(|| {
                    self.at(
                        &h,
                        "fencing.header",
                        format_args!("{:?} is not a lower-case HTTP header name", h.get_ref()),
                    )
                })?,
        })
    }

    fn marks(&self, m: raw::Marks) -> Result<MarksSettings, ConfigError> {
        let etcd = m.etcd;
        if etcd.is_some() && m.store != raw::StoreKind::Etcd {
            return Err(self.error(0, "marks.etcd", "only used with store = \"etcd\""));
        }
        Ok(match (m.store, m.path) {
            (raw::StoreKind::Memory, None) => MarksSettings::Memory,
            (raw::StoreKind::Memory, Some(p)) => {
                return Err(self.at(&p, "marks.path", "only used with store = \"file\""))
            }
            (raw::StoreKind::Etcd, Some(p)) => {
                return Err(self.at(&p, "marks.path", "only used with store = \"file\""))
            }
            (raw::StoreKind::Etcd, None) => match etcd {
                Some(e) => MarksSettings::Etcd(self.etcd(e)?),
                None => {
                    return Err(self.error(
                        0,
                        "marks.etcd",
                        "store = \"etcd\" needs a [marks.etcd] table with endpoints",
                    ))
                }
            },
            (raw::StoreKind::File, p) => {
                let p = p.map_or_else(|| "data/marks.db".to_owned(), Spanned::into_inner);
                if p.is_empty() {
                    return Err(self.error(0, "marks.path", "must not be empty"));
                }
                let base = self.file.parent().unwrap_or(Path::new(""));
                MarksSettings::File { path: base.join(p) }
            }
        })
    }

    /// Route `i`; `None` when its upstream is invalid (reported already).
    fn route(
        &self,
        i: usize,
        r: raw::Route,
        upstreams: &[UpstreamSettings],
        broken: &HashSet<String>,
        names: &mut HashSet<String>,
        marks: Option<&MarksSettings>,
    ) -> Result<Option<RouteSettings>, ConfigError> {
        let key = |k: &str| format!("route[{i}].{k}");
        let name = r.name.get_ref().clone();
        if name.is_empty() {
            return Err(self.at(&r.name, key("name"), "must not be empty"));
        }
        if !names.insert(name.clone()) {
            return Err(self.at(
                &r.name,
                key("name"),
                format_args!("another [[route]] is already named {name:?}"),
            ));
        }
        if broken.contains(r.upstream.get_ref()) {
            return Ok(None); // its upstream's own error was reported
        }
        let upstream = upstreams
            .iter()
            .position(|u| &u.name == r.upstream.get_ref())
            .ok_or_else(|| {
                self.at(
                    &r.upstream,
                    key("upstream"),
                    format_args!("no [[upstream]] is named {:?}", r.upstream.get_ref()),
                )
            })?;
        let path = match (r.path, r.path_prefix, r.path_pattern) {
            (Some(p), None, None) => PathMatch::Exact(self.route_path(&p, &key("path"))?),
            (None, Some(p), None) => PathMatch::Prefix(self.route_path(&p, &key("path_prefix"))?),
            (None, None, Some(p)) => {
                let pattern = PathPattern::parse(p.get_ref())
                    .map_err(|e| self.error(p.span().start + 1 + e.at, key("path_pattern"), e))?;
                // Its literal segments must be in normal form, as a request's path is.
                let literal = pattern.as_str().replace(['{', '}', '*'], "");
                if let Err(e) = path::normalize(&literal) {
                    return Err(self.at(
                        &p,
                        key("path_pattern"),
                        format_args!("{:?} is not a normal-form path: {e}", p.get_ref()),
                    ));
                }
                PathMatch::Pattern(pattern)
            }
            (Some(p), _, _) | (None, Some(p), Some(_)) => {
                return Err(self.at(
                    &p,
                    key("path"),
                    "set one of path, path_prefix and path_pattern",
                ))
            }
            (None, None, None) => {
                return Err(self.at(
                    &r.name,
                    key("path_prefix"),
                    "a route needs path, path_prefix or path_pattern (use path_prefix = \"/\" \
                     for everything)",
                ))
            }
        };
        let methods = match r.methods {
            None => None,
            Some(list) => {
                if list.get_ref().is_empty() {
                    return Err(self.at(
                        &list,
                        key("methods"),
                        "must list at least one method (omit it for every method)",
                    ));
                }
                let mut out = Vec::new();
                for (j, m) in list.get_ref().iter().enumerate() {
                    let s = m.get_ref();
                    let valid = !s.is_empty()
                        && s.bytes()
                            .all(|b| b.is_ascii_uppercase() || b == b'-' || b == b'_');
                    let method = valid
                        .then(|| Method::from_bytes(s.as_bytes()).ok())
                        .flatten()
                        .ok_or_else(|| {
                            self.at(
                                m,
                                key(&format!("methods[{j}]")),
                                format_args!(
                                    "{s:?} is not an HTTP method (upper case, e.g. \"POST\")"
                                ),
                            )
                        })?;
                    if !out.contains(&method) {
                        out.push(method);
                    }
                }
                Some(out)
            }
        };
        let host =
            match r.host {
                None => None,
                Some(h) => Some(crate::proxy::host::parse_route_host(h.get_ref()).map_err(
                    |why| self.at(&h, key("host"), format_args!("{:?} {why}", h.get_ref())),
                )?),
            };
        let (resource, template) = match r.resource {
            None if matches!(path, PathMatch::Pattern(_)) && r.guard => {
                return Err(self.at(
                    &r.name,
                    key("resource"),
                    "a guarded route with path_pattern needs a resource template, e.g. \
                     resource = \"warehouse/{id}\"",
                ))
            }
            None => (name.clone(), None),
            Some(res) if res.get_ref().is_empty() => {
                return Err(self.at(&res, key("resource"), "must not be empty"))
            }
            Some(res) => {
                let captures: Vec<&str> = match &path {
                    PathMatch::Pattern(p) => p.names().collect(),
                    _ => Vec::new(),
                };
                let t = ResourceTemplate::parse(res.get_ref(), captures.iter().copied())
                    .map_err(|e| self.error(res.span().start + 1 + e.at, key("resource"), e))?;
                let template = (!t.is_fixed()).then_some(t);
                (res.into_inner(), template)
            }
        };
        let max_marks = match r.max_marks {
            Some(m) if template.is_none() || !r.guard => {
                return Err(self.at(
                    &m,
                    key("max_marks"),
                    "only used on a guarded route whose resource is a template",
                ))
            }
            Some(m) if *m.get_ref() == 0 => {
                return Err(self.at(&m, key("max_marks"), "must be at least 1"))
            }
            Some(m) => Some(m.into_inner()),
            None => template.as_ref().map(|_| super::DEFAULT_MAX_MARKS),
        };
        let epoch = self.epoch_feed(
            [
                (r.lock, crate::client::session::EpochOf::Lock, "lock"),
                (
                    r.election,
                    crate::client::session::EpochOf::Election,
                    "election",
                ),
                (r.rwlock, crate::client::session::EpochOf::RwLock, "rwlock"),
                (
                    r.semaphore,
                    crate::client::session::EpochOf::Semaphore,
                    "semaphore",
                ),
            ],
            r.lock_namespace,
            (r.guard, &path, &resource, template.as_ref()),
            marks,
            &key,
        )?;
        let max_token = match r.max_token {
            Some(m) if *m.get_ref() == 0 => {
                return Err(self.at(&m, key("max_token"), "must be at least 1"))
            }
            Some(m) if !r.guard => {
                return Err(self.at(&m, key("max_token"), "only used with guard = true"))
            }
            m => m.map(Spanned::into_inner),
        };
        let up = &upstreams[upstream];
        let connect_timeout = match r.connect_timeout_ms {
            Some(t) if *t.get_ref() == 0 => {
                return Err(self.at(&t, key("connect_timeout_ms"), "must be at least 1"))
            }
            Some(t) => Duration::from_millis(t.into_inner()),
            None => up.connect_timeout,
        };
        let response_timeout = match r.response_timeout_ms {
            Some(0) => None,
            Some(t) => Some(Duration::from_millis(t)),
            None => up.response_timeout,
        };
        let max_body_bytes = r.max_body_bytes.map(Spanned::into_inner);
        let websocket =
            match r.websocket {
                Some(w) if *w.get_ref() && up.protocol != Protocol::Http1 => return Err(self.at(
                    &w,
                    key("websocket"),
                    "needs an upstream with protocol = \"http1\" (WebSocket upgrades are HTTP/1.1)",
                )),
                w => w.is_some_and(Spanned::into_inner),
            };
        Ok(Some(RouteSettings {
            name,
            upstream,
            path,
            methods,
            host,
            resource,
            template,
            max_marks,
            epoch,
            guard: r.guard,
            missing_token: r.missing_token,
            strip_token: r.strip_token,
            other_methods: r.other_methods,
            get_bodies: r.get_bodies,
            max_token,
            drain_timeout: Duration::from_millis(r.drain_timeout_ms),
            connect_timeout,
            response_timeout,
            max_body_bytes,
            websocket,
            allow_unguarded_tunnel: r.allow_unguarded_tunnel,
        }))
    }

    /// A route's `lock`, `election`, `rwlock` or `semaphore` and `lock_namespace` (at most one
    /// of the four). A semaphore's slot is the route pattern's `{slot}` capture, which its
    /// resource must use too (one mark per slot, as `Permit::resource` names it).
    #[allow(clippy::type_complexity)]
    fn epoch_feed(
        &self,
        given: [(
            Option<Spanned<String>>,
            crate::client::session::EpochOf,
            &str,
        ); 4],
        namespace: Option<Spanned<String>>,
        (guard, path, resource, template): (bool, &PathMatch, &str, Option<&ResourceTemplate>),
        marks: Option<&MarksSettings>,
        key: &dyn Fn(&str) -> String,
    ) -> Result<Option<super::EpochFeed>, ConfigError> {
        let mut set = given
            .into_iter()
            .filter_map(|(v, kind, k)| v.map(|v| (v, kind, k)));
        let Some((name, kind, k)) = set.next() else {
            return match namespace {
                Some(ns) => Err(self.at(
                    &ns,
                    key("lock_namespace"),
                    "only used with lock, election, rwlock or semaphore",
                )),
                None => Ok(None),
            };
        };
        if let Some((other, _, k2)) = set.next() {
            return Err(self.at(
                &other,
                key(k2),
                format_args!(
                    "set one of lock, election, rwlock and semaphore ({k} is set already)"
                ),
            ));
        }
        if !guard {
            return Err(self.at(&name, key(k), "only used on a guarded route"));
        }
        if marks.is_some() && !matches!(marks, Some(MarksSettings::Etcd(_))) {
            return Err(self.at(
                &name,
                key(k),
                "needs [marks] store = \"etcd\": the epoch is read, with the mark, from the \
                 etcd cluster the primitive lives in",
            ));
        }
        let namespace = match namespace {
            Some(ns) => {
                if let Err(e) = crate::client::session::epoch_key(ns.get_ref(), kind, "x") {
                    return Err(self.at(&ns, key("lock_namespace"), e));
                }
                ns.into_inner()
            }
            None => crate::client::session::DEFAULT_NAMESPACE.to_owned(),
        };
        let captures: Vec<&str> = match path {
            PathMatch::Pattern(p) => p.names().collect(),
            _ => Vec::new(),
        };
        let parsed = ResourceTemplate::parse(name.get_ref(), captures.iter().copied())
            .map_err(|e| self.error(name.span().start + 1 + e.at, key(k), e))?;
        let within = match template {
            Some(t) => parsed.placeholders_within(t),
            None => parsed.is_fixed(),
        };
        if !within {
            return Err(self.at(
                &name,
                key(k),
                format_args!(
                    "may only use placeholders of resource = {resource:?}: one entity must be \
                     fed by one primitive"
                ),
            ));
        }
        if kind == crate::client::session::EpochOf::Semaphore {
            let slot = ResourceTemplate::parse("{slot}", captures.iter().copied()).ok();
            let per_slot = match (slot, template) {
                (Some(slot), Some(t)) => slot.placeholders_within(t),
                _ => false,
            };
            if !per_slot {
                return Err(self.at(
                    &name,
                    key(k),
                    "needs a path_pattern with a {slot} capture that the resource uses too \
                     (e.g. path_pattern = \"/jobs/{slot}/run\", resource = \"jobs/{slot}\"): \
                     each slot has its own epoch and its own mark",
                ));
            }
        }
        let fixed_key = if parsed.is_fixed() && kind != crate::client::session::EpochOf::Semaphore {
            let k_ = crate::client::session::epoch_key(&namespace, kind, parsed.as_str())
                .map_err(|e| self.at(&name, key(k), e))?;
            Some(std::sync::Arc::from(k_))
        } else {
            None
        };
        Ok(Some(super::EpochFeed {
            kind,
            namespace,
            name: parsed,
            fixed_key,
        }))
    }

    pub(super) fn route_path(&self, p: &Spanned<String>, key: &str) -> Result<String, ConfigError> {
        if p.get_ref().contains(['?', '#']) {
            return Err(self.at(
                p,
                key,
                "must not contain '?' or '#' (routes match the path alone, never the query)",
            ));
        }
        match path::normalize(p.get_ref()) {
            Ok(n) if !n.contains(';') => Ok(n.into_owned()),
            Ok(_) => Err(self.at(p, key, "must not contain ';'")),
            Err(e) => Err(self.at(
                p,
                key,
                format_args!("{:?} is not a normal-form path: {e}", p.get_ref()),
            )),
        }
    }
}

/// Keeps `r`'s value, or notes its error and gives `None`.
fn keep<T>(errors: &mut Vec<ConfigError>, r: Result<T, ConfigError>) -> Option<T> {
    r.map_err(|e| errors.push(e)).ok()
}

/// The guarded routes that route `i`'s WebSocket tunnels could reach unchecked: `i` allows
/// upgrades without a current token of theirs (unguarded, `missing_token = "allow"`, or
/// guarded by another resource) and they send to one of its upstream's addresses. `None`
/// when there are none.
pub(super) fn tunnel_around(
    routes: &[RouteSettings],
    upstreams: &[UpstreamSettings],
    i: usize,
) -> Option<Vec<String>> {
    let r = &routes[i];
    if !r.websocket {
        return None;
    }
    let open = !r.guard || r.missing_token == crate::fence::guard::MissingToken::Allow;
    let of = |u: &UpstreamSettings| -> Vec<(String, u16)> {
        let default = if u.scheme == http::uri::Scheme::HTTPS {
            443
        } else {
            80
        };
        u.addresses
            .iter()
            .map(|a| (same_host(a.host()), a.port_u16().unwrap_or(default)))
            .collect()
    };
    let ours = of(&upstreams[r.upstream]);
    let guarded: Vec<String> = routes
        .iter()
        .filter(|g| !std::ptr::eq(*g, r) && g.guard && (open || g.resource != r.resource))
        .filter(|g| of(&upstreams[g.upstream]).iter().any(|a| ours.contains(a)))
        .map(|g| g.name.clone())
        .collect();
    (!guarded.is_empty()).then_some(guarded)
}

/// Why a WebSocket route next to guarded ones is a hole, in words.
pub(super) fn tunnel_risk(route: &RouteSettings, guarded: &[String]) -> String {
    let how = if !route.guard {
        "unguarded route"
    } else if route.missing_token == crate::fence::guard::MissingToken::Allow {
        "route with missing_token = \"allow\""
    } else {
        "route of another resource"
    };
    format!(
        "{how} {:?} allows WebSocket upgrades to an upstream that also serves guarded routes \
         ({}): once the upstream answers 101 the connection is a raw tunnel palisade no longer \
         reads, so a stale owner can send their writes through it to an upstream that keeps \
         parsing HTTP on it",
        route.name,
        guarded
            .iter()
            .map(|g| format!("{g:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A host as a connection reaches it, for telling whether two upstreams are one: lower case,
/// no trailing dot, and every spelling of this machine's loopback (`localhost`, `127.x.y.z`,
/// `::1`, `0.0.0.0`, `::ffff:127.0.0.1`) as one. Other names are not resolved.
fn same_host(host: &str) -> String {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    let h = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
    let loopback = h == "localhost"
        || h.ends_with(".localhost")
        || h.parse::<std::net::IpAddr>().is_ok_and(|ip| match ip {
            std::net::IpAddr::V4(v4) => v4.is_loopback() || v4.is_unspecified(),
            std::net::IpAddr::V6(v6) => {
                v6.is_loopback()
                    || v6.is_unspecified()
                    || v6
                        .to_ipv4_mapped()
                        .is_some_and(|v4| v4.is_loopback() || v4.is_unspecified())
            }
        });
    if loopback {
        "loopback".to_owned()
    } else {
        h
    }
}
