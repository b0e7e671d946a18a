//! Configuration: TOML in, validated settings out (DESIGN 5).
//!
//! Two layers. `raw` structs mirror the file with `deny_unknown_fields`, so a typo is an error,
//! not a silently ignored guard. [`Config::parse`] then validates them into typed settings
//! (socket addresses, header names, methods, resolved upstream indices). Every error names the
//! file, the line and column, and the key, e.g.
//! `palisade.toml:14:12: route[1].upstream: no [[upstream]] is named "legcy"`.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderName, Method, Uri};
use serde::Deserialize;
use toml::Spanned;

use crate::path;

mod etcd;

pub use etcd::{EtcdSettings, EtcdTls, Password};

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it was read from (for messages).
    pub file: PathBuf,
    /// The data-path listener.
    pub proxy: ProxySettings,
    /// The admin listener (default `127.0.0.1:9901`); `None` with `[admin] enabled = false`.
    pub admin: Option<AdminSettings>,
    /// Which header carries the token.
    pub fencing: FencingSettings,
    /// Where marks are kept.
    pub marks: MarksSettings,
    /// Upstreams, in file order.
    pub upstreams: Vec<UpstreamSettings>,
    /// Routes, in file order (first match wins).
    pub routes: Vec<RouteSettings>,
    /// Valid but risky choices, each naming its place in the file (see [`ConfigWarning`]).
    pub warnings: Vec<ConfigWarning>,
}

/// A configuration that is valid but probably not what was meant, e.g. an unguarded route that
/// forwards methods a guarded route with the same paths does not list. `palisade check`
/// prints them; `palisade run` logs them at `warn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The file.
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// Dotted path of the key, e.g. `route[2].methods`.
    pub key: String,
    /// What is risky and how to fix it.
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}: {}",
            self.file.display(),
            self.line,
            self.column,
            self.key,
            self.message
        )
    }
}

/// `[proxy]`.
#[derive(Debug, Clone)]
pub struct ProxySettings {
    /// `listen`: HTTP/1.1 and h2c on one address.
    pub listen: SocketAddr,
    /// `workers`: runtime worker threads; `None` = one per available core.
    pub workers: Option<usize>,
    /// `shutdown_grace_ms`: how long in-flight requests may run after a shutdown signal.
    pub shutdown_grace: Duration,
    /// `max_connections`: open client connections at most; more are accepted and closed.
    pub max_connections: usize,
    /// `header_read_timeout_ms`: from accept until the first request head is complete (or the
    /// HTTP/2 preface arrived).
    pub header_read_timeout: Duration,
    /// `idle_timeout_ms`: keep-alive idle (HTTP/1.1) and HTTP/2 idle (no open stream).
    pub idle_timeout: Duration,
    /// `http2_keepalive_interval_ms`: HTTP/2 PING interval (and answer timeout); `None` when 0.
    pub http2_keepalive_interval: Option<Duration>,
    /// `require_nfkc_paths`: refuse paths whose decoded text changes under Unicode NFKC.
    pub require_nfkc_paths: bool,
}

/// `[admin]`.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// `listen`: `/metrics`, `/livez`, `/readyz`, `/marks`.
    pub listen: SocketAddr,
}

/// `[fencing]`.
#[derive(Debug, Clone)]
pub struct FencingSettings {
    /// `header`: the request header (and gRPC metadata key) carrying the token.
    pub header: HeaderName,
}

/// `[marks]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarksSettings {
    /// `store = "memory"`: lost on exit.
    Memory,
    /// `store = "file"`: the default.
    File {
        /// `path`, resolved against the config file's directory.
        path: PathBuf,
    },
    /// `store = "etcd"`: shared by every replica (`[marks.etcd]`).
    Etcd(EtcdSettings),
}

/// How palisade talks to an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// HTTP/1.1 with keep-alive.
    Http1,
    /// HTTP/2 over cleartext with prior knowledge (gRPC upstreams).
    H2c,
}

