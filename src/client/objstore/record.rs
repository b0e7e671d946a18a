//! The lease record: one small JSON object per election, and the conditional writes on it.
//!
//! The record is never deleted. Its `generation` is the token of the term that wrote it, so
//! deleting it would restart tokens at 1 behind every resource's mark (the flaw of libraries
//! that delete on release): releasing rewrites it with `released: true` and the same
//! generation, and the next leader writes generation + 1.
//!
//! Every write also bumps `revision`, so no two writes ever store the same bytes. S3 and most
//! S3-compatible stores derive the ETag from the content (its MD5): without the bump, a
//! leader's renewal would keep the ETag, followers would see "unchanged" and take over from
//! a live leader, and an old ETag could match again (ABA) after the content came back.

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};

use super::error::Error;

/// The stored form. Unknown fields are ignored, so a later version may add some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Record {
    /// The token of the term that wrote the record.
    pub(super) generation: u64,
    /// Bumped on every write, never reset.
    pub(super) revision: u64,
    /// Names the term: unique to the write that won it, kept by its renewals. Lets a
    /// candidate recognise its own write when the answer to it was lost.
    pub(super) nonce: String,
    /// The leader's self-description, for observers.
    pub(super) holder: String,
    /// The leader's TTL: followers wait at least this long (and at least their own).
    pub(super) ttl_ms: u64,
    /// Set by the leader's release: a follower may take over at once.
    pub(super) released: bool,
}

impl Record {
    /// The first record of an election.
    pub(super) fn first(nonce: String, holder: String, ttl_ms: u64) -> Record {
        Record {
            generation: 1,
            revision: 1,
            nonce,
            holder,
            ttl_ms,
            released: false,
        }
    }

    /// The record of the next term, replacing this one.
    pub(super) fn successor(
        &self,
        nonce: String,
        holder: String,
        ttl_ms: u64,
        path: &Path,
    ) -> Result<Record, Error> {
        let generation =
            self.generation
                .checked_add(1)
                .ok_or_else(|| Error::GenerationExhausted {
                    path: path.to_string(),
                    generation: self.generation,
                })?;
        Ok(Record {
            generation,
            revision: self.revision.saturating_add(1),
            nonce,
            holder,
            ttl_ms,
            released: false,
        })
    }

    /// The same term, rewritten (a renewal), or released.
    pub(super) fn rewrite(&self, released: bool) -> Record {
        Record {
            revision: self.revision.saturating_add(1),
            released,
            ..self.clone()
        }
    }

    fn encode(&self) -> PutPayload {
        // A struct of integers, bools and strings always serializes.
        PutPayload::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

/// A record as read or written, with the version to make the next write conditional on.
#[derive(Debug, Clone)]
pub(super) struct Stored {
    pub(super) record: Record,
    pub(super) version: UpdateVersion,
}

impl Stored {
    /// Whether `other` is the same stored version (same ETag and object version).
    pub(super) fn same_version(&self, other: &Stored) -> bool {
        self.version == other.version
    }
}

/// How a conditional write ended, when the store answered.
#[derive(Debug)]
pub(super) enum Write {
    /// Written; the version to replace it with next.
    Done(UpdateVersion),
    /// The precondition failed: the record exists (create) or changed (replace).
    Conflict,
}

/// Reads the record; `None` when there is none.
///
/// # Errors
/// [`Error::CorruptRecord`], [`Error::NoETag`], or a store error.
pub(super) async fn read(store: &dyn ObjectStore, path: &Path) -> Result<Option<Stored>, Error> {
    let got = match store.get(path).await {
        Ok(got) => got,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(Error::store("read the lease record")(e)),
    };
    let version = UpdateVersion {
        e_tag: got.meta.e_tag.clone(),
        version: got.meta.version.clone(),
    };
    let bytes = got
        .bytes()
        .await
        .map_err(Error::store("read the lease record"))?;
    let record = serde_json::from_slice(&bytes).map_err(|source| Error::CorruptRecord {
        path: path.to_string(),
        source,
    })?;
    if version.e_tag.is_none() {
        return Err(Error::NoETag {
            path: path.to_string(),
        });
    }
    Ok(Some(Stored { record, version }))
}

/// Creates the record only if there is none (`If-None-Match: *`).
pub(super) async fn create(
    store: &dyn ObjectStore,
    path: &Path,
    record: &Record,
) -> Result<Write, Error> {
    put(store, path, record, PutMode::Create).await
}

/// Replaces the record only if it is still `version` (`If-Match: <etag>`).
pub(super) async fn replace(
    store: &dyn ObjectStore,
    path: &Path,
    record: &Record,
    version: &UpdateVersion,
) -> Result<Write, Error> {
    put(store, path, record, PutMode::Update(version.clone())).await
}

async fn put(
    store: &dyn ObjectStore,
    path: &Path,
    record: &Record,
    mode: PutMode,
) -> Result<Write, Error> {
    let opts = PutOptions {
        mode,
        ..PutOptions::default()
    };
    match store.put_opts(path, record.encode(), opts).await {
        Ok(r) if r.e_tag.is_none() => Err(Error::NoETag {
            path: path.to_string(),
        }),
        Ok(r) => Ok(Write::Done(UpdateVersion {
            e_tag: r.e_tag,
            version: r.version,
        })),
        Err(
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
        ) => Ok(Write::Conflict),
        Err(e) => Err(Error::store("write the lease record")(e)),
    }
}

/// Runs one store request, giving up after `after`.
pub(super) async fn timed<T>(
    op: &'static str,
    after: std::time::Duration,
    request: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(after, request)
        .await
        .unwrap_or(Err(Error::Timeout { op, after }))
}
