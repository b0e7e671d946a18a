//! Raw settings in, typed settings out, every error naming its key and place.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use http::uri::Scheme;
use http::{Method, Uri};
use toml::Spanned;

use super::*;

impl Validator<'_> {
    pub(super) fn validate(&self, raw: raw::File) -> Result<Config, ConfigError> {
        let proxy = ProxySettings {
            listen: self.listen(&raw.proxy.listen, "proxy.listen")?,
            workers: match raw.proxy.workers {
                Some(w) if *w.get_ref() == 0 => {
                    return Err(self.at(&w, "proxy.workers", "must be at least 1"))
                }
                w => w.map(Spanned::into_inner),
            },
            shutdown_grace: Duration::from_millis(raw.proxy.shutdown_grace_ms),
            max_connections: self.positive(
                raw.proxy.max_connections,
                "proxy.max_connections",
                10_000,
            )?,
            header_read_timeout: Duration::from_millis(self.positive(
                raw.proxy.header_read_timeout_ms,
                "proxy.header_read_timeout_ms",
                10_000,
            )?),
            idle_timeout: Duration::from_millis(self.positive(
                raw.proxy.idle_timeout_ms,
                "proxy.idle_timeout_ms",
                60_000,
            )?),
            http2_keepalive_interval: (raw.proxy.http2_keepalive_interval_ms > 0)
                .then(|| Duration::from_millis(raw.proxy.http2_keepalive_interval_ms)),
            require_nfkc_paths: raw.proxy.require_nfkc_paths,
        };
        let admin = match raw.admin {
            None => Some(AdminSettings {
                listen: DEFAULT_ADMIN_LISTEN.parse().expect("valid default"),
            }),
            Some(a) if !a.enabled => None,
            Some(a) => Some(AdminSettings {
                listen: match a.listen {
                    Some(l) => self.listen(&l, "admin.listen")?,
                    None => DEFAULT_ADMIN_LISTEN.parse().expect("valid default"),
                },
            }),
        };
        let header = match raw.fencing.header {
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
        };
        let etcd = raw.marks.etcd;
        if etcd.is_some() && raw.marks.store != raw::StoreKind::Etcd {
            return Err(self.error(0, "marks.etcd", "only used with store = \"etcd\""));
        }
        let marks = match (raw.marks.store, raw.marks.path) {
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
                let p = p.map_or_else(|| "data/marks.json".to_owned(), Spanned::into_inner);
                if p.is_empty() {
                    return Err(self.error(0, "marks.path", "must not be empty"));
                }
                let base = self.file.parent().unwrap_or(Path::new(""));
                MarksSettings::File { path: base.join(p) }
            }
        };

        let mut upstreams: Vec<UpstreamSettings> = Vec::with_capacity(raw.upstream.len());
        for (i, u) in raw.upstream.into_iter().enumerate() {
            let key = |k: &str| format!("upstream[{i}].{k}");
            let name = u.name.get_ref();
            if name.is_empty() {
                return Err(self.at(&u.name, key("name"), "must not be empty"));
            }
            if upstreams.iter().any(|x| &x.name == name) {
                return Err(self.at(
                    &u.name,
                    key("name"),
                    format_args!("another [[upstream]] is already named {name:?}"),
                ));
            }
            let bad_url = |why: &str| {
                self.at(
                    &u.url,
                    key("url"),
                    format_args!("{:?} {why}", u.url.get_ref()),
                )
            };
            let uri: Uri = u
                .url
                .get_ref()
                .parse()
                .map_err(|_| bad_url("is not a URL"))?;
            if uri.scheme() != Some(&Scheme::HTTP) {
                return Err(bad_url(
                    "must start with http:// (TLS to upstreams is not supported yet)",
                ));
            }
            let authority = uri
                .authority()
                .cloned()
                .ok_or_else(|| bad_url("has no host"))?;
            if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                return Err(bad_url(
                    "must not have a path or query: routes forward the request's own path",
                ));
            }
            upstreams.push(UpstreamSettings {
                name: name.clone(),
                scheme: Scheme::HTTP,
                authority,
                protocol: u.protocol,
                connect_timeout: Duration::from_millis(u.connect_timeout_ms),
                response_timeout: (u.response_timeout_ms > 0)
                    .then(|| Duration::from_millis(u.response_timeout_ms)),
            });
        }

        let mut routes: Vec<RouteSettings> = Vec::with_capacity(raw.route.len());
        let mut names = HashSet::new();
        let mut spans = Vec::with_capacity(raw.route.len());
        for (i, r) in raw.route.into_iter().enumerate() {
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
            let path = match (r.path, r.path_prefix) {
                (Some(p), None) => PathMatch::Exact(self.route_path(&p, &key("path"))?),
                (None, Some(p)) => PathMatch::Prefix(self.route_path(&p, &key("path_prefix"))?),
                (Some(p), Some(_)) => {
                    return Err(self.at(
                        &p,
                        key("path"),
                        "set either path or path_prefix, not both",
                    ))
                }
                (None, None) => {
                    return Err(self.at(
                        &r.name,
                        key("path_prefix"),
                        "a route needs path or path_prefix (use \"/\" for everything)",
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
            let host = match r.host {
                None => None,
                Some(h) => Some(crate::host::parse_route_host(h.get_ref()).map_err(|why| {
                    self.at(&h, key("host"), format_args!("{:?} {why}", h.get_ref()))
                })?),
            };
            let resource = match r.resource {
                None => name.clone(),
                Some(res) if res.get_ref().is_empty() => {
                    return Err(self.at(&res, key("resource"), "must not be empty"))
                }
                Some(res) => res.into_inner(),
            };
            let max_token = match r.max_token {
                Some(m) if *m.get_ref() == 0 => {
                    return Err(self.at(&m, key("max_token"), "must be at least 1"))
                }
                Some(m) if !r.guard => {
                    return Err(self.at(&m, key("max_token"), "only used with guard = true"))
                }
                m => m.map(Spanned::into_inner),
            };
            spans.push(r.name.span().start);
            routes.push(RouteSettings {
                name,
                upstream,
                path,
                methods,
                host,
                resource,
                guard: r.guard,
                missing_token: r.missing_token,
                strip_token: r.strip_token,
                other_methods: r.other_methods,
                get_bodies: r.get_bodies,
                max_token,
                drain_timeout: Duration::from_millis(r.drain_timeout_ms),
            });
        }
        let access_log = raw.access_log.map(|a| self.access_log(a)).transpose()?;
        let warnings = self.method_warnings(&routes, &spans);
        Ok(Config {
            file: self.file.to_path_buf(),
            proxy,
            admin,
            fencing: FencingSettings { header },
            marks,
            upstreams,
            routes,
            access_log,
            warnings,
        })
    }

    pub(super) fn route_path(&self, p: &Spanned<String>, key: &str) -> Result<String, ConfigError> {
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
