//! Epochs followed by watch, for resources fed by a lock in `cached` mode: the new owner's
//! acquisition moves the local mark as soon as the watch delivers it, so that equal tokens
//! keep being judged on the local copy.
//!
//! One watch per primitive kind and namespace (`/palisade/lock/`, ...), started on first use.
//! Each epoch key maps to the resources it feeds (weakly: evicted entities go with their
//! entry). Whenever a watch starts again, or has missed events, every followed resource is
//! marked stale (`epoch_fresh` false), so its next admission reads the epoch afresh: a gap in
//! the watch never lets an old owner in, and an epoch that went back is found by that read.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use super::advance::learn;
use super::Resource;
use crate::marks::MarkStore;

/// The followed epoch keys and the watches behind them.
#[derive(Default)]
pub(super) struct Followed {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Epoch key -> the resources it feeds.
    keys: HashMap<Arc<str>, Vec<Weak<Resource>>>,
    /// `keys.len()` after the last sweep of dead entries.
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

/// The prefix a watch for `key` (`<namespace>/<kind>/<name>/epoch`) covers: `<namespace>/<kind>/`.
fn prefix_of(key: &str) -> Option<&str> {
    let name_start = key.strip_suffix("/epoch")?.rfind('/')? + 1;
    Some(&key[..name_start])
}

impl Followed {
    /// Follows `key` for `resource`: `false` when the store cannot watch it (every admission
    /// then reads the epoch).
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
        let fed = st.keys.entry(Arc::clone(key)).or_default();
        if !fed.iter().any(|w| w.as_ptr() == Arc::as_ptr(resource)) {
            fed.retain(|w| w.strong_count() > 0);
            fed.push(Arc::downgrade(resource));
        }
        // Evicted entities leave dead entries: swept whenever the map doubled.
        if st.keys.len() > 2 * st.swept_at.max(1024) {
            st.keys.retain(|_, fed| {
                fed.retain(|w| w.strong_count() > 0);
                !fed.is_empty()
            });
            st.swept_at = st.keys.len();
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

    /// Every followed resource must read its epoch again.
    fn unsettle(&self) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for r in st.keys.values().flatten().filter_map(Weak::upgrade) {
            r.epoch_fresh.store(false, Ordering::Release);
        }
    }
}

/// Applies the watch's news: a new epoch is learned (published, older requests aborted); a
/// gap unsettles every followed resource.
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
            let seen = r.epoch_seen.fetch_max(revision, Ordering::SeqCst);
            if revision < seen {
                // Not from a watch that runs in revision order: read it again.
                r.epoch_fresh.store(false, Ordering::Release);
            } else if revision > r.mark() {
                learn(r, revision).await;
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
    }
}
