//! The slots of a semaphore: their keys, the permit count, and how the first in line takes a
//! free slot (see the parent module for the key layout).

use super::MAX_PERMITS;
use crate::client::backend::{Compare, EventKind, KeyRange, Op, Txn, TxnResponse};
use crate::client::error::Error;
use crate::client::queue::{lost_error, pause, token, txn_riding_out, Pending, Primitive};
use crate::client::session::{Incarnation, Session};
use crate::token::FencingToken;

fn permits_key(p: &Primitive) -> String {
    format!("{}/permits", p.path)
}

pub(super) fn slots(p: &Primitive) -> KeyRange {
    KeyRange::prefix(format!("{}/s/", p.path))
}

pub(super) fn slot_key(p: &Primitive, slot: u32) -> String {
    format!("{}/s/{slot}", p.path)
}

pub(super) fn epoch_key(p: &Primitive, slot: u32) -> String {
    format!("{}/{slot}", crate::client::session::epoch_of(&p.path))
}

pub(super) fn epoch_value(entry: &str) -> Vec<u8> {
    format!("S:{entry}").into_bytes()
}

/// The lowest slot below `permits` that no key in `held` (a range over `P/s/`) occupies.
pub(super) fn free_slot(p: &Primitive, r: &TxnResponse, at: usize, permits: u32) -> Option<u32> {
    let prefix = format!("{}/s/", p.path);
    let held: Vec<u32> = r
        .range(at)
        .iter()
        .filter_map(|kv| kv.key.strip_prefix(&prefix)?.parse().ok())
        .collect();
    (0..permits).find(|s| !held.contains(s))
}

/// Writes `P/permits` if it is missing, or checks that it says `permits`; with `ride_out` (a
/// blocking `acquire`), through a short store outage.
pub(super) async fn check_permits(
    session: &Session,
    p: &Primitive,
    permits: u32,
    ride_out: bool,
) -> Result<(), Error> {
    if permits == 0 || permits > MAX_PERMITS {
        return Err(Error::InvalidPermits(permits));
    }
    let key = permits_key(p);
    let txn = || Txn {
        when: vec![Compare::CreateRevisionEq(KeyRange::key(key.clone()), 0)],
        then: vec![Op::Put {
            key: key.clone(),
            value: permits.to_string().into_bytes(),
            lease: 0,
        }],
        otherwise: vec![Op::get(key.clone())],
    };
    // Safe to repeat: it writes the count only where none is.
    let r = if ride_out {
        txn_riding_out(session, "semaphore permits", txn).await?
    } else {
        session
            .backend()
            .txn(txn())
            .await
            .map_err(Error::store("semaphore permits"))?
    };
    if r.succeeded {
        return Ok(());
    }
    let stored = r
        .range(0)
        .first()
        .and_then(|kv| std::str::from_utf8(&kv.value).ok()?.parse().ok())
        .unwrap_or(0);
    if stored != permits {
        return Err(Error::PermitsMismatch {
            name: p.name.clone(),
            stored,
            asked: permits,
        });
    }
    Ok(())
}