/// `[[upstream]]`.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// `name`, referenced by routes.
    pub name: String,
    /// Scheme of `url` (always `http`).
    pub scheme: Scheme,
    /// Host and port of `url`.
    pub authority: Authority,
    /// `protocol`.
    pub protocol: Protocol,
    /// `connect_timeout_ms`.
    pub connect_timeout: Duration,
    /// `response_timeout_ms`: until the response headers arrive; `None` when 0.
    pub response_timeout: Option<Duration>,
}

/// What a guarded route does with a request that carries no token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    /// 428 Precondition Required (gRPC INVALID_ARGUMENT).
    Reject,
    /// Forward it unchecked, counted as `outcome="missing"`.
    Allow,
}

/// Which paths a route matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// `path`: this path, also with a trailing `/` or a `.format` suffix.
    Exact(String),
    /// `path_prefix`: every path starting with it.
    Prefix(String),
}

impl PathMatch {
    /// Whether `key` (a [`path::match_key`]) is matched.
    pub fn matches(&self, key: &str) -> bool {
        match self {
            // Also `/orders/` and `/orders.json`: frameworks (Rails' `(.:format)`, older Spring)
            // route those to the same handler, so they must not fall through to another route.
            PathMatch::Exact(p) => key.strip_prefix(p.as_str()).is_some_and(|rest| {
                rest.is_empty() || rest == "/" || (rest.starts_with('.') && !rest.contains('/'))
            }),
            PathMatch::Prefix(p) => key.starts_with(p.as_str()),
        }
    }
}

impl PathMatch {
    /// Whether some request path could match both.
    pub fn overlaps(&self, other: &PathMatch) -> bool {
        let (a, b) = (self.text(), other.text());
        a.starts_with(b) || b.starts_with(a)
    }

    /// Whether every path `other` matches is matched by `self` too.
    pub fn covers(&self, other: &PathMatch) -> bool {
        match (self, other) {
            (PathMatch::Prefix(p), o) => o.text().starts_with(p.as_str()),
            (PathMatch::Exact(a), PathMatch::Exact(b)) => a == b,
            (PathMatch::Exact(_), PathMatch::Prefix(_)) => false,
        }
    }

    fn text(&self) -> &str {
        match self {
            PathMatch::Exact(p) | PathMatch::Prefix(p) => p,
        }
    }
}

/// RFC 9110 9.2.1: methods that do not change the resource. With bodies on them refused
/// (`get_bodies`), an unguarded route may forward them to guarded paths.
fn is_safe(m: &Method) -> bool {
    matches!(m.as_str(), "GET" | "HEAD" | "OPTIONS" | "TRACE")
}

fn hosts_overlap(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// `[[route]]`.
#[derive(Debug, Clone)]
pub struct RouteSettings {
    /// `name`: unique; the `route` label.
    pub name: String,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    /// `path` or `path_prefix`.
    pub path: PathMatch,
    /// `methods`; `None` = every method.
    pub methods: Option<Vec<Method>>,
    /// `host`, lower-cased, without port; `None` = any host.
    pub host: Option<String>,
    /// `resource`: the mark key (default: the route's name).
    pub resource: String,
    /// `guard`.
    pub guard: bool,
    /// `missing_token`.
    pub missing_token: MissingToken,
    /// `strip_token`: remove the token header (and trailer) before forwarding.
    pub strip_token: bool,
    /// `other_methods`: what a guarded route does with a method it does not list.
    pub other_methods: OtherMethods,
    /// `get_bodies`: what to do with a request body on GET, HEAD, OPTIONS, TRACE or CONNECT.
    pub get_bodies: GetBodies,
    /// `max_token`: tokens above it are refused as malformed (400); `None`: no ceiling.
    pub max_token: Option<u64>,
    /// `drain_timeout_ms`: on an advance through this route, how long to wait for requests
    /// admitted under older marks before aborting them (see [`crate::drain`]).
    pub drain_timeout: Duration,
}

/// What a route does with a request whose path (and host) it matches but whose method it does
/// not list (`other_methods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OtherMethods {
    /// Try the next routes (the default). `palisade check` warns when a later unguarded route
    /// would then forward an unsafe method to the guarded paths.
    FallThrough,
    /// Answer 405 Method Not Allowed with an `Allow` header (gRPC UNIMPLEMENTED).
    Reject,
}

