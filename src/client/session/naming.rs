//! Names, namespaces and owner identities: what keys a session writes.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::client::error::Error;

pub use crate::client::limits::MAX_NAME_BYTES;

/// The longest lease TTL: etcd's own maximum (`MaxLeaseTTL`, 9 000 000 000 s).
pub const MAX_TTL: Duration = Duration::from_secs(9_000_000_000);

/// The path segments under a namespace that hold primitives. A namespace containing one of
/// them as a segment could nest inside another namespace's primitive (`/ns` and
/// `/ns/lock/a/q`), and its keys would then be read as that primitive's queue entries.
const KINDS: [&str; 4] = ["lock", "rwlock", "election", "semaphore"];

/// Checks a primitive name: non-empty and at most [`MAX_NAME_BYTES`].
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(Error::InvalidName(shorten(name)));
    }
    Ok(())
}

/// Checks a namespace: no segment may be a primitive kind (see [`KINDS`]).
pub(crate) fn check_namespace(namespace: &str) -> Result<(), Error> {
    if namespace.len() > MAX_NAME_BYTES || namespace.split('/').any(|s| KINDS.contains(&s)) {
        return Err(Error::InvalidNamespace(shorten(namespace)));
    }
    Ok(())
}

/// Checks a TTL: 1 s ..= [`MAX_TTL`].
pub(crate) fn check_ttl(ttl: Duration) -> Result<u64, Error> {
    if ttl < Duration::from_secs(1) || ttl > MAX_TTL {
        return Err(Error::InvalidTtl(ttl));
    }
    // Whole seconds, rounded up: etcd's unit.
    Ok(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
}

/// A name as error messages show it: at most 64 bytes of it, and its length.
pub(crate) fn shorten(name: &str) -> String {
    const SHOWN: usize = 64;
    if name.len() <= SHOWN {
        return name.to_owned();
    }
    let mut end = SHOWN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &name[..end], name.len())
}

/// The key of one primitive: `namespace/kind/escaped-name`.
pub(crate) fn path(namespace: &str, kind: &str, name: &str) -> Result<String, Error> {
    check_name(name)?;
    // '/' and '%' are escaped so that no name's keys fall under another name's prefix.
    const ESCAPE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'/').add(b'%');
    let encoded = percent_encoding::utf8_percent_encode(name, ESCAPE);
    Ok(format!("{namespace}/{kind}/{encoded}"))
}

/// The primitives whose epoch key a resource can follow as its mark (the proxy's `lock`,
/// `rwlock` and `election` route keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochOf {
    /// A lock ([`crate::client::lock`]).
    Lock,
    /// A read/write lock ([`crate::client::rwlock`]): writers and read phases bump one epoch.
    RwLock,
    /// An election ([`crate::client::election`]).
    Election,
    /// A semaphore ([`crate::client::semaphore`]): one epoch per slot (see [`slot_epoch_key`]).
    Semaphore,
}

impl EpochOf {
    /// The kind's path segment.
    pub const fn as_str(self) -> &'static str {
        match self {
            EpochOf::Lock => "lock",
            EpochOf::RwLock => "rwlock",
            EpochOf::Election => "election",
            EpochOf::Semaphore => "semaphore",
        }
    }
}

/// The epoch key of primitive `name` of `kind` in `namespace`, whose mod revision is the
/// current owner's token (`docs/design.md#key-layout`): the one definition of the key layout,
/// used by the primitives themselves and by resources that follow them (the proxy's `lock`
/// routes).
///
/// # Errors
/// [`Error::InvalidName`] or [`Error::InvalidNamespace`], as a session would refuse them.
pub fn epoch_key(namespace: &str, kind: EpochOf, name: &str) -> Result<String, Error> {
    check_namespace(namespace)?;
    Ok(epoch_of(&path(namespace, kind.as_str(), name)?))
}

/// The epoch key of slot `slot` of semaphore `name` in `namespace`, whose mod revision is the
/// token of the slot's current holder (its resource is `name/slot`, as
/// [`crate::client::semaphore::Permit::resource`] names it).
///
/// # Errors
/// As [`epoch_key`].
pub fn slot_epoch_key(namespace: &str, name: &str, slot: u32) -> Result<String, Error> {
    Ok(format!(
        "{}/{slot}",
        epoch_key(namespace, EpochOf::Semaphore, name)?
    ))
}

/// The epoch key of the primitive whose keys start with `path`.
pub(crate) fn epoch_of(path: &str) -> String {
    format!("{path}/epoch")
}

/// A fresh owner identity for a session: random (std's per-process random hash keys), mixed
/// with a counter, the process id and the time, so that two sessions on one lease (a restarted
/// instance beside its predecessor) never share one.
pub(crate) fn new_owner() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    // Relaxed: only uniqueness of the value matters, no other memory is published by it.
    h.write_u64(NEXT.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}

/// The last segment of a queue key: `<owner:016x>-<lease:016x>`.
pub(crate) fn entry_suffix(owner: u64, lease: i64) -> String {
    format!("{owner:016x}-{lease:016x}")
}

/// The owner id in a queue key written by [`entry_suffix`]; 0 when the key has another form.
pub(crate) fn owner_of(key: &str) -> u64 {
    let last = key.rsplit('/').next().unwrap_or("");
    last.split_once('-')
        .and_then(|(owner, _)| u64::from_str_radix(owner, 16).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_namespaces_and_ttls_are_checked() {
        assert!(check_name("a").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME_BYTES + 1)).is_err());
        assert!(check_namespace("/apps/orders").is_ok());
        assert!(check_namespace("/ns/lock/a/q").is_err());
        assert!(check_ttl(Duration::MAX).is_err());
        assert_eq!(check_ttl(Duration::from_millis(1500)).unwrap(), 2);
        let long = "é".repeat(1000);
        let shown = shorten(&long);
        assert!(
            shown.len() < 100 && shown.ends_with("(2000 bytes)"),
            "{shown}"
        );
        assert_eq!(owner_of(&format!("/p/q/w/{}", entry_suffix(0xab, 7))), 0xab);
        assert_ne!(new_owner(), new_owner());
    }
}
