//! Marks in etcd, shared by every proxy replica in front of the same service
//! (`docs/design.md#durability`).
//!
//! Key `<prefix><resource>`, value the mark as 8 bytes big-endian, so that etcd's bytewise
//! value compare orders marks numerically. An advance is one transaction:
//!
//! ```text
//! If(CreateRevision(key) == 0) Then Put(key, t)            -- first mark of the resource
//! Else Txn( If(Value(key) < t) Then Put(key, t) Else Get(key) )
//! ```
//!
//! (a value compare on a missing key fails, hence the outer branch). A lost race returns the
//! winner's mark, which admission judges the request against again: a mark never goes down,
//! whatever order replicas write in.
//!
//! Every request is bounded by `request_timeout_ms` (etcd-client has no default timeout); a
//! store that cannot answer fails closed (503). Within that bound an `Unavailable` answer is
//! retried: etcd-client's balanced channel keeps picking a member that is down (its requests
//! fail at once with "tcp connect error") and a leader election fails requests in flight, so
//! without retries a cluster that lost one member of three would fail a share of requests for
//! as long as the member stays down. Every operation here may be retried: reads, and the
//! advance transaction, whose second attempt finds its own write and reports it.
//!
//! A confirmation of a resource fed by a lock (a route's `lock`) also reads the lock's epoch
//! key, in one transaction with the mark: its mod revision is the current owner's token.
//! (Two reads sent at once instead measured 0.74x of a plain confirmation against the
//! transaction's 0.88x, `benches/replicas.sh`.)
//!
//! [`EtcdStore::subscribe`] runs a watch on the prefix that resumes from the last revision it
//! saw after a disconnect, and reloads every mark when that revision was compacted away.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, Txn, TxnOp, TxnOpResponse,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::settings::EtcdSettings;
use super::{BoxFuture, Confirmed, Consistency, Epoch, MarkStore, Marks, StoreError};

mod repair;
mod watch;

pub use repair::Found;

/// The etcd mark store.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    prefix: String,
    timeout: Duration,
    consistency: Consistency,
    /// The revision of the last `load`, where the watch starts.
    loaded_at: std::sync::atomic::AtomicI64,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.inner.prefix)
            .field("consistency", &self.inner.consistency)
            .finish_non_exhaustive()
    }
}

fn etcd_err(what: &str) -> impl FnOnce(etcd_client::Error) -> StoreError + '_ {
    move |e| StoreError::Etcd(format!("{what}: {e}"))
}

