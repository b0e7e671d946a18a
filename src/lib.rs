//! Palisade: fencing tokens that make zombie owners harmless.
//!
//! A process that held a lock or led an election can freeze, lose its lease and wake up still
//! believing it owns a resource. Palisade makes its late writes harmless: every owner gets a
//! strictly increasing fencing token, attaches it to every request, and the resource (or the
//! `palisade` proxy in front of it) refuses any token below the highest it has accepted.
//!
//! # Layout
//! - [`token`]: the token type and its one strict wire form.
//! - [`guard`]: the admission rule, pure (no I/O).
//! - [`marks`]: mark stores that keep high-water marks across restarts.
//! - [`admission`]: the guard composed with a store (persist before forward).
//! - [`path`]: request paths in normal form, so routes cannot be bypassed.
//! - [`config`]: TOML configuration and its validation.
//! - [`reject`]: every refusal and its HTTP and gRPC form, in one table.
//! - [`metrics`]: Prometheus metric families.
//! - [`proxy`]: the request pipeline of the reverse proxy.
//! - [`admin`]: `/metrics`, `/livez`, `/readyz`, `/marks`.
//! - [`server`]: the accept loop with graceful shutdown.
//! - [`app`]: wiring config, store, proxy and admin together.

pub mod admin;
pub mod admission;
pub mod app;
pub mod config;
pub mod guard;
pub mod marks;
pub mod metrics;
pub mod path;
pub mod proxy;
pub mod reject;
pub mod server;
pub mod token;

pub use admission::Admission;
pub use app::{run, Listeners};
pub use config::Config;
pub use guard::{Verdict, Watermark};
pub use token::FencingToken;
