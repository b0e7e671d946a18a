//! An in-process provider: a small store with etcd's semantics (one monotonic revision
//! counter, leases that expire, transactions, watches with history), shared by every
//! [`MemoryProvider`] cloned or [`connect`](MemoryProvider::connect)ed from the same one.
//!
//! For tests and single-process use. Leases expire on tokio's clock, so tests can pause time.
//! [`MemoryProvider::set_partitioned`] cuts one client off the store, as a network partition
//! would, to test lease loss without a real network.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{
    Backend, BackendError, BoxFuture, Compare, Event, EventKind, Events, KeyRange, Kv, LeaseId,
    LeaseInfo, Op, OpResponse, Provider, Revision, SortByCreate, Txn, TxnResponse,
};
use crate::error::Error;
use crate::session::{Session, SessionOptions};

/// How many past events the store keeps for watches that start in the past.
const HISTORY: usize = 100_000;
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
}

struct Store {
    state: Mutex<State>,
    next_client: AtomicU64,
    reaper_started: AtomicBool,
}

#[derive(Default)]
struct State {
    revision: Revision,
    kvs: BTreeMap<String, Kv>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    history: VecDeque<Event>,
    compacted: Revision,
    watchers: Vec<Watcher>,
}

struct Lease {
    ttl: i64,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct Watcher {
    client: u64,
    range: KeyRange,
    tx: mpsc::UnboundedSender<Vec<Event>>,
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

fn refused(msg: &str) -> BackendError {
    BackendError::Refused(msg.to_owned().into())
}

impl State {
    fn compare(&self, c: &Compare) -> bool {
        match c {
            Compare::CreateRevisionEq(range, rev) => {
                let mut any = false;
                for (k, kv) in self.kvs.range(range.start.clone()..) {
                    if !range.contains(k) {
                        break;
                    }
                    any = true;
                    if kv.create_revision != *rev {
                        return false;
                    }
                }
                any || *rev == 0
            }
            Compare::ValueEq(key, value) => self.kvs.get(key).is_some_and(|kv| &kv.value == value),
        }
    }

    fn range(
        &self,
        range: &KeyRange,
        sort: Option<SortByCreate>,
        limit: i64,
        max_create: Revision,
    ) -> Vec<Kv> {
        let mut out: Vec<Kv> = self
            .kvs
            .range(range.start.clone()..)
            .take_while(|(k, _)| range.contains(k))
            .filter(|(_, kv)| max_create == 0 || kv.create_revision <= max_create)
            .map(|(_, kv)| kv.clone())
            .collect();
        match sort {
            Some(SortByCreate::Ascending) => out.sort_by_key(|kv| kv.create_revision),
            Some(SortByCreate::Descending) => {
                out.sort_by_key(|kv| std::cmp::Reverse(kv.create_revision))
            }
            None => {}
        }
        if limit > 0 {
            out.truncate(limit as usize);
        }
        out
    }

    /// Decides every branch of `txn`, nested ones included, on the state before any of its
    /// writes (as etcd does), and rejects the whole transaction up front if a put names a
    /// lease that does not exist, so nothing is applied half-way.
    fn plan(&self, txn: &Txn, branches: &mut Vec<bool>) -> Result<(), BackendError> {
        let ok = txn.when.iter().all(|c| self.compare(c));
        branches.push(ok);
        for op in if ok { &txn.then } else { &txn.otherwise } {
            match op {
                Op::Put { lease, .. } if *lease != 0 && !self.leases.contains_key(lease) => {
                    return Err(refused("requested lease not found"));
                }
                Op::Txn(inner) => self.plan(inner, branches)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Applies `txn` at revision `rev` (the revision its writes get) along the branches
    /// [`State::plan`] chose, collecting events.
    fn apply(
        &mut self,
        txn: &Txn,
        rev: Revision,
        branches: &mut std::vec::IntoIter<bool>,
        events: &mut Vec<Event>,
    ) -> Result<(bool, Vec<OpResponse>), BackendError> {
        let ok = branches.next().expect("planned");
        let ops = if ok { &txn.then } else { &txn.otherwise };
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            out.push(match op {
                Op::Put { key, value, lease } => {
                    if *lease != 0 && !self.leases.contains_key(lease) {
                        return Err(refused("requested lease not found"));
                    }
                    let create_revision = self.kvs.get(key).map_or(rev, |kv| kv.create_revision);
                    if let Some(old) = self.kvs.get(key) {
                        if old.lease != 0 {
                            if let Some(l) = self.leases.get_mut(&old.lease) {
                                l.keys.remove(key);
                            }
                        }
                    }
                    if *lease != 0 {
                        self.leases
                            .get_mut(lease)
                            .expect("checked above")
                            .keys
                            .insert(key.clone());
                    }
                    let kv = Kv {
                        key: key.clone(),
                        value: value.clone(),
                        create_revision,
                        mod_revision: rev,
                        lease: *lease,
                    };
                    self.kvs.insert(key.clone(), kv.clone());
                    events.push(Event {
                        kind: EventKind::Put,
                        kv,
                    });
                    OpResponse::Put
                }
                Op::Range {
                    range,
                    sort,
                    limit,
                    max_create_revision,
                } => OpResponse::Range(self.range(range, *sort, *limit, *max_create_revision)),
                Op::Delete { key } => match self.kvs.remove(key) {
                    Some(kv) => {
                        if let Some(l) = self.leases.get_mut(&kv.lease) {
                            l.keys.remove(key);
                        }
                        events.push(Event {
                            kind: EventKind::Delete,
                            kv: Kv {
                                value: Vec::new(),
                                mod_revision: rev,
                                ..kv
                            },
                        });
                        OpResponse::Delete
                    }
                    None => OpResponse::Delete,
                },
                Op::Txn(inner) => {
                    let (succeeded, responses) = self.apply(inner, rev, branches, events)?;
                    OpResponse::Txn(TxnResponse {
                        succeeded,
                        revision: rev,
                        responses,
                    })
                }
            });
        }
        Ok((ok, out))
    }

    fn publish(&mut self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        self.watchers.retain(|w| {
            let mine: Vec<Event> = events
                .iter()
                .filter(|e| w.range.contains(&e.kv.key))
                .cloned()
                .collect();
            mine.is_empty() || w.tx.send(mine).is_ok()
        });
        for e in events {
            if self.history.len() == HISTORY {
                if let Some(old) = self.history.pop_front() {
                    self.compacted = old.kv.mod_revision;
                }
            }
            self.history.push_back(e);
        }
    }

    fn revoke(&mut self, id: LeaseId) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        if lease.keys.is_empty() {
            return true;
        }
        self.revision += 1;
        let rev = self.revision;
        let mut events = Vec::new();
        for key in lease.keys {
            if let Some(kv) = self.kvs.remove(&key) {
                events.push(Event {
                    kind: EventKind::Delete,
                    kv: Kv {
                        value: Vec::new(),
                        mod_revision: rev,
                        ..kv
                    },
                });
            }
        }
        self.publish(events);
        true
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
            st.publish(events);
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
