//! Admission: the pure [`guard`](crate::guard) rule composed with a [`MarkStore`].
//!
//! An equal token is one atomic load. A higher token takes the resource's advance lock, checks
//! again, makes the token durable, publishes it and only then admits (persist before forward,
//! DESIGN 3). Advances of one resource are serialized so a lower concurrent advance loses and is
//! re-checked; advances of different resources do not wait for each other (beyond the store).
//!
//! With a shared store (etcd, several replicas), two more things happen here:
//! - `linearizable`: every admission first waits for a store read that started after it
//!   arrived ([`crate::confirm`]), so a replica whose copy lags can never admit a zombie;
//! - advances made by other replicas (seen by that read, by the store's watch, or by losing an
//!   advance race) are *learned*: published locally and, since the new owner is already
//!   writing through another replica, this replica's requests under older marks are aborted at
//!   once (a drain with no wait).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::confirm::Coalescer;
use crate::drain::{Drain, Entry, Ticket};
use crate::guard::{Verdict, Watermark};
use crate::marks::{Consistency, MarkStore, Marks, StoreError};
use crate::metrics::{MarkMetrics, Metrics, StoreMetrics};
use crate::token::FencingToken;

/// One fenced resource: its mark and the lock that serializes its advances.
#[derive(Debug)]
pub struct Resource {
    name: Arc<str>,
    mark: Watermark,
    advancing: tokio::sync::Mutex<()>,
    drain: Drain,
    confirm: Arc<Coalescer>,
    metrics: MarkMetrics,
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
}

type Resources = BTreeMap<String, Arc<Resource>>;

impl Resource {
    fn new(name: &str, initial: u64, metrics: &Metrics) -> Arc<Self> {
        let metrics = metrics.mark(name);
        metrics.mark.set(initial as i64);
        Arc::new(Resource {
            name: name.into(),
            mark: Watermark::new(initial),
            advancing: tokio::sync::Mutex::new(()),
            drain: Drain::new(initial),
            confirm: Arc::default(),
            metrics,
        })
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
    /// Above the mark, but the store could not make it durable; the mark is unchanged.
    #[error("the mark store could not persist token {token}")]
    Unavailable {
        /// The refused token.
        token: FencingToken,
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
    /// Whatever the store's `load` returns; the proxy must not start without its marks.
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
        let loaded = store.load().await.inspect_err(|_| load.errors.inc())?;
        load.duration.observe(started.elapsed().as_secs_f64());
        let resources: Vec<S> = resources.into_iter().collect();
        let configured: std::collections::BTreeSet<&str> =
            resources.iter().map(AsRef::as_ref).collect();
        let orphaned: Vec<&String> = loaded
            .keys()
            .filter(|k| !configured.contains(k.as_str()))
            .collect();
        if !orphaned.is_empty() {
            // Usually a renamed route without an explicit `resource`: its mark stays under the
            // old name and the new name starts at 0.
            tracing::warn!(
                ?orphaned,
                "the store holds marks for resources no route guards"
            );
        }
        let resources: Resources = resources
            .into_iter()
            .map(|name| {
                let name = name.as_ref();
                let initial = loaded.get(name).copied().unwrap_or(0);
                (name.to_owned(), Resource::new(name, initial, metrics))
            })
            .collect();
        let resources = Arc::new(RwLock::new(resources));
        let persist_metrics = metrics.store(store.kind(), "persist");
        let confirm_metrics = metrics.store(store.kind(), "confirm");
        let learner = store.subscribe().map(|mut rx| {
            let resources = Arc::clone(&resources);
            tokio::spawn(async move {
                while let Some((name, mark)) = rx.recv().await {
                    let res = read(&resources).get(&name).cloned();
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
        })
    }

    /// The resource named `name`, if it is known (configured, or opened since).
    pub fn resource(&self, name: &str) -> Option<Arc<Resource>> {
        read(&self.resources).get(name).cloned()
    }

    /// The resource named `name`, loading its mark from the store the first time it is asked
    /// for (resources chosen per request by a guard layer, routes added by a reload).
    ///
    /// # Errors
    /// The store's error when the mark cannot be loaded: the resource is not guarded on a
    /// guess.
    pub async fn resource_or_open(&self, name: &str) -> Result<Arc<Resource>, StoreError> {
        if let Some(r) = self.resource(name) {
            return Ok(r);
        }
        let initial = match self.store.consistency() {
            Consistency::Local => self.store.load().await?.get(name).copied().unwrap_or(0),
            _ => self.store.confirm(name).await?,
        };
        let mut map = self.resources.write().unwrap_or_else(|e| e.into_inner());
        // Another request may have opened it meanwhile: keep the first.
        Ok(Arc::clone(map.entry(name.to_owned()).or_insert_with(
            || Resource::new(name, initial, &self.metrics),
        )))
    }

    /// Current marks of every known resource.
    pub fn marks(&self) -> Marks {
        read(&self.resources)
            .iter()
            .map(|(k, r)| (k.clone(), r.mark()))
            .collect()
    }

    /// The store behind the marks.
    pub fn store(&self) -> &dyn MarkStore {
        &*self.store
    }

    /// The decision for `token` when it needs no waiting: `Some(Ok)` for an equal token on a
    /// store this process owns whose generation is ready (the fast path, no future to poll),
    /// `Some(Err(Stale))` below the mark, `None` when [`Admission::admit`] must decide (an
    /// advance, a drain in progress, a shared store that confirms every admission).
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

    /// Decides whether `resource` admits `token` (DESIGN 3), and counts the admitted request
    /// as in flight until the returned [`Ticket`] is dropped (see [`crate::drain`]).
    ///
    /// An advance persists the token, publishes it, and then waits for the requests admitted
    /// under older marks for at most `drain_timeout` before aborting them; equal-token requests
    /// that arrive during that drain wait for it too. The advance path runs in its own task so
    /// that a client hanging up mid-advance cannot leave the store written but the mark
    /// unpublished, or hold the advance lock half-way.
    ///
    /// # Errors
    /// [`Refused::Stale`] below the mark, [`Refused::Unavailable`] when an advance could not be
    /// made durable.
    pub async fn admit(
        &self,
        resource: &Arc<Resource>,
        token: FencingToken,
        drain_timeout: Duration,
    ) -> Result<(Admitted, Ticket), Refused> {
        if self.store.consistency() == Consistency::Linearizable {
            let m = self.confirm_metrics.clone();
            let stored = resource
                .confirm
                .confirm(&self.store, &resource.name, move |took, failed| {
                    m.duration.observe(took.as_secs_f64());
                    if failed {
                        m.errors.inc();
                    }
                })
                .await
                .map_err(|e| Refused::Unavailable {
                    token,
                    source: StoreError::Shared(e),
                })?;
            if stored > resource.mark() {
                learn(Arc::clone(resource), stored).await;
            }
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
                                source: StoreError::TaskLost(e),
                            })
                        }
                    }
                }
            }
        }
    }
}

