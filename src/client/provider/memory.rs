//! An in-process provider: a small store with etcd's semantics (one monotonic revision
//! counter, leases that expire, transactions, watches with history), shared by every
//! [`MemoryProvider`] cloned or [`connect`](MemoryProvider::connect)ed from the same one.
//!
//! For tests and single-process use. Leases expire on tokio's clock, so tests can pause time.
//! [`MemoryProvider::set_partitioned`] cuts one client off the store, as a network partition
//! would, to test lease loss without a real network; [`MemoryProvider::lose_write_answers`]
//! loses the answers of writes the store did apply, as a connection that breaks after the
//! store wrote does.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Provider;
use crate::client::backend::{
    Backend, BackendError, BoxFuture, Event, Events, KeyRange, LeaseId, LeaseInfo, Revision, Txn,
    TxnResponse,
};
use crate::client::error::Error;
use crate::client::session::{Session, SessionOptions};

mod state;

use self::state::{Lease, State, Watcher};

/// How often leases are checked for expiry.
const REAP_EVERY: Duration = Duration::from_millis(20);

/// A client of an in-process store (see the module docs).
#[derive(Clone)]
pub struct MemoryProvider {
    store: Arc<Store>,
    client: Arc<ClientState>,
}

impl std::fmt::Debug for MemoryProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryProvider")
            .field("client", &self.client.id)
            .field(
                "partitioned",
                &self.client.partitioned.load(Ordering::Relaxed),
            )
            .finish()
    }
}

struct ClientState {
    id: u64,
    partitioned: AtomicBool,
    /// How many more applied writes answer as if the connection broke.
    lose_write_answers: AtomicU32,
}

struct Store {
    state: Mutex<State>,
    next_client: AtomicU64,
    reaper_started: AtomicBool,
}

impl Default for MemoryProvider {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryProvider {
    /// A new, empty store and a first client of it.
    pub fn new() -> Self {
        let store = Arc::new(Store {
            state: Mutex::new(State {
                next_lease: 0x1000,
                ..State::default()
            }),
            next_client: AtomicU64::new(0),
            reaper_started: AtomicBool::new(false),
        });
        Self::client_of(store)
    }

    fn client_of(store: Arc<Store>) -> Self {
        let id = store.next_client.fetch_add(1, Ordering::Relaxed);
        Self {
            store,
            client: Arc::new(ClientState {
                id,
                partitioned: AtomicBool::new(false),
                lose_write_answers: AtomicU32::new(0),
            }),
        }
    }

    /// Another client of the same store, with its own partition switch (another "process").
    pub fn connect(&self) -> Self {
        Self::client_of(Arc::clone(&self.store))
    }

    /// Cuts this client off the store (`true`) or reconnects it (`false`). While cut, every
    /// request fails as unavailable and its watches end, exactly like a network partition:
    /// keepalives stop reaching the store and its leases expire there.
    pub fn set_partitioned(&self, partitioned: bool) {
        self.client.partitioned.store(partitioned, Ordering::SeqCst);
        if partitioned {
            let id = self.client.id;
            self.store.lock().watchers.retain(|w| w.client != id);
        }
    }

    /// The next `n` transactions of this client that write are applied, but each answers
    /// as unavailable: the write happened and the client does not know, as when a
    /// connection breaks between the store's write and its answer. Code that retries must
    /// cope with its own earlier write.
    pub fn lose_write_answers(&self, n: u32) {
        self.client.lose_write_answers.store(n, Ordering::SeqCst);
    }

    /// The store's current revision.
    pub fn revision(&self) -> i64 {
        self.store.lock().revision
    }

    /// Every key under `prefix`, for inspection in tests.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let range = KeyRange::prefix(prefix);
        self.store
            .lock()
            .kvs
            .keys()
            .filter(|k| range.contains(k))
            .cloned()
            .collect()
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.client.partitioned.load(Ordering::SeqCst) {
            return Err(BackendError::Unavailable(
                "memory provider client is partitioned".into(),
            ));
        }
        Ok(())
    }

    fn take_lost_answer(&self) -> bool {
        self.client
            .lose_write_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn start_reaper(&self) {
        if self.store.reaper_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak: Weak<Store> = Arc::downgrade(&self.store);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(REAP_EVERY).await;
                let Some(store) = weak.upgrade() else { return };
                let mut st = store.lock();
                let now = Instant::now();
                let expired: Vec<LeaseId> = st
                    .leases
                    .iter()
                    .filter(|(_, l)| l.deadline <= now)
                    .map(|(id, _)| *id)
                    .collect();
                for id in expired {
                    st.revoke(id);
                }
            }
        });
    }
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct MemEvents(mpsc::UnboundedReceiver<Vec<Event>>);

