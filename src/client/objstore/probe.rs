//! The startup check: refuse a store that ignores preconditions.
//!
//! Some S3-compatible servers (and some proxies in front of S3) accept `If-Match` and
//! `If-None-Match` and then ignore them. An election on such a store looks fine until two
//! candidates take the same record at once. So before the first campaign, the elector makes
//! conditional writes whose outcome it knows, on an object of its own
//! (`PREFIX/.precondition-probe`):
//!
//! 1. an unconditional write, which gives the probe's current ETag;
//! 2. `If-Match` with an ETag the store cannot have issued: must fail;
//! 3. `If-None-Match: *` on the (existing) probe: must fail;
//! 4. `If-Match` with the ETag from step 1 (or a later one, if another elector probes at the
//!    same moment): must succeed, or conditional writes would never work at all.
//!
//! The probe object is left in place: deleting it could let a concurrent elector's step 3
//! succeed on a missing object and refuse a good store.

use object_store::path::Path;
use std::time::Duration;

use object_store::{
    ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, PutResult, UpdateVersion,
};

use super::error::Error;
use super::options::Timing;
use super::record::timed;

const OP: &str = "check the store's conditional writes";

/// Runs the check on `PREFIX/.precondition-probe`.
pub(super) async fn check(store: &dyn ObjectStore, prefix: &str, t: &Timing) -> Result<(), Error> {
    let path = Path::from(format!("{prefix}/.precondition-probe"));
    let after = t.request_timeout;
    put(store, &path, PutMode::Overwrite, after)
        .await?
        .map_err(Error::store(OP))?;

    let bogus = UpdateVersion {
        e_tag: Some("\"palisade-probe-never-an-etag\"".to_owned()),
        version: None,
    };
    expect_refused(
        put(store, &path, PutMode::Update(bogus), after).await?,
        "If-Match",
    )?;
    expect_refused(
        put(store, &path, PutMode::Create, after).await?,
        "If-None-Match: *",
    )?;

    // Read the current ETag (not step 1's answer: a concurrent probe may have written since)
    // and replace on it; retry a few times if other probes keep changing it.
    for _ in 0..5 {
        let head = async { store.head(&path).await.map_err(Error::store(OP)) };
        let meta = timed(OP, after, head).await?;
        let Some(e_tag) = meta.e_tag else {
            return Err(Error::NoETag {
                path: path.to_string(),
            });
        };
        let version = UpdateVersion {
            e_tag: Some(e_tag),
            version: meta.version,
        };
        match put(store, &path, PutMode::Update(version), after).await? {
            Ok(_) => return Ok(()),
            Err(object_store::Error::Precondition { .. }) => continue,
            Err(e) => return Err(Error::store(OP)(e)),
        }
    }
    Err(Error::ETagNeverMatches {
        path: path.to_string(),
    })
}

/// One probe write within `after`: the outer error is a timeout, the inner the store's answer.
async fn put(
    store: &dyn ObjectStore,
    path: &Path,
    mode: PutMode,
    after: Duration,
) -> Result<Result<PutResult, object_store::Error>, Error> {
    let opts = PutOptions {
        mode,
        ..PutOptions::default()
    };
    let body = PutPayload::from_static(b"palisade: conditional-write probe\n");
    timed(OP, after, async {
        Ok(store.put_opts(path, body, opts).await)
    })
    .await
}

/// A write that had to fail: `Precondition`/`AlreadyExists` is the good answer, success
/// means the store ignored `check`.
fn expect_refused(
    r: Result<PutResult, object_store::Error>,
    check: &'static str,
) -> Result<(), Error> {
    match r {
        Err(
            object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. },
        ) => Ok(()),
        Ok(_) => Err(Error::PreconditionsIgnored { check }),
        Err(e) => Err(Error::store(OP)(e)),
    }
}
