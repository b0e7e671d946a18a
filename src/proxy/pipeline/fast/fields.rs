//! A head's fields as byte ranges of the buffer they were read into: what the fast path gives
//! the checks and the rewriting rules ([`Fields`], [`FieldsMut`]) instead of a `HeaderMap`.
//!
//! Why: a `HeaderMap` costs a map, a name and a value (each an allocation and a copy) per
//! field per request, for heads that are read once, edited in two or three places and written
//! out again. Here the fields stay where httparse found them; the store's vectors are kept for
//! the connection's life, so a request allocates nothing. The edits behave as `HeaderMap`'s,
//! field order included (see [`super::shared::Fields`]), so that [`FieldList::write`] writes
//! what hyper's path would.

use http::header::HeaderName;

use super::shared::{same_name, Fields, FieldsMut, NewValue};

/// Where a name's or a value's bytes are: `at` and `len` in the head's own bytes, or, with
/// [`EXTRA`] set in `at`, in the store's `extra` bytes (what the rewriting added). Plain
/// numbers, so that clearing the store touches none of its old entries: at 256 connections
/// each connection's store is cold in the cache when its next request comes.
#[derive(Debug, Clone, Copy)]
struct Span {
    at: u32,
    len: u32,
}

/// The bit of [`Span::at`] that says the bytes are in `extra`.
const EXTRA: u32 = 1 << 31;

/// One field as it came: its name's group and its value.
#[derive(Debug)]
struct Field {
    group: u16,
    value: Span,
}

/// The fields of one name (a `HeaderMap` entry).
#[derive(Debug)]
struct Group {
    /// [`key`] of the name: most lookups are for names a head does not have, and are told
    /// apart by this alone.
    key: u32,
    name: Span,
    /// Set by `insert`: the one value that replaced all of this name's fields.
    replaced: Option<Span>,
}

/// The vectors a [`FieldList`] uses, kept by the connection between its requests.
#[derive(Debug, Default)]
pub(super) struct FieldStore {
    fields: Vec<Field>,
    groups: Vec<Group>,
    /// The live groups in written order (removal swaps the last into the removed's place).
    order: Vec<u16>,
    extra: Vec<u8>,
}

impl FieldStore {
    /// Starts over with the fields of a head parsed from `src` (httparse's slices of it).
    pub(super) fn fill(&mut self, src: &[u8], headers: &[httparse::Header<'_>]) {
        self.fields.clear();
        self.groups.clear();
        self.order.clear();
        self.extra.clear();
        for h in headers {
            let name = h.name.as_bytes();
            let k = key(name);
            let group = match self.order.iter().copied().find(|g| {
                let group = &self.groups[usize::from(*g)];
                let Span { at, len } = group.name;
                group.key == k && src[at as usize..(at + len) as usize].eq_ignore_ascii_case(name)
            }) {
                Some(g) => g,
                None => {
                    // At most `MAX_HEADERS` (100) fields: the index fits.
                    let g = self.groups.len() as u16;
                    self.groups.push(Group {
                        key: k,
                        name: src_span(src, name),
                        replaced: None,
                    });
                    self.order.push(g);
                    g
                }
            };
            self.fields.push(Field {
                group,
                value: src_span(src, h.value),
            });
        }
    }

    /// The fields, read from `src` (the bytes [`FieldStore::fill`] was given).
    pub(super) fn list<'a>(&'a mut self, src: &'a [u8]) -> FieldList<'a> {
        FieldList { src, store: self }
    }
}

/// A name's length and its first and last bytes in lower case: equal for equal names (any
/// case). Names are shorter than 64 KiB (`HeaderName`'s limit, checked when parsed).
fn key(name: &[u8]) -> u32 {
    let (first, last) = match name {
        [] => (0, 0),
        [f, .., l] => (*f, *l),
        [f] => (*f, *f),
    };
    (name.len() as u32) << 16
        | u32::from(first.to_ascii_lowercase()) << 8
        | u32::from(last.to_ascii_lowercase())
}

/// Where `part`, a slice of `src`, lies in it.
fn src_span(src: &[u8], part: &[u8]) -> Span {
    let at = (part.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize);
    debug_assert!(at + part.len() <= src.len());
    // A head is at most `max_header_bytes` (far below 2 GiB).
    Span {
        at: at as u32,
        len: part.len() as u32,
    }
}

/// A head's fields over the bytes they were read from.
pub(super) struct FieldList<'a> {
    src: &'a [u8],
    store: &'a mut FieldStore,
}

