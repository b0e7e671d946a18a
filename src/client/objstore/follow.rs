//! Campaigning: follow the record until it is free, then take it with a conditional write.
//!
//! A follower never reads a clock off the record. It takes over only when
//!
//! - there is no record (`If-None-Match: *` creates generation 1), or
//! - the record is marked released (`If-Match` on that version, generation + 1), or
//! - it has seen the *same version* (ETag) for the TTL on its own monotonic clock, counted
//!   from the answer to the read that first showed it, and the takeover's `If-Match` on that
//!   version proves nobody wrote in between (every write changes the content, so a version
//!   never comes back). The TTL waited is the larger of the record's and our own.
//!
//! The leader that wrote that version started the write before our read's answer, and stops
//! acting `margin` before its own TTL from that start, so by the time we may take over it
//! has stopped, whatever the clocks' offsets.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::error::Error;
use super::record::{self, timed, Record, Stored, Write};
use super::term::{Shared, Won};
use crate::token::FencingToken;

/// A version being watched, since when, and for how long it must stay.
struct Watched {
    stored: Stored,
    since: Instant,
    wait: Duration,
}

/// Waits until this candidate wins the record.
///
/// # Errors
/// [`Error::CorruptRecord`], [`Error::NoETag`], [`Error::GenerationExhausted`] or an
/// unsupported store; transient store errors are retried (and logged) while campaigning.
pub(super) async fn campaign(s: &Shared, holder: &str) -> Result<Won, Error> {
    let t = s.timing;
    let mut watched: Option<Watched> = None;
    let mut troubled = false;
    loop {
        let read = timed(
            "read the lease record",
            t.request_timeout,
            record::read(&*s.store, &s.path),
        )
        .await;
        let seen = Instant::now();
        match read {
            Ok(None) => {
                let record = Record::first(nonce(), holder.to_owned(), millis(t.ttl));
                if let Some(won) = attempt(s, record, None).await? {
                    return Ok(won);
                }
                // Someone created it first: read it at once.
                continue;
            }
            Ok(Some(now)) if now.record.released => {
                if let Some(won) = take(s, &now, holder).await? {
                    return Ok(won);
                }
                continue;
            }
            Ok(Some(now)) => {
                troubled = false;
                let same = watched
                    .as_ref()
                    .is_some_and(|w| w.stored.same_version(&now));
                if !same {
                    let wait = t.ttl.max(Duration::from_millis(now.record.ttl_ms));
                    watched = Some(Watched {
                        stored: now,
                        since: seen,
                        wait,
                    });
                }
            }
            Err(e) if e.is_transient() => {
                // Once per outage. The watched version stays watched: the takeover's
                // If-Match still proves it never changed.
                if !troubled {
                    tracing::warn!(election = %s.name, error = %e, "cannot read the lease record");
                }
                troubled = true;
            }
            Err(e) => return Err(e),
        }
        let mut wake = Instant::now() + t.poll_every;
        if let Some(w) = &watched {
            let due = w.since + w.wait;
            if Instant::now() >= due {
                let stored = w.stored.clone();
                watched = None;
                if let Some(won) = take(s, &stored, holder).await? {
                    return Ok(won);
                }
                continue;
            }
            wake = wake.min(due);
        }
        tokio::time::sleep_until(wake).await;
    }
}

/// Replaces `prev` with the next term's record.
async fn take(s: &Shared, prev: &Stored, holder: &str) -> Result<Option<Won>, Error> {
    let record =
        prev.record
            .successor(nonce(), holder.to_owned(), millis(s.timing.ttl), &s.path)?;
    attempt(s, record, Some(prev)).await
}

/// One conditional write of `record` (a create when `prev` is `None`). `Ok(None)`: someone
/// else wrote first, or the outcome is unknown and the record is not ours.
async fn attempt(s: &Shared, record: Record, prev: Option<&Stored>) -> Result<Option<Won>, Error> {
    let t = s.timing;
    let token = FencingToken::new(record.generation).ok_or_else(|| Error::GenerationExhausted {
        path: s.path.to_string(),
        generation: 0,
    })?;
    let op = "take the lease record";
    let sent = Instant::now();
    let put = async {
        match prev {
            None => record::create(&*s.store, &s.path, &record).await,
            Some(prev) => record::replace(&*s.store, &s.path, &record, &prev.version).await,
        }
    };
    let written = match timed(op, t.request_timeout, put).await {
        Ok(Write::Done(version)) => Some(version),
        Ok(Write::Conflict) => return Ok(None),
        Err(e) if e.is_transient() => {
            // The write may have landed with its answer lost: the record names this attempt
            // (its nonce is unique) only if it did.
            tracing::debug!(election = %s.name, error = %e, "takeover write failed");
            let read = timed(op, t.request_timeout, record::read(&*s.store, &s.path)).await;
            match read {
                Ok(Some(now)) if now.record == record => Some(now.version),
                Ok(_) => None,
                Err(e) if e.is_transient() => None,
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    Ok(written.map(|version| Won {
        stored: Stored { record, version },
        token,
        sent,
    }))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A value no other write will carry: a randomly keyed hash (std seeds `RandomState` from
/// the OS) of this process, a counter and the time.
fn nonce() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    // Relaxed: the counter only has to differ between calls, not order anything.
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let h = RandomState::new().hash_one((std::process::id(), n, at));
    format!("{h:016x}{n:x}")
}
