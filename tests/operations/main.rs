//! Palisade as operators run it: drains between owners, reloads, replicas sharing marks in
//! etcd, `palisade marks`, and the binary as a process.
//!
//! - `drain.rs` (+ `drain/`): an advance waits for or aborts older owners' requests in flight;
//! - `reload.rs`: reloads under load, connections and marks kept;
//! - `reload_ops.rs`: SIGHUP, `POST /reload`, the keys only a restart changes, the status page;
//! - `replicas.rs`: replicas on a 3-node etcd cluster (feature `etcd`);
//! - `marks_cli.rs`: `palisade marks list|set` and its audit trail;
//! - `process.rs`: restart after `kill -9`, a corrupt marks file, memory under large bodies,
//!   `palisade check` and `health`.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "etcd")]
#[path = "../support/etcd.rs"]
mod etcd;

mod drain;
mod marks_cli;
mod process;
mod reload;
mod reload_ops;
#[cfg(feature = "etcd")]
mod replicas;
