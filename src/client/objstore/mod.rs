//! Leader election on an object store (feature `object-store`): no etcd, just a bucket.
//!
//! The pattern of Litestream and hoplock: one small lease record per election at
//! `PREFIX/NAME`, created with `If-None-Match: *` and replaced with `If-Match: <etag>`. It
//! runs on any [`object_store`] backend with conditional puts: S3 and S3-compatible servers
//! (feature `object-store-aws` adds object_store's S3 client), GCS, Azure, and
//! [`InMemory`](object_store::memory::InMemory) for tests. The store is the one part of
//! another crate in palisade's API: bringing the bucket you already have is the point.
//!
//! Tokens are the record's **generation**, and two weaknesses of those libraries are fixed:
//!
//! - **The generation never goes backwards.** Release rewrites the record as released with
//!   the same generation instead of deleting it, and the next leader writes generation + 1
//!   (see `record.rs`). Never delete a record by hand either: tokens would restart at 1,
//!   below every resource's mark, and the next leaders would be refused until the record's
//!   generation passes the mark again.
//! - **No synchronized wall clocks.** Nobody compares a timestamp from the record with its
//!   own clock. A follower takes over only after it has seen the same record version for a
//!   full TTL on its own monotonic clock ([`tokio::time::Instant`]); the leader stops
//!   acting (its [`LossSignal`] fires) `margin` before its own TTL has elapsed since the
//!   *start* of its last successful write. [`ElectorOptions`] documents the margins.
//!
//! Before the first campaign, [`Elector::new`] checks that the store honours preconditions
//! (a conditional write that must fail has to fail) and refuses a store that ignores them
//! ([`Error::PreconditionsIgnored`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), palisade::client::objstore::Error> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use palisade::client::objstore::{object_store::memory::InMemory, Elector, ElectorOptions};
//!
//! let store = Arc::new(InMemory::new()); // or an AmazonS3, GoogleCloudStorage, ...
//! let options = ElectorOptions::new().with_ttl(Duration::from_secs(10)).with_holder("node-1");
//! let elector = Elector::new(store, options).await?; // refuses a store without preconditions
//! let outcome = elector
//!     .lead("scheduler", |ctx| async move {
//!         // Stamp ctx.token on every request; stop when ctx.lost fires.
//!         let mut lost = ctx.lost;
//!         tokio::select! {
//!             reason = lost.wait() => format!("lost: {reason}"),
//!             _ = tokio::time::sleep(Duration::from_secs(60)) => "done".to_owned(),
//!         }
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

mod error;
mod events;
mod follow;
mod options;
mod probe;
mod record;
mod term;

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

pub use error::Error;
pub use events::{Event, Events, LossReason};
pub use object_store;
use object_store::path::Path;
use object_store::ObjectStore;
pub use options::ElectorOptions;
pub use term::{LeaderContext, Leadership, LossSignal};
use tokio::sync::broadcast;

use crate::token::FencingToken;

/// The longest election name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// Campaigns and leads elections stored in one object store. Cheap to clone; clones share
/// the candidacies and the event stream.
#[derive(Clone)]
pub struct Elector {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn ObjectStore>,
    options: ElectorOptions,
    timing: options::Timing,
    events: broadcast::Sender<Event>,
    /// Names this elector campaigns for or leads.
    active: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for Elector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Elector")
            .field("store", &self.inner.store.to_string())
            .field("options", &self.inner.options)
            .finish()
    }
}

/// What the record says now (see [`Elector::current`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The generation: the token of the term that wrote the record.
    pub token: FencingToken,
    /// The holder's self-description ([`ElectorOptions::with_holder`]).
    pub holder: String,
    /// Whether that term was released (nobody leads until the next term).
    pub released: bool,
}

impl Elector {
    /// Validates `options` and checks that `store` honours conditional writes (four small
    /// writes to `PREFIX/.precondition-probe`, see `probe.rs`).
    ///
    /// # Errors
    /// [`Error::InvalidOptions`]; [`Error::PreconditionsIgnored`] when a write that had to
    /// fail succeeded; [`Error::ConditionalWritesUnsupported`], [`Error::ETagNeverMatches`],
    /// [`Error::NoETag`]; a store error or timeout.
    pub async fn new(store: Arc<dyn ObjectStore>, options: ElectorOptions) -> Result<Self, Error> {
        let timing = options.validate()?;
        probe::check(&*store, &options.prefix, &timing).await?;
        let (events, _) = broadcast::channel(256);
        Ok(Elector {
            inner: Arc::new(Inner {
                store,
                options,
                timing,
                events,
                active: Mutex::default(),
            }),
        })
    }