impl Events for MemEvents {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<Vec<Event>, BackendError>>> {
        Box::pin(async move { self.0.recv().await.map(Ok) })
    }
}

impl Backend for MemoryProvider {
    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResponse, BackendError>> {
        let result = self.check().and_then(|()| {
            let mut st = self.store.lock();
            let rev = st.revision + 1;
            let mut branches = Vec::new();
            st.plan(&txn, &mut branches)?;
            let mut events = Vec::new();
            let (succeeded, responses) =
                st.apply(&txn, rev, &mut branches.into_iter(), &mut events)?;
            if !events.is_empty() {
                st.revision = rev;
            }
            let wrote = !events.is_empty();
            st.publish(events);
            if wrote && self.take_lost_answer() {
                return Err(BackendError::Unavailable(
                    "memory provider lost the answer to an applied write".into(),
                ));
            }
            Ok(TxnResponse {
                succeeded,
                revision: st.revision,
                responses,
            })
        });
        Box::pin(async move { result })
    }

    fn watch(
        &self,
        range: KeyRange,
        from: Revision,
    ) -> BoxFuture<'_, Result<Box<dyn Events>, BackendError>> {
        let result = self.check().and_then(|()| {
            let mut st = self.store.lock();
            if from <= st.compacted {
                return Err(BackendError::Compacted(st.compacted));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            let past: Vec<Event> = st
                .history
                .iter()
                .filter(|e| e.kv.mod_revision >= from && range.contains(&e.kv.key))
                .cloned()
                .collect();
            if !past.is_empty() {
                let _ = tx.send(past);
            }
            st.watchers.push(Watcher {
                client: self.client.id,
                range,
                tx,
            });
            Ok(Box::new(MemEvents(rx)) as Box<dyn Events>)
        });
        Box::pin(async move { result })
    }

    fn lease_grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<(LeaseId, i64), BackendError>> {
        let result = self.check().map(|()| {
            self.start_reaper();
            let mut st = self.store.lock();
            st.next_lease += 1;
            let id = st.next_lease;
            let deadline = Instant::now() + Duration::from_secs(ttl_secs as u64);
            st.leases.insert(
                id,
                Lease {
                    ttl: ttl_secs,
                    deadline,
                    keys: BTreeSet::new(),
                },
            );
            (id, ttl_secs)
        });
        Box::pin(async move { result })
    }

    fn lease_keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<i64, BackendError>> {
        let result = self.check().map(|()| {
            let mut st = self.store.lock();
            let now = Instant::now();
            let expired = st.leases.get(&lease).is_some_and(|l| l.deadline <= now);
            if expired {
                // An expired lease is never renewed, even before the reaper got to it.
                st.revoke(lease);
            }
            match st.leases.get_mut(&lease) {
                Some(l) => {
                    l.deadline = now + Duration::from_secs(l.ttl as u64);
                    l.ttl
                }
                None => 0,
            }
        });
        Box::pin(async move { result })
    }

    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), BackendError>> {
        let result = self.check().map(|()| {
            self.store.lock().revoke(lease);
        });
        Box::pin(async move { result })
    }

    fn lease_ttl(&self, lease: LeaseId) -> BoxFuture<'_, Result<LeaseInfo, BackendError>> {
        let result = self.check().map(|()| {
            let mut st = self.store.lock();
            let now = Instant::now();
            if st.leases.get(&lease).is_some_and(|l| l.deadline <= now) {
                st.revoke(lease);
            }
            st.leases
                .get(&lease)
                .map_or_else(LeaseInfo::default, |l| LeaseInfo {
                    remaining: l.deadline.saturating_duration_since(now).as_secs().max(1) as i64,
                    granted: l.ttl,
                    keys: l.keys.iter().cloned().collect(),
                })
        });
        Box::pin(async move { result })
    }
}

impl Provider for MemoryProvider {
    fn session(
        &self,
        options: SessionOptions,
    ) -> impl std::future::Future<Output = Result<Session, Error>> + Send {
        Session::start(Arc::new(self.clone()), options)
    }
}

#[cfg(test)]
mod tests;