impl FieldList<'_> {
    fn bytes(&self, span: Span) -> &[u8] {
        let (at, len) = ((span.at & !EXTRA) as usize, span.len as usize);
        if span.at & EXTRA == 0 {
            &self.src[at..at + len]
        } else {
            &self.store.extra[at..at + len]
        }
    }

    /// Keeps `b` in the store's own bytes.
    fn keep(&mut self, b: &[u8]) -> Span {
        let at = self.store.extra.len() as u32 | EXTRA;
        self.store.extra.extend_from_slice(b);
        Span {
            at,
            len: b.len() as u32,
        }
    }

    /// The position in `order` of the live group named `name`.
    fn find(&self, name: &HeaderName) -> Option<usize> {
        let k = key(name.as_str().as_bytes());
        self.store.order.iter().position(|g| {
            let group = &self.store.groups[usize::from(*g)];
            group.key == k && same_name(self.bytes(group.name), name)
        })
    }

    /// Writes each field as `name: value` with the name in lower case (as hyper writes a
    /// `HeaderName`), in `HeaderMap` order.
    pub(super) fn write(&self, out: &mut Vec<u8>) {
        for &g in &self.store.order {
            let group = &self.store.groups[usize::from(g)];
            let name = self.bytes(group.name);
            let mut line = |value: &[u8]| {
                out.extend(name.iter().map(u8::to_ascii_lowercase));
                out.extend_from_slice(b": ");
                out.extend_from_slice(value);
                out.extend_from_slice(b"\r\n");
            };
            match group.replaced {
                Some(v) => line(self.bytes(v)),
                None => {
                    for f in self.store.fields.iter().filter(|f| f.group == g) {
                        line(self.bytes(f.value));
                    }
                }
            }
        }
    }
}

impl<'a> Fields for FieldList<'a> {
    fn values<'s>(&'s self, name: &HeaderName) -> impl Iterator<Item = &'s [u8]> + use<'s, 'a> {
        let (replaced, group) = match self.find(name) {
            None => (None, None),
            Some(i) => {
                let g = self.store.order[i];
                match self.store.groups[usize::from(g)].replaced {
                    Some(v) => (Some(self.bytes(v)), None),
                    None => (None, Some(g)),
                }
            }
        };
        let fields = if group.is_some() {
            &self.store.fields[..]
        } else {
            &[]
        };
        replaced.into_iter().chain(
            fields
                .iter()
                .filter(move |f| Some(f.group) == group)
                .map(|f| self.bytes(f.value)),
        )
    }

    fn names(&self) -> impl Iterator<Item = &[u8]> {
        self.store
            .order
            .iter()
            .map(|g| self.bytes(self.store.groups[usize::from(*g)].name))
    }
}

impl FieldsMut for FieldList<'_> {
    fn remove(&mut self, name: &HeaderName) {
        if let Some(i) = self.find(name) {
            self.store.order.swap_remove(i);
        }
    }

    fn insert(&mut self, name: &HeaderName, value: NewValue<'_>) {
        let value = match value {
            NewValue::Static(s) => s.as_bytes(),
            // As `HeaderValue::from_bytes`: no control bytes but tab, no DEL.
            NewValue::Bytes(b) if b.iter().all(|&c| (c >= b' ' && c != 0x7f) || c == b'\t') => b,
            NewValue::Bytes(_) => return,
        };
        let value = self.keep(value);
        match self.find(name) {
            Some(i) => {
                let g = usize::from(self.store.order[i]);
                self.store.groups[g].replaced = Some(value);
            }
            None => {
                let g = self.store.groups.len() as u16;
                let name_bytes = name.as_str().as_bytes();
                let k = key(name_bytes);
                let name = self.keep(name_bytes);
                self.store.groups.push(Group {
                    key: k,
                    name,
                    replaced: Some(value),
                });
                self.store.order.push(g);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http::header::{HeaderMap, HeaderValue};

    use super::super::shared::rewrite::strip_hop_by_hop;
    use super::*;

    /// Each field as `name: value` in `HeaderMap` order, as the fast path wrote heads before
    /// it had its own list.
    fn by_map(h: &HeaderMap) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in h {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    /// Response heads relayed to the client: the same bytes as through a `HeaderMap`.
    #[test]
    fn a_response_head_is_edited_and_written_as_through_a_header_map() {
        let token = HeaderName::from_static("x-fencing-token");
        let heads = [
            "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: x\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\n",
            "HTTP/1.1 204 No Content\r\nSet-Cookie: a=1\r\nX: 1\r\nset-cookie: b=2\r\nContent-Length: 0\r\nKeep-Alive: timeout=5\r\n\r\n",
            "HTTP/1.1 200 OK\r\nConnection: x-drop, close\r\nX-Drop: 1\r\nTE: trailers;q=1\r\nUpgrade: h2c\r\nx-a: 1\r\nProxy-Authenticate: y\r\nx-b: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\nte: deflate\r\nx-fencing-token: 4\r\nconnection: x-fencing-token\r\nTransfer-Encoding: chunked\r\n\r\n",
        ];
        for raw in heads {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            let len = match resp.parse(raw.as_bytes()).unwrap() {
                httparse::Status::Complete(n) => n,
                httparse::Status::Partial => panic!("{raw:?}"),
            };
            let no_content = resp.code == Some(204);
            let mut map = HeaderMap::new();
            for h in resp.headers.iter() {
                map.append(
                    HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(h.value).unwrap(),
                );
            }
            strip_hop_by_hop(&mut map, &token);
            let mut store = FieldStore::default();
            store.fill(&raw.as_bytes()[..len], resp.headers);
            let mut list = store.list(&raw.as_bytes()[..len]);
            strip_hop_by_hop(&mut list, &token);
            if no_content {
                map.remove(http::header::CONTENT_LENGTH);
                FieldsMut::remove(&mut list, &http::header::CONTENT_LENGTH);
            }
            let mut got = Vec::new();
            list.write(&mut got);
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(&by_map(&map)),
                "{raw:?}"
            );
            assert_eq!(
                list.contains(&http::header::DATE),
                map.contains_key(http::header::DATE)
            );
        }
    }
}
