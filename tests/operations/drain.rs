//! Drains, end to end over loopback sockets: an advance waits for (or aborts) the requests
//! older owners still have in flight before the new owner's first request is forwarded, so an
//! upstream never completes a lower token's request after a higher token's request reached it.
//!
//! - `recorder.rs`: the upstream, which records the order of every request's start and end;
//! - `harness.rs`: the proxy in front of it, clients that pace their bodies, and the check of
//!   the guarantee at the upstream;
//! - `waits.rs`: slow old owners waited for or aborted, delivered requests waited for;
//! - `kept.rs`: the abort reaches requests of kept-alive connections;
//! - `zombie.rs`: a client process frozen mid-body, over HTTP/1.1 and gRPC;
//! - `grpc_streams.rs`: cut gRPC client streams never end cleanly upstream;
//! - `stress.rs`: many owners at random body speeds.

mod grpc_streams;
mod harness;
mod kept;
mod recorder;
mod stress;
mod waits;
mod zombie;
