//! Palisade: fencing tokens that make zombie owners harmless.
//!
//! A process that held a lock or led an election can freeze, lose its lease and wake up still
//! believing it owns a resource. Palisade makes its late writes harmless: every owner gets a
//! strictly increasing fencing token, attaches it to every request, and the resource (or the
//! `palisade` proxy in front of it) refuses any token below the highest it has accepted.
//!
//! # Layout
//!
//! The folders are the three parties of the fencing contract:
//!
//! - [`client`]: the owner's side. Sessions ([`client::session`]), [`client::lock`],
//!   [`client::rwlock`], [`client::election`] and [`client::semaphore`] on etcd (feature
//!   `etcd`) or in memory ([`client::provider`]), each handing out tokens, [`client::owner`]
//!   (a grant's token with its fenced feedback: a resource's stale refusal ends the ownership
//!   at once), and [`client::transport`] to stamp tokens on requests, send fence requests and
//!   read refusals. Always built. With `etcd`, `client::fenced_txn` makes writes to etcd
//!   itself commit only while their writer owns. With `object-store`, `client::objstore` leads
//!   elections on an object store (S3, GCS, Azure, in memory) with the lease record's
//!   generation as the token: no etcd needed.
//! - [`fence`] (features `proxy` or `layer`): the resource's side, shared by the proxy and the
//!   in-process guard: the pure rule ([`fence::guard`]), mark stores ([`fence::marks`]),
//!   persist-before-forward ([`fence::admission`]), confirmation rounds for shared stores
//!   ([`fence::confirm`]), in-flight drains ([`fence::drain`]) and the bodies that carry them
//!   ([`fence::flight`]), the table of refusals ([`fence::reject`]), [`fence::metrics`],
//!   request paths in normal form ([`fence::path`]), path prefixes matched at segment
//!   boundaries ([`PathPrefix`]), resources taken from the request ([`fence::template`]), and
//!   the tower layer (`fence::layer`, feature `layer`).
//! - [`proxy`] (feature `proxy`, default): the reverse proxy for services that cannot be
//!   changed. Its public face is what starts and steers it: the configuration
//!   ([`proxy::config`]) and its [`proxy::reload`], the wiring ([`proxy::app`]: [`App`],
//!   [`Listeners`], [`run`]) and the accept loop ([`proxy::server`]). The request pipeline,
//!   access log and admin endpoints are internal: the guide (`docs/proxy.md`) describes
//!   their behaviour.
//! - [`token`]: the token type and its one strict wire form, used by all three.
//!
//! The crate root re-exports the types a user names most (`palisade::LockService`,
//! `palisade::FenceLayer`, ...); everything else is named by its party
//! (`palisade::client::session::Loss`, `palisade::fence::marks::EtcdStore`), so a use site says
//! which side of the contract it is on. The `palisade` binary's command line is not part of
//! the library (`src/bin/palisade/`).
//!
//! # Features
//!
//! `proxy` (default) builds the `palisade` binary and everything it needs. A library user
//! who only takes locks and leads elections sets `default-features = false, features =
//! ["etcd"]` and compiles no HTTP server, configuration or metrics; `layer` adds the guard as
//! a tower layer; `etcd-tls` adds TLS to etcd; `grpc` adds gRPC metadata helpers;
//! `object-store` adds `client::objstore` (bring your own `object_store` backend) and
//! `object-store-aws` the same with object_store's S3 client; `metrics` reports what the
//! process holds (held, leader, acquisitions, losses by reason, renewals, lease left) through
//! the `metrics` facade, to the exporter the application installs.

pub mod client;
#[cfg(feature = "fence")]
pub mod fence;
#[cfg(feature = "proxy")]
pub mod proxy;
pub mod token;

pub use client::election::{ElectionService, LeaderKey, Leadership, Observation, Term};
pub use client::error::Error;
pub use client::lock::{LockGrant, LockService};
pub use client::owner::Owner;
#[cfg(feature = "etcd")]
pub use client::provider::etcd::EtcdProvider;
pub use client::provider::memory::MemoryProvider;
pub use client::provider::Provider;
pub use client::rwlock::{Mode, RwGrant, RwLockService};
pub use client::semaphore::{Permit, SemaphoreService};
pub use client::session::{Loss, LossSignal, Session, SessionOptions, SessionState};
#[cfg(feature = "fence")]
pub use fence::admission::Admission;
#[cfg(feature = "fence")]
pub use fence::guard::{Verdict, Watermark};
#[cfg(feature = "layer")]
pub use fence::layer::FenceLayer;
#[cfg(feature = "fence")]
pub use fence::marks::{FileStore, MarkStore, MemoryStore};
#[cfg(feature = "fence")]
pub use fence::metrics::Metrics;
#[cfg(feature = "fence")]
pub use fence::path_prefix::PathPrefix;
#[cfg(feature = "proxy")]
pub use proxy::app::{run, App, Listeners};
#[cfg(feature = "proxy")]
pub use proxy::config::Config;
pub use token::FencingToken;
