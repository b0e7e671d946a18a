//! `[[upstream]]` tables: one address (`url`) or several (`urls`), timeouts and ejection.

use std::time::Duration;

use http::uri::Scheme;
use http::Uri;
use toml::Spanned;

use super::*;

/// Default `connect_timeout_ms`.
const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default `idle_timeout_ms` (what hyper-util's pool uses).
const IDLE_TIMEOUT_MS: u64 = 90_000;
/// Default `fail_timeout_ms` (nginx's).
const FAIL_TIMEOUT_MS: u64 = 10_000;
/// Default `health_check_interval_ms`.
const HEALTH_INTERVAL_MS: u64 = 5_000;

impl Validator<'_> {
    /// Validates upstream `i`; `earlier` are the ones before it (names must be unique).
    pub(super) fn upstream(
        &self,
        i: usize,
        u: raw::RawUpstream,
        earlier: &[UpstreamSettings],
    ) -> Result<UpstreamSettings, ConfigError> {
        let key = |k: &str| format!("upstream[{i}].{k}");
        let name = u.name.get_ref();
        if name.is_empty() {
            return Err(self.at(&u.name, key("name"), "must not be empty"));
        }
        if earlier.iter().any(|x| &x.name == name) {
            return Err(self.at(
                &u.name,
                key("name"),
                format_args!("another [[upstream]] is already named {name:?}"),
            ));
        }
        let mut schemes = Vec::new();
        let addresses = match (&u.url, &u.urls) {
            (Some(url), None) => vec![self.address(url, &key("url"), &mut schemes)?],
            (None, Some(urls)) => {
                if urls.get_ref().is_empty() {
                    return Err(self.at(urls, key("urls"), "must list at least one URL"));
                }
                let mut out: Vec<Authority> = Vec::with_capacity(urls.get_ref().len());
                for (j, url) in urls.get_ref().iter().enumerate() {
                    let a = self.address(url, &key(&format!("urls[{j}]")), &mut schemes)?;
                    if out.contains(&a) {
                        return Err(self.at(
                            url,
                            key(&format!("urls[{j}]")),
                            format_args!("{a} is listed twice"),
                        ));
                    }
                    out.push(a);
                }
                out
            }
            (Some(url), Some(_)) => {
                return Err(self.at(url, key("url"), "set either url or urls, not both"))
            }
            (None, None) => {
                return Err(self.at(
                    &u.name,
                    key("url"),
                    "an upstream needs url (one address) or urls (several)",
                ))
            }
        };
        let https = schemes[0] == Scheme::HTTPS;
        let (url_key, url_at) = match (&u.url, &u.urls) {
            (Some(url), _) => ("url", url.span().start),
            (_, Some(urls)) => ("urls", urls.span().start),
            _ => unreachable!("checked above"),
        };
        if schemes.iter().any(|s| *s != schemes[0]) {
            return Err(self.error(url_at, key(url_key), "mixes http:// and https:// addresses"));
        }
        match (u.protocol, https) {
            (Protocol::H2c, true) => {
                return Err(self.error(url_at, key(url_key), "protocol = \"h2c\" is cleartext: use http://, or protocol = \"h2\" for HTTP/2 over TLS"))
            }
            (Protocol::H2, false) => {
                return Err(self.error(url_at, key(url_key), "protocol = \"h2\" is HTTP/2 over TLS: use https:// (or protocol = \"h2c\")"))
            }
            _ => {}
        }
        let ca = match &u.ca {
            None => None,
            Some(c) if !https => {
                return Err(self.at(c, key("ca"), "only used with https:// upstreams"))
            }
            Some(c) => {
                let path = self
                    .file
                    .parent()
                    .unwrap_or(std::path::Path::new(""))
                    .join(c.get_ref());
                self.pem_certs(c, &path, &key("ca"))?;
                Some(path)
            }
        };
        let positive = |v: &Option<Spanned<u64>>, k: &str, default: u64| match v {
            Some(t) if *t.get_ref() == 0 => Err(self.at(t, key(k), "must be at least 1")),
            Some(t) => Ok(*t.get_ref()),
            None => Ok(default),
        };
        let connect_timeout = positive(
            &u.connect_timeout_ms,
            "connect_timeout_ms",
            CONNECT_TIMEOUT_MS,
        )?;
        let idle_timeout = positive(&u.idle_timeout_ms, "idle_timeout_ms", IDLE_TIMEOUT_MS)?;
        let fail_timeout = positive(&u.fail_timeout_ms, "fail_timeout_ms", FAIL_TIMEOUT_MS)?;
        let max_fails = match u.max_fails {
            Some(m) if *m.get_ref() == 0 => {
                return Err(self.at(&m, key("max_fails"), "must be at least 1"))
            }
            Some(m) => m.into_inner(),
            None => 1,
        };
        let health_check = match (u.health_check_path, u.health_check_interval_ms) {
            (None, None) => None,
            (None, Some(i)) => {
                return Err(self.at(
                    &i,
                    key("health_check_interval_ms"),
                    "only used with health_check_path",
                ))
            }
            (Some(p), _) if u.protocol != Protocol::Http1 => {
                return Err(self.at(
                    &p,
                    key("health_check_path"),
                    "health checks speak HTTP/1.1: only for protocol = \"http1\"",
                ))
            }
            (Some(p), interval) => {
                let path = p.get_ref();
                let printable = path.bytes().all(|b| b.is_ascii_graphic());
                if !path.starts_with('/') || !printable {
                    return Err(self.at(
                        &p,
                        key("health_check_path"),
                        format_args!("{path:?} must be a path starting with / (visible ASCII)"),
                    ));
                }
                let interval = positive(&interval, "health_check_interval_ms", HEALTH_INTERVAL_MS)?;
                Some(HealthCheck {
                    path: p.into_inner(),
                    interval: Duration::from_millis(interval),
                })
            }
        };
        Ok(UpstreamSettings {
            name: name.clone(),
            scheme: schemes[0].clone(),
            ca,
            authority: addresses[0].clone(),
            addresses,
            protocol: u.protocol,
            connect_timeout: Duration::from_millis(connect_timeout),
            response_timeout: (u.response_timeout_ms > 0)
                .then(|| Duration::from_millis(u.response_timeout_ms)),
            idle_timeout: Duration::from_millis(idle_timeout),
            max_fails,
            fail_timeout: Duration::from_millis(fail_timeout),
            health_check,
        })
    }

    /// One upstream URL: `http://host:port` or `https://host:port`, nothing after the
    /// authority. Its scheme is pushed onto `schemes`.
    fn address(
        &self,
        url: &Spanned<String>,
        key: &str,
        schemes: &mut Vec<Scheme>,
    ) -> Result<Authority, ConfigError> {
        let bad = |why: &str| self.at(url, key, format_args!("{:?} {why}", url.get_ref()));
        let uri: Uri = url.get_ref().parse().map_err(|_| bad("is not a URL"))?;
        match uri.scheme() {
            Some(s) if *s == Scheme::HTTP || *s == Scheme::HTTPS => schemes.push(s.clone()),
            _ => return Err(bad("must start with http:// or https://")),
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("has no host"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad(
                "must not have a path or query: routes forward the request's own path",
            ));
        }
        Ok(authority)
    }
}
