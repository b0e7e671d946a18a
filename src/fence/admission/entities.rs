//! The entities of resource templates in memory: created on first use, evicted when idle
//! under `[marks] max_cached`, read again from the store before their next admission.
//!
//! An entity is idle, and may be evicted, when nothing but the resource table holds it (no
//! request has it in hand, no advance or drain of it runs: each of those holds a reference),
//! no request admitted under its mark is in flight, and its advance lock is free. Its mark is
//! durable by then (an advance persists before it publishes), so the store's copy is the
//! truth and the next request reads it back: never a guess. Concurrent first uses of one
//! entity share one store read. Eviction is a second-chance (clock) queue: an entity used
//! since it was last looked at gets another round.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use super::{Admission, Resource, Shared};
use crate::fence::marks::StoreError;

/// Default `[marks] max_cached`: entities kept in memory.
pub const DEFAULT_MAX_CACHED: usize = 100_000;

/// The in-memory side of the entities (see the module docs).
#[derive(Debug)]
pub(super) struct Entities {
    max: AtomicUsize,
    count: AtomicUsize,
    queue: Mutex<VecDeque<Weak<Resource>>>,
    /// One gate per entity being loaded: the first caller reads the store, the others wait.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The stored-marks budget of each template, counted from the store at first use.
    quotas: tokio::sync::Mutex<HashMap<String, Arc<Quota>>>,
    /// What each template's entities share.
    shared: Mutex<HashMap<String, Arc<Shared>>>,
    /// Loads from the store and evictions, for metrics and tests.
    pub(super) loaded: AtomicUsize,
    pub(super) evicted: AtomicUsize,
}

impl Default for Entities {
    fn default() -> Self {
        Self {
            max: AtomicUsize::new(DEFAULT_MAX_CACHED),
            count: AtomicUsize::new(0),
            queue: Mutex::default(),
            loading: Mutex::default(),
            quotas: tokio::sync::Mutex::default(),
            shared: Mutex::default(),
            loaded: AtomicUsize::new(0),
            evicted: AtomicUsize::new(0),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A caller's place at an entity's loading gate; leaving (also when the caller's future is
/// dropped half-way) removes the gate once nobody else waits at it.
struct Gate<'e> {
    entities: &'e Entities,
    name: &'e str,
    gate: Arc<tokio::sync::Mutex<()>>,
}

impl<'e> Gate<'e> {
    fn enter(entities: &'e Entities, name: &'e str) -> Self {
        let mut loading = lock(&entities.loading);
        let gate = Arc::clone(loading.entry(name.to_owned()).or_default());
        Gate {
            entities,
            name,
            gate,
        }
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        let mut loading = lock(&self.entities.loading);
        // The map's and ours: nobody else waits at this gate.
        if loading
            .get(self.name)
            .is_some_and(|g| Arc::strong_count(g) == 2)
        {
            loading.remove(self.name);
        }
    }
}

/// How many marks a template may store, and how many it does (this process's count: the
/// store's at first use, plus every new entity's first advance since).
#[derive(Debug)]
pub(super) struct Quota {
    limit: std::sync::atomic::AtomicU64,
    used: std::sync::atomic::AtomicU64,
}

impl Quota {
    /// Takes one stored mark; `false` when the limit is reached.
    pub(super) fn take(&self) -> bool {
        let limit = self.limit.load(Relaxed);
        self.used
            .fetch_update(Relaxed, Relaxed, |u| (u < limit).then_some(u + 1))
            .is_ok()
    }

    /// Gives back what `take` took (the write failed).
    pub(super) fn give_back(&self) {
        let _ = self
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(1)));
    }

    pub(super) fn limit(&self) -> u64 {
        self.limit.load(Relaxed)
    }

    /// The route's limit as configured now (a reload may have changed it); written only
    /// when it changed, so that hits on the hot path leave the line shared.
    fn set_limit(&self, limit: u64) {
        if self.limit.load(Relaxed) != limit {
            self.limit.store(limit, Relaxed);
        }
    }
}

/// Marks an entity as used, for the second-chance queue.
#[derive(Debug, Default)]
pub(super) struct Touched(AtomicBool);

impl Touched {
    pub(super) fn touch(&self) {
        // A plain load first: most hits find it set already and write nothing.
        if !self.0.load(Relaxed) {
            self.0.store(true, Relaxed);
        }
    }
}

impl Entities {
    /// What the entities of `template` share.
    pub(super) fn shared_of(
        &self,
        template: &str,
        metrics: &crate::fence::metrics::Metrics,
    ) -> Arc<Shared> {
        let mut all = lock(&self.shared);
        if let Some(s) = all.get(template) {
            return Arc::clone(s);
        }
        let s = Shared::new(metrics.keyed_mark(template));
        all.insert(template.to_owned(), Arc::clone(&s));
        s
    }

