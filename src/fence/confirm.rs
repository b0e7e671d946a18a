//! Confirmation rounds: how a linearizable shared store (etcd) confirms every admission
//! without one store read per request.
//!
//! # Design
//!
//! A request may only be judged on a store read that *started after the request arrived*;
//! otherwise a replica could admit a zombie on the strength of a read taken before the new
//! owner's advance was acknowledged elsewhere. Each resource therefore has at most one read in
//! flight and one *next* round:
//!
//! ```text
//!  request arrives ──► join `next` (create it if absent) ──► wait for its result
//!  driver: loop { take `next` (none: stop) ──► read the store ──► hand the result to it }
//! ```
//!
//! A round is taken by the driver only after every request in it has joined, so its read
//! starts after all of them arrived. Requests that arrive while a read is in flight join the
//! following round, never the one in flight. Under load each read serves every request that
//! arrived during the previous read: the store sees at most one read per resource per round
//! trip, whatever the request rate, and the cost per request falls as load rises.

use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;

use crate::fence::marks::{Confirmed, MarkStore, StoreError};

/// The rounds of one resource.
#[derive(Debug, Default)]
pub struct Coalescer {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Whether a driver task is running for this resource.
    running: bool,
    /// The round that the next read will serve.
    next: Option<Arc<Round>>,
    /// The epoch key the resource's reads include (the latest caller's: a reload may change
    /// it), for a resource fed by a lock.
    epoch: Option<Arc<str>>,
    /// Rounds read so far: each result says which it was.
    rounds: u64,
}

/// What one confirmation round read.
#[derive(Debug, Clone)]
pub struct Confirmation {
    /// The round's number: later rounds started later.
    pub round: u64,
    /// The epoch key it read, if any (a caller that asked for another one must not use it).
    pub epoch_key: Option<Arc<str>>,
    /// The store's answer.
    pub found: Confirmed,
}

#[derive(Debug, Default)]
struct Round {
    result: OnceLock<Result<Confirmation, Arc<StoreError>>>,
    done: Notify,
}

impl Round {
    async fn wait(&self) -> Result<Confirmation, Arc<StoreError>> {
        loop {
            let n = self.done.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(r) = self.result.get() {
                return r.clone();
            }
            n.await;
        }
    }
}

impl Coalescer {
    /// The stored mark of `resource` (and the epoch of `epoch`, the key of the lock that
    /// feeds it), from a read of `store` that starts after this call.
    ///
    /// `observe` is called once per read with its duration and whether it failed (metrics).
    ///
    /// # Errors
    /// The store's error, shared by every request of the round.
    pub async fn confirm(
        self: &Arc<Self>,
        store: &Arc<dyn MarkStore>,
        resource: &Arc<str>,
        epoch: Option<&Arc<str>>,
        observe: impl Fn(std::time::Duration, bool) + Send + Sync + 'static,
    ) -> Result<Confirmation, Arc<StoreError>> {
        let round = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.epoch.as_ref() != epoch {
                st.epoch = epoch.cloned();
            }
            let round = Arc::clone(st.next.get_or_insert_with(Arc::default));
            if !st.running {
                st.running = true;
                tokio::spawn(drive(
                    Arc::clone(self),
                    Arc::clone(store),
                    Arc::clone(resource),
                    observe,
                ));
            }
            round
        };
        // Answered within the store's bound from this call, even when the read before this
        // round is itself running out of time (the round's own read starts only after it).
        match store.request_timeout() {
            Some(bound) => tokio::time::timeout(bound, round.wait())
                .await
                .unwrap_or_else(|_| Err(Arc::new(StoreError::Timeout(bound)))),
            None => round.wait().await,
        }
    }
}

async fn drive(
    me: Arc<Coalescer>,
    store: Arc<dyn MarkStore>,
    resource: Arc<str>,
    observe: impl Fn(std::time::Duration, bool),
) {
    loop {
        let (round, epoch, number) = {
            let mut st = me.state.lock().unwrap_or_else(|e| e.into_inner());
            match st.next.take() {
                Some(r) => {
                    st.rounds += 1;
                    (r, st.epoch.clone(), st.rounds)
                }
                None => {
                    st.running = false;
                    return;
                }
            }
        };
        let started = std::time::Instant::now();
        let r = store
            .confirm(&resource, epoch.as_deref())
            .await
            .map(|found| Confirmation {
                round: number,
                epoch_key: epoch,
                found,
            })
            .map_err(Arc::new);
        observe(started.elapsed(), r.is_err());
        let _ = round.result.set(r);
        round.done.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::marks::{BoxFuture, Consistency, Marks};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A store whose reads take 10 ms (paused time) and are counted.
    struct Slow {
        reads: AtomicU64,
        mark: AtomicU64,
    }

    impl MarkStore for Slow {
        fn kind(&self) -> &'static str {
            "slow"
        }
        fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
            Box::pin(async { Ok(Marks::new()) })
        }
        fn persist<'a>(&'a self, _: &'a str, m: u64) -> BoxFuture<'a, Result<u64, StoreError>> {
            Box::pin(async move { Ok(m) })
        }
        fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn consistency(&self) -> Consistency {
            Consistency::Linearizable
        }
        fn confirm<'a>(
            &'a self,
            _: &'a str,
            _: Option<&'a str>,
        ) -> BoxFuture<'a, Result<Confirmed, StoreError>> {
            Box::pin(async move {
                let at_start = self.mark.load(Ordering::SeqCst);
                self.reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                Ok(Confirmed {
                    mark: at_start,
                    epoch: None,
                })
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_share_reads_that_started_after_they_arrived() {
        let slow = Arc::new(Slow {
            reads: AtomicU64::new(0),
            mark: AtomicU64::new(1),
        });
        let store: Arc<dyn MarkStore> = slow.clone();
        let c = Arc::new(Coalescer::default());
        let name: Arc<str> = "r".into();
        // 100 requests at once: one read serves them all.
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let (c, store, name) = (c.clone(), store.clone(), name.clone());
            tasks.push(tokio::spawn(async move {
                c.confirm(&store, &name, None, |_, _| {})
                    .await
                    .unwrap()
                    .found
                    .mark
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 1);
        }
        assert_eq!(slow.reads.load(Ordering::SeqCst), 1);

        // A request that arrives while a read is in flight, after the mark changed, must not
        // get that (older) read's answer.
        let first = {
            let (c, store, name) = (c.clone(), store.clone(), name.clone());
            tokio::spawn(async move {
                c.confirm(&store, &name, None, |_, _| {})
                    .await
                    .unwrap()
                    .found
                    .mark
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        slow.mark.store(2, Ordering::SeqCst);
        let late = c
            .confirm(&store, &name, None, |_, _| {})
            .await
            .unwrap()
            .found
            .mark;
        assert_eq!(
            first.await.unwrap(),
            1,
            "the read in flight started before the change"
        );
        assert_eq!(
            late, 2,
            "a later arrival waits for a read that started after it"
        );
        assert_eq!(slow.reads.load(Ordering::SeqCst), 3);
    }
}
