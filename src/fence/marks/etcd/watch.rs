//! The watch behind [`EtcdStore::subscribe`]: advances made by other replicas, resumed
//! from the last revision seen after a disconnect, every mark reloaded after a compaction.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use tokio::sync::mpsc;

use super::{decode, EtcdStore};

impl EtcdStore {
    /// Forwards every mark written under the prefix after revision `seen` until the receiver
    /// is dropped. A broken watch is re-created from the last revision seen; a compacted one
    /// reloads every mark first.
    pub(super) async fn watch_loop(self, mut seen: i64, tx: mpsc::UnboundedSender<(String, u64)>) {
        let prefix = self.inner.prefix.clone();
        let mut backoff = Duration::from_millis(50);
        loop {
            if tx.is_closed() {
                return;
            }
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(seen + 1);
            let stream = match self
                .bounded("watch", || {
                    let mut watch = self.inner.client.watch_client();
                    let (prefix, options) = (prefix.clone(), options.clone());
                    async move { watch.watch(prefix, Some(options)).await }
                })
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "etcd marks watch: cannot start; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let mut stream = stream;
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    () = tx.closed() => return,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "etcd marks watch broke; resuming");
                        break;
                    }
                };
                backoff = Duration::from_millis(50);
                if resp.compact_revision() > 0 {
                    // Events after `seen` are gone: read the present instead.
                    tracing::warn!(
                        compacted = resp.compact_revision(),
                        seen,
                        "etcd marks watch fell behind a compaction; reloading every mark"
                    );
                    match self.load_all().await {
                        Ok((marks, rev)) => {
                            for (name, mark) in marks {
                                let _ = tx.send((name, mark));
                            }
                            seen = rev;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "etcd marks reload failed; retrying");
                            tokio::time::sleep(backoff).await;
                        }
                    }
                    break;
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    seen = seen.max(kv.mod_revision());
                    if ev.event_type() != EventType::Put {
                        continue;
                    }
                    let Some(name) = kv.key().get(prefix.len()..) else {
                        continue;
                    };
                    match decode(kv.key(), kv.value()) {
                        Ok(mark) => {
                            let _ = tx.send((String::from_utf8_lossy(name).into_owned(), mark));
                        }
                        Err(e) => tracing::error!(error = %e, "etcd marks watch: bad value"),
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Forwards `(key, mod revision)` of every write under `prefix` from now on until the
    /// receiver is dropped, and `("", 0)` each time the watch is (re)established: changes
    /// before that may have been missed.
    pub(super) async fn watch_keys_loop(
        self,
        prefix: String,
        tx: mpsc::UnboundedSender<(String, u64)>,
    ) {
        // Every (re)start watches from the present and says that events were missed: the
        // followed resources read their epochs again, so no resume revision is kept.
        let mut backoff = Duration::from_millis(50);
        loop {
            if tx.is_closed() {
                return;
            }
            let options = WatchOptions::new().with_prefix();
            let stream = self
                .bounded("watch", || {
                    let mut watch = self.inner.client.watch_client();
                    let (prefix, options) = (prefix.clone(), options.clone());
                    async move { watch.watch(prefix, Some(options)).await }
                })
                .await;
            let mut stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, %prefix, "etcd epoch watch: cannot start; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    () = tx.closed() => return,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, %prefix, "etcd epoch watch broke; resuming");
                        break;
                    }
                };
                backoff = Duration::from_millis(50);
                if resp.created() {
                    // Established (its start revision fixed): whatever changed before is
                    // read afresh by the next admissions.
                    let _ = tx.send((String::new(), 0));
                }
                if resp.compact_revision() > 0 || resp.canceled() {
                    break;
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    // Queue entries share the prefix: only epoch keys are news.
                    let k = kv.key();
                    let slot = k
                        .iter()
                        .rposition(|b| *b == b'/')
                        .is_some_and(|i| k[..i].ends_with(b"/epoch") && i + 1 < k.len());
                    if !k.ends_with(b"/epoch") && !slot {
                        continue;
                    }
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    // A deleted epoch is news too (0): its resources read it again.
                    let revision = match ev.event_type() {
                        EventType::Put => u64::try_from(kv.mod_revision()).unwrap_or(0),
                        EventType::Delete => 0,
                    };
                    let _ = tx.send((key, revision));
                }
            }
            // Broken: events may be missed until it is up again, so no resource stays fresh.
            let _ = tx.send((String::new(), 0));
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}