/// The first in line takes a free slot, waiting for one to be freed when all are held.
///
/// Reads its entry and the slots at one revision; when every slot is held, watches the queue
/// and the slots from that revision + 1 (one range covers `P/q/` .. `P/s/`) and reads again
/// after any slot's or its own entry's delete, so a freed slot is never missed.
pub(super) async fn take_slot(
    session: &Session,
    pending: &mut Pending,
    p: &Primitive,
    permits: u32,
) -> Result<(u32, FencingToken), Error> {
    let me = pending.incarnation().clone();
    let mut loss = session.loss_signal();
    let slot_prefix = format!("{}/s/", p.path);
    // A take whose answer was lost may have landed: our entry then moved into a slot.
    let mut take_unanswered = false;
    loop {
        let r = txn_riding_out(session, "read slots", || Txn {
            when: vec![],
            then: vec![
                Op::get(me.key.clone()),
                Op::Range {
                    range: slots(p),
                    sort: None,
                    limit: 0,
                    max_create_revision: 0,
                },
            ],
            otherwise: vec![],
        })
        .await?;
        if r.range(0).first().map(|kv| kv.create_revision) != Some(me.create_revision) {
            if take_unanswered {
                // The slot's key, epoch and token were written in one transaction with the
                // delete of our entry, so its create revision is the token we were not told.
                if let Some(kv) = r.range(1).iter().find(|kv| {
                    kv.value == me.key.as_bytes() && kv.create_revision > me.create_revision
                }) {
                    let slot = kv
                        .key
                        .strip_prefix(&slot_prefix)
                        .and_then(|s| s.parse().ok());
                    if let Some(slot) = slot {
                        pending.moved(Incarnation {
                            key: kv.key.clone(),
                            create_revision: kv.create_revision,
                        });
                        return Ok((slot, token(kv.create_revision)));
                    }
                }
            }
            session.confirm_lease().await;
            return Err(lost_error(session));
        }
        if let Some(slot) = free_slot(p, &r, 1, permits) {
            let key = slot_key(p, slot);
            // Armed before the request: if it lands but the answer is lost, the slot is
            // still freed.
            pending.also_clean(key.clone(), me.key.clone().into_bytes());
            let t = session
                .backend()
                .txn(Txn {
                    when: vec![
                        Compare::CreateRevisionEq(
                            KeyRange::key(me.key.clone()),
                            me.create_revision,
                        ),
                        Compare::CreateRevisionEq(KeyRange::key(key.clone()), 0),
                    ],
                    then: vec![
                        Op::Delete {
                            key: me.key.clone(),
                        },
                        Op::Put {
                            key: key.clone(),
                            value: me.key.clone().into_bytes(),
                            lease: session.lease(),
                        },
                        Op::Put {
                            key: epoch_key(p, slot),
                            value: epoch_value(&me.key),
                            lease: 0,
                        },
                    ],
                    otherwise: vec![Op::get(me.key.clone())],
                })
                .await;
            let t = match t {
                Ok(t) => t,
                Err(e) if e.is_transient() => {
                    take_unanswered = true;
                    pause(session, &mut loss).await?;
                    continue;
                }
                Err(e) => return Err(Error::store("take slot")(e)),
            };
            if t.succeeded {
                pending.moved(Incarnation {
                    key,
                    create_revision: t.revision,
                });
                return Ok((slot, token(t.revision)));
            }
            // Someone took that slot first (a `try_acquire`), or our entry is gone: read again.
            continue;
        }
        let range = KeyRange {
            start: format!("{}/q/", p.path),
            end: slots(p).end,
        };
        let mut events = match session.backend().watch(range, r.revision + 1).await {
            Ok(ev) => ev,
            Err(e) if e.is_transient() => {
                pause(session, &mut loss).await?;
                continue;
            }
            Err(e) => return Err(Error::store("watch slots")(e)),
        };
        loop {
            tokio::select! {
                batch = events.next() => match batch {
                    Some(Ok(batch)) => {
                        if batch.iter().any(|e| e.kind == EventKind::Delete
                            && (e.kv.key.starts_with(&slot_prefix) || e.kv.key == me.key))
                        {
                            break;
                        }
                    }
                    // Broken, compacted or ended watch: read again and watch anew.
                    Some(Err(_)) | None => break,
                },
                _ = loss.wait() => return Err(lost_error(session)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::backend::{Kv, OpResponse};

    #[test]
    fn the_lowest_unheld_slot_below_the_count_is_free() {
        let p = Primitive {
            name: "s".into(),
            path: "/ns/semaphore/jobs".into(),
        };
        let kv = |k: &str| Kv {
            key: k.into(),
            value: vec![],
            create_revision: 1,
            mod_revision: 1,
            lease: 0,
        };
        let r = |keys: &[&str]| TxnResponse {
            succeeded: true,
            revision: 1,
            responses: vec![OpResponse::Range(keys.iter().copied().map(kv).collect())],
        };
        assert_eq!(free_slot(&p, &r(&[]), 0, 3), Some(0));
        let some = r(&["/ns/semaphore/jobs/s/0", "/ns/semaphore/jobs/s/2"]);
        assert_eq!(free_slot(&p, &some, 0, 3), Some(1));
        let all = r(&[
            "/ns/semaphore/jobs/s/0",
            "/ns/semaphore/jobs/s/1",
            "/ns/semaphore/jobs/s/2",
        ]);
        assert_eq!(free_slot(&p, &all, 0, 3), None);
        // A slot beyond the count (another count used before) never counts as free.
        assert_eq!(
            free_slot(&p, &r(&["/ns/semaphore/jobs/s/9"]), 0, 1),
            Some(0)
        );
    }
}
