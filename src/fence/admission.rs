//! Admission: the pure [`guard`](crate::fence::guard) rule composed with a [`MarkStore`].
//!
//! An equal token is one atomic load. A higher token takes the resource's advance lock, checks
//! again, makes the token durable, publishes it and only then admits (persist before forward,
//! `docs/design.md#admission`). Advances of one resource are serialized so a lower concurrent
//! advance loses and is re-checked; advances of different resources do not wait for each other
//! (beyond the store).
//!
//! With a shared store (etcd, several replicas), two more things happen here:
//! - `linearizable`: every admission first waits for a store read that started after it
//!   arrived ([`crate::fence::confirm`]), so a replica whose copy lags can never admit a zombie;
//! - advances made by other replicas (seen by that read, by the store's watch, or by losing an
//!   advance race) are *learned*: published locally and, since the new owner is already
//!   writing through another replica, this replica's requests under older marks are aborted at
//!   once (a drain with no wait).

use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

mod advance;
mod entities;
mod follow;
mod open;

pub use entities::DEFAULT_MAX_CACHED;

use self::advance::{advance, learn};
use crate::fence::confirm::Coalescer;
use crate::fence::drain::{AbortBoard, Drain, Entry, Ticket};
use crate::fence::guard::{Verdict, Watermark};
use crate::fence::marks::{Consistency, Epoch, MarkStore, Marks, StoreError};
use crate::fence::metrics::{MarkMetrics, Metrics, StoreMetrics};
use crate::fence::reject::StoreStep;
use crate::token::FencingToken;

/// One fenced resource: its mark and the lock that serializes its advances.
// In this order: what every admission reads or writes (the mark, the drain, `touched`, and
// the reference count before them) fills the first cache line of the allocation, which on
// a templated route is cold (each request names another entity): one miss, not three.
#[derive(Debug)]
#[repr(C)]
pub struct Resource {
    mark: Watermark,
    drain: Drain,
    /// Used since the entity cache last looked (entities of templates only).
    touched: entities::Touched,
    /// A fixed resource of a route (or one a reload aliased): never evicted, even when its
    /// name is also an entity of a template.
    pinned: std::sync::atomic::AtomicBool,
    /// Asked for by a route (or layer) with `max_marks`: its first advance takes a stored
    /// mark from its template's quota.
    limited: std::sync::atomic::AtomicBool,
    /// Shared by the entities of one template (a fixed resource has its own).
    shared: Arc<Shared>,
    /// Also its key in the resource table (one copy of the name; the lookup compares the
    /// table's key).
    name: Arc<str>,
    advancing: tokio::sync::Mutex<()>,
    /// What only some resources use, made on first use (a pointer for the others): the
    /// confirmation round, the lock that feeds it, the names a reload gave it.
    rare: std::sync::OnceLock<Box<Rare>>,
}

/// What the entities of one template share: kept once, not in each of millions.
#[derive(Debug)]
struct Shared {
    metrics: MarkMetrics,
    /// The template's stored-marks budget (entities of a route with `max_marks` only), set
    /// at the first use of one of them.
    quota: std::sync::OnceLock<Arc<entities::Quota>>,
    /// Where connections watch the aborts of the template's entities.
    aborts: Arc<AbortBoard>,
}

impl Shared {
    fn new(metrics: MarkMetrics) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            quota: std::sync::OnceLock::new(),
            aborts: Arc::default(),
        })
    }
}

/// The parts of a resource that only some resources use (see [`Resource::rare`]).
#[derive(Debug, Default)]
struct Rare {
    /// Only stores confirmed per admission use it.
    confirm: std::sync::OnceLock<Arc<Coalescer>>,
    /// What it knows of the lock that feeds it (a route's `lock`).
    fed: Fed,
    /// Other names this resource answers to since a reload carried its mark over to them
    /// (see [`Admission::carry`]): every advance persists the mark under each of them too.
    aliases: std::sync::Mutex<Vec<String>>,
}