/// How long an advance may wait for the store before it is refused with 503.
pub const PERSIST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The advance path: `Ok(None)` when the token turned out equal to the mark by the time the
/// lock was taken (the caller then enters the normal way).
async fn advance(
    res: Arc<Resource>,
    store: Arc<dyn MarkStore>,
    metrics: StoreMetrics,
    token: FencingToken,
    drain_timeout: Duration,
) -> Result<Option<(Admitted, Ticket)>, Refused> {
    let _serialized = res.advancing.lock().await;
    // Another advance may have won while this one waited for the lock.
    let from = match res.mark.check(token) {
        Verdict::Admit => return Ok(None),
        Verdict::Stale { mark } => return Err(Refused::Stale { token, mark }),
        Verdict::Advance { from } => from,
    };
    let started = Instant::now();
    // A hung write (stalled disk, unreachable store) must fail closed, not stall every
    // advance of the resource behind the lock. A write that lands late only raises the
    // stored mark, which is safe.
    let persisted =
        match tokio::time::timeout(PERSIST_TIMEOUT, store.persist(&res.name, token.get())).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(PERSIST_TIMEOUT)),
        };
    metrics.duration.observe(started.elapsed().as_secs_f64());
    let stored = match persisted {
        Ok(stored) => stored,
        Err(source) => {
            metrics.errors.inc();
            return Err(Refused::Unavailable { token, source });
        }
    };
    if stored > token.get() {
        // Another replica advanced further first: take its mark, and this request is stale.
        publish_learned(&res, stored).await;
        return Err(Refused::Stale {
            token,
            mark: stored,
        });
    }
    // The new generation goes in before the mark is published, so that no request admitted
    // under the new mark can be counted in the old generation.
    let (ticket, old) = res.drain.install(token.get());
    let now = res.mark.publish(token);
    res.metrics.mark.set(now as i64);
    res.metrics.advances.inc();
    tracing::info!(resource = %res.name, from, to = now, "mark advanced");
    let drained = res.drain.finish(&ticket, &old, drain_timeout).await;
    res.metrics
        .drain_duration
        .observe(drained.waited.as_secs_f64());
    if drained.aborted > 0 {
        res.metrics.drain_timeouts.inc();
        res.metrics.drain_aborted.inc_by(drained.aborted);
        tracing::warn!(
            resource = %res.name,
            mark = now,
            aborted = drained.aborted,
            ?drain_timeout,
            "requests of older owners still in flight after the drain time were aborted"
        );
    }
    Ok(Some((Admitted::Advanced { from }, ticket)))
}

fn read(r: &RwLock<Resources>) -> std::sync::RwLockReadGuard<'_, Resources> {
    r.read().unwrap_or_else(|e| e.into_inner())
}

