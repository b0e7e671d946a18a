//! The operator's repair of a mark in etcd (`palisade marks set`): an outright write, audited
//! in the same transaction.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::{decode, EtcdStore};
use crate::fence::marks::StoreError;

/// A mark as found before a repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The stored mark (0: no key).
    Mark(u64),
    /// A value that is not an 8-byte mark (e.g. written with `etcdctl put`, which drops NUL
    /// bytes); its length.
    Corrupt(usize),
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::Mark(m) => write!(f, "{m}"),
            Found::Corrupt(n) => write!(f, "corrupt ({n} bytes)"),
        }
    }
}

/// The key space of audit records.
const AUDIT_ROOT: &str = "/palisade-audit";

impl EtcdStore {
    /// Where audit records of repairs go: under `/palisade-audit`, followed by the marks
    /// prefix (`/palisade/marks/` -> `/palisade-audit/palisade/marks/`), so that they are
    /// never under this or another deployment's marks prefix, where they would be read as
    /// marks (`/palisade-audit` is reserved for this).
    pub fn audit_prefix(&self) -> String {
        let p = &self.inner.prefix;
        let sep = if p.starts_with('/') { "" } else { "/" };
        let end = if p.ends_with('/') { "" } else { "/" };
        format!("{AUDIT_ROOT}{sep}{p}{end}")
    }

    /// At most `limit` marks (0: all) of resources whose names start with `names`, with
    /// values that are not marks reported rather than refused (an operator listing the store
    /// is often repairing it).
    ///
    /// # Errors
    /// [`StoreError`] when etcd cannot be read within the request timeout.
    pub async fn list_for_repair(
        &self,
        names: &str,
        limit: usize,
    ) -> Result<Vec<(String, Found)>, StoreError> {
        let prefix = self.inner.prefix.clone();
        let from = format!("{prefix}{names}");
        let resp = self
            .bounded("list", || {
                let mut kv = self.inner.client.kv_client();
                let from = from.clone();
                let options = etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_limit(i64::try_from(limit).unwrap_or(0));
                async move { kv.get(from, Some(options)).await }
            })
            .await?;
        Ok(resp
            .kvs()
            .iter()
            .map(|kv| {
                let name = String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned();
                let found = decode(kv.key(), kv.value())
                    .map_or(Found::Corrupt(kv.value().len()), Found::Mark);
                (name, found)
            })
            .collect())
    }

    /// Sets `resource`'s mark to `value` outright (lower or higher; 0 deletes the key), and
    /// in the same transaction stores `audit(found)` under [`EtcdStore::audit_prefix`] at
    /// `audit_key`: the change happens with its record or not at all. Returns what was found.
    ///
    /// # Errors
    /// [`StoreError`] when etcd cannot be read or written, or the mark kept changing under
    /// the repair (a proxy advancing it: stop the replicas first).
    pub async fn overwrite_audited(
        &self,
        resource: &str,
        value: u64,
        audit_key: &str,
        audit: impl Fn(Found) -> String,
    ) -> Result<Found, StoreError> {
        let key = self.key(resource);
        let record = format!("{}{audit_key}", self.audit_prefix());
        if record.starts_with(self.inner.prefix.as_str()) {
            return Err(StoreError::Etcd(format!(
                "the marks prefix {:?} contains the audit key space {AUDIT_ROOT}: choose \
                 another [marks.etcd] prefix before repairing marks",
                self.inner.prefix
            )));
        }
        for _ in 0..5 {
            let current = self
                .bounded("repair read", || {
                    let mut kv = self.inner.client.kv_client();
                    let key = key.clone();
                    async move { kv.get(key, None).await }
                })
                .await?;
            let (found, unchanged) = match current.kvs().first() {
                Some(kv) => (
                    decode(kv.key(), kv.value())
                        .map_or(Found::Corrupt(kv.value().len()), Found::Mark),
                    Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision()),
                ),
                None => (
                    Found::Mark(0),
                    Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                ),
            };
            let write = if value == 0 {
                TxnOp::delete(key.clone(), None)
            } else {
                TxnOp::put(key.clone(), value.to_be_bytes().to_vec(), None)
            };
            let txn = Txn::new()
                .when([unchanged])
                .and_then([write, TxnOp::put(record.clone(), audit(found), None)]);
            let resp = self
                .bounded("repair", || {
                    let mut kv = self.inner.client.kv_client();
                    let txn = txn.clone();
                    async move { kv.txn(txn).await }
                })
                .await?;
            if resp.succeeded() {
                return Ok(found);
            }
        }
        Err(StoreError::Etcd(format!(
            "the mark of {resource} kept changing during the repair (a running proxy is \
             advancing it); stop the replicas first"
        )))
    }
}
