//! The claims of the process test, from the candidates' reports and the resource's log.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::processes::Stop;
use super::{support, POLL, SLACK, TTL};

/// Generations: every term has its own token (none reused), each candidate's tokens go up,
/// and releases are followed by their generation + 1. Returns token -> child.
pub(crate) fn check_terms(lines: &[(usize, String)]) -> BTreeMap<u64, usize> {
    let mut acquired = BTreeMap::new();
    let mut per_child: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut released = Vec::new();
    for (i, l) in lines {
        let w: Vec<&str> = l.split(' ').collect();
        match w[0] {
            "error" => panic!("child {i}: {l}"),
            "acquired" => {
                let t: u64 = w[1].parse().unwrap();
                assert!(acquired.insert(t, *i).is_none(), "token {t} won twice");
                per_child.entry(*i).or_default().push(t);
            }
            "ended" if w[3] == "released=true" => released.push(w[1].parse::<u64>().unwrap()),
            _ => {}
        }
    }
    for (i, tokens) in &per_child {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "child {i}: {tokens:?}"
        );
    }
    let n = acquired.len() as u64;
    // A generation nobody reported would be a takeover write that landed while both its
    // answer and the read-back were lost (a safe gap: the record then simply expires).
    let highest = acquired.keys().max().copied().unwrap_or(0);
    let handed_on = released
        .iter()
        .filter(|t| acquired.contains_key(&(*t + 1)))
        .count();
    eprintln!(
        "terms: {n} (generations 1..={highest}, {} unreported); per candidate: {:?}; released \
         and re-acquired with generation + 1: {handed_on}",
        highest - n,
        (0..5)
            .map(|i| per_child.get(&i).map_or(0, Vec::len))
            .collect::<Vec<_>>()
    );
    assert!(
        n >= 10 && handed_on >= 3,
        "too few terms: {n}, {handed_on} hand-overs"
    );
    acquired
}

/// Writes: what reached the resource never goes down and comes from won terms only; a leader
/// that believed its term live was never refused (unless its request arrived after its own
/// deadline); every write sent by a leader woken past its term was refused.
pub(crate) fn check_writes(
    lines: &[(usize, String)],
    seen: &[support::Seen],
    acquired: &BTreeMap<u64, usize>,
) {
    let tokens: Vec<u64> = seen
        .iter()
        .map(|s| s.token.as_deref().unwrap().parse().unwrap())
        .collect();
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "the accepted tokens went down"
    );
    assert!(
        tokens.iter().all(|t| acquired.contains_key(t)),
        "a token nobody won"
    );
    let (mut live, mut late, mut zombies) = (0, 0, 0);
    for (i, l) in lines {
        let w: Vec<&str> = l.split(' ').collect();
        if w[0] != "wrote" {
            continue;
        }
        let field = |k: &str| w.iter().find_map(|f| f.strip_prefix(k)).unwrap();
        let status: u16 = w[2].parse().unwrap();
        let left: u64 = field("left_ms=").parse().unwrap();
        let took: u64 = field("took_ms=").parse().unwrap();
        if field("live=") == "true" {
            live += 1;
            if status != 200 {
                assert!(
                    status == 409 && took >= left,
                    "child {i}: a live leader's write was refused before its deadline: {l}"
                );
                late += 1;
            }
        } else {
            zombies += 1;
            assert_eq!(status, 409, "child {i}: a stale write was accepted: {l}");
        }
    }
    eprintln!(
        "writes: {live} by live leaders ({late} refused, sent in time but arriving after the \
         leader's own deadline), {zombies} by leaders woken after their term (all refused); \
         accepted by the resource: {}",
        tokens.len()
    );
    assert!(zombies >= 1, "no stopped leader came back to write");
    assert!(live >= 200, "too little work: {live} writes");
}

/// Failover: the next term began within TTL + POLL (+ round trips) of the leader's stop.
pub(crate) fn check_failovers(stops: &[Stop], lines: &[(usize, String)]) {
    let acquisitions: Vec<(u64, u128)> = lines
        .iter()
        .filter_map(|(_, l)| {
            let w: Vec<&str> = l.split(' ').collect();
            (w[0] == "acquired").then(|| (w[1].parse().unwrap(), w[2].parse().unwrap()))
        })
        .collect();
    let mut taken = Vec::new();
    for s in stops {
        let next = acquisitions
            .iter()
            .filter(|(t, _)| *t > s.token)
            .map(|(_, at)| *at)
            .min()
            .unwrap_or_else(|| {
                panic!("nobody took over from child {}'s term {}", s.child, s.token)
            });
        let after = Duration::from_micros(u64::try_from(next.saturating_sub(s.at)).unwrap());
        taken.push(after);
    }
    let ms: Vec<u128> = taken.iter().map(Duration::as_millis).collect();
    eprintln!(
        "leaders stopped: {}; failover after the stop (ms): {ms:?}",
        stops.len()
    );
    assert!(stops.len() >= 6, "too few stops: {}", stops.len());
    for (s, after) in stops.iter().zip(&taken) {
        assert!(
            *after <= TTL + POLL + SLACK,
            "child {} (term {}): failover took {after:?} > TTL + poll + {SLACK:?}",
            s.child,
            s.token
        );
    }
}