    /// Registers an entity just inserted in the resource table.
    pub(super) fn admitted(&self, r: &Arc<Resource>, metrics: &crate::fence::metrics::Metrics) {
        self.loaded.fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        let m = metrics.entities();
        m.loaded.inc();
        m.cached.inc();
        lock(&self.queue).push_back(Arc::downgrade(r));
    }
}

impl Admission {
    /// Keeps at most `max` entities of resource templates in memory (at least 1).
    pub fn set_max_cached(&self, max: usize) {
        self.entities.max.store(max.max(1), Relaxed);
    }

    /// Entities in memory now, loaded from the store so far, and evicted so far.
    pub fn entity_counts(&self) -> (usize, usize, usize) {
        let e = &self.entities;
        (
            e.count.load(Relaxed),
            e.loaded.load(Relaxed),
            e.evicted.load(Relaxed),
        )
    }

    /// The entity `name` of the resource template `template`, its mark loaded from the store
    /// the first time it is asked for, and again after it was evicted. Its metrics are the
    /// template's (no per-entity series).
    ///
    /// # Errors
    /// The store's error when the mark cannot be loaded: the entity is not guarded on a
    /// guess.
    pub async fn entity(&self, name: &str, template: &str) -> Result<Arc<Resource>, StoreError> {
        self.entity_inner(name, template).await
    }

    /// [`Admission::entity`] for a template that may store at most `max_marks` marks: a new
    /// entity's first advance beyond that is refused ([`super::Refused::Full`]). The count
    /// starts from the marks the store holds for the template's names.
    ///
    /// # Errors
    /// As [`Admission::entity`].
    pub async fn entity_within(
        &self,
        name: &str,
        template: &crate::fence::template::ResourceTemplate,
        max_marks: Option<u64>,
    ) -> Result<Arc<Resource>, StoreError> {
        if let Some(entity) = self.entity_cached(name, max_marks) {
            return Ok(entity);
        }
        let entity = self.entity_inner(name, template.as_str()).await?;
        if let Some(limit) = max_marks {
            let q = match entity.shared.quota.get() {
                Some(q) => {
                    q.set_limit(limit);
                    Arc::clone(q)
                }
                None => self.quota(template, limit).await?,
            };
            // Only into the quota slot of this template's entities: an entity first opened
            // by another template (one name, two templates) keeps that one's.
            let own = Arc::ptr_eq(
                &entity.shared,
                &self.entities.shared_of(template.as_str(), &self.metrics),
            );
            if own {
                let _ = entity.shared.quota.set(q);
            }
            entity.limited.store(true, Relaxed);
        }
        Ok(entity)
    }

    /// [`Admission::entity_within`] when it needs no waiting: the entity is in memory and
    /// its quota known. `None`: call `entity_within`.
    pub fn entity_cached(&self, name: &str, max_marks: Option<u64>) -> Option<Arc<Resource>> {
        let entity = self.resource(name)?;
        if let Some(limit) = max_marks {
            entity.shared.quota.get()?.set_limit(limit);
            if !entity.limited.load(Relaxed) {
                entity.limited.store(true, Relaxed);
            }
        }
        Some(entity)
    }

