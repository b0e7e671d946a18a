use super::*;
use crate::LockService;

#[tokio::test(start_paused = true)]
async fn a_lease_without_keepalives_expires_on_tokio_time() {
    let p = MemoryProvider::new();
    let s = p
        .session(SessionOptions::new().with_ttl(Duration::from_secs(3)))
        .await
        .unwrap();
    let g = s.lock("a").await.unwrap();
    assert_eq!(p.keys("/palisade/lock/a/q/").len(), 1);
    p.set_partitioned(true);
    let mut lost = g.loss_signal();
    assert_eq!(lost.wait().await, crate::Loss::SessionLost);
    tokio::time::sleep(Duration::from_secs(1)).await;
    p.set_partitioned(false);
    assert!(
        p.keys("/palisade/lock/a/q/").is_empty(),
        "the store expired the lease"
    );
}