impl Resource {
    /// The resource's name (its key in the mark store).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The current mark (0: nothing accepted yet).
    pub fn mark(&self) -> u64 {
        self.mark.get()
    }

    /// The token of an advance of this resource that is draining older owners' requests
    /// now, if one is.
    pub fn draining(&self) -> Option<u64> {
        self.drain.draining()
    }
}

/// A resource's view of the lock that feeds it (a route's `lock`).
#[derive(Debug, Default)]
struct Fed {
    /// The epoch as the latest confirmation round read it: a later round that reads a lower
    /// one found it gone back (etcd restored from an older snapshot), and fails closed.
    seen: std::sync::Mutex<EpochSeen>,
    /// `cached` mode: the generation (plus one) in which its epoch was last read; equal to
    /// the current one, equal tokens are judged on the local mark (see `follow`).
    fresh: std::sync::atomic::AtomicU64,
    /// The epoch key the watch follows for it.
    followed: std::sync::Mutex<Option<Arc<str>>>,
}

impl Resource {
    fn rare(&self) -> &Rare {
        self.rare.get_or_init(Box::default)
    }

    fn fed(&self) -> &Fed {
        &self.rare().fed
    }

    /// What it knows of its feeding lock, if it ever looked.
    fn fed_if_any(&self) -> Option<&Fed> {
        self.rare.get().map(|r| &r.fed)
    }

    /// The names a reload gave it besides its own.
    fn aliases(&self) -> Vec<String> {
        self.rare.get().map_or_else(Vec::new, |r| {
            r.aliases.lock().unwrap_or_else(|e| e.into_inner()).clone()
        })
    }

    fn metrics(&self) -> &MarkMetrics {
        &self.shared.metrics
    }
}

/// What a resource last read of its feeding lock's epoch.
#[derive(Debug, Default)]
struct EpochSeen {
    /// The epoch key read (a reload may change it: the history starts again).
    key: Option<Arc<str>>,
    /// The confirmation round that read it.
    round: u64,
    /// Its revision.
    revision: u64,
}

/// Every known resource by name (hashed: entities of templates can be millions, and the hot
/// path looks one up per request). A resource's key is its own name, shared; an alias's is
/// the alias.
type Resources = std::collections::HashMap<Arc<str>, Arc<Resource>>;

impl Resource {
    fn new(name: &str, initial: u64, metrics: &Metrics) -> Arc<Self> {
        Self::with_shared(
            name,
            initial,
            Shared::new(metrics.mark(name)),
            Drain::new(initial),
        )
    }

    /// An entity of a template: what its template's entities share, a one-count drain.
    fn entity(name: &str, initial: u64, shared: Arc<Shared>) -> Arc<Self> {
        let drain = Drain::single(initial, Arc::clone(&shared.aborts));
        Self::with_shared(name, initial, shared, drain)
    }

