//! The `palisade` reverse proxy (feature `proxy`, on by default): configuration and its
//! reload, the request pipeline in front of an unmodified upstream, the access log, the
//! accept loop, the admin endpoints and the operator's `palisade marks` commands, and (with
//! `etcd`) `palisade lock|elect -- CMD`.

pub mod access_log;
pub mod admin;
pub mod app;
pub mod config;
mod error_chain;
#[cfg(feature = "etcd")]
pub mod hold_cli;
pub mod host;
pub mod marks_cli;
pub mod pipeline;
pub mod reload;
pub mod server;

pub use pipeline::{Aborted, Affinity, BodyError, Proxy, ProxyBody, RequestBody, Tracked};
