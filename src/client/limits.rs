//! The bounds the client checks its inputs against before any request: below the primitives
//! that enforce them and the error type that reports them.

/// The longest primitive name, in bytes. Keys must fit etcd's request limit (1.5 MiB by
/// default, with several keys per request); a kilobyte is far more than a name needs.
pub const MAX_NAME_BYTES: usize = 1024;

/// The largest permit count of a semaphore.
pub const MAX_PERMITS: u32 = 4096;