    fn with_shared(name: &str, initial: u64, shared: Arc<Shared>, drain: Drain) -> Arc<Self> {
        if let Some(g) = &shared.metrics.mark {
            g.set(initial as i64);
        }
        Arc::new(Resource {
            name: name.into(),
            mark: Watermark::new(initial),
            advancing: tokio::sync::Mutex::new(()),
            drain,
            rare: std::sync::OnceLock::new(),
            shared,
            touched: entities::Touched::default(),
            pinned: std::sync::atomic::AtomicBool::new(false),
            limited: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Its entry in the resource table.
    fn entry(self: Arc<Self>) -> (Arc<str>, Arc<Self>) {
        (Arc::clone(&self.name), self)
    }
}

/// A token the resource accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// The token equals the mark.
    Current,
    /// The token raised the mark from `from`; it is durable.
    Advanced {
        /// The previous mark.
        from: u64,
    },
}

/// A token the resource refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Below the mark.
    #[error("token {token} is below the mark {mark}")]
    Stale {
        /// The refused token.
        token: FencingToken,
        /// The resource's mark.
        mark: u64,
    },
    /// A new entity of a template whose `max_marks` stored marks exist: its first mark is
    /// not stored.
    #[error("the template's limit of {limit} stored marks is reached")]
    Full {
        /// The refused token.
        token: FencingToken,
        /// The limit.
        limit: u64,
    },
    /// Above the epoch of the lock that feeds the resource: no owner was ever given this
    /// token (a forged or mistaken one). The mark is unchanged.
    #[error("token {token} is above the feeding lock's epoch {epoch}: never issued")]
    Unissued {
        /// The refused token.
        token: FencingToken,
        /// The epoch key's mod revision: the current owner's token.
        epoch: u64,
    },
    /// The store failed a step the verdict needed (the confirmation read, or making a higher
    /// token durable); the mark is unchanged.
    #[error("{step}")]
    Unavailable {
        /// The refused token.
        token: FencingToken,
        /// The step that failed.
        step: StoreStep,
        /// Why the store failed.
        #[source]
        source: StoreError,
    },
}

/// Every fenced resource and the store behind their marks.
pub struct Admission {
    store: Arc<dyn MarkStore>,
    resources: Arc<RwLock<Resources>>,
    metrics: Metrics,
    persist_metrics: StoreMetrics,
    confirm_metrics: StoreMetrics,
    /// Applies advances made elsewhere (the store's watch); stopped on drop.
    learner: Option<tokio::task::JoinHandle<()>>,
    /// The entities of resource templates in memory.
    entities: entities::Entities,
    /// Epoch keys followed by watch (`cached` mode, resources fed by a lock).
    followed: Arc<follow::Followed>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(t) = &self.learner {
            t.abort();
        }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("store", &self.store.kind())
            .field("resources", &self.resources)
            .finish()
    }
}

