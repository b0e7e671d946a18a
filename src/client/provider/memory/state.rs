//! The store's state behind its lock, and the transitions of etcd's semantics on it: one
//! revision counter, transactions decided on the state before their writes, leases whose
//! revocation deletes their keys, and the history and watchers every write is published to.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::backend::{
    BackendError, Compare, Event, EventKind, KeyRange, Kv, LeaseId, Op, OpResponse, Revision,
    SortByCreate, Txn, TxnResponse,
};

/// How many past events the store keeps for watches that start in the past.
const HISTORY: usize = 100_000;

#[derive(Default)]
pub(super) struct State {
    pub(super) revision: Revision,
    pub(super) kvs: BTreeMap<String, Kv>,
    pub(super) leases: HashMap<LeaseId, Lease>,
    pub(super) next_lease: LeaseId,
    pub(super) history: VecDeque<Event>,
    pub(super) compacted: Revision,
    pub(super) watchers: Vec<Watcher>,
}

pub(super) struct Lease {
    pub(super) ttl: i64,
    pub(super) deadline: Instant,
    pub(super) keys: BTreeSet<String>,
}

pub(super) struct Watcher {
    pub(super) client: u64,
    pub(super) range: KeyRange,
    pub(super) tx: mpsc::UnboundedSender<Vec<Event>>,
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
            Compare::ModRevisionGreater(key, rev) => {
                self.kvs.get(key).map_or(0, |kv| kv.mod_revision) > *rev
            }
            Compare::ModRevisionEq(key, rev) => {
                self.kvs.get(key).map_or(0, |kv| kv.mod_revision) == *rev
            }
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
    pub(super) fn plan(&self, txn: &Txn, branches: &mut Vec<bool>) -> Result<(), BackendError> {
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
    pub(super) fn apply(
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

    pub(super) fn publish(&mut self, events: Vec<Event>) {
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

    pub(super) fn revoke(&mut self, id: LeaseId) -> bool {
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
