//! The owner's side: sessions (leases kept alive), and the lock, read/write lock, election and
//! semaphore primitives that hand out fencing tokens, on etcd or in memory, plus the helpers
//! that stamp a token on outgoing requests, and (feature `etcd`) fenced transactions on etcd
//! itself. With `object-store`, [`objstore`] runs leader election on an object store instead.
//!
//! The guide below is `docs/client.md` in the repository, included as it is: its examples are
//! this module's doctests.
#![doc = include_str!("../../docs/client.md")]

pub(crate) mod backend;
pub mod election;
pub mod error;
#[cfg(feature = "etcd")]
pub mod fenced_txn;
mod limits;
pub mod lock;
#[cfg(feature = "metrics")]
pub(crate) mod metrics;
#[cfg(feature = "object-store")]
pub mod objstore;
pub mod owner;
pub mod provider;
pub(crate) mod queue;
pub mod rwlock;
pub mod semaphore;
pub mod session;
pub mod transport;
