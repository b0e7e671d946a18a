//! Adding resources to a running admission: per request (a guard layer's resource chosen
//! from the request) and per reload (routes new to the configuration).

use std::sync::Arc;

use super::advance::learn;
use std::time::Duration;

use super::{read, Admission, Refused, Resource};
use crate::marks::{Consistency, StoreError};
use crate::reject::StoreStep;
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
        let missing: std::collections::BTreeSet<String> = {
            let known = read(&self.resources);
            names
                .into_iter()
                .filter(|n| !known.contains_key(n.as_ref()))
                .map(|n| n.as_ref().to_owned())
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
            let all = self.store.load().await?;
            loaded.extend(missing.into_iter().map(|n| {
                let m = all.get(&n).copied().unwrap_or(0);
                (n, m)
            }));
        } else {
            for n in missing {
                let m = self.store.confirm(&n).await?;
                loaded.push((n, m));
            }
        }
        let mut opened = Vec::new();
        {
            let mut map = self.resources.write().unwrap_or_else(|e| e.into_inner());
            for (name, initial) in loaded {
                map.entry(name).or_insert_with_key(|name| {
                    opened.push(name.clone());
                    match template {
                        None => Resource::new(name, initial, &self.metrics),
                        Some(t) => {
                            Resource::with_metrics(name, initial, self.metrics.keyed_mark(t))
                        }
                    }
                });
            }
        }
        if !local {
            // Another replica may have advanced a mark between the read above and the insert;
            // the store's watch skipped that event (the name was not known yet). One more read
            // now that the resource is in the map closes the gap.
            for name in &opened {
                let stored = self.store.confirm(name).await?;
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
            Ok(self.store.load().await?.get(name).copied().unwrap_or(0))
        } else {
            self.store.confirm(name).await
        }
    }

    /// Carries the mark of `from` over to `to` for a reload whose routes send `from`'s
    /// requests to `to`: `to` is raised to `from`'s mark now, and every later advance of
    /// `from` (a request the old routes admitted) raises `to` as well before it is admitted,
    /// so the two cannot diverge while requests routed by the old table finish. Returns
    /// `to`'s mark afterwards.
    ///
    /// # Errors
    /// [`Refused::Unavailable`] when `to` could not be loaded or raised.
    pub async fn carry(&self, from: &str, to: &str) -> Result<u64, Refused> {
        let Some(source) = self.resource(from) else {
            return Ok(0);
        };
        let target = self
            .resource_or_open(to)
            .await
            .map_err(|e| Refused::Unavailable {
                token: FencingToken::new(source.mark().max(1)).expect("not 0"),
                step: StoreStep::Load,
                source: e,
            })?;
        let link = |a: &Resource, b: &Arc<Resource>| {
            let mut links = a.linked.lock().unwrap_or_else(|e| e.into_inner());
            if !links.iter().any(|l| Arc::ptr_eq(l, b)) {
                links.push(Arc::clone(b));
            }
        };
        let mark = {
            // With the advance lock: an advance of `from` in progress finishes first (its
            // mark is read below); any later one sees the link.
            let _serialized = source.advancing.lock().await;
            link(&source, &target);
            source.mark()
        };
        {
            // And back: the new name's first advance aborts the old name's requests still in
            // flight before it is admitted.
            let _serialized = target.advancing.lock().await;
            link(&target, &source);
        }
        // A shared store may hold a higher mark than this replica has seen yet.
        let stored = if self.store.consistency() == Consistency::Local {
            0
        } else {
            self.stored_mark(from)
                .await
                .map_err(|e| Refused::Unavailable {
                    token: FencingToken::new(mark.max(1)).expect("not 0"),
                    step: StoreStep::Confirm,
                    source: e,
                })?
        };
        self.raise(to, mark.max(stored)).await
    }

    /// Forgets the links [`Admission::carry`] made between `from` and `to` (once no request
    /// routed by the table that needed them is left).
    pub fn unlink(&self, from: &str, to: &str) {
        let (Some(a), Some(b)) = (self.resource(from), self.resource(to)) else {
            return;
        };
        for (x, y) in [(&a, &b), (&b, &a)] {
            x.linked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|l| !Arc::ptr_eq(l, y));
        }
    }
}
