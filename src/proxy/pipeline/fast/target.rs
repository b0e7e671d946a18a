//! The request target of a fast-path request, read as `http::Uri` reads an origin-form target,
//! without building one.
//!
//! Why: a `Uri` copies the target into a new buffer on every request. The fast path must still
//! accept exactly the targets hyper's path accepts (hyper parses them with `http::Uri`; the
//! others go to hyper, which refuses them) and see the same path and query (a `#fragment` is
//! dropped). The byte classes below are `http`'s (1.x, `uri/path.rs`); the tests check every
//! byte against `http::Uri` itself.

/// hyper answers 414 above this URI length: such requests go to hyper.
pub(super) const MAX_URI_LEN: usize = (u16::MAX - 1) as usize;

/// An origin-form target's parts, as offsets into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Target {
    /// End of the path (where `?` or the end is).
    pub(super) path_end: usize,
    /// End of the path and query: a fragment starts here, and is not part of the request.
    pub(super) end: usize,
}

/// Reads `t`, which starts with `/` and is valid UTF-8 (httparse checked), as `http::Uri`
/// does; `None` where `Uri` refuses it.
pub(super) fn parse(t: &str) -> Option<Target> {
    let b = t.as_bytes();
    if b.is_empty() || b.len() > MAX_URI_LEN {
        return None;
    }
    let mut i = 0;
    let mut path_end = b.len();
    let mut end = b.len();
    while i < b.len() {
        match b[i] {
            b'?' => {
                path_end = i;
                break;
            }
            b'#' => {
                path_end = i;
                return Some(Target { path_end, end: i });
            }
            c if path_byte(c) => {}
            _ => return None,
        }
        i += 1;
    }
    if path_end < b.len() {
        i += 1;
        while i < b.len() {
            match b[i] {
                b'#' => {
                    end = i;
                    break;
                }
                c if query_byte(c) => {}
                _ => return None,
            }
            i += 1;
        }
    }
    Some(Target { path_end, end })
}

/// Bytes `http` takes as they are in a path (0x80 and above: UTF-8, already checked).
fn path_byte(c: u8) -> bool {
    matches!(c, 0x21 | 0x24..=0x3B | 0x3D | 0x40..=0x5F | 0x61..=0x7A | 0x7C | 0x7E)
        || matches!(c, b'"' | b'{' | b'}')
        || c >= 0x80
}

/// Bytes `http` takes as they are in a query.
fn query_byte(c: u8) -> bool {
    matches!(c, 0x21 | 0x24..=0x3B | 0x3D | 0x3F..=0x7E) || c >= 0x80
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `http::Uri` makes of `t`: its path and its path-and-query.
    fn by_http(t: &str) -> Option<(String, String)> {
        let u = http::Uri::try_from(t).ok()?;
        let pq = u.path_and_query()?.as_str().to_owned();
        Some((u.path().to_owned(), pq))
    }

    fn by_us(t: &str) -> Option<(String, String)> {
        let p = parse(t)?;
        Some((t[..p.path_end].to_owned(), t[..p.end].to_owned()))
    }

    #[test]
    fn every_byte_is_read_as_http_reads_it() {
        for c in 0u8..0x80 {
            let ch = char::from(c);
            for t in [
                format!("/a{ch}b"),
                format!("/a?q{ch}r"),
                format!("/{ch}"),
                format!("/a?{ch}"),
                format!("/a#x{ch}"),
                format!("/a?b#{ch}"),
            ] {
                assert_eq!(by_us(&t), by_http(&t), "{t:?}");
            }
        }
        for t in [
            "/",
            "/a/b?c=d&e",
            "/a#f",
            "/a?#",
            "/?",
            "/a?b?c",
            "/é?ü",
            "/a%20b",
            "/a?b#c?d",
        ] {
            assert_eq!(by_us(t), by_http(t), "{t:?}");
        }
    }
}
