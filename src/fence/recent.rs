//! The last refusals, for the admin listener's status page: a small ring of records behind
//! one mutex, written only when a request is refused (never on an admitted one).
//!
//! A zombie retrying in a loop would fill the ring with one row; repeats of the newest record
//! (same route, resource, token, mark, reason and peer address) are counted in it instead, so
//! that the other refusals stay in view. Every refusal is still counted in
//! `palisade_requests_total` and written to the access log.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::fence::reject::Rejection;

/// How many refusals the ring keeps.
pub const RECENT_REFUSALS: usize = 50;

/// One refusal (or a run of equal ones), as the status page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// When it (the last of the run) was refused.
    pub at: SystemTime,
    /// The route it matched.
    pub route: Arc<str>,
    /// The resource it was judged for (the entity, for a templated route), if it got that far.
    pub resource: Option<String>,
    /// Its token, when one parsed.
    pub token: Option<u64>,
    /// The mark it was refused by (a stale refusal's), or the resource's mark then.
    pub mark: Option<u64>,
    /// The machine-readable code of the refusal table (`stale_token`, `missing_token`, ...).
    pub reason: &'static str,
    /// The HTTP status it was answered with.
    pub status: u16,
    /// Who sent it (the last of the run).
    pub peer: SocketAddr,
    /// How many refusals in a row this record stands for (1 or more).
    pub count: u64,
}

/// The ring of the last [`RECENT_REFUSALS`] refusals, newest last.
#[derive(Debug, Default)]
pub struct RecentRefusals {
    ring: Mutex<VecDeque<Refusal>>,
}

impl RecentRefusals {
    /// Records `rejection` of a request to `route` from `peer`; `resource` is its resource's
    /// name and mark, when it has one.
    pub fn record(
        &self,
        route: &Arc<str>,
        rejection: &Rejection,
        resource: Option<(&str, u64)>,
        token: Option<u64>,
        peer: SocketAddr,
    ) {
        let (status, _, reason) = rejection.classify();
        let mark = match rejection {
            Rejection::Stale { mark, .. } => Some(*mark),
            Rejection::Unissued { epoch, .. } => Some(*epoch),
            _ => resource.map(|(_, m)| m),
        };
        let name = resource.map(|(n, _)| n);
        let at = SystemTime::now();
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(last) = ring.back_mut() {
            if *last.route == **route
                && last.resource.as_deref() == name
                && last.token == token
                && last.mark == mark
                && last.reason == reason
                && last.peer.ip() == peer.ip()
            {
                last.count += 1;
                last.at = at;
                last.peer = peer;
                return;
            }
        }
        if ring.len() == RECENT_REFUSALS {
            ring.pop_front();
        }
        ring.push_back(Refusal {
            at,
            route: Arc::clone(route),
            resource: name.map(str::to_owned),
            token,
            mark,
            reason,
            status: status.as_u16(),
            peer,
            count: 1,
        });
    }

    /// The refusals kept, newest first.
    pub fn newest_first(&self) -> Vec<Refusal> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn keeps_the_last_refusals_newest_first_and_counts_repeats_in_one_record() {
        let recent = RecentRefusals::default();
        let route: Arc<str> = Arc::from("orders");
        let stale = |token| Rejection::Stale { token, mark: 51 };
        recent.record(&route, &stale(34), Some(("orders", 51)), Some(34), peer(1));
        // The zombie again, from another connection of the same host.
        recent.record(&route, &stale(34), Some(("orders", 51)), Some(34), peer(2));
        recent.record(&route, &Rejection::MissingToken, None, None, peer(3));
        let got = recent.newest_first();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].reason, "missing_token");
        assert_eq!(got[0].status, 428);
        assert_eq!(got[1].reason, "stale_token");
        assert_eq!(
            (got[1].token, got[1].mark, got[1].count),
            (Some(34), Some(51), 2)
        );
        assert_eq!(got[1].peer, peer(2), "the last of the run");

        for token in 1..=(RECENT_REFUSALS as u64 + 5) {
            recent.record(
                &route,
                &stale(token),
                Some(("orders", 51)),
                Some(token),
                peer(1),
            );
        }
        let got = recent.newest_first();
        assert_eq!(got.len(), RECENT_REFUSALS);
        assert_eq!(got[0].token, Some(RECENT_REFUSALS as u64 + 5));
        assert_eq!(got[RECENT_REFUSALS - 1].token, Some(6));
    }
}
