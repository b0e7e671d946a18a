//! Adding resources to a running admission: per request (a guard layer's resource chosen
//! from the request) and per reload (routes new to the configuration).

use std::sync::Arc;

use super::advance::learn;
use std::time::Duration;

use super::{read, Admission, Refused, Resource};
use crate::fence::marks::{Consistency, StoreError};
use crate::fence::reject::StoreStep;
use crate::token::FencingToken;

impl Admission {
    /// The resource named `name`, loading its mark from the store the first time it is asked
    /// for (resources chosen per request by a guard layer).
    ///
    /// # Errors
    /// The store's error when the mark cannot be loaded: the resource is not guarded on a
    /// guess.
    pub async fn resource_or_open(&self, name: &str) -> Result<Arc<Resource>, StoreError> {
        if let Some(r) = self.resource(name) {
            return Ok(r);
        }
        self.open_resources([name]).await?;
        Ok(self
            .resource(name)
            .expect("open_resources inserts every name it was given"))
    }

    /// Adds every resource of `names` that is not known yet, each with its mark loaded from
    /// the store, and returns the names it added. A reload calls this before the new routes
    /// serve, so a guarded route never starts from a guessed mark.
    ///
    /// Known resources are left exactly as they are: the same [`Resource`] (its mark, its
    /// advance lock and its in-flight requests) is what the routes of every configuration
    /// share, so admissions in flight on the old configuration and the first ones on the new
    /// one are judged against one mark. Marks are never reset or replaced here. Two callers
    /// opening the same name at once both read the store; the first insert wins and the
    /// second keeps it.
    ///
    /// # Errors
    /// The store's error when a mark cannot be read. Names inserted before a failure stay
    /// (their marks were read from the store).
    pub async fn open_resources<I, S>(&self, names: I) -> Result<Vec<String>, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.open_with(names, None).await
    }

    pub(super) async fn open_with<I, S>(
        &self,
        names: I,
        template: Option<&str>,
    ) -> Result<Vec<String>, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let pinned_names: Vec<String> = names.into_iter().map(|n| n.as_ref().to_owned()).collect();
        let missing: std::collections::BTreeSet<String> = {
            let known = read(&self.resources);
            if template.is_none() {
                for n in &pinned_names {
                    if let Some(r) = known.get(n.as_str()) {
                        r.pinned.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            pinned_names
                .iter()
                .filter(|n| !known.contains_key(n.as_str()))
                .cloned()
                .collect()
        };
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        let local = self.store.consistency() == Consistency::Local;
        let mut loaded = Vec::with_capacity(missing.len());
        if local {
            // This process is the only writer of a local store, and only resources in the map
            // are ever advanced: nothing can change these marks between this read and the
            // insert below.
            let names: Vec<String> = missing.iter().cloned().collect();
            let all = self.store.load_named(&names).await?;
            loaded.extend(missing.into_iter().map(|n| {
                let m = all.get(&n).copied().unwrap_or(0);
                (n, m)
            }));
        } else {
            for n in missing {
                let m = self.store.confirm(&n, None).await?.mark;
                loaded.push((n, m));
            }
        }
        let mut opened = Vec::new();
        {
            let mut map = self.resources.write().unwrap_or_else(|e| e.into_inner());
            if template.is_none() {
                // Fixed resources already in the map (first opened as an entity) stay now.
                for name in &pinned_names {
                    if let Some(r) = map.get(name.as_str()) {
                        r.pinned.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            for (name, initial) in loaded {
                if map.contains_key(name.as_str()) {
                    continue;
                }
                let r = match template {
                    None => {
                        let r = Resource::new(&name, initial, &self.metrics);
                        r.pinned.store(true, std::sync::atomic::Ordering::Relaxed);
                        r
                    }
                    Some(t) => {
                        let r = Resource::entity(
                            &name,
                            initial,
                            self.entities.shared_of(t, &self.metrics),
                        );
                        // In the cache from the insert on (a caller dropped half-way must
                        // not leave it unevictable), with a second chance to be used.
                        r.touched.touch();
                        self.entities.admitted(&r, &self.metrics);
                        r
                    }
                };
                let (key, r) = r.entry();
                map.insert(key, r);
                opened.push(name);
            }
        }
        if !local {
            // Another replica may have advanced a mark between the read above and the insert;
            // the store's watch skipped that event (the name was not known yet). One more read
            // now that the resource is in the map closes the gap.
            for name in &opened {
                let stored = self.store.confirm(name, None).await?.mark;
                if let Some(res) = self.resource(name).filter(|r| stored > r.mark()) {
                    learn(res, stored).await;
                }
            }
        }
        Ok(opened)
    }

    /// Raises the mark of `name` to at least `mark` as an advance would (persisted first,
    /// then published; older requests of the resource are aborted at once), and returns the
    /// mark afterwards. A reload carrying a renamed resource's mark over uses it; a mark
    /// already at or above `mark` is left as it is.
    ///
    /// # Errors
    /// [`Refused::Unavailable`] when the store could not load or persist the mark.
    pub async fn raise(&self, name: &str, mark: u64) -> Result<u64, Refused> {
        let Some(token) = FencingToken::new(mark) else {
            return Ok(self.resource(name).map_or(0, |r| r.mark()));
        };
        let resource =
            self.resource_or_open(name)
                .await
                .map_err(|source| Refused::Unavailable {
                    token,
                    step: StoreStep::Load,
                    source,
                })?;
        match self.admit(&resource, token, Duration::ZERO).await {
            Ok(_) | Err(Refused::Stale { .. }) => Ok(resource.mark()),
            Err(e) => Err(e),
        }
    }

    /// The stored mark of `name` (0 when none), read from the store without adding the
    /// resource: for looking up resources no route guards.
    ///
    /// # Errors
    /// The store's error when it cannot be read.
    pub async fn stored_mark(&self, name: &str) -> Result<u64, StoreError> {
        if self.store.consistency() == Consistency::Local {
            let names = [name.to_owned()];
            Ok(self
                .store
                .load_named(&names)
                .await?
                .get(name)
                .copied()
                .unwrap_or(0))
        } else {
            Ok(self.store.confirm(name, None).await?.mark)
        }
    }

    /// Carries the mark of `from` over to `to` for a reload whose routes send `from`'s
    /// requests to `to`. When `to` is new to this process, it becomes another name of the
    /// same resource: one mark, one drain and one advance lock for both, so requests routed
    /// by the old table (still in flight, or arriving) and by the new one are judged and
    /// drained together, and every advance is persisted under both names (until a restart,
    /// after which each name has its own mark, equal then). When `to` is already a resource
    /// of its own here (two resources merged), its mark is raised to `from`'s. Returns
    /// `to`'s mark afterwards.
    ///
    /// # Errors
    /// [`Refused::Unavailable`] when a mark could not be read or persisted.
    pub async fn carry(&self, from: &str, to: &str) -> Result<u64, Refused> {
        let Some(source) = self.resource(from) else {
            return Ok(0);
        };
        let unavailable = |step: StoreStep, e: StoreError| Refused::Unavailable {
            token: FencingToken::new(source.mark().max(1)).expect("not 0"),
            step,
            source: e,
        };
        if let Some(existing) = self.resource(to) {
            if Arc::ptr_eq(&existing, &source) {
                return Ok(source.mark()); // already one resource
            }
            let stored = self
                .stored_mark(from)
                .await
                .map_err(|e| unavailable(StoreStep::Confirm, e))?;
            return self.raise(to, source.mark().max(stored)).await;
        }
        // The higher of both stored marks, for both names: neither may start lower.
        let stored_to = self
            .stored_mark(to)
            .await
            .map_err(|e| unavailable(StoreStep::Load, e))?;
        let stored_from = if self.store.consistency() == Consistency::Local {
            0
        } else {
            self.stored_mark(from)
                .await
                .map_err(|e| unavailable(StoreStep::Confirm, e))?
        };
        {
            let _serialized = source.advancing.lock().await;
            let mut aliases = source
                .rare()
                .aliases
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !aliases.iter().any(|a| a == to) {
                aliases.push(to.to_owned());
            }
        }
        let target = source.mark().max(stored_to).max(stored_from);
        // Raises `from` (persisting `to` too, as an alias now) if anything is higher; else
        // persists `to` at the current mark.
        if target > source.mark() {
            self.raise(from, target).await?;
        } else if let Some(m) = FencingToken::new(target) {
            self.store
                .persist(to, m.get())
                .await
                .map_err(|e| unavailable(StoreStep::Persist { token: m.get() }, e))?;
        }
        {
            let mut map = self.resources.write().unwrap_or_else(|e| e.into_inner());
            source
                .pinned
                .store(true, std::sync::atomic::Ordering::Relaxed);
            map.entry(to.into()).or_insert_with(|| Arc::clone(&source));
        }
        Ok(source.mark())
    }
}
