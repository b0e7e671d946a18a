//! The owner's side: sessions, locks, read/write locks, elections and semaphores on both
//! providers, fenced etcd transactions, object-store elections, `palisade lock|elect`, and the
//! loop back from a resource's refusal to its owner.
//!
//! - `coord.rs` (+ `coord/`): one behaviour suite against the in-memory provider and real
//!   etcd, and crashes (SIGSTOP, SIGKILL) of real holder processes;
//! - `fenced.rs`: owners on real etcd behind the proxy: fence requests, refusals told back;
//! - `fenced_txn.rs`, `stm.rs`: writes to etcd that commit only while their writer owns;
//! - `semaphore.rs`: contender processes behind the proxy, one guarded route per slot;
//! - `objstore.rs`: elections on an in-memory object store, on tokio's paused clock;
//! - `objstore_s3.rs` (+ `objstore_s3/`): elections on moto's S3 server, with SIGSTOPped
//!   candidate processes;
//! - `cli_lock.rs`: `palisade lock|elect NAME -- CMD` over shell jobs.
//!
//! Each file needs the features its `cfg` below names (`--all-features` builds them all).

#[cfg(feature = "proxy")]
#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "etcd")]
#[path = "../support/etcd.rs"]
mod etcd;
#[cfg(feature = "object-store")]
#[path = "../support/faulty_store.rs"]
mod faulty_store;
#[cfg(feature = "object-store-aws")]
#[path = "../support/moto.rs"]
mod moto;
#[cfg(feature = "etcd")]
#[path = "../support/netcut.rs"]
mod netcut;

#[cfg(all(feature = "etcd", feature = "proxy"))]
mod cli_lock;
#[cfg(all(feature = "etcd", feature = "grpc"))]
mod coord;
#[cfg(all(feature = "etcd", feature = "proxy", feature = "grpc"))]
mod fenced;
#[cfg(feature = "etcd")]
mod fenced_txn;
#[cfg(feature = "object-store")]
mod objstore;
#[cfg(all(feature = "object-store-aws", feature = "proxy"))]
mod objstore_s3;
#[cfg(all(feature = "etcd", feature = "proxy"))]
mod semaphore;
#[cfg(feature = "etcd")]
mod stm;