impl EtcdStore {
    /// Connects to the endpoints of `settings` (at most `dial_timeout` for the first
    /// connection). The password, when configured, is read here and never logged.
    ///
    /// # Errors
    /// [`StoreError::Etcd`] when no endpoint can be reached or the TLS files are unusable.
    pub async fn connect(settings: &EtcdSettings) -> Result<Self, StoreError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(settings.dial_timeout)
            .with_timeout(settings.request_timeout)
            .with_keep_alive(Duration::from_secs(10), settings.request_timeout);
        if let Some(user) = &settings.username {
            let password = settings.password()?;
            options = options.with_user(user.clone(), password);
        }
        options = tls(settings, options)?;
        let connect = Client::connect(settings.endpoints.clone(), Some(options));
        let client = match tokio::time::timeout(settings.dial_timeout, connect).await {
            Ok(r) => r.map_err(etcd_err("connect"))?,
            Err(_) => {
                return Err(StoreError::Etcd(format!(
                    "connect: no endpoint answered within {:?}",
                    settings.dial_timeout
                )))
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                prefix: settings.prefix.clone(),
                timeout: settings.request_timeout,
                consistency: settings.consistency,
                loaded_at: std::sync::atomic::AtomicI64::new(0),
            }),
        })
    }

    fn key(&self, resource: &str) -> Vec<u8> {
        format!("{}{resource}", self.inner.prefix).into_bytes()
    }

    /// Runs `op` to completion within `request_timeout` in all, retrying an `Unavailable`
    /// answer (a member that is down, a leader change) while time is left.
    async fn bounded<T, F, Fut>(&self, what: &'static str, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.inner.timeout;
        let mut pause = Duration::ZERO;
        loop {
            match tokio::time::timeout_at(deadline, op()).await {
                Err(_) => return Err(StoreError::Timeout(self.inner.timeout)),
                Ok(Err(e)) if unavailable(&e) && Instant::now() + pause < deadline => {
                    tracing::debug!(error = %e, what, "etcd unavailable; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).clamp(Duration::from_millis(5), Duration::from_millis(100));
                }
                Ok(r) => return r.map_err(etcd_err(what)),
            }
        }
    }

    /// Every mark under the prefix and the revision they were read at.
    async fn load_all(&self) -> Result<(Marks, i64), StoreError> {
        let prefix = self.inner.prefix.clone();
        let resp = self
            .bounded("load", || {
                let mut kv = self.inner.client.kv_client();
                let prefix = prefix.clone();
                async move { kv.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let mut marks = Marks::new();
        for kv in resp.kvs() {
            let name = String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned();
            marks.insert(name, decode(kv.key(), kv.value())?);
        }
        let rev = resp.header().map_or(0, |h| h.revision());
        Ok((marks, rev))
    }
}

#[cfg(feature = "etcd-tls")]
fn tls(settings: &EtcdSettings, options: ConnectOptions) -> Result<ConnectOptions, StoreError> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let Some(t) = &settings.tls else {
        return Ok(options);
    };
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| StoreError::Etcd(format!("{}: {e}", p.display())))
    };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &t.ca {
        tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
    }
    if let Some((cert, key)) = &t.identity {
        tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    Ok(options.with_tls(tls))
}

#[cfg(not(feature = "etcd-tls"))]
fn tls(settings: &EtcdSettings, options: ConnectOptions) -> Result<ConnectOptions, StoreError> {
    match settings.tls {
        None => Ok(options),
        Some(_) => Err(StoreError::Etcd(
            "TLS to etcd needs palisade built with the `etcd-tls` feature".to_owned(),
        )),
    }
}

/// Whether `e` says the request did not get an answer from a healthy member (worth another
/// member, or another try after an election): `Unavailable`, a transport error, or an
/// `Unknown` status whose cause is the connection itself (a member killed mid-request resets
/// it: tonic reports `Unknown` with the reset as its source). Every store request may be
/// sent again: reads, and writes that only raise a mark.
fn unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => match s.code() {
            tonic::Code::Unavailable => true,
            tonic::Code::Unknown => connection_failed(s),
            _ => false,
        },
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Whether a status's causes include the connection failing (reset, aborted, broken pipe,
/// closed) rather than an answer from etcd.
fn connection_failed(s: &tonic::Status) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
            ) {
                return true;
            }
        }
        cur = c.source();
    }
    // Some versions give the cause only as text.
    let m = s.message().to_ascii_lowercase();
    [
        "connection reset",
        "connectionreset",
        "broken pipe",
        "connection aborted",
    ]
    .iter()
    .any(|w| m.contains(w))
}

/// A stored mark: exactly 8 bytes, big-endian.
fn decode(key: &[u8], value: &[u8]) -> Result<u64, StoreError> {
    <[u8; 8]>::try_from(value)
        .map(u64::from_be_bytes)
        .map_err(|_| {
            StoreError::Etcd(format!(
                "key {} holds {} bytes, not an 8-byte big-endian mark; refusing to guess",
                String::from_utf8_lossy(key),
                value.len()
            ))
        })
}

