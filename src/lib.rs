//! Palisade: fencing tokens that make zombie owners harmless.
//!
//! A process that held a lock or led an election can freeze, lose its lease and wake up still
//! believing it owns a resource. Palisade makes its late writes harmless: every owner gets a
//! strictly increasing fencing token, attaches it to every request, and the resource (or the
//! `palisade` proxy in front of it) refuses any token below the highest it has accepted.
//!
//! # Layout
//!
//! The proxy and guard (the resource's side):
//! - [`token`]: the token type and its one strict wire form.
//! - [`guard`]: the admission rule, pure (no I/O).
//! - [`marks`]: mark stores that keep high-water marks across restarts.
//! - [`admission`]: the guard composed with a store (persist before forward).
//! - [`drain`]: requests in flight per mark, drained (or aborted) before an advance goes on.
//! - `layer` (feature `layer`): the same admission as a tower layer, in-process.
//! - [`path`]: request paths in normal form, so routes cannot be bypassed.
//! - [`host`]: Host headers and authorities in one strict form, for the same reason.
//! - [`config`]: TOML configuration and its validation.
//! - [`confirm`]: confirmation rounds that let concurrent admissions share one store read.
//! - [`reject`]: every refusal and its HTTP and gRPC form, in one table.
//! - [`metrics`]: Prometheus metric families.
//! - [`proxy`]: the request pipeline of the reverse proxy.
//! - [`admin`]: `/metrics`, `/livez`, `/readyz`, `/marks`.
//! - [`server`]: the accept loop with graceful shutdown.
//! - [`app`]: wiring config, store, proxy and admin together.
//!
//! The client library (the owner's side):
//! - [`session`]: a lease kept alive, with a signal when it is lost.
//! - [`lock`], [`rwlock`], [`election`]: the primitives, each handing out fencing tokens.
//! - [`provider`]: etcd (feature `etcd`) and in-memory providers behind one model.
//! - [`transport`]: stamping requests with a token and reading it back (HTTP, gRPC).
//! - [`error`]: the client library's error.

pub mod admin;
pub mod admission;
pub mod app;
pub mod config;
pub mod confirm;
pub mod drain;
pub mod election;
pub mod error;
pub mod guard;
pub mod host;
#[cfg(feature = "layer")]
pub mod layer;
pub mod lock;
pub mod marks;
pub mod metrics;
pub mod path;
pub mod provider;
pub mod proxy;
mod queue;
pub mod reject;
pub mod rwlock;
pub mod server;
pub mod session;
pub mod token;
pub mod transport;

pub use admission::Admission;
pub use app::{run, Listeners};
pub use config::Config;
pub use election::{ElectionService, LeaderKey, Leadership, Observation, Term};
pub use error::Error;
pub use guard::{Verdict, Watermark};
#[cfg(feature = "layer")]
pub use layer::FenceLayer;
pub use marks::{FileStore, MarkStore, MemoryStore};
pub use metrics::Metrics;
pub use lock::{LockGrant, LockService};
pub use provider::memory::MemoryProvider;
pub use provider::Provider;
pub use rwlock::{Mode, RwGrant, RwLockService};
pub use session::{Loss, LossSignal, Session, SessionOptions, SessionState};
pub use token::FencingToken;
