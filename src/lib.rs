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
//! - [`client`]: the owner's side. Sessions ([`session`]), [`lock`], [`rwlock`],
//!   [`election`] and [`semaphore`] on etcd (feature `etcd`) or in memory ([`provider`]), each
//!   handing out tokens, [`owner`] (a grant's token with its fenced feedback: a resource's
//!   stale refusal ends the ownership at once), and [`transport`] to stamp tokens on requests,
//!   send fence requests and read refusals. Always built. With
//!   `etcd`, `fenced_txn` makes writes to etcd itself commit only while their writer owns.
//!   With `object-store`, [`objstore`] leads elections on an object store (S3, GCS, Azure,
//!   in memory) with the lease record's generation as the token: no etcd needed.
//! - [`fence`] (features `proxy` or `layer`): the resource's side, shared by the proxy and the
//!   in-process guard: the pure rule ([`guard`]), mark stores ([`marks`]), persist-before-
//!   forward ([`admission`]), confirmation rounds for shared stores ([`confirm`]), in-flight
//!   drains ([`drain`]) and the bodies that carry them ([`flight`]), the table of refusals
//!   ([`reject`]), [`metrics`], request [`path`] normal form, path prefixes matched at
//!   segment boundaries ([`PathPrefix`]), resources taken from the request ([`template`]),
//!   and the tower layer (`layer`, feature `layer`).
//! - [`proxy`] (feature `proxy`, default): the reverse proxy for services that cannot be
//!   changed: [`config`] and its [`reload`], the request [`host`] normal form, the
//!   request [`pipeline`](proxy::pipeline), the [`access_log`], the accept loop ([`server`]),
//!   the [`admin`] endpoints, the wiring ([`app`]), and the operator's commands: `palisade marks`
//!   ([`marks_cli`](proxy::marks_cli)) and, with `etcd`, `palisade lock|elect NAME -- CMD`
//!   (`proxy::hold_cli`), which runs a command while holding a lock or leading, with its
//!   token in the command's environment.
//! - [`token`]: the token type and its one strict wire form, used by all three.
//!
//! The short paths (`palisade::session`, `palisade::admission`, ...) are re-exports of the
//! modules in those folders.
//!
//! # Features
//!
//! `proxy` (default) builds the `palisade` binary and everything it needs. A library user
//! who only takes locks and leads elections sets `default-features = false, features =
//! ["etcd"]` and compiles no HTTP server, configuration or metrics; `layer` adds the guard as
//! a tower layer; `etcd-tls` adds TLS to etcd; `grpc` adds gRPC metadata helpers;
//! `object-store` adds [`objstore`] (bring your own `object_store` backend) and
//! `object-store-aws` the same with object_store's S3 client; `metrics` reports what the
//! process holds (held, leader, acquisitions, losses by reason, renewals, lease left) through
//! the `metrics` facade, to the exporter the application installs.

pub mod client;
#[cfg(feature = "fence")]
pub mod fence;
#[cfg(feature = "proxy")]
pub mod proxy;
pub mod token;

#[cfg(feature = "etcd")]
pub use client::fenced_txn;
#[cfg(feature = "object-store")]
pub use client::objstore;
pub(crate) use client::queue;
pub use client::{election, error, lock, owner, provider, rwlock, semaphore, session, transport};
#[cfg(feature = "layer")]
pub use fence::layer;
#[cfg(feature = "fence")]
pub use fence::{
    admission, confirm, drain, flight, guard, marks, metrics, path, recent, reject, template,
};
#[cfg(feature = "proxy")]
pub use proxy::{access_log, admin, app, config, host, reload, server};

#[cfg(feature = "fence")]
pub use admission::Admission;
#[cfg(feature = "proxy")]
pub use app::{run, App, Listeners};
#[cfg(feature = "proxy")]
pub use config::Config;
pub use election::{ElectionService, LeaderKey, Leadership, Observation, Term};
pub use error::Error;
#[cfg(feature = "fence")]
pub use fence::path_prefix::PathPrefix;
#[cfg(feature = "fence")]
pub use guard::{Verdict, Watermark};
#[cfg(feature = "layer")]
pub use layer::FenceLayer;
pub use lock::{LockGrant, LockService};
#[cfg(feature = "fence")]
pub use marks::{FileStore, MarkStore, MemoryStore};
#[cfg(feature = "fence")]
pub use metrics::Metrics;
pub use owner::Owner;
pub use provider::memory::MemoryProvider;
pub use provider::Provider;
pub use rwlock::{Mode, RwGrant, RwLockService};
pub use semaphore::{Permit, SemaphoreService};
pub use session::{Loss, LossSignal, Session, SessionOptions, SessionState};
pub use token::FencingToken;
