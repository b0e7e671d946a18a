//! The file as written: serde structs with `deny_unknown_fields`, before validation.

use super::*;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct File {
    pub(super) proxy: RawProxy,
    pub(super) admin: Option<Admin>,
    #[serde(default)]
    pub(super) fencing: Fencing,
    #[serde(default)]
    pub(super) marks: Marks,
    #[serde(default)]
    pub(super) upstream: Vec<RawUpstream>,
    #[serde(default)]
    pub(super) route: Vec<Route>,
    pub(super) access_log: Option<super::access_log::Raw>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProxy {
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
    pub(super) max_header_bytes: Option<Spanned<usize>>,
    #[serde(default = "default_fast_path")]
    pub(super) http1_fast_path: bool,
    pub(super) tls: Option<Tls>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Tls {
    pub(super) cert: Spanned<String>,
    pub(super) key: Spanned<String>,
    pub(super) client_ca: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Admin {
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    pub(super) listen: Option<Spanned<String>>,
    pub(super) token_env: Option<Spanned<String>>,
    pub(super) tls: Option<Tls>,
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
    #[serde(default)]
    pub(super) retired: Vec<Spanned<String>>,
    pub(super) max_cached: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) name: Spanned<String>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) urls: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default = "default_protocol")]
    pub(super) protocol: Protocol,
    pub(super) connect_timeout_ms: Option<Spanned<u64>>,
    #[serde(default = "default_response_timeout")]
    pub(super) response_timeout_ms: u64,
    pub(super) idle_timeout_ms: Option<Spanned<u64>>,
    pub(super) max_fails: Option<Spanned<u32>>,
    pub(super) fail_timeout_ms: Option<Spanned<u64>>,
    pub(super) health_check_path: Option<Spanned<String>>,
    pub(super) health_check_interval_ms: Option<Spanned<u64>>,
    pub(super) ca: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Route {
    pub(super) name: Spanned<String>,
    pub(super) upstream: Spanned<String>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) path_prefix: Option<Spanned<String>>,
    pub(super) path_pattern: Option<Spanned<String>>,
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
    pub(super) connect_timeout_ms: Option<Spanned<u64>>,
    pub(super) response_timeout_ms: Option<u64>,
    pub(super) max_body_bytes: Option<Spanned<u64>>,
    pub(super) websocket: Option<Spanned<bool>>,
    #[serde(default)]
    pub(super) allow_unguarded_tunnel: bool,
    pub(super) max_marks: Option<Spanned<u64>>,
    pub(super) lock: Option<Spanned<String>>,
    pub(super) election: Option<Spanned<String>>,
    pub(super) rwlock: Option<Spanned<String>>,
    pub(super) semaphore: Option<Spanned<String>>,
    pub(super) lock_namespace: Option<Spanned<String>>,
}

/// `[proxy] http1_fast_path` when the file does not say (see `ProxySettings::http1_fast_path`).
fn default_fast_path() -> bool {
    crate::proxy::config::DEFAULT_HTTP1_FAST_PATH
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
fn default_response_timeout() -> u64 {
    30_000
}
fn yes() -> bool {
    true
}
fn default_missing() -> MissingToken {
    MissingToken::Reject
}
