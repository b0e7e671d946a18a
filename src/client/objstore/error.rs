//! What can go wrong in an object-store election, as one typed enum.

use std::time::Duration;

use super::events::LossReason;

/// Why an object-store election operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The startup check wrote a conditional request that had to fail, and the store accepted
    /// it: the store ignores `check` (or a proxy in front of it drops the header). Two
    /// candidates could then both win the same record, and two leaders would act at once.
    #[error(
        "the object store ignores {check} on writes: a conditional write that had to fail \
         succeeded, so two candidates could both win; use a store with conditional puts (for \
         S3-compatible stores: If-Match and If-None-Match on PutObject)"
    )]
    PreconditionsIgnored {
        /// The precondition the store ignored: `If-Match` or `If-None-Match: *`.
        check: &'static str,
    },
    /// The store (or its configuration, e.g. `S3ConditionalPut::Disabled`) refuses
    /// conditional writes altogether.
    #[error("the object store does not support conditional writes: {source}")]
    ConditionalWritesUnsupported {
        /// The store's refusal.
        #[source]
        source: object_store::Error,
    },
    /// The startup check replaced its probe object on the ETag the store had just reported,
    /// and the store refused every time: `If-Match` cannot work with it (for example, a proxy
    /// in front of the store rewrites ETags).
    #[error("the object store refuses If-Match even with the current ETag of {path}")]
    ETagNeverMatches {
        /// The probe's path.
        path: String,
    },
    /// The store answered a write or read of `path` without an ETag, so the record cannot be
    /// replaced conditionally.
    #[error("the object store gave no ETag for {path}: conditional replacement needs one")]
    NoETag {
        /// The object's path.
        path: String,
    },
    /// The object at the election's path is not a lease record (or is from a newer format).
    /// Nobody can take it over without knowing its generation, so the campaign stops here
    /// instead of guessing; an operator must look at it (and must not delete it: see the
    /// module docs on why the record is never deleted).
    #[error("{path} is not a palisade lease record: {source}")]
    CorruptRecord {
        /// The object's path.
        path: String,
        /// Why it could not be read.
        #[source]
        source: serde_json::Error,
    },
    /// The record's generation is `u64::MAX`: there is no higher token to take.
    #[error("{path}: generation {generation} cannot be increased")]
    GenerationExhausted {
        /// The object's path.
        path: String,
        /// The stored generation.
        generation: u64,
    },
    /// Election names are 1 to 256 bytes, a valid object path, and do not start with `.`
    /// (names under the prefix starting with `.` are the elector's own, like the probe).
    #[error("invalid election name {0:?}")]
    InvalidName(String),
    /// The options break one of the rules in [`ElectorOptions`](super::ElectorOptions).
    #[error("invalid election options: {0}")]
    InvalidOptions(&'static str),
    /// This elector already campaigns for, or leads, `name`. One elector holds at most one
    /// candidacy per name, so a second caller cannot silently share a term's token.
    #[error("{name}: this elector already campaigns or leads")]
    AlreadyCampaigning {
        /// The election's name.
        name: String,
    },
    /// A store request failed.
    #[error("{op}: {source}")]
    Store {
        /// What was being done.
        op: &'static str,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A store request got no answer in time.
    #[error("{op}: no answer within {after:?}")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// `release` on a leadership that was already released.
    #[error("already released")]
    Released,
    /// `release` found that the term had already ended: a later leader may have taken over
    /// and writes made under this term's token since then may have been fenced. The record
    /// is marked released all the same when it still names this term.
    #[error("{name}: leadership had already ended ({reason}) before this release")]
    LostBeforeRelease {
        /// The election's name.
        name: String,
        /// How it ended.
        reason: LossReason,
    },
}

impl Error {
    pub(super) fn store(op: &'static str) -> impl FnOnce(object_store::Error) -> Error {
        move |source| match source {
            object_store::Error::NotImplemented { .. } => {
                Error::ConditionalWritesUnsupported { source }
            }
            source => Error::Store { op, source },
        }
    }

    /// Worth trying again later (a follower keeps following; a leader retries until its
    /// deadline): transport trouble, not a broken store or record.
    pub(super) fn is_transient(&self) -> bool {
        matches!(self, Error::Store { .. } | Error::Timeout { .. })
    }
}