impl Admission {
    /// Loads the marks of `resources` from `store`.
    ///
    /// Marks the store holds for other resources are kept in the store untouched (marks are
    /// state, not config: a route removed today may come back tomorrow).
    ///
    /// # Errors
    /// Whatever the store's `load_named` returns; the proxy must not start without its marks.
    pub async fn open<I, S>(
        store: Arc<dyn MarkStore>,
        resources: I,
        metrics: &Metrics,
    ) -> Result<Self, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let load = metrics.store(store.kind(), "load");
        let started = Instant::now();
        let resources: Vec<S> = resources.into_iter().collect();
        let configured: std::collections::BTreeSet<&str> =
            resources.iter().map(AsRef::as_ref).collect();
        // A store may hold millions of entities' marks: read only the configured resources'
        // (entities are read on first use).
        let names: Vec<String> = configured.iter().map(|n| (*n).to_owned()).collect();
        let loaded = store
            .load_named(&names)
            .await
            .inspect_err(|_| load.errors.inc())?;
        load.duration.observe(started.elapsed().as_secs_f64());
        let resources: Resources = resources
            .into_iter()
            .map(|name| {
                let name = name.as_ref();
                let initial = loaded.get(name).copied().unwrap_or(0);
                Resource::new(name, initial, metrics).entry()
            })
            .collect();
        let resources = Arc::new(RwLock::new(resources));
        let persist_metrics = metrics.store(store.kind(), "persist");
        let confirm_metrics = metrics.store(store.kind(), "confirm");
        let learner = store.subscribe().map(|mut rx| {
            let resources = Arc::clone(&resources);
            tokio::spawn(async move {
                while let Some((name, mark)) = rx.recv().await {
                    let res = read(&resources).get(name.as_str()).cloned();
                    if let Some(res) = res.filter(|r| mark > r.mark()) {
                        learn(res, mark).await;
                    }
                }
            })
        });
        Ok(Self {
            store,
            resources,
            metrics: metrics.clone(),
            persist_metrics,
            confirm_metrics,
            learner,
            entities: entities::Entities::default(),
            followed: Arc::default(),
        })
    }

    /// The resource named `name`, if it is known (configured, or opened since).
    pub fn resource(&self, name: &str) -> Option<Arc<Resource>> {
        let r = read(&self.resources).get(name).cloned();
        if let Some(r) = &r {
            // Used: an entity gets another round in the cache (see `entities`).
            r.touched.touch();
        }
        r
    }

    /// Current marks of every known resource.
    pub fn marks(&self) -> Marks {
        read(&self.resources)
            .iter()
            .map(|(k, r)| (k.to_string(), r.mark()))
            .collect()
    }

    /// The resources whose advance is draining older owners' requests now, with the token
    /// of that advance, by name (a snapshot of every resource in memory, entities included).
    pub fn drains_in_progress(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = read(&self.resources)
            .iter()
            .filter_map(|(name, r)| Some((name.to_string(), r.draining()?)))
            .collect();
        out.sort_unstable();
        out
    }

    /// The store behind the marks.
    pub fn store(&self) -> &dyn MarkStore {
        &*self.store
    }

    /// The decision for `token` when it needs no waiting: `Some(Ok)` for an equal token on a
    /// store this process owns whose generation is ready (the fast path, no future to poll),
    /// `Some(Err(Stale))` below the mark, `None` when [`Admission::admit`] must decide (an
    /// advance, a drain in progress, a shared store that confirms every admission).
    // Always inlined: its result, returned through memory, costs a failed store-to-load
    // forward (measured: about 5 ns of the equal path's 20; `Drain::enter_shard` says more).
    #[inline(always)]
    pub fn admit_now(
        &self,
        resource: &Resource,
        token: FencingToken,
    ) -> Option<Result<Ticket, Refused>> {
        if self.store.consistency() == Consistency::Linearizable {
            return None;
        }
        match resource.mark.check(token) {
            Verdict::Stale { mark } => Some(Err(Refused::Stale { token, mark })),
            Verdict::Advance { .. } => None,
            Verdict::Admit => match resource.drain.enter(token.get()) {
                Entry::Entered(ticket) => Some(Ok(ticket)),
                Entry::Stale { mark } => Some(Err(Refused::Stale { token, mark })),
                Entry::NotReady(_) | Entry::Retry => None,
            },
        }
    }

    /// Decides whether `resource` admits `token` (`docs/design.md#admission`), and counts the
    /// admitted request as in flight until the returned [`Ticket`] is dropped (see
    /// [`crate::fence::drain`]).
    ///
    /// An advance persists the token, publishes it, and then waits for the requests admitted
    /// under older marks for at most `drain_timeout` before aborting them; equal-token requests
    /// that arrive during that drain wait for it too. The advance path runs in its own task so
    /// that a client hanging up mid-advance cannot leave the store written but the mark
    /// unpublished, or hold the advance lock half-way.
    ///
    /// The fast path ([`Admission::admit_now`]) is decided when this is called, so an
    /// admitted request counts as in flight from the call on (await the future at once);
    /// only what has to wait is left to the future (boxed, so that the fast path's future
    /// stays small).
    ///
    /// # Errors
    /// [`Refused::Stale`] below the mark, [`Refused::Unavailable`] when an advance could not be
    /// made durable.
    // Inlined: a steady owner's admission is the fast path, decided right here at the call.
    #[inline]
    pub fn admit<'a>(
        &'a self,
        resource: &'a Arc<Resource>,
        token: FencingToken,
        drain_timeout: Duration,
    ) -> impl Future<Output = Result<(Admitted, Ticket), Refused>> + Send + 'a {
        let now = self.admit_now(resource, token);
        async move {
            match now {
                Some(decided) => decided.map(|ticket| (Admitted::Current, ticket)),
                None => Box::pin(self.admit_waiting(resource, token, drain_timeout)).await,
            }
        }
    }

    /// [`Admission::admit`] for a caller that tried [`Admission::admit_now`] already.
    ///
    /// # Errors
    /// As [`Admission::admit`].
    pub async fn admit_waiting(
        &self,
        resource: &Arc<Resource>,
        token: FencingToken,
        drain_timeout: Duration,
    ) -> Result<(Admitted, Ticket), Refused> {
        self.admit_confirmed(resource, token, drain_timeout, None)
            .await
    }

    /// [`Admission::admit`] for a resource fed by a lock whose epoch key is `epoch` (a proxy
    /// route with `lock`, `election` or `rwlock`; linearizable marks in etcd only): the
    /// confirmation read also reads the epoch, and the effective mark is the higher of the
    /// two. The new owner's acquisition therefore fences the old one before the new owner
    /// sends anything; a token above the epoch was never issued ([`Refused::Unissued`]); an
    /// epoch key that is missing, or went back, fails closed ([`StoreStep::Epoch`]).
    ///
    /// # Errors
    /// As [`Admission::admit`], and [`Refused::Unissued`].
    pub async fn admit_fed(
        &self,
        resource: &Arc<Resource>,
        token: FencingToken,
        epoch: &Arc<str>,
        drain_timeout: Duration,
    ) -> Result<(Admitted, Ticket), Refused> {
        match self.store.consistency() {
            Consistency::Linearizable => {
                self.admit_confirmed(resource, token, drain_timeout, Some(epoch))
                    .await
            }
            Consistency::Cached => {
                // Read before the watch is asked and the epoch read: a gap the watch reports
                // meanwhile moves it, and the read then does not count as fresh.
                let generation = self.followed.generation();
                if !self.followed.is_fresh(resource) || token.get() > resource.mark() {
                    let watched = self.followed.follow(&self.store, epoch, resource);
                    self.confirm_now(resource, token, Some(epoch)).await?;
                    if watched && self.followed.generation() == generation {
                        resource
                            .fed()
                            .fresh
                            .store(generation + 1, std::sync::atomic::Ordering::Release);
                    }
                }
                self.admit_confirmed(resource, token, drain_timeout, None)
                    .await
            }
            // Only etcd reads epochs (the configuration refuses the others).
            Consistency::Local => Err(Refused::Unavailable {
                token,
                step: StoreStep::Epoch,
                source: StoreError::Etcd("this mark store cannot read a lock's epoch".to_owned()),
            }),
        }
    }

    /// [`Admission::admit_fed`] decided at once, when it can be: `cached` mode with the epoch
    /// read in the current generation (see `follow`), and a token not above the local mark.
    #[inline]
    pub fn admit_fed_now(
        &self,
        resource: &Resource,
        token: FencingToken,
    ) -> Option<Result<Ticket, Refused>> {
        if self.store.consistency() != Consistency::Cached || !self.followed.is_fresh(resource) {
            return None;
        }
        self.admit_now(resource, token)
    }

    /// Every resource fed by a lock reads its epoch again at its next admission (`cached`
    /// mode): a reload calls it, since it may have changed the locks that feed them.
    pub fn unsettle_epochs(&self) {
        self.followed.unsettle();
    }

    /// A confirmation round of `resource`'s stored mark (and of its feeding lock's `epoch`,
    /// for a resource that has one), learned: a higher mark (the new owner's acquisition, or
    /// another replica's advance) is published and this replica's requests under older marks
    /// are aborted at once. A token above the epoch is [`Refused::Unissued`].
    async fn confirm_now(
        &self,
        resource: &Arc<Resource>,
        token: FencingToken,
        epoch: Option<&Arc<str>>,
    ) -> Result<(), Refused> {
        let m = self.confirm_metrics.clone();
        let read = resource
            .rare()
            .confirm
            .get_or_init(Arc::default)
            .confirm(&self.store, &resource.name, epoch, move |took, failed| {
                m.duration.observe(took.as_secs_f64());
                if failed {
                    m.errors.inc();
                }
            })
            .await
            .map_err(|e| Refused::Unavailable {
                token,
                step: StoreStep::Confirm,
                source: StoreError::Shared(e),
            })?;
        let fed = match epoch {
            None => None,
            Some(key) => Some(epoch_of(resource, &read, key, token)?),
        };
        let effective = read.found.mark.max(fed.unwrap_or(0));
        if effective > resource.mark() {
            learn(Arc::clone(resource), effective).await;
        }
        match fed {
            Some(e) if token.get() > e => Err(Refused::Unissued { token, epoch: e }),
            _ => Ok(()),
        }
    }

    async fn admit_confirmed(
        &self,
        resource: &Arc<Resource>,
        token: FencingToken,
        drain_timeout: Duration,
        epoch: Option<&Arc<str>>,
    ) -> Result<(Admitted, Ticket), Refused> {
        if self.store.consistency() == Consistency::Linearizable {
            self.confirm_now(resource, token, epoch).await?;
        }
        loop {
            match resource.mark.check(token) {
                Verdict::Stale { mark } => return Err(Refused::Stale { token, mark }),
                Verdict::Admit => match resource.drain.enter(token.get()) {
                    Entry::Entered(ticket) => return Ok((Admitted::Current, ticket)),
                    Entry::Stale { mark } => return Err(Refused::Stale { token, mark }),
                    Entry::NotReady(generation) => Drain::wait_ready(&generation).await,
                    Entry::Retry => tokio::task::yield_now().await,
                },
                Verdict::Advance { .. } => {
                    let task = tokio::spawn(advance(
                        Arc::clone(resource),
                        Arc::clone(&self.store),
                        self.persist_metrics.clone(),
                        token,
                        drain_timeout,
                    ));
                    match task.await {
                        Ok(Ok(Some(admitted))) => return Ok(admitted),
                        // Another advance to the same token won the lock: judge again.
                        Ok(Ok(None)) => continue,
                        Ok(Err(e)) => return Err(e),
                        Err(e) => {
                            return Err(Refused::Unavailable {
                                token,
                                step: StoreStep::Persist { token: token.get() },
                                source: StoreError::TaskLost(e),
                            })
                        }
                    }
                }
            }
        }
    }
}

