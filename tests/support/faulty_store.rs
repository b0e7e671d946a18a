//! An object store that misbehaves on purpose, around a real one (object_store's
//! `InMemory`, or an S3 client): it can ignore preconditions as some S3-compatible servers
//! do, refuse every request as an unreachable store does, or lose the answer to a write
//! that it did perform.

#![allow(dead_code, unreachable_pub)]

use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use palisade::client::objstore::object_store::path::Path;
use palisade::client::objstore::object_store::{
    self, CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use tokio_stream::Stream;

type BoxStream<T> = std::pin::Pin<Box<dyn Stream<Item = T> + Send + 'static>>;

/// What the store does wrong now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Nothing: the inner store as it is.
    #[default]
    None,
    /// Writes `If-Match` and `If-None-Match: *` puts unconditionally.
    IgnorePreconditions,
    /// Ignores `If-Match` only (creates stay conditional).
    IgnoreIfMatch,
    /// Ignores `If-None-Match: *` only.
    IgnoreIfNoneMatch,
    /// Refuses conditional puts as "not implemented" (S3ConditionalPut::Disabled does).
    NoConditionalPuts,
    /// Every request fails, as if the store were unreachable.
    Down,
    /// The next put is performed but its answer is an error (then back to `None`).
    LoseNextPutAnswer,
}

#[derive(Debug, Clone)]
pub struct Faulty {
    inner: Arc<dyn ObjectStore>,
    fault: Arc<Mutex<Fault>>,
}

impl Faulty {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        Self {
            inner,
            fault: Arc::default(),
        }
    }

    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap()
    }

    fn down(&self) -> Result<()> {
        if self.fault() == Fault::Down {
            return Err(object_store::Error::Generic {
                store: "Faulty",
                source: "the store is down".into(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Faulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Faulty {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> Result<PutResult> {
        self.down()?;
        let fault = self.fault();
        match (fault, &opts.mode) {
            (Fault::IgnorePreconditions, PutMode::Create | PutMode::Update(_))
            | (Fault::IgnoreIfMatch, PutMode::Update(_))
            | (Fault::IgnoreIfNoneMatch, PutMode::Create) => opts.mode = PutMode::Overwrite,
            (Fault::NoConditionalPuts, PutMode::Create | PutMode::Update(_)) => {
                return Err(object_store::Error::NotImplemented {
                    operation: "conditional put".into(),
                    implementer: self.to_string(),
                })
            }
            _ => {}
        }
        let r = self.inner.put_opts(location, payload, opts).await;
        if fault == Fault::LoseNextPutAnswer {
            self.set(Fault::None);
            r?;
            return Err(object_store::Error::Generic {
                store: "Faulty",
                source: "the answer was lost".into(),
            });
        }
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.down()?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.down()?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Vec<Bytes>> {
        self.down()?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(&self, locations: BoxStream<Result<Path>>) -> BoxStream<Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.down()?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.down()?;
        self.inner.copy_opts(from, to, options).await
    }
}
