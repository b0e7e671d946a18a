//! The etcd provider, on a caller-owned `etcd_client::Client` (etcd-client 0.21).
//!
//! etcd-client has no default request timeout and does not resume watches, so this provider
//! adds both: every request is bounded by [`EtcdProvider::with_request_timeout`], read-only
//! requests are retried on transient failures, and the primitives re-create a watch (from a
//! fresh read) whenever one breaks.
//!
//! The primitives never use etcd's v3lock/v3election services: those orphan a 60 s lease when
//! called without one, and they cannot return a fencing token that is bumped on acquisition.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, SortOrder, SortTarget, Txn as EtcdTxn, TxnOp, TxnOpResponse,
    TxnResponse as EtcdTxnResponse, WatchOptions, WatchStream,
};

use super::Provider;
use crate::client::backend::{
    Backend, BackendError, BoxFuture, Compare, Event, EventKind, Events, KeyRange, Kv, LeaseId,
    LeaseInfo, Op, OpResponse, Revision, SortByCreate, Txn, TxnResponse,
};
use crate::client::error::Error;
use crate::client::session::{Session, SessionOptions};

/// Default bound on every etcd request.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const READ_ATTEMPTS: u32 = 3;

/// Sessions, locks and elections on etcd.
#[derive(Clone)]
pub struct EtcdProvider {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    timeout: Duration,
    keepers: tokio::sync::Mutex<HashMap<LeaseId, (LeaseKeeper, LeaseKeepAliveStream)>>,
}

impl std::fmt::Debug for EtcdProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdProvider")
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl EtcdProvider {
    /// A provider on `client`, which the caller keeps owning (it is cloned, not consumed).
    pub fn new(client: &Client) -> Self {
        Self::build(client.clone(), DEFAULT_REQUEST_TIMEOUT)
    }

    /// Bounds every request (default [`DEFAULT_REQUEST_TIMEOUT`]).
    pub fn with_request_timeout(self, timeout: Duration) -> Self {
        Self::build(self.inner.client.clone(), timeout)
    }

    fn build(client: Client, timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                timeout,
                keepers: tokio::sync::Mutex::default(),
            }),
        }
    }

    async fn bounded<T, F>(&self, f: F) -> Result<T, BackendError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(self.inner.timeout, f).await {
            Ok(r) => r.map_err(map_err),
            Err(_) => Err(BackendError::Timeout(self.inner.timeout)),
        }
    }
}

fn map_err(e: etcd_client::Error) -> BackendError {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::Cancelled
                    | Code::Aborted
                    | Code::Unknown
            ) =>
        {
            BackendError::Unavailable(Box::new(s))
        }
        E::GRpcStatus(s) => BackendError::Refused(Box::new(s)),
        E::TransportError(t) => BackendError::Unavailable(Box::new(t)),
        E::IoError(io) => BackendError::Unavailable(Box::new(io)),
        E::WatchError(m) | E::LeaseKeepAliveError(m) => BackendError::Unavailable(m.into()),
        other => BackendError::Refused(Box::new(other)),
    }
}

/// Whether a transaction can write (only read-only ones are retried).
fn writes(txn: &Txn) -> bool {
    txn.then.iter().chain(&txn.otherwise).any(|op| match op {
        Op::Put { .. } | Op::Delete { .. } => true,
        Op::Range { .. } => false,
        Op::Txn(t) => writes(t),
    })
}

