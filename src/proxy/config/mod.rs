//! Configuration: TOML in, validated settings out (`docs/design.md#configuration-names`).
//!
//! Two layers. `raw` structs mirror the file with `deny_unknown_fields`, so a typo is an error,
//! not a silently ignored guard. [`Config::parse`] then validates them into typed settings
//! (socket addresses, header names, methods, resolved upstream indices). Every error names the
//! file, the line and column, and the key, e.g.
//! `palisade.toml:14:12: route[1].upstream: no [[upstream]] is named "legcy"`.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderName, Method};
use serde::Deserialize;
use toml::Spanned;

use crate::fence::path;
use crate::fence::template::{PathPattern, ResourceTemplate};

mod access_log;
mod admin;
mod error;
mod etcd;
mod raw;
mod tls;
mod upstream;
mod validate;
mod warnings;

pub use crate::fence::marks::settings::{EtcdSettings, EtcdTls, Password};
pub use access_log::{AccessLogFormat, AccessLogSettings, AccessLogTarget};
pub use admin::{AdminSettings, AdminToken};

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it was read from (for messages).
    pub file: PathBuf,
    /// The SHA-256 of the file's text, 64 lower-case hex digits: `palisade_config_info{digest}`,
    /// so that replicas running different files can be told apart.
    pub digest: String,
    /// The data-path listener.
    pub proxy: ProxySettings,
    /// The admin listener (default `127.0.0.1:9901`); `None` with `[admin] enabled = false`.
    pub admin: Option<AdminSettings>,
    /// Which header carries the token.
    pub fencing: FencingSettings,
    /// Where marks are kept.
    pub marks: MarksSettings,
    /// `[marks] retired`: resources whose protection the operator removed on purpose. A
    /// reload that stops guarding a resource with a mark is refused unless it is listed here
    /// (see [`crate::proxy::reload`]); their marks stay in the store.
    pub retired: Vec<String>,
    /// `[marks] max_cached`: entities of resource templates kept in memory (default
    /// 100000); idle ones beyond it are evicted and read from the store again when needed.
    pub max_cached: usize,
    /// Upstreams, in file order.
    pub upstreams: Vec<UpstreamSettings>,
    /// Routes, in file order (first match wins).
    pub routes: Vec<RouteSettings>,
    /// `[access_log]`; `None` (no table) = no access log.
    pub access_log: Option<AccessLogSettings>,
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
    /// `max_header_bytes`: the largest request head (request line and headers) accepted;
    /// HTTP/1.1 clients over it get 431, HTTP/2 clients a stream error.
    pub max_header_bytes: usize,
    /// `http1_fast_path`: serve plain-TCP HTTP/1.1 requests to plain HTTP/1.1 upstreams on
    /// palisade's own parser and relay instead of hyper's (see `crate::proxy::fast`); anything
    /// it does not handle still goes to hyper. Needs a restart to change. Default:
    /// [`DEFAULT_HTTP1_FAST_PATH`].
    pub http1_fast_path: bool,
    /// `[proxy.tls]`: terminate TLS on `listen`.
    pub tls: Option<TlsSettings>,
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
    /// HTTP/2 over TLS, negotiated with ALPN (`https://` upstreams, gRPC over TLS).
    H2,
}

impl Protocol {
    /// HTTP/2 (`h2c` or `h2`): one multiplexed connection shared by every request.
    pub fn is_http2(self) -> bool {
        matches!(self, Protocol::H2c | Protocol::H2)
    }
}

pub use error::ConfigError;
pub use tls::TlsSettings;

/// `[[upstream]]`. Equal settings mean an unchanged upstream: a reload keeps its connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSettings {
    /// `name`, referenced by routes.
    pub name: String,
    /// Scheme of `url` (`http`, or `https` for TLS to the upstream).
    pub scheme: Scheme,
    /// `ca`: PEM CA certificates that an `https` upstream's certificate must chain to;
    /// `None`: the system's trusted roots.
    pub ca: Option<PathBuf>,
    /// Host and port of `url`, or of the first of `urls`.
    pub authority: Authority,
    /// Host and port of every address (`url`, or each of `urls`), tried round robin.
    pub addresses: Vec<Authority>,
    /// `protocol`.
    pub protocol: Protocol,
    /// `connect_timeout_ms` (default 2000): per address tried.
    pub connect_timeout: Duration,
    /// `response_timeout_ms` (default 30000): until the response headers arrive; `None` when 0.
    pub response_timeout: Option<Duration>,
    /// `idle_timeout_ms` (default 90000): an idle upstream connection older than this is
    /// closed rather than reused.
    pub idle_timeout: Duration,
    /// `max_fails` (default 1): consecutive connect failures that eject an address.
    pub max_fails: u32,
    /// `fail_timeout_ms` (default 10000): how long an ejected address is skipped.
    pub fail_timeout: Duration,
    /// `health_check_path` and `health_check_interval_ms` (default 5000): an active check.
    pub health_check: Option<HealthCheck>,
}

