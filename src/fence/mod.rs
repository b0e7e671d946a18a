//! The resource's side, shared by the proxy and the in-process layer: the admission rule, the
//! mark stores, in-flight drains and the one table of refusals. Nothing here knows about the
//! proxy's configuration or the client library.

pub mod admission;
pub mod confirm;
pub mod drain;
pub mod flight;
pub mod grpc;
pub mod guard;
#[cfg(feature = "layer")]
pub mod layer;
pub mod marks;
pub mod metrics;
pub mod path;
pub mod path_prefix;
pub mod recent;
pub mod reject;
pub mod template;