/// The epoch that confirmation round `read` found for `resource`, fed by the lock whose epoch
/// key is `key`: its revision, or the refusal (fail closed) when the round did not read that
/// key (two locks named for one resource, or a reload changing it meanwhile), the key is
/// missing, or its revision went below one a later-started round read before (an older
/// epoch could admit an older owner).
fn epoch_of(
    resource: &Resource,
    read: &crate::fence::confirm::Confirmation,
    key: &Arc<str>,
    token: FencingToken,
) -> Result<u64, Refused> {
    let unavailable = |source| Refused::Unavailable {
        token,
        step: StoreStep::Epoch,
        source,
    };
    let (Some(read_key), Some(found)) = (&read.epoch_key, read.found.epoch) else {
        return Err(unavailable(StoreError::EpochMissing {
            key: key.to_string(),
        }));
    };
    if read_key != key {
        return Err(unavailable(StoreError::Etcd(format!(
            "the confirmation read {read_key}, not {key}: two locks feed this resource (or a \
             reload is changing it); refusing"
        ))));
    }
    let Epoch::At(now) = found else {
        return Err(unavailable(StoreError::EpochMissing {
            key: key.to_string(),
        }));
    };
    let mut seen = resource
        .fed()
        .seen
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if seen.key.as_ref() != Some(key) {
        *seen = EpochSeen {
            key: Some(Arc::clone(key)),
            round: read.round,
            revision: now,
        };
    } else if read.round > seen.round {
        if now < seen.revision {
            return Err(unavailable(StoreError::EpochRewound {
                key: key.to_string(),
                seen: seen.revision,
                now,
            }));
        }
        seen.round = read.round;
        seen.revision = now;
    }
    Ok(now)
}

/// How long an advance may wait for the store before it is refused with 503.
pub const PERSIST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn read(r: &RwLock<Resources>) -> std::sync::RwLockReadGuard<'_, Resources> {
    r.read().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests;