/// An active health check: every `interval`, `GET path` on each address (HTTP/1.1); an address
/// that does not answer 2xx or 3xx within `connect_timeout` plus `interval` is down until it
/// does again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// `health_check_path`, origin-form (`/healthz`).
    pub path: String,
    /// `health_check_interval_ms`.
    pub interval: Duration,
}

pub use crate::fence::guard::MissingToken;

/// Which paths a route matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// `path`: this path, also with a trailing `/` or a `.format` suffix.
    Exact(String),
    /// `path_prefix`: the prefix and every path below it, at segment boundaries
    /// ([`crate::fence::path_prefix`]: `/warehouses/1` never takes `/warehouses/12`).
    Prefix(String),
    /// `path_pattern`: segments captured for a resource template ([`crate::fence::template`]).
    Pattern(PathPattern),
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
            PathMatch::Prefix(p) => crate::fence::path_prefix::matches(p, key),
            PathMatch::Pattern(p) => p.is_match(key),
        }
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
    /// `resource`: the mark key (default: the route's name), or a template's text.
    pub resource: String,
    /// `resource` when it has placeholders (`warehouse/{id}`): one mark per filled name.
    pub template: Option<ResourceTemplate>,
    /// `max_marks`: stored marks a templated route may hold (default 1000000); a new entity
    /// beyond it is refused (503 `marks_full`). `None` for a fixed resource.
    pub max_marks: Option<u64>,
    /// `lock`, `election`, `rwlock` or `semaphore` (with `lock_namespace`): the primitive
    /// whose epoch key is also the route's mark (marks in etcd).
    pub epoch: Option<EpochFeed>,
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
    /// admitted under older marks before aborting them (see [`crate::fence::drain`]).
    pub drain_timeout: Duration,
    /// `connect_timeout_ms`: the upstream's unless the route sets its own.
    pub connect_timeout: Duration,
    /// `response_timeout_ms`: the upstream's unless the route sets its own; `None` when 0.
    pub response_timeout: Option<Duration>,
    /// `max_body_bytes`: the largest request body forwarded; larger ones get 413.
    pub max_body_bytes: Option<u64>,
    /// `websocket`: HTTP/1.1 `Upgrade: websocket` requests are forwarded as upgrades (guarded
    /// once, at the upgrade request); otherwise `Upgrade` is removed like any hop-by-hop
    /// header.
    pub websocket: bool,
    /// `allow_unguarded_tunnel`: accept an unguarded `websocket` route whose upstream also
    /// serves guarded routes (a warning instead of an error; see [`ConfigWarning`]).
    pub allow_unguarded_tunnel: bool,
}

/// A route's `lock`, `election` or `rwlock`: the client library's primitive whose epoch key
/// (its mod revision is the current owner's token) feeds the route's mark. The effective
/// mark is the highest of the stored mark and that revision; a token above the revision was
/// never issued (403 `unissued`).
#[derive(Debug, Clone)]
pub struct EpochFeed {
    /// Which kind of primitive.
    pub kind: crate::client::session::EpochOf,
    /// `lock_namespace` (default: the library's, `/palisade`).
    pub namespace: String,
    /// The primitive's name: fixed, or a template over placeholders of `resource`.
    pub name: ResourceTemplate,
    /// The epoch key of a fixed name (never for a semaphore: its slot comes from the
    /// request).
    pub fixed_key: Option<std::sync::Arc<str>>,
}

impl EpochFeed {
    /// The epoch key of the primitive a request names (`name` filled from the same request).
    ///
    /// # Errors
    /// The name is not one the client library would accept (empty, over 1024 bytes).
    pub fn key(&self, name: &str) -> Result<String, crate::client::error::Error> {
        crate::client::session::epoch_key(&self.namespace, self.kind, name)
    }

