//! The `palisade` reverse proxy (feature `proxy`, on by default): configuration and its
//! reload, the request pipeline in front of an unmodified upstream, the access log, the
//! accept loop, the admin endpoints and the operator's `palisade marks` commands, and (with
//! `etcd`) `palisade lock|elect -- CMD`.

pub(crate) mod access_log;
pub(crate) mod admin;
pub mod app;
pub mod config;
mod error_chain;
pub(crate) mod host;
pub(crate) mod pipeline;
pub mod reload;
pub mod server;

pub use access_log::AccessLogError;