fn to_etcd(txn: &Txn) -> EtcdTxn {
    let when: Vec<EtcdCompare> = txn
        .when
        .iter()
        .map(|c| match c {
            Compare::CreateRevisionEq(range, rev) => {
                let c = EtcdCompare::create_revision(range.start.as_str(), CompareOp::Equal, *rev);
                match &range.end {
                    Some(end) => c.with_range(end.as_str()),
                    None => c,
                }
            }
            Compare::ValueEq(key, value) => {
                EtcdCompare::value(key.as_str(), CompareOp::Equal, value.clone())
            }
            Compare::ModRevisionGreater(key, rev) => {
                EtcdCompare::mod_revision(key.as_str(), CompareOp::Greater, *rev)
            }
            Compare::ModRevisionEq(key, rev) => {
                EtcdCompare::mod_revision(key.as_str(), CompareOp::Equal, *rev)
            }
        })
        .collect();
    let ops = |ops: &[Op]| -> Vec<TxnOp> {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => {
                    let opts = (*lease != 0).then(|| PutOptions::new().with_lease(*lease));
                    TxnOp::put(key.as_str(), value.clone(), opts)
                }
                Op::Range {
                    range,
                    sort,
                    limit,
                    max_create_revision,
                } => {
                    let mut o = GetOptions::new();
                    if let Some(end) = &range.end {
                        o = o.with_range(end.as_str());
                    }
                    if let Some(s) = sort {
                        let order = match s {
                            SortByCreate::Ascending => SortOrder::Ascend,
                            SortByCreate::Descending => SortOrder::Descend,
                        };
                        o = o.with_sort(SortTarget::Create, order);
                    }
                    if *limit > 0 {
                        o = o.with_limit(*limit);
                    }
                    if *max_create_revision > 0 {
                        o = o.with_max_create_revision(*max_create_revision);
                    }
                    TxnOp::get(range.start.as_str(), Some(o))
                }
                Op::Delete { key } => TxnOp::delete(key.as_str(), None),
                Op::Txn(t) => TxnOp::txn(to_etcd(t)),
            })
            .collect()
    };
    EtcdTxn::new()
        .when(when)
        .and_then(ops(&txn.then))
        .or_else(ops(&txn.otherwise))
}

fn kv(k: &etcd_client::KeyValue) -> Kv {
    Kv {
        key: String::from_utf8_lossy(k.key()).into_owned(),
        value: k.value().to_vec(),
        create_revision: k.create_revision(),
        mod_revision: k.mod_revision(),
        lease: k.lease(),
    }
}

fn from_etcd(r: &EtcdTxnResponse, outer_revision: Revision) -> TxnResponse {
    let revision = r.header().map_or(outer_revision, |h| h.revision());
    let responses = r
        .op_responses()
        .iter()
        .map(|op| match op {
            TxnOpResponse::Put(_) => OpResponse::Put,
            TxnOpResponse::Get(g) => OpResponse::Range(g.kvs().iter().map(kv).collect()),
            TxnOpResponse::Delete(_) => OpResponse::Delete,
            TxnOpResponse::Txn(t) => OpResponse::Txn(from_etcd(t, revision)),
        })
        .collect();
    TxnResponse {
        succeeded: r.succeeded(),
        revision,
        responses,
    }
}

struct EtcdEvents(WatchStream);

impl Events for EtcdEvents {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<Vec<Event>, BackendError>>> {
        Box::pin(async move {
            loop {
                let resp = match self.0.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => return None,
                    Err(e) => return Some(Err(map_err(e))),
                };
                if resp.canceled() {
                    return match resp.compact_revision() {
                        0 => None,
                        rev => Some(Err(BackendError::Compacted(rev))),
                    };
                }
                if resp.events().is_empty() {
                    continue;
                }
                let events = resp
                    .events()
                    .iter()
                    .filter_map(|e| {
                        let kind = match e.event_type() {
                            EventType::Put => EventKind::Put,
                            EventType::Delete => EventKind::Delete,
                        };
                        e.kv().map(|k| Event { kind, kv: kv(k) })
                    })
                    .collect();
                return Some(Ok(events));
            }
        })
    }
}

