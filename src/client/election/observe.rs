//! Following an election from the outside.

use std::time::Duration;

use tokio::sync::mpsc;

use super::{current, read_term, Observation};
use crate::client::backend::KeyRange;
use crate::client::error::Error;
use crate::client::queue::Primitive;
use crate::client::session::Session;

/// A stream of [`Observation`]s; stops its background watch when dropped.
///
/// It never ends on its own. Store trouble (a disconnect, a restarted etcd) is reported once
/// per outage as an `Err` item, and observing goes on: every reconnection reads the election
/// afresh and watches from that read's revision + 1, so no change is missed after it. Terms
/// are reported in increasing token order, each at most once (a term that ended is never
/// reported again); a proclaimed value is reported under its term's token. A term that
/// began and ended entirely within an outage is not reported: it is over by then.
pub struct Observer {
    rx: mpsc::Receiver<Result<Observation, Error>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl Observer {
    pub(super) fn start(session: Session, p: Primitive) -> Self {
        let (tx, rx) = mpsc::channel(16);
        let task = tokio::spawn(follow(session, p, tx));
        Self { rx, task }
    }

    /// The next observation, or an `Err` reporting store trouble (observing continues).
    /// `None` only if the observing task itself stopped (its runtime shut down).
    pub async fn next(&mut self) -> Option<Result<Observation, Error>> {
        self.rx.recv().await
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(session: Session, p: Primitive, tx: mpsc::Sender<Result<Observation, Error>>) {
    let mut last: Option<Observation> = None;
    let mut highest = 0u64;
    let mut troubled = false;
    let mut backoff = Duration::from_millis(100);
    loop {
        let r = match session.backend().txn(current(&p)).await {
            Ok(r) => r,
            Err(e) => {
                // Once per outage, so a long one does not flood the caller.
                if !troubled && tx.send(Err(Error::store("observe")(e))).await.is_err() {
                    return;
                }
                troubled = true;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        troubled = false;
        backoff = Duration::from_millis(100);
        if let Some(obs) = read_term(&r) {
            let fresh = match (&obs, &last) {
                // A proclamation: same term, new value.
                (Observation::Leader(t), Some(Observation::Leader(l))) if t.token == l.token => {
                    t.value != l.value
                }
                // A new term; an ended one (token <= highest) is never reported again.
                (Observation::Leader(t), _) => t.token.get() > highest,
                (Observation::NoLeader, Some(Observation::NoLeader)) => false,
                (Observation::NoLeader, _) => true,
            };
            if fresh {
                if let Observation::Leader(t) = &obs {
                    highest = t.token.get();
                }
                if tx.send(Ok(obs.clone())).await.is_err() {
                    return;
                }
                last = Some(obs);
            }
        }
        let watched = session
            .backend()
            .watch(KeyRange::prefix(format!("{}/", p.path)), r.revision + 1)
            .await;
        match watched {
            // Any change under the election (or a broken watch) means: read again.
            Ok(mut events) => {
                let _ = events.next().await;
            }
            // Re-created after a pause; the read above starts from the present.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