    async fn quota(
        &self,
        template: &crate::fence::template::ResourceTemplate,
        limit: u64,
    ) -> Result<Arc<Quota>, StoreError> {
        let mut quotas = self.entities.quotas.lock().await;
        if let Some(q) = quotas.get(template.as_str()) {
            q.set_limit(limit);
            return Ok(Arc::clone(q));
        }
        // The store's names under the template's literal start (a count, not a read of
        // them: possibly a few more than the template's own, which only errs on the safe side).
        let stored = self.store.count(template.literal_prefix()).await?;
        let q = Arc::new(Quota {
            limit: std::sync::atomic::AtomicU64::new(limit),
            used: std::sync::atomic::AtomicU64::new(stored),
        });
        quotas.insert(template.as_str().to_owned(), Arc::clone(&q));
        Ok(q)
    }

    async fn entity_inner(&self, name: &str, template: &str) -> Result<Arc<Resource>, StoreError> {
        if let Some(r) = self.resource(name) {
            return Ok(r);
        }
        let gate = Gate::enter(&self.entities, name);
        let opened = {
            let _first = gate.gate.lock().await;
            self.load_entity(name, template).await
        };
        drop(gate);
        let entity = opened?;
        self.evict_idle();
        Ok(entity)
    }

    async fn load_entity(&self, name: &str, template: &str) -> Result<Arc<Resource>, StoreError> {
        if let Some(r) = self.resource(name) {
            return Ok(r); // loaded by the caller that went first
        }
        // Evicted again before this caller took it (the cache is tiny and busy): load again.
        for _ in 0..3 {
            self.open_with([name], Some(template)).await?;
            if let Some(entity) = self.resource(name) {
                return Ok(entity);
            }
        }
        Err(StoreError::Etcd(format!(
            "entity {name} was evicted three times before its first use: raise [marks] \
             max_cached"
        )))
    }

    /// Evicts idle entities until at most `max_cached` remain (or none is idle).
    fn evict_idle(&self) {
        let e = &self.entities;
        let max = e.max.load(Relaxed);
        if e.count.load(Relaxed) <= max {
            return;
        }
        // Lock order: the resource table before the queue (an insert registers the entity
        // with the table locked), so the queue is never held while the table is taken.
        // Two rounds at most: the first clears the second-chance bits.
        let mut budget = lock(&e.queue).len() * 2;
        while e.count.load(Relaxed) > max && budget > 0 {
            budget -= 1;
            let Some(weak) = lock(&e.queue).pop_front() else {
                break;
            };
            let Some(r) = weak.upgrade() else { continue };
            if r.pinned.load(Relaxed) {
                // A fixed resource by now: not the cache's to evict.
                e.count.fetch_sub(1, Relaxed);
                self.metrics.entities().cached.dec();
                continue;
            }
            if r.touched.0.swap(false, Relaxed) {
                lock(&e.queue).push_back(weak);
                continue;
            }
            let mut map = self.resources.write().unwrap_or_else(|e| e.into_inner());
            // With the table locked nobody can take a new reference: the table's and `r` are
            // all there are when no request, advance or drain holds it (Acquire: see the
            // releases of the references dropped before).
            let idle = Arc::strong_count(&r) == 2 && {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                r.drain.in_flight() == 0 && r.advancing.try_lock().is_ok()
            };
            let evicted = idle && map.get(r.name()).is_some_and(|m| Arc::ptr_eq(m, &r));
            if evicted {
                map.remove(r.name());
            }
            drop(map);
            if evicted {
                e.count.fetch_sub(1, Relaxed);
                e.evicted.fetch_add(1, Relaxed);
                let m = self.metrics.entities();
                m.evicted.inc();
                m.cached.dec();
            } else {
                lock(&e.queue).push_back(weak);
            }
        }
    }
}