impl Backend for EtcdProvider {
    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResponse, BackendError>> {
        Box::pin(async move {
            let read_only = !writes(&txn);
            let request = to_etcd(&txn);
            let mut attempt = 0;
            loop {
                let mut client = self.inner.client.clone();
                match self.bounded(client.txn(request.clone())).await {
                    Ok(r) => return Ok(from_etcd(&r, 0)),
                    // Reads are idempotent; writes are never repeated here (the caller decides).
                    Err(e) if read_only && e.is_transient() && attempt + 1 < READ_ATTEMPTS => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        })
    }

    fn watch(
        &self,
        range: KeyRange,
        from: Revision,
    ) -> BoxFuture<'_, Result<Box<dyn Events>, BackendError>> {
        Box::pin(async move {
            let mut opts = WatchOptions::new().with_start_revision(from);
            if let Some(end) = &range.end {
                opts = opts.with_range(end.as_str());
            }
            let mut client = self.inner.client.clone();
            let stream = self
                .bounded(client.watch(range.start.as_str(), Some(opts)))
                .await?;
            Ok(Box::new(EtcdEvents(stream)) as Box<dyn Events>)
        })
    }

    fn lease_grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<(LeaseId, i64), BackendError>> {
        Box::pin(async move {
            let mut client = self.inner.client.clone();
            let r = self.bounded(client.lease_grant(ttl_secs, None)).await?;
            Ok((r.id(), r.ttl()))
        })
    }

    fn lease_keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<i64, BackendError>> {
        Box::pin(async move {
            // The stream is taken out for the round and put back only after a complete one: a
            // round abandoned half-way (timeout, cancellation) leaves no stream whose next
            // message would be the previous round's answer.
            let taken = self.inner.keepers.lock().await.remove(&lease);
            let (mut keeper, mut stream) = match taken {
                Some(pair) => pair,
                None => {
                    let mut client = self.inner.client.clone();
                    match tokio::time::timeout(self.inner.timeout, client.lease_keep_alive(lease))
                        .await
                    {
                        Ok(Ok(pair)) => pair,
                        // etcd-client's way of saying the first keepalive got TTL 0.
                        Ok(Err(etcd_client::Error::LeaseKeepAliveError(m)))
                            if m.contains("not found") =>
                        {
                            return Ok(0)
                        }
                        Ok(Err(e)) => return Err(map_err(e)),
                        Err(_) => return Err(BackendError::Timeout(self.inner.timeout)),
                    }
                }
            };
            let round = async {
                keeper.keep_alive().await?;
                stream.message().await
            };
            match self.bounded(round).await {
                Ok(Some(r)) => {
                    self.inner
                        .keepers
                        .lock()
                        .await
                        .insert(lease, (keeper, stream));
                    Ok(r.ttl().max(0))
                }
                Ok(None) => Err(BackendError::Unavailable("keepalive stream closed".into())),
                Err(e) => Err(e),
            }
        })
    }

    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            self.inner.keepers.lock().await.remove(&lease);
            let mut client = self.inner.client.clone();
            match self.bounded(client.lease_revoke(lease)).await {
                Ok(_) => Ok(()),
                // Already gone (expired): revoking is done.
                Err(BackendError::Refused(e)) if e.to_string().contains("not found") => Ok(()),
                Err(e) => Err(e),
            }
        })
    }

    fn lease_ttl(&self, lease: LeaseId) -> BoxFuture<'_, Result<LeaseInfo, BackendError>> {
        Box::pin(async move {
            let mut client = self.inner.client.clone();
            let opts = etcd_client::LeaseTimeToLiveOptions::new().with_keys();
            let r = self
                .bounded(client.lease_time_to_live(lease, Some(opts)))
                .await?;
            Ok(LeaseInfo {
                remaining: r.ttl().max(0),
                granted: r.granted_ttl(),
                keys: r
                    .keys()
                    .iter()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect(),
            })
        })
    }
}

impl Provider for EtcdProvider {
    fn session(
        &self,
        options: SessionOptions,
    ) -> impl Future<Output = Result<Session, Error>> + Send {
        Session::start(Arc::new(self.clone()), options)
    }
}