/// Applies a mark advanced by another replica (cancel-safe: runs in its own task).
async fn learn(res: Arc<Resource>, mark: u64) {
    let task = tokio::spawn(async move {
        let _serialized = res.advancing.lock().await;
        publish_learned(&res, mark).await;
    });
    let _ = task.await;
}

/// With the advance lock held: publishes `mark` if it is higher and aborts this replica's
/// requests under older marks at once (their new owner is already writing elsewhere).
async fn publish_learned(res: &Resource, mark: u64) {
    let Some(token) = FencingToken::new(mark) else {
        return;
    };
    let from = match res.mark.check(token) {
        Verdict::Advance { from } => from,
        Verdict::Admit | Verdict::Stale { .. } => return,
    };
    let (ticket, old) = res.drain.install(mark);
    let now = res.mark.publish(token);
    res.metrics.mark.set(now as i64);
    res.metrics.advances.inc();
    tracing::info!(resource = %res.name, from, to = now, "mark advanced by another replica");
    let drained = res.drain.finish(&ticket, &old, Duration::ZERO).await;
    drop(ticket);
    if drained.aborted > 0 {
        res.metrics.drain_timeouts.inc();
        res.metrics.drain_aborted.inc_by(drained.aborted);
        tracing::warn!(
            resource = %res.name,
            mark = now,
            aborted = drained.aborted,
            "requests under older marks aborted: another replica admitted a newer owner"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marks::MemoryStore;

    const D: Duration = Duration::from_secs(2);

    fn t(v: u64) -> FencingToken {
        FencingToken::new(v).unwrap()
    }

    #[tokio::test]
    async fn equal_admits_higher_advances_lower_is_stale() {
        let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
        let store = Arc::new(MemoryStore::with_marks([("orders".to_owned(), 34)].into()));
        let adm = Admission::open(store.clone(), ["orders"], &metrics)
            .await
            .unwrap();
        let r = adm.resource("orders").unwrap().clone();
        assert_eq!(r.mark(), 34);
        assert_eq!(adm.admit(&r, t(34), D).await.unwrap().0, Admitted::Current);
        assert_eq!(
            adm.admit(&r, t(51), D).await.unwrap().0,
            Admitted::Advanced { from: 34 }
        );
        assert!(matches!(
            adm.admit(&r, t(34), D).await,
            Err(Refused::Stale { mark: 51, .. })
        ));
        assert_eq!(store.load().await.unwrap().get("orders"), Some(&51));
    }

    /// Many tasks on several threads race random tokens around a rising base. Any admission
    /// that starts after another one finished must not admit a lower token, a stale verdict
    /// must report a higher mark, and the final mark is the highest admitted token.
    #[test]
    fn concurrent_admissions_never_admit_below_an_earlier_admission() {
        use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
            let adm = Arc::new(
                Admission::open(Arc::new(MemoryStore::new()), ["r"], &metrics)
                    .await
                    .unwrap(),
            );
            let res = adm.resource("r").unwrap().clone();
            let highest = Arc::new(AtomicU64::new(0));
            let base = Arc::new(AtomicU64::new(10));
            let mut tasks = Vec::new();
            for seed in 1..=8u64 {
                let (adm, res, highest, base) =
                    (adm.clone(), res.clone(), highest.clone(), base.clone());
                tasks.push(tokio::spawn(async move {
                    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let (mut admitted, mut stale) = (0u64, 0u64);
                    for i in 0..20_000u64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if i % 64 == 0 {
                            base.fetch_add(1, SeqCst);
                        }
                        let t = t(base.load(SeqCst) + x % 8 - 4);
                        let before = highest.load(SeqCst);
                        match adm.admit(&res, t, D).await {
                            Ok(_) => {
                                assert!(
                                    t.get() >= before,
                                    "admitted {t} after {before} was admitted"
                                );
                                assert!(res.mark() >= t.get());
                                highest.fetch_max(t.get(), SeqCst);
                                admitted += 1;
                            }
                            Err(Refused::Stale { mark, .. }) => {
                                assert!(mark > t.get());
                                stale += 1;
                            }
                            Err(e) => panic!("{e}"),
                        }
                        if i % 16 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    (admitted, stale)
                }));
            }
            let (mut admitted, mut stale) = (0, 0);
            for task in tasks {
                let (a, s) = task.await.unwrap();
                admitted += a;
                stale += s;
            }
            assert!(
                admitted > 1000 && stale > 1000,
                "admitted {admitted}, stale {stale}"
            );
            assert_eq!(
                res.mark(),
                highest.load(SeqCst),
                "final mark is the highest admitted token"
            );
            assert_eq!(
                adm.store().load().await.unwrap()["r"],
                res.mark(),
                "and it is the stored mark"
            );
        });
    }
}
