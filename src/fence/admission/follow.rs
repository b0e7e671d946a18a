//! Epochs followed by watch, for resources fed by a lock in `cached` mode: the new owner's
//! acquisition moves the local mark as soon as the watch delivers it, so that equal tokens
//! keep being judged on the local copy.
//!
//! One watch per primitive kind and namespace (`/palisade/lock/`, ...), started on first use.
//! Each epoch key maps to the resources it feeds (weakly: evicted entities go with their
//! entry). A resource is *fresh* when its epoch was read successfully in the current
//! generation; the generation moves whenever a watch starts, starts again, breaks or misses
//! events, so every followed resource then reads its epoch afresh at its next admission: a
//! gap in a watch never lets an old owner in, and an epoch that went back is found by that
//! read. A deleted epoch key makes the resources it feeds stale.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::advance::learn;
use super::Resource;
use crate::fence::marks::MarkStore;

/// The followed epoch keys, the watches behind them and the generation.
#[derive(Default)]
pub(super) struct Followed {
    state: Mutex<State>,
    generation: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Epoch key -> the resources it feeds.
    keys: HashMap<Arc<str>, Vec<Weak<Resource>>>,
    /// Entries in `keys` after the last sweep of dead ones.
    swept_at: usize,
    /// The prefixes watched, with their tasks (aborted on drop).
    watches: HashMap<String, tokio::task::JoinHandle<()>>,
}

impl Drop for Followed {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for t in st.watches.values() {
            t.abort();
        }
    }
}

/// The prefix a watch for `key` (`<namespace>/<kind>/<name>/epoch`, or a semaphore slot's
/// `.../epoch/<slot>`) covers: `<namespace>/<kind>/`.
fn prefix_of(key: &str) -> Option<&str> {
    let primitive = match key.strip_suffix("/epoch") {
        Some(p) => p,
        None => {
            let (p, slot) = key.rsplit_once("/epoch/")?;
            if slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p
        }
    };
    let name_start = primitive.rfind('/')? + 1;
    Some(&key[..name_start])
}

impl Followed {
    /// The current generation: a resource whose epoch was read in it is fresh.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Every followed resource must read its epoch again (a reload may have changed the
    /// locks that feed them; a watch had a gap).
    pub(super) fn unsettle(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether `resource` may be judged on its local mark now.
    pub(super) fn is_fresh(&self, resource: &Resource) -> bool {
        resource
            .fed_if_any()
            .is_some_and(|f| f.fresh.load(Ordering::Acquire) == self.generation() + 1)
    }

    /// Follows `key` for `resource` (once per resource): `false` when the store cannot watch
    /// it (every admission then reads the epoch).
    pub(super) fn follow(
        self: &Arc<Self>,
        store: &Arc<dyn MarkStore>,
        key: &Arc<str>,
        resource: &Arc<Resource>,
    ) -> bool {
        let Some(prefix) = prefix_of(key) else {
            return false;
        };
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.watches.contains_key(prefix) {
            let Some(rx) = store.watch_keys(prefix) else {
                return false;
            };
            let me = Arc::downgrade(self);
            st.watches
                .insert(prefix.to_owned(), tokio::spawn(deliver(me, rx)));
        }
        let mut followed = resource
            .fed()
            .followed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if followed.as_deref() != Some(&**key) {
            st.keys
                .entry(Arc::clone(key))
                .or_default()
                .push(Arc::downgrade(resource));
            *followed = Some(Arc::clone(key));
        }
        drop(followed);
        // Evicted entities (and changed keys) leave dead entries: swept when the map doubled.
        let entries: usize = st.keys.values().map(Vec::len).sum();
        if entries > 2 * st.swept_at.max(1024) {
            st.keys.retain(|k, fed| {
                fed.retain(|w| {
                    w.upgrade().is_some_and(|r| {
                        r.fed()
                            .followed
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_deref()
                            == Some(&**k)
                    })
                });
                !fed.is_empty()
            });
            st.swept_at = st.keys.values().map(Vec::len).sum();
        }
        true
    }

    fn resources(&self, key: &str) -> Vec<Arc<Resource>> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.keys
            .get(key)
            .map(|fed| fed.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }
}

/// Applies the watch's news: a new epoch is learned (published, older requests aborted) in a
/// task of its own (an advance in progress holds the resource's lock); a deleted key makes
/// its resources stale; a gap moves the generation.
async fn deliver(
    followed: Weak<Followed>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(String, u64)>,
) {
    while let Some((key, revision)) = rx.recv().await {
        let Some(f) = followed.upgrade() else {
            return;
        };
        if key.is_empty() {
            f.unsettle();
            continue;
        }
        for r in f.resources(&key) {
            if revision == 0 {
                if let Some(f) = r.fed_if_any() {
                    f.fresh.store(0, Ordering::Release);
                }
            } else if revision > r.mark() {
                tokio::spawn(learn(r, revision));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_watch_covers_the_kind_and_namespace_of_its_key() {
        assert_eq!(
            super::prefix_of("/palisade/lock/orders/epoch"),
            Some("/palisade/lock/")
        );
        assert_eq!(
            super::prefix_of("/a/b/election/locks%2Fw%2F7/epoch"),
            Some("/a/b/election/")
        );
        assert_eq!(super::prefix_of("/palisade/lock/orders/q/x"), None);
        assert_eq!(
            super::prefix_of("/palisade/semaphore/jobs/epoch/3"),
            Some("/palisade/semaphore/")
        );
        assert_eq!(super::prefix_of("/palisade/semaphore/jobs/epoch/x"), None);
    }
}