/// What a route does with a body on a method that has none by convention (`get_bodies`).
///
/// Many servers never read a GET body (Python's `BaseHTTPRequestHandler`, many legacy apps), so
/// its bytes would be parsed as the next request on the connection: a request palisade never
/// checked. Refusing such bodies closes that smuggling path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GetBodies {
    /// 400 Bad Request (the default).
    Reject,
    /// Forward the body; the upstream connection is closed after that request
    /// (`Connection: close`) so unread bytes can never be read as another request.
    Forward,
}

/// A configuration that could not be read or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, or a key is unknown, missing, mistyped or invalid.
    #[error("{}:{line}:{column}: {key}: {message}", file.display())]
    Invalid {
        /// The file.
        file: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// Dotted path of the key, e.g. `route[1].methods[0]`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

mod raw {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct File {
        pub(super) proxy: Proxy,
        pub(super) admin: Option<Admin>,
        #[serde(default)]
        pub(super) fencing: Fencing,
        #[serde(default)]
        pub(super) marks: Marks,
        #[serde(default)]
        pub(super) upstream: Vec<Upstream>,
        #[serde(default)]
        pub(super) route: Vec<Route>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Proxy {
        pub(super) listen: Spanned<String>,
        pub(super) workers: Option<Spanned<usize>>,
        #[serde(default = "default_grace")]
        pub(super) shutdown_grace_ms: u64,
        pub(super) max_connections: Option<Spanned<usize>>,
        pub(super) header_read_timeout_ms: Option<Spanned<u64>>,
        pub(super) idle_timeout_ms: Option<Spanned<u64>>,
        #[serde(default = "default_h2_keepalive")]
        pub(super) http2_keepalive_interval_ms: u64,
        #[serde(default)]
        pub(super) require_nfkc_paths: bool,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Admin {
        #[serde(default = "yes")]
        pub(super) enabled: bool,
        pub(super) listen: Option<Spanned<String>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Fencing {
        pub(super) header: Option<Spanned<String>>,
    }

    #[derive(Deserialize, Clone, Copy, PartialEq, Eq, Default)]
    #[serde(rename_all = "lowercase")]
    pub(super) enum StoreKind {
        Memory,
        #[default]
        File,
        Etcd,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Marks {
        #[serde(default)]
        pub(super) store: StoreKind,
        pub(super) path: Option<Spanned<String>>,
        pub(super) etcd: Option<super::etcd::Raw>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Upstream {
        pub(super) name: Spanned<String>,
        pub(super) url: Spanned<String>,
        #[serde(default = "default_protocol")]
        pub(super) protocol: Protocol,
        #[serde(default = "default_connect_timeout")]
        pub(super) connect_timeout_ms: u64,
        #[serde(default = "default_response_timeout")]
        pub(super) response_timeout_ms: u64,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Route {
        pub(super) name: Spanned<String>,
        pub(super) upstream: Spanned<String>,
        pub(super) path: Option<Spanned<String>>,
        pub(super) path_prefix: Option<Spanned<String>>,
        pub(super) methods: Option<Spanned<Vec<Spanned<String>>>>,
        pub(super) host: Option<Spanned<String>>,
        pub(super) resource: Option<Spanned<String>>,
        #[serde(default = "yes")]
        pub(super) guard: bool,
        #[serde(default = "default_missing")]
        pub(super) missing_token: MissingToken,
        #[serde(default)]
        pub(super) strip_token: bool,
        #[serde(default = "default_other_methods")]
        pub(super) other_methods: OtherMethods,
        #[serde(default = "default_get_bodies")]
        pub(super) get_bodies: GetBodies,
        pub(super) max_token: Option<Spanned<u64>>,
        #[serde(default = "default_drain")]
        pub(super) drain_timeout_ms: u64,
    }

    fn default_grace() -> u64 {
        10_000
    }
    fn default_drain() -> u64 {
        2_000
    }
    fn default_h2_keepalive() -> u64 {
        20_000
    }
    fn default_other_methods() -> OtherMethods {
        OtherMethods::FallThrough
    }
    fn default_get_bodies() -> GetBodies {
        GetBodies::Reject
    }
    fn default_protocol() -> Protocol {
        Protocol::Http1
    }
    fn default_connect_timeout() -> u64 {
        2_000
    }
    fn default_response_timeout() -> u64 {
        30_000
    }
    fn yes() -> bool {
        true
    }
    fn default_missing() -> MissingToken {
        MissingToken::Reject
    }
}

/// The default admin address: loopback only.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9901";

impl Config {
    /// Reads and validates the file at `path`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, line, column and key of the first problem.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let file = path.as_ref().to_path_buf();
        let text = std::fs::read_to_string(&file).map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
        Self::parse(&text, &file)
    }

    /// Validates `text` as if read from `file` (relative paths resolve against its directory).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the line, column and key of the first problem.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let v = Validator { text, file };
        let de = toml::Deserializer::new(text);
        let raw: raw::File = serde_path_to_error::deserialize(de).map_err(|e| v.serde_error(e))?;
        v.validate(raw)
    }
}

struct Validator<'a> {
    text: &'a str,
    file: &'a Path,
}

impl Validator<'_> {
    fn error(
        &self,
        offset: usize,
        key: impl Into<String>,
        message: impl fmt::Display,
    ) -> ConfigError {
        let before = &self.text[..offset.min(self.text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            line,
            column,
            key: key.into(),
            message: message.to_string(),
        }
    }

    fn at<T>(
        &self,
        s: &Spanned<T>,
        key: impl Into<String>,
        message: impl fmt::Display,
    ) -> ConfigError {
        self.error(s.span().start, key, message)
    }

    fn serde_error(&self, e: serde_path_to_error::Error<toml::de::Error>) -> ConfigError {
        // serde_spanned's wrapper shows up in the path of a mistyped `Spanned` value.
        let mut key = e
            .path()
            .to_string()
            .replace(".$__serde_spanned_private_value", "");
        let inner = e.into_inner();
        let span = inner.span();
        let message = inner.message().trim().to_owned();
        if key == "." {
            key = "(top level)".to_owned();
        }
        self.error(span.map_or(0, |s| s.start), key, message)
    }

    /// A number that must be at least 1, or `default` when absent.
    fn positive<T>(&self, v: Option<Spanned<T>>, key: &str, default: T) -> Result<T, ConfigError>
    where
        T: Copy + PartialEq + From<u8>,
    {
        match v {
            None => Ok(default),
            Some(v) if *v.get_ref() == T::from(0) => Err(self.at(&v, key, "must be at least 1")),
            Some(v) => Ok(v.into_inner()),
        }
    }

    fn listen(&self, s: &Spanned<String>, key: &str) -> Result<SocketAddr, ConfigError> {
        s.get_ref().parse().map_err(|e| {
            self.at(
                s,
                key,
                format_args!("{:?} is not an IP:port socket address ({e})", s.get_ref()),
            )
        })
    }

    fn validate(&self, raw: raw::File) -> Result<Config, ConfigError> {
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
        let warnings = self.method_warnings(&routes, &spans);
        Ok(Config {
            file: self.file.to_path_buf(),
            proxy,
            admin,
            fencing: FencingSettings { header },
            marks,
            upstreams,
            routes,
            warnings,
        })
    }

    /// Warns where an unguarded route forwards, to a guarded route's paths, an unsafe method
    /// the guarded route does not list (so a zombie could use it unchecked), and where an
    /// earlier unguarded route takes every request a guarded route was meant to check.
    fn method_warnings(&self, routes: &[RouteSettings], spans: &[usize]) -> Vec<ConfigWarning> {
        let mut out = Vec::new();
        let warn = |i: usize, message: String| {
            let ConfigError::Invalid {
                file,
                line,
                column,
                key,
                message,
            } = self.error(spans[i], format!("route[{i}]"), message)
            else {
                unreachable!("error() builds Invalid")
            };
            ConfigWarning {
                file,
                line,
                column,
                key,
                message,
            }
        };
        for (gi, g) in routes.iter().enumerate().filter(|(_, g)| g.guard) {
            for (ri, r) in routes
                .iter()
                .enumerate()
                .filter(|(ri, r)| *ri != gi && !r.guard)
            {
                if !hosts_overlap(g.host.as_deref(), r.host.as_deref()) {
                    continue;
                }
                if ri < gi {
                    let shadowed = r.path.covers(&g.path)
                        && match (&r.methods, &g.methods) {
                            (None, _) => true,
                            (Some(rm), None) => rm.iter().any(|m| !is_safe(m)),
                            (Some(rm), Some(gm)) => gm.iter().any(|m| rm.contains(m)),
                        };
                    if shadowed {
                        out.push(warn(
                            ri,
                            format!(
                                "unguarded route {:?} comes before guarded route {:?} and matches \
                                 all of its paths, so requests meant for the guard reach the \
                                 upstream unchecked; move it after route[{gi}]",
                                r.name, g.name
                            ),
                        ));
                    }
                    continue;
                }
                let Some(listed) = &g.methods else { continue };
                if g.other_methods == OtherMethods::Reject || !g.path.overlaps(&r.path) {
                    continue;
                }
                let leaked = match &r.methods {
                    None => {
                        "every method it does not list (PROPFIND, MKCOL, MOVE, unknown ones...)"
                            .to_owned()
                    }
                    Some(rm) => {
                        let unsafe_unlisted: Vec<&str> = rm
                            .iter()
                            .filter(|m| !is_safe(m) && !listed.contains(m))
                            .map(Method::as_str)
                            .collect();
                        if unsafe_unlisted.is_empty() {
                            continue;
                        }
                        unsafe_unlisted.join(", ")
                    }
                };
                out.push(warn(
                    ri,
                    format!(
                        "unguarded route {:?} also matches paths of guarded route {:?}, so {leaked} \
                         sent there reaches the upstream without a token check; list only safe \
                         methods (GET, HEAD, OPTIONS) on this route, or set other_methods = \
                         \"reject\" on route[{gi}]",
                        r.name, g.name
                    ),
                ));
            }
        }
        out
    }

    fn route_path(&self, p: &Spanned<String>, key: &str) -> Result<String, ConfigError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[[upstream]]
name = "legacy"
url = "http://127.0.0.1:9000"

[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
"#;

    fn err(text: &str) -> (usize, usize, String, String) {
        match Config::parse(text, Path::new("p.toml")).unwrap_err() {
            ConfigError::Invalid {
                line,
                column,
                key,
                message,
                ..
            } => (line, column, key, message),
            e => panic!("{e}"),
        }
    }

    #[test]
    fn base_config_is_valid_with_defaults() {
        let c = Config::parse(BASE, Path::new("conf/p.toml")).unwrap();
        assert_eq!(c.routes[0].resource, "orders");
        assert!(c.routes[0].guard);
        assert_eq!(c.routes[0].missing_token, MissingToken::Reject);
        assert_eq!(
            c.marks,
            MarksSettings::File {
                path: PathBuf::from("conf/data/marks.json")
            }
        );
        assert_eq!(c.fencing.header.as_str(), "x-fencing-token");
        assert_eq!(
            c.admin.unwrap().listen.to_string(),
            DEFAULT_ADMIN_LISTEN,
            "admin on loopback by default"
        );
    }

    #[test]
    fn unknown_key_names_line_column_and_key() {
        let text = BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\ngaurd = false",
        );
        let (line, col, key, msg) = err(&text);
        assert_eq!((line, col), (14, 1));
        assert_eq!(key, "route[0].gaurd");
        assert!(msg.contains("unknown field"), "{msg}");
    }

    #[test]
    fn unknown_upstream_duplicate_route_bad_listen_bad_method() {
        let (line, col, key, _) =
            err(&BASE.replace("upstream = \"legacy\"", "upstream = \"legcy\""));
        assert_eq!((line, col, key.as_str()), (11, 12, "route[0].upstream"));

        let dup =
            format!("{BASE}\n[[route]]\nname = \"orders\"\nupstream = \"legacy\"\npath = \"/x\"\n");
        let (line, col, key, _) = err(&dup);
        assert_eq!((line, col, key.as_str()), (16, 8, "route[1].name"));

        let (line, col, key, _) = err(&BASE.replace("127.0.0.1:0", "localhost:80"));
        assert_eq!((line, col, key.as_str()), (3, 10, "proxy.listen"));

        let (line, col, key, _) = err(&BASE.replace("[\"POST\"]", "[\"POST\", \"get\"]"));
        assert_eq!((line, col, key.as_str()), (13, 20, "route[0].methods[1]"));
    }

    #[test]
    fn connection_limits_have_defaults_and_refuse_zero() {
        let c = Config::parse(BASE, Path::new("p.toml")).unwrap();
        assert_eq!(c.proxy.max_connections, 10_000);
        assert_eq!(c.proxy.header_read_timeout, Duration::from_secs(10));
        assert_eq!(c.proxy.idle_timeout, Duration::from_secs(60));
        assert_eq!(
            c.proxy.http2_keepalive_interval,
            Some(Duration::from_secs(20))
        );
        for key in [
            "max_connections",
            "header_read_timeout_ms",
            "idle_timeout_ms",
        ] {
            let text = BASE.replace(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:0\"\n{key} = 0"),
            );
            let (line, _, k, msg) = err(&text);
            assert_eq!((line, k.as_str()), (4, format!("proxy.{key}").as_str()));
            assert!(msg.contains("at least 1"), "{msg}");
        }
    }

    #[test]
    fn route_hosts_max_token_and_method_policies_are_validated() {
        let (_, _, key, msg) = err(&BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\nhost = \"u@api.example.com\"",
        ));
        assert_eq!(key, "route[0].host");
        assert!(msg.contains("letters, digits"), "{msg}");
        let (_, _, key, _) = err(&BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\nmax_token = 0",
        ));
        assert_eq!(key, "route[0].max_token");
        let (_, _, key, _) = err(&BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\nguard = false\nmax_token = 9",
        ));
        assert_eq!(key, "route[0].max_token");
        let (_, _, key, _) = err(&BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\nother_methods = \"drop\"",
        ));
        assert_eq!(key, "route[0].other_methods");
        let c = Config::parse(
            &BASE.replace(
                "methods = [\"POST\"]",
                "methods = [\"POST\"]\nhost = \"API.Example.com.\"\nget_bodies = \"forward\"",
            ),
            Path::new("p.toml"),
        )
        .unwrap();
        assert_eq!(c.routes[0].host.as_deref(), Some("api.example.com"));
        assert_eq!(c.routes[0].get_bodies, GetBodies::Forward);
    }

    #[test]
    fn route_paths_must_be_normal() {
        let (_, _, key, msg) = err(&BASE.replace("\"/orders\"", "\"/a/../orders\""));
        assert_eq!(key, "route[0].path_prefix");
        assert!(msg.contains("normal-form"), "{msg}");
    }

    #[test]
    fn exact_paths_match_with_trailing_slash_or_format_suffix() {
        let m = PathMatch::Exact("/exact".into());
        assert!(m.matches("/exact") && m.matches("/exact/") && m.matches("/exact.json"));
        assert!(!m.matches("/exactly") && !m.matches("/exact/x") && !m.matches("/exact.d/x"));
    }
}
