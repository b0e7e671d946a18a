//! Stale refusals in the log without a flood: a zombie that retries in a loop would otherwise
//! write one INFO line per request.
//!
//! The first refusal of a token on a resource (one owner, fenced) is logged whole; later ones
//! of the same pair are counted and summed up in one line per pair every
//! [`SUMMARY_INTERVAL`] while they go on. Nothing an audit needs is lost: the access log keeps
//! a line per request, and `palisade_stale_rejections_total` counts every refusal.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How often repeated refusals of one owner are summed up in the log.
pub(super) const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);
/// Pairs remembered at most; beyond it, every count is written out and the table starts over.
const MAX_PAIRS: usize = 4096;

/// Which stale refusals to log whole, and the counts of the others (see the module docs).
#[derive(Debug)]
pub(super) struct StaleLog {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// resource -> token -> refusals not yet written out (looked up without allocating).
    pairs: HashMap<String, HashMap<u64, Pending>>,
    count: usize,
    last_summary: Instant,
}

#[derive(Debug)]
struct Pending {
    route: String,
    mark: u64,
    repeated: u64,
}

/// One summary line, written after the lock is released.
struct Summary {
    route: String,
    resource: String,
    token: u64,
    mark: u64,
    repeated: u64,
}

impl StaleLog {
    /// A new log; with a tokio runtime at hand, a task writes the summaries on time even when
    /// no further refusal comes (it ends with the log).
    pub(super) fn new() -> Arc<Self> {
        let log = Arc::new(StaleLog {
            state: Mutex::new(State {
                pairs: HashMap::new(),
                count: 0,
                last_summary: Instant::now(),
            }),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak: Weak<StaleLog> = Arc::downgrade(&log);
            rt.spawn(async move {
                let mut tick = tokio::time::interval(SUMMARY_INTERVAL);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let Some(log) = weak.upgrade() else { return };
                    log.summarize(false);
                }
            });
        }
        log
    }

    /// Records a stale refusal of `token` on `resource`; `true` when it is the first of that
    /// pair (or the first since its last quiet interval) and should be logged whole.
    pub(super) fn first(&self, route: &str, resource: &str, token: u64, mark: u64) -> bool {
        let (first, due) = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let known = s
                .pairs
                .get_mut(resource)
                .and_then(|per| per.get_mut(&token));
            let first = match known {
                Some(p) => {
                    p.repeated += 1;
                    p.mark = mark;
                    if p.route != route {
                        route.clone_into(&mut p.route);
                    }
                    false
                }
                None => {
                    let pending = Pending {
                        route: route.to_owned(),
                        mark,
                        repeated: 0,
                    };
                    s.pairs
                        .entry(resource.to_owned())
                        .or_default()
                        .insert(token, pending);
                    s.count += 1;
                    true
                }
            };
            let full = s.count > MAX_PAIRS;
            let due =
                (full || s.last_summary.elapsed() >= SUMMARY_INTERVAL).then(|| take(&mut s, full));
            (first, due)
        };
        write(due.unwrap_or_default());
        first
    }

    /// Writes out the counts if the interval is over (or `now`): one line per pair that was
    /// refused again; pairs that stayed quiet are forgotten, so their next refusal is logged
    /// whole again.
    fn summarize(&self, now: bool) {
        let due = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            (now || s.last_summary.elapsed() >= SUMMARY_INTERVAL).then(|| take(&mut s, false))
        };
        write(due.unwrap_or_default());
    }
}

impl Drop for StaleLog {
    fn drop(&mut self) {
        let s = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        write(take(s, true));
    }
}

/// The repeats to write out; resets their counts and forgets quiet pairs (or all of them).
fn take(s: &mut State, forget_all: bool) -> (Vec<Summary>, std::time::Duration) {
    let since = s.last_summary.elapsed();
    let mut out = Vec::new();
    let mut count = 0;
    s.pairs.retain(|resource, per| {
        per.retain(|token, p| {
            if p.repeated == 0 {
                return false;
            }
            out.push(Summary {
                route: p.route.clone(),
                resource: resource.clone(),
                token: *token,
                mark: p.mark,
                repeated: p.repeated,
            });
            p.repeated = 0;
            !forget_all
        });
        count += per.len();
        !per.is_empty()
    });
    s.count = count;
    s.last_summary = Instant::now();
    (out, since)
}

fn write((lines, since): (Vec<Summary>, std::time::Duration)) {
    for l in lines {
        tracing::info!(
            route = %l.route,
            resource = %l.resource,
            token = l.token,
            mark = l.mark,
            repeated = l.repeated,
            seconds = since.as_secs(),
            "stale token refused again (repeats of one owner are summed up here; the access \
             log has every request)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_refusal_of_an_owner_is_logged_whole() {
        let log = StaleLog::new();
        assert!(log.first("r", "orders", 34, 51));
        assert!(!log.first("r", "orders", 34, 51));
        assert!(!log.first("r", "orders", 34, 52));
        assert!(log.first("r", "orders", 35, 52), "another owner");
        assert!(log.first("r", "stock", 34, 51), "another resource");
        // A summary writes out the repeats and forgets quiet pairs.
        log.summarize(true);
        assert!(
            !log.first("r", "orders", 34, 51),
            "repeated in the last interval"
        );
        log.summarize(true);
        log.summarize(true);
        assert!(
            log.first("r", "orders", 34, 51),
            "quiet for an interval: logged again"
        );
    }
}