impl MarkStore for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn request_timeout(&self) -> Option<Duration> {
        Some(self.inner.timeout)
    }

    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
        Box::pin(async move {
            let (marks, rev) = self.load_all().await?;
            self.inner
                .loaded_at
                .store(rev, std::sync::atomic::Ordering::Relaxed);
            Ok(marks)
        })
    }

    fn load_named<'a>(&'a self, names: &'a [String]) -> BoxFuture<'a, Result<Marks, StoreError>> {
        Box::pin(async move {
            let mut marks = Marks::new();
            let mut first_rev = None;
            // etcd refuses transactions of more than 128 operations by default.
            for chunk in names.chunks(64) {
                let txn = Txn::new().and_then(
                    chunk
                        .iter()
                        .map(|n| TxnOp::get(self.key(n), None))
                        .collect::<Vec<_>>(),
                );
                let resp = self
                    .bounded("load", || {
                        let mut kv = self.inner.client.kv_client();
                        let txn = txn.clone();
                        async move { kv.txn(txn).await }
                    })
                    .await?;
                first_rev.get_or_insert(resp.header().map_or(0, |h| h.revision()));
                for (name, r) in chunk.iter().zip(resp.op_responses()) {
                    if let TxnOpResponse::Get(g) = r {
                        if let Some(kv) = g.kvs().first() {
                            marks.insert(name.clone(), decode(kv.key(), kv.value())?);
                        }
                    }
                }
            }
            if first_rev.is_none() {
                // No names: the watch still needs a revision to start from.
                let resp = self
                    .bounded("load", || {
                        let mut kv = self.inner.client.kv_client();
                        let key = self.inner.prefix.clone();
                        async move { kv.get(key, Some(GetOptions::new().with_count_only())).await }
                    })
                    .await?;
                first_rev = Some(resp.header().map_or(0, |h| h.revision()));
            }
            self.inner
                .loaded_at
                .store(first_rev.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
            Ok(marks)
        })
    }

    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let key = self.key(resource);
            let value = mark.to_be_bytes().to_vec();
            let raise = Txn::new()
                .when([Compare::value(key.clone(), CompareOp::Less, value.clone())])
                .and_then([TxnOp::put(key.clone(), value.clone(), None)])
                .or_else([TxnOp::get(key.clone(), None)]);
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.clone(), value, None)])
                .or_else([TxnOp::txn(raise)]);
            let resp = self
                .bounded("advance", || {
                    let mut kv = self.inner.client.kv_client();
                    let txn = txn.clone();
                    async move { kv.txn(txn).await }
                })
                .await?;
            if resp.succeeded() {
                return Ok(mark);
            }
            let inner = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Txn(t) => Some(t),
                _ => None,
            });
            let Some(inner) = inner else {
                return Err(StoreError::Etcd("advance: no nested response".to_owned()));
            };
            if inner.succeeded() {
                return Ok(mark);
            }
            for r in inner.op_responses() {
                if let TxnOpResponse::Get(g) = r {
                    if let Some(kv) = g.kvs().first() {
                        // `Value < mark` failed: the stored mark is at least `mark`.
                        return Ok(decode(kv.key(), kv.value())?.max(mark));
                    }
                }
            }
            Err(StoreError::Etcd(
                "advance: the key vanished during the transaction".to_owned(),
            ))
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // A linearizable read goes through the cluster's leader and a quorum: the same
            // path an advance needs.
            let key = self.inner.prefix.clone();
            self.bounded("ready", || {
                let mut kv = self.inner.client.kv_client();
                let key = key.clone();
                let options = GetOptions::new().with_prefix().with_count_only();
                async move { kv.get(key, Some(options)).await }
            })
            .await
            .map(|_| ())
        })
    }

    fn consistency(&self) -> Consistency {
        self.inner.consistency
    }

    fn count<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let from = format!("{}{prefix}", self.inner.prefix);
            let resp = self
                .bounded("count", || {
                    let mut kv = self.inner.client.kv_client();
                    let from = from.clone();
                    let options = GetOptions::new().with_prefix().with_count_only();
                    async move { kv.get(from, Some(options)).await }
                })
                .await?;
            Ok(u64::try_from(resp.count()).unwrap_or(0))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Marks, StoreError>> {
        Box::pin(async move {
            // One range read of at most `limit` keys: never the whole prefix.
            let from = format!("{}{prefix}", self.inner.prefix);
            let resp = self
                .bounded("list", || {
                    let mut kv = self.inner.client.kv_client();
                    let from = from.clone();
                    let options = GetOptions::new()
                        .with_prefix()
                        .with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
                    async move { kv.get(from, Some(options)).await }
                })
                .await?;
            let mut marks = Marks::new();
            for kv in resp.kvs() {
                let name =
                    String::from_utf8_lossy(&kv.key()[self.inner.prefix.len()..]).into_owned();
                marks.insert(name, decode(kv.key(), kv.value())?);
            }
            Ok(marks)
        })
    }

    fn confirm<'a>(
        &'a self,
        resource: &'a str,
        epoch: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Confirmed, StoreError>> {
        Box::pin(async move {
            let key = self.key(resource);
            let Some(epoch) = epoch else {
                let resp = self
                    .bounded("confirm", || {
                        let mut kv = self.inner.client.kv_client();
                        let key = key.clone();
                        async move { kv.get(key, None).await }
                    })
                    .await?;
                let mark = match resp.kvs().first() {
                    Some(kv) => decode(kv.key(), kv.value())?,
                    None => 0,
                };
                return Ok(Confirmed { mark, epoch: None });
            };
            // One transaction: the mark and the epoch at one revision.
            let resp = self
                .bounded("confirm", || {
                    let mut kv = self.inner.client.kv_client();
                    let txn = Txn::new()
                        .and_then(vec![TxnOp::get(key.clone(), None), TxnOp::get(epoch, None)]);
                    async move { kv.txn(txn).await }
                })
                .await?;
            let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            });
            let (Some(marked), Some(fed)) = (gets.next(), gets.next()) else {
                return Err(StoreError::Etcd(
                    "confirm: the transaction did not answer both reads".to_owned(),
                ));
            };
            let mark = match marked.kvs().first() {
                Some(kv) => decode(kv.key(), kv.value())?,
                None => 0,
            };
            let epoch = match fed.kvs().first() {
                Some(kv) => Epoch::At(u64::try_from(kv.mod_revision()).unwrap_or(0)),
                None => Epoch::Missing,
            };
            Ok(Confirmed {
                mark,
                epoch: Some(epoch),
            })
        })
    }

    fn watch_keys(&self, prefix: &str) -> Option<mpsc::UnboundedReceiver<(String, u64)>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let store = self.clone();
        let prefix = prefix.to_owned();
        tokio::spawn(async move { store.watch_keys_loop(prefix, tx).await });
        Some(rx)
    }

    fn subscribe(&self) -> Option<mpsc::UnboundedReceiver<(String, u64)>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let store = self.clone();
        let from = self
            .inner
            .loaded_at
            .load(std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(async move { store.watch_loop(from, tx).await });
        Some(rx)
    }
}

#[cfg(test)]
mod classify {
    use super::unavailable;

    /// A member killed mid-request: tonic's `Unknown` with the reset as its cause is retried,
    /// as `Unavailable` is; an answer from etcd is not.
    #[test]
    fn a_reset_connection_is_retried_an_answer_is_not() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let status = tonic::Status::from_error(Box::new(reset));
        assert_eq!(status.code(), tonic::Code::Unknown);
        assert!(unavailable(&etcd_client::Error::GRpcStatus(status)));
        let text =
            tonic::Status::unknown("transport error: Connection reset by peer (os error 104)");
        assert!(unavailable(&etcd_client::Error::GRpcStatus(text)));
        assert!(unavailable(&etcd_client::Error::GRpcStatus(
            tonic::Status::unavailable("x")
        )));
        for answer in [
            tonic::Status::unknown("etcdserver: mvcc: required revision has been compacted"),
            tonic::Status::invalid_argument("etcdserver: key is not provided"),
            tonic::Status::permission_denied("etcdserver: permission denied"),
        ] {
            assert!(!unavailable(&etcd_client::Error::GRpcStatus(answer)));
        }
    }
}
