//! Header fields as the pipeline's rules read and edit them, whatever holds them: hyper's
//! `HeaderMap` on hyper's path, or the fast path's list of byte ranges in the client's (or the
//! upstream's) own buffer.
//!
//! Why: the checks ([`super::Proxy::admit`]) and the head rewriting ([`super::rewrite`]) are
//! written once, against these traits, so that both data paths judge and forward a request by
//! the same code, while the fast path builds no map, name or value per request.
//!
//! The operations mean exactly what `HeaderMap`'s do, including where a field ends up in the
//! written head: fields of one name are kept together in the order of the name's first field,
//! `insert` on a present name replaces all its values in place, a new name goes last, and
//! `remove` moves the last name into the removed one's place (`HeaderMap` removes by swap).
//! The fast path's writer relies on this to send the upstream the same bytes hyper's would.

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::token::{FencingToken, TokenError};

/// Read access to a head's fields. Names are compared ASCII case-insensitively (`HeaderMap`'s
/// are lower case already; the fast path's are as the peer sent them).
pub(super) trait Fields {
    /// The values of the fields named `name`, in order.
    fn values<'s>(&'s self, name: &HeaderName) -> impl Iterator<Item = &'s [u8]> + use<'s, Self>;

    /// Each distinct name once, in the head's order (any letter case).
    fn names(&self) -> impl Iterator<Item = &[u8]>;

    /// The first value of `name`.
    fn first<'s>(&'s self, name: &HeaderName) -> Option<&'s [u8]> {
        self.values(name).next()
    }

    /// Whether a field named `name` is present.
    fn contains(&self, name: &HeaderName) -> bool {
        self.first(name).is_some()
    }

    /// The fencing token in the fields named `name` (one rule: [`crate::token::from_values`]).
    fn token(&self, name: &HeaderName) -> Result<Option<FencingToken>, TokenError> {
        crate::token::from_values(self.values(name))
    }
}

/// A value put into a head by a rewriting rule.
#[derive(Debug, Clone, Copy)]
pub(super) enum NewValue<'v> {
    /// A constant (`close`, `trailers`, `http`).
    Static(&'static str),
    /// Computed for this request (an address list, a host).
    Bytes(&'v [u8]),
}

/// Edits to a head's fields, with `HeaderMap`'s semantics (see the module docs).
pub(super) trait FieldsMut: Fields {
    /// Removes every field named `name`.
    fn remove(&mut self, name: &HeaderName);

    /// Replaces every field named `name` by one with `value` (at the first one's place), or
    /// adds it last. A value that is not a valid field value is not inserted.
    fn insert(&mut self, name: &HeaderName, value: NewValue<'_>);
}

impl Fields for HeaderMap {
    fn values<'s>(&'s self, name: &HeaderName) -> impl Iterator<Item = &'s [u8]> + use<'s> {
        self.get_all(name).into_iter().map(HeaderValue::as_bytes)
    }

    fn names(&self) -> impl Iterator<Item = &[u8]> {
        self.keys().map(|n| n.as_str().as_bytes())
    }

    fn first<'s>(&'s self, name: &HeaderName) -> Option<&'s [u8]> {
        self.get(name).map(HeaderValue::as_bytes)
    }

    fn contains(&self, name: &HeaderName) -> bool {
        self.contains_key(name)
    }

    fn token(&self, name: &HeaderName) -> Result<Option<FencingToken>, TokenError> {
        crate::token::from_headers(self, name)
    }
}

impl FieldsMut for HeaderMap {
    fn remove(&mut self, name: &HeaderName) {
        HeaderMap::remove(self, name);
    }

    fn insert(&mut self, name: &HeaderName, value: NewValue<'_>) {
        let value = match value {
            NewValue::Static(s) => HeaderValue::from_static(s),
            NewValue::Bytes(b) => match HeaderValue::from_bytes(b) {
                Ok(v) => v,
                Err(_) => return,
            },
        };
        HeaderMap::insert(self, name.clone(), value);
    }
}

/// Whether `value` reads as a string to `HeaderValue::to_str`: visible ASCII, space and tab.
pub(super) fn is_text(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| (b' '..0x7f).contains(&b) || b == b'\t')
}

/// Whether the field name `a` (any case) is `name`.
pub(super) fn same_name(a: &[u8], name: &HeaderName) -> bool {
    a.eq_ignore_ascii_case(name.as_str().as_bytes())
}