    /// The epoch key of slot `slot` (the `{slot}` capture) of the semaphore a request names.
    ///
    /// # Errors
    /// As [`EpochFeed::key`].
    pub fn slot_key(&self, name: &str, slot: u32) -> Result<String, crate::client::error::Error> {
        crate::client::session::slot_epoch_key(&self.namespace, name, slot)
    }
}

/// Which route of a table takes a request (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick<'a, T> {
    /// This route forwards it.
    To(&'a T),
    /// The path matched a route that refuses methods it does not list (405).
    MethodNotAllowed(&'a T),
    /// No route takes it (404).
    Nowhere,
}

/// The routing rule, shared by the data path and by what a reload checks: the first route
/// whose host (any case) and path (a [`path::match_key`]) match and that lists the method
/// (any case: a legacy upstream may treat `post` as POST, so a lower-case spelling must not
/// slip past a guarded route), or that refuses methods it does not list.
#[inline]
pub fn pick<'a, T>(
    routes: &'a [T],
    settings: impl Fn(&T) -> &RouteSettings,
    method: &str,
    host: &str,
    key: &str,
) -> Pick<'a, T> {
    for r in routes {
        let s = settings(r);
        let place = s
            .host
            .as_deref()
            .is_none_or(|h| host.eq_ignore_ascii_case(h))
            && s.path.matches(key);
        if !place {
            continue;
        }
        let listed = s
            .methods
            .as_ref()
            .is_none_or(|ms| ms.iter().any(|m| m.as_str().eq_ignore_ascii_case(method)));
        if listed {
            return Pick::To(r);
        }
        if s.other_methods == OtherMethods::Reject {
            return Pick::MethodNotAllowed(r);
        }
    }
    Pick::Nowhere
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

/// Default `max_marks` of a templated route.
pub const DEFAULT_MAX_MARKS: u64 = 1_000_000;

/// The default admin address: loopback only.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9901";

/// Default `proxy.http1_fast_path`.
pub const DEFAULT_HTTP1_FAST_PATH: bool = true;

/// Default `proxy.max_header_bytes`: 64 KiB, as nginx's `large_client_header_buffers` allows
/// in total.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// The smallest `proxy.max_header_bytes`: hyper's HTTP/1.1 read buffer cannot be smaller.
pub const MIN_HEADER_BYTES: usize = 8 * 1024;

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

    /// One line per route, in the order routes are tried: what it matches and what it does
    /// (`palisade check` prints these).
    pub fn describe(&self) -> Vec<String> {
        self.routes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let methods = r.methods.as_ref().map_or_else(
                    || "every method".to_owned(),
                    |m| m.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
                );
                let host = r
                    .host
                    .as_deref()
                    .map_or_else(String::new, |h| format!(" host {h},"));
                let what = if r.guard && r.template.is_some() {
                    format!(
                        "guarded by one mark per entity, resource template {:?}, at most {} \
                         stored marks (max_marks; new entities beyond are refused with 503)",
                        r.resource,
                        r.max_marks.unwrap_or(DEFAULT_MAX_MARKS)
                    )
                } else if r.guard {
                    format!("guarded by the mark of resource {:?}", r.resource)
                } else {
                    "unguarded (forwarded unchecked)".to_owned()
                };
                let tunnel = if r.websocket {
                    ", WebSocket upgrades"
                } else {
                    ""
                };
                format!(
                    "route[{i}] {:?}:{host} {}, {methods} -> upstream {:?}, {what}{tunnel}",
                    r.name,
                    r.path.describe(),
                    self.upstreams[r.upstream].name
                )
            })
            .collect()
    }

    /// Validates `text` as if read from `file` (relative paths resolve against its directory).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the line, column and key of the problem, or
    /// [`ConfigError::Several`] with every problem found. A file that is not valid TOML, or
    /// has an unknown, missing or mistyped key, stops at that first error.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let v = Validator { text, file };
        let de = toml::Deserializer::new(text);
        let raw: raw::File = serde_path_to_error::deserialize(de).map_err(|e| v.serde_error(e))?;
        v.validate(raw)
    }
}

/// The SHA-256 of `text` in lower-case hex ([`Config::digest`]).
fn digest(text: &str) -> String {
    use std::fmt::Write;
    let d = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    d.as_ref()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
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
}

#[cfg(test)]
mod tests;