    /// Follows this elector's terms from now on.
    pub fn events(&self) -> Events {
        Events(self.inner.events.subscribe())
    }

    /// Waits until this candidate leads `name`, and returns the term with its token.
    ///
    /// Cancel-safe: dropping the future abandons the candidacy. (A takeover write whose
    /// answer never came may have won; the record then expires after its TTL.)
    ///
    /// # Errors
    /// [`Error::InvalidName`], [`Error::AlreadyCampaigning`], [`Error::CorruptRecord`],
    /// [`Error::GenerationExhausted`], [`Error::NoETag`], an unsupported store. Transient
    /// store errors are retried while campaigning (and logged once per outage).
    pub async fn campaign(&self, name: &str) -> Result<Leadership, Error> {
        let path = self.path(name)?;
        let claim = Claim::new(&self.inner, name)?;
        let shared = Arc::new(term::Shared {
            store: self.inner.store.clone(),
            path,
            name: name.to_owned(),
            timing: self.inner.timing,
            events: self.inner.events.clone(),
            #[cfg(feature = "metrics")]
            asked: tokio::time::Instant::now(),
        });
        let won = follow::campaign(&shared, &self.inner.options.holder).await?;
        Ok(term::start(shared, won, claim))
    }

    /// Campaigns for `name`, runs `work` while leading, waits for it to return, then
    /// releases (hoplock's `Elector.Lead`). `work` learns of a lost term through
    /// [`LeaderContext::lost`]; the release waits for `work`, so this helper never lets the
    /// next leader start while `work` still runs under a term it believes it holds.
    ///
    /// # Errors
    /// The campaign's errors; a failed release is logged (followers then take over once the
    /// TTL has passed).
    pub async fn lead<F, Fut, T>(&self, name: &str, work: F) -> Result<T, Error>
    where
        F: FnOnce(LeaderContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let mut leadership = self.campaign(name).await?;
        let out = work(leadership.context()).await;
        if let Err(e) = leadership.release().await {
            tracing::debug!(election = name, error = %e, "release after lead");
        }
        Ok(out)
    }

    /// The record of `name` as stored now, `None` if no term was ever won. Says who wrote it
    /// last, not whether that leader still acts: only time without a new version tells that.
    ///
    /// # Errors
    /// [`Error::InvalidName`], [`Error::CorruptRecord`], [`Error::NoETag`], a store error.
    pub async fn current(&self, name: &str) -> Result<Option<Lease>, Error> {
        let path = self.path(name)?;
        let read = record::timed(
            "read the lease record",
            self.inner.timing.request_timeout,
            record::read(&*self.inner.store, &path),
        )
        .await?;
        Ok(read.and_then(|s| {
            Some(Lease {
                token: FencingToken::new(s.record.generation)?,
                holder: s.record.holder,
                released: s.record.released,
            })
        }))
    }

    fn path(&self, name: &str) -> Result<Path, Error> {
        let invalid = || {
            let cut = name.char_indices().nth(64).map_or(name.len(), |(i, _)| i);
            Error::InvalidName(name[..cut].to_owned())
        };
        if name.is_empty() || name.len() > MAX_NAME_BYTES || name.starts_with('.') {
            return Err(invalid());
        }
        let full = format!("{}/{name}", self.inner.options.prefix);
        let path = Path::parse(&full).map_err(|_| invalid())?;
        // Path::parse drops empty segments ("a//b"); a name must map to itself.
        if path.as_ref() != full {
            return Err(invalid());
        }
        Ok(path)
    }
}

/// One candidacy per name and elector, held from the campaign to the end of the term.
pub(crate) struct Claim {
    inner: Arc<Inner>,
    name: String,
}

impl Claim {
    fn new(inner: &Arc<Inner>, name: &str) -> Result<Claim, Error> {
        let mut active = inner.active.lock().unwrap_or_else(|p| p.into_inner());
        if !active.insert(name.to_owned()) {
            return Err(Error::AlreadyCampaigning {
                name: name.to_owned(),
            });
        }
        Ok(Claim {
            inner: inner.clone(),
            name: name.to_owned(),
        })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut active = self.inner.active.lock().unwrap_or_else(|p| p.into_inner());
        active.remove(&self.name);
    }
}
