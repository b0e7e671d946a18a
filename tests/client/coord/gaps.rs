//! Gaps against etcd's concurrency package: the leader's identity in terms, and
//! resuming a term after a restart.

use super::defects::next;
use super::*;

/// Gap: `leader()` and observations say who leads (key, lease, owner id), not only the token
/// and value.
pub(crate) async fn terms_carry_the_leaders_identity(fx: &Fx) {
    let s = fx.session().await;
    let watcher = fx.session().await;
    let mut obs = watcher.observe("who").await.unwrap();
    assert_eq!(next(&mut obs).await, Observation::NoLeader);
    let l = s.campaign("who", "v").await.unwrap();
    let term = watcher.leader("who").await.unwrap().unwrap();
    assert_eq!(term.key, l.incarnation().key());
    assert_eq!(term.lease, s.lease_id());
    assert_eq!(term.owner, s.owner_id());
    let Observation::Leader(seen) = next(&mut obs).await else {
        panic!("expected a leader")
    };
    assert_eq!(seen, term);
}

/// Gap: a leader restarted within its lease's TTL resumes its term, token included, and only
/// while that term is current.
pub(crate) async fn a_restarted_leader_resumes_its_term_with_its_token(fx: &Fx) {
    let (old, cut) = fx.cuttable_ttl(Duration::from_secs(10)).await;
    let leadership = old.campaign("res", "v1").await.unwrap();
    let key = leadership.leader_key();
    // The "process" dies: cut off, never resigning.
    cut.cut();
    std::mem::forget(leadership);
    let new = fx
        .session_with(Fx::options(TTL).resuming(&key))
        .await
        .unwrap();
    assert_ne!(new.owner_id(), old.owner_id());
    let resumed = new.resume(&key).await.unwrap();
    assert_eq!(resumed.token(), key.token, "the term keeps its token");
    let term = new.leader("res").await.unwrap().unwrap();
    assert_eq!(term.token, key.token);
    resumed.proclaim("v2").await.unwrap();
    assert_eq!(new.leader("res").await.unwrap().unwrap().value, b"v2");
    // Once resigned, the term is over and cannot be resumed again.
    resumed.resign().await.unwrap();
    let again = new.resume(&key).await;
    assert!(matches!(again, Err(Error::NotLeader { .. })), "{again:?}");
    let next_leader = fx.session().await.campaign("res", "n").await.unwrap();
    assert!(next_leader.token() > key.token);
}
