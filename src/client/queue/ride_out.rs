//! Riding out a short store outage: a blocking acquisition repeats a transaction whose answer
//! did not come, instead of failing in the middle of its wait.
//!
//! An unanswered transaction may have been applied, or may still be applied later (a request
//! the store read before the connection broke, or one slower than the request timeout), even
//! after its repeat. So only transactions that stay right when they land twice, in any order,
//! are repeated: reads; entering the queue (the key names the session: a repeat adopts the
//! first put, and a put that lands after the entry was let go is looked for again, see
//! `Pending::late_put`); confirming (a repeat that finds the epoch already naming our entry
//! writes nothing); joining a read phase; writing a semaphore's permit count.

use std::time::Duration;

use super::lost_error;
use crate::client::backend::{Txn, TxnResponse};
use crate::client::error::Error;
use crate::client::session::{LossSignal, Session};

/// How long a blocking acquisition waits before asking an unreachable store again.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Waits before asking an unreachable store again; fails with the session's loss if that
/// comes first (`loss`: the session's signal, taken once by the caller).
pub(crate) async fn pause(session: &Session, loss: &mut LossSignal) -> Result<(), Error> {
    tokio::select! {
        () = tokio::time::sleep(RETRY_PAUSE) => Ok(()),
        _ = loss.wait() => Err(lost_error(session)),
    }
}

/// Sends the transaction `make` builds until the store answers, while the session's lease may
/// still be alive; fails with the session's loss once it cannot be, and at once on errors
/// that are not transient.
pub(crate) async fn txn_riding_out(
    session: &Session,
    op: &'static str,
    make: impl Fn() -> Txn,
) -> Result<TxnResponse, Error> {
    txn_noting(session, op, &mut false, make).await
}

/// [`txn_riding_out`], setting `unanswered` when an attempt got no answer (it may land later).
pub(super) async fn txn_noting(
    session: &Session,
    op: &'static str,
    unanswered: &mut bool,
    make: impl Fn() -> Txn,
) -> Result<TxnResponse, Error> {
    let mut loss = session.loss_signal();
    loop {
        session.ensure_alive()?;
        match session.backend().txn(make()).await {
            Ok(r) => return Ok(r),
            Err(e) if e.is_transient() => {
                *unanswered = true;
                pause(session, &mut loss).await?;
            }
            Err(e) => return Err(Error::store(op)(e)),
        }
    }
}
