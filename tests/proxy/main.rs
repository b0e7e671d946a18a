//! The proxy's request path end to end, over real loopback sockets: admission and
//! forwarding, both HTTP/1.1 engines, attacks, limits, upstreams, WebSockets, TLS and the
//! access log.
//!
//! - `requests.rs`: tokens and refusals, routes, protocols, headers, failures, gRPC, resource
//!   templates, fence requests, and the admission table every fence passes;
//! - `fast_path.rs`: the fast path's own framing rules over raw sockets on both sides;
//! - `differential.rs` (+ `differential/`): the two engines compared byte for byte on a
//!   seeded corpus;
//! - `hardening.rs`: attacks over raw sockets against a legacy upstream;
//! - `limits.rs`: connection limits of a real process under a lowered open-files limit;
//! - `upstreams.rs`: several addresses, ejection, health checks, timeouts, size limits;
//! - `affinity.rs`: upstream connections kept per client connection, the idle pool;
//! - `websocket.rs`, `tls.rs`, `access_log.rs`.

#[path = "../support/mod.rs"]
mod support;

mod access_log;
mod affinity;
mod differential;
mod fast_path;
mod hardening;
mod limits;
mod requests;
mod tls;
mod upstreams;
mod websocket;
