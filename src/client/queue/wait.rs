//! Waiting for one's turn in the queue: reads and watches, never writes, so every step can
//! be repeated through a store outage.

use super::{lost_error, pause, txn_riding_out, Pending, Primitive};
use crate::client::backend::{EventKind, KeyRange, Kv, Op, SortByCreate, Txn};
use crate::client::error::Error;

impl Pending {
    /// Waits until no entry created before ours satisfies `blocks`.
    ///
    /// Reads from a fresh revision, then watches the newest blocker (and our own entry) from
    /// the read's revision + 1, so no delete is missed and no stale history is replayed; after
    /// every delete it reads again, so a waiter never skips a live holder even when the entry
    /// in front of it goes first.
    pub(crate) async fn wait_turn(
        &self,
        p: &Primitive,
        blocks: impl Fn(&Kv) -> bool,
    ) -> Result<(), Error> {
        let me = self.incarnation().clone();
        let mut loss = self.session.loss_signal();
        loop {
            let r = txn_riding_out(&self.session, "read queue", || Txn {
                when: vec![],
                then: vec![
                    Op::get(me.key.clone()),
                    Op::Range {
                        range: KeyRange::prefix(p.queue()),
                        sort: Some(SortByCreate::Descending),
                        limit: 0,
                        max_create_revision: me.create_revision - 1,
                    },
                ],
                otherwise: vec![],
            })
            .await?;
            if r.range(0).first().map(|kv| kv.create_revision) != Some(me.create_revision) {
                // Our entry is gone: the lease expired or was revoked (or someone deleted it).
                self.session.confirm_lease().await;
                return Err(lost_error(&self.session));
            }
            // The store filters by create revision too, but `max_create_revision == 0` means
            // "no limit", so the bound is applied here as well.
            let Some(blocker) = r
                .range(1)
                .iter()
                .find(|kv| kv.create_revision < me.create_revision && blocks(kv))
            else {
                return Ok(());
            };
            let (lo, hi) = if blocker.key < me.key {
                (&blocker.key, &me.key)
            } else {
                (&me.key, &blocker.key)
            };
            let range = KeyRange {
                start: lo.clone(),
                end: Some(format!("{hi}\0")),
            };
            let watched = [blocker.key.clone(), me.key.clone()];
            let mut events = match self.session.backend().watch(range, r.revision + 1).await {
                Ok(ev) => ev,
                Err(e) if e.is_transient() => {
                    pause(&self.session, &mut loss).await?;
                    continue;
                }
                Err(e) => return Err(Error::store("watch queue")(e)),
            };
            loop {
                tokio::select! {
                    batch = events.next() => match batch {
                        Some(Ok(batch)) => {
                            if batch.iter().any(|e| e.kind == EventKind::Delete && watched.contains(&e.kv.key)) {
                                break;
                            }
                        }
                        // Broken, compacted or ended watch: read again and watch anew.
                        Some(Err(_)) | None => break,
                    },
                    _ = loss.wait() => return Err(lost_error(&self.session)),
                }
            }
        }
    }
}
