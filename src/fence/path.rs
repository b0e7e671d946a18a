//! Request paths in normal form, so a guarded route cannot be reached by another spelling.
//!
//! Palisade matches routes on the path it forwards, and it only forwards paths that every
//! reasonable upstream reads the same way. A path is accepted when it
//!
//! - starts with `/` and contains no empty segment (`//`, `/;x/`) except a trailing `/`;
//! - has no `.` or `..` segment, also not with `;parameters` after it (`/..;/admin`);
//! - contains only visible ASCII, and no `\`;
//! - uses `%XX` escapes only with two hex digits, and never for a character that has a plain
//!   spelling in a path segment (letters, digits, `-._~`, `!$&'()*+,=:@`), for `/`, `\`, `;`
//!   or `%` itself, or for a control byte;
//! - escapes bytes above 0x7F only as shortest-form UTF-8 (`%C3%A9`), never overlong forms
//!   (`%C0%AF` is an old spelling of `/`), surrogates or stray continuation bytes.
//!
//! With `require_nfkc_paths` the decoded path must also be unchanged by Unicode NFKC, for
//! upstreams that normalise (`/%EF%BD%8Frders`, a full-width `o`, reads as `/orders` there).
//!
//! Anything else is refused with 400 before routing. The one normalization applied is
//! upper-casing the hex digits of escapes (`%c3` -> `%C3`), used for matching and forwarding
//! alike.
//!
//! Matching additionally ignores `;parameters` at the end of segments (servlet containers strip
//! them), so `/orders;jsessionid=1/7` is matched as `/orders/7`; the path is forwarded as it
//! came. Matching is case-sensitive: in front of a case-insensitive upstream, guard with
//! prefixes that cover every casing or lower-case the paths upstream of palisade.

use std::borrow::Cow;

/// Why a request path is not in normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// Not an origin-form path (`*`, empty).
    #[error("path must start with '/'")]
    NotAbsolute,
    /// `//` inside the path.
    #[error("path contains an empty segment ('//')")]
    EmptySegment,
    /// A `.` or `..` segment.
    #[error("path contains a '.' or '..' segment")]
    DotSegment,
    /// A raw backslash.
    #[error("path contains a backslash")]
    Backslash,
    /// A control byte, space or non-ASCII byte.
    #[error("path contains a byte that must be percent-encoded (0x{0:02x})")]
    RawByte(u8),
    /// `%` not followed by two hex digits.
    #[error("path contains an invalid percent escape")]
    BadEscape,
    /// An escape that changes meaning when an upstream decodes it.
    #[error("path percent-encodes {0:?}, which must not be encoded")]
    ForbiddenEscape(char),
    /// Escaped bytes above 0x7F that are not shortest-form UTF-8 (overlong, surrogate, stray).
    #[error("path percent-encodes bytes that are not shortest-form UTF-8")]
    BadUtf8Escape,
    /// The decoded path changes under Unicode NFKC (`require_nfkc_paths`).
    #[error("path is not in Unicode NFKC form")]
    NotNfkc,
}

/// Checks `path` and returns it in normal form (borrowed when nothing changed).
///
/// # Errors
/// [`PathError`] names the first rule the path breaks.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathError> {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    let mut lower_hex = false;
    // Consecutive escaped bytes above 0x7F, checked as UTF-8 once the run ends.
    let mut high = [0u8; 4];
    let mut high_len = 0;
    let mut i = 0;
    while i < b.len() {
        if high_len > 0 && (b[i] != b'%' || b.get(i + 1).is_none_or(|h| hex_value(*h) < 8)) {
            end_utf8_run(&high[..high_len], true)?;
            high_len = 0;
        }
        match b[i] {
            b'%' => {
                let (hi, lo) = match (b.get(i + 1), b.get(i + 2)) {
                    (Some(&h), Some(&l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit() => {
                        (h, l)
                    }
                    _ => return Err(PathError::BadEscape),
                };
                lower_hex |= hi.is_ascii_lowercase() || lo.is_ascii_lowercase();
                let decoded = (hex(hi) << 4) | hex(lo);
                if decoded >= 0x80 {
                    high[high_len] = decoded;
                    high_len += 1;
                    if let Some(n) = end_utf8_run(&high[..high_len], false)? {
                        high.copy_within(n..high_len, 0);
                        high_len -= n;
                    }
                    i += 3;
                    continue;
                }
                // Whatever may stand raw in a path segment (RFC 3986 pchar: unreserved,
                // sub-delims, ':' and '@') must: upstreams decode `%40` to `@`, so two
                // spellings would name one entity (or take one prefix) twice.
                if decoded.is_ascii_alphanumeric()
                    || matches!(
                        decoded,
                        b'-' | b'.'
                            | b'_'
                            | b'~'
                            | b'/'
                            | b'\\'
                            | b';'
                            | b'%'
                            | b'!'
                            | b'$'
                            | b'&'
                            | b'\''
                            | b'('
                            | b')'
                            | b'*'
                            | b'+'
                            | b','
                            | b'='
                            | b':'
                            | b'@'
                    )
                    || decoded.is_ascii_control()
                {
                    return Err(PathError::ForbiddenEscape(char::from(decoded)));
                }
                i += 3;
                continue;
            }
            b'\\' => return Err(PathError::Backslash),
            c if !c.is_ascii_graphic() => return Err(PathError::RawByte(c)),
            _ => {}
        }
        i += 1;
    }
    if high_len > 0 {
        end_utf8_run(&high[..high_len], true)?;
    }
    let mut segments = path[1..].split('/').peekable();
    while let Some(seg) = segments.next() {
        let last = segments.peek().is_none();
        if seg.is_empty() && !last {
            return Err(PathError::EmptySegment);
        }
        let name = seg.split(';').next().unwrap_or(seg);
        // `/;x/orders` reads as `//orders` to an upstream that strips segment parameters.
        if name.is_empty() && !last {
            return Err(PathError::EmptySegment);
        }
        if name == "." || name == ".." {
            return Err(PathError::DotSegment);
        }
    }
    if !lower_hex {
        return Ok(Cow::Borrowed(path));
    }
    let mut out = String::with_capacity(path.len());
    let mut escape_left = 0;
    for c in path.chars() {
        if c == '%' {
            escape_left = 2;
            out.push(c);
        } else if escape_left > 0 {
            escape_left -= 1;
            out.push(c.to_ascii_uppercase());
        } else {
            out.push(c);
        }
    }
    Ok(Cow::Owned(out))
}

/// Checks the escaped high bytes seen so far. Returns how many complete, valid characters
/// lead the buffer (to drop them), `None` while a character is still incomplete, or an error
/// for an invalid sequence, or for an incomplete one when `at_end`.
fn end_utf8_run(bytes: &[u8], at_end: bool) -> Result<Option<usize>, PathError> {
    match std::str::from_utf8(bytes) {
        Ok(_) => Ok(Some(bytes.len())),
        Err(e) if e.error_len().is_none() && !at_end => Ok(None),
        Err(_) => Err(PathError::BadUtf8Escape),
    }
}

fn hex_value(c: u8) -> u8 {
    if c.is_ascii_hexdigit() {
        hex(c)
    } else {
        0
    }
}

/// Whether a normal-form path (see [`normalize`]) decodes to text that Unicode NFKC leaves
/// unchanged. Paths without escapes are ASCII and always are.
#[cfg(feature = "proxy")]
pub fn is_nfkc(path: &str) -> bool {
    if !path.contains('%') {
        return true;
    }
    let Ok(text) = percent_encoding::percent_decode_str(path).decode_utf8() else {
        return false;
    };
    unicode_normalization::is_nfkc_quick(text.chars()) == unicode_normalization::IsNormalized::Yes
        || unicode_normalization::UnicodeNormalization::nfkc(text.chars()).eq(text.chars())
}

fn hex(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => c - b'A' + 10,
    }
}

/// The form routes are matched against: a normal-form path with `;parameters` removed from
/// every segment. Borrowed when the path has none.
pub fn match_key(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    for (i, seg) in path.split('/').enumerate() {
        if i > 0 {
            out.push('/');
        }
        out.push_str(seg.split(';').next().unwrap_or(seg));
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_paths_pass_unchanged() {
        for p in [
            "/",
            "/orders",
            "/orders/",
            "/orders/7?x",
            "/a%20b",
            "/caf%C3%A9",
            "/a;b=c/d",
            "/a.b/..c/.d",
        ] {
            assert_eq!(normalize(p), Ok(Cow::Borrowed(p)), "{p}");
        }
    }

    #[test]
    fn lower_case_escapes_are_upper_cased() {
        assert_eq!(normalize("/caf%c3%a9").unwrap(), "/caf%C3%A9");
    }

    #[test]
    fn alternative_spellings_are_refused() {
        use PathError::*;
        let cases = [
            ("", NotAbsolute),
            ("*", NotAbsolute),
            ("orders", NotAbsolute),
            ("//orders", EmptySegment),
            ("/orders//7", EmptySegment),
            ("/;x/orders", EmptySegment),
            ("/./orders", DotSegment),
            ("/x/../orders", DotSegment),
            ("/x/..;/orders", DotSegment),
            ("/x/.;a/orders", DotSegment),
            ("/orders/..", DotSegment),
            ("/x\\..\\orders", Backslash),
            ("/%6Frders", ForbiddenEscape('o')),
            ("/%6frders", ForbiddenEscape('o')),
            ("/x/%2e%2e/orders", ForbiddenEscape('.')),
            ("/x%2Forders", ForbiddenEscape('/')),
            ("/x%5Corders", ForbiddenEscape('\\')),
            ("/orders%00", ForbiddenEscape('\0')),
            ("/orders%3Bx", ForbiddenEscape(';')),
            ("/users/a%40b", ForbiddenEscape('@')),
            ("/a%2Bb", ForbiddenEscape('+')),
            ("/a%3Ab", ForbiddenEscape(':')),
            ("/%2536Frders", ForbiddenEscape('%')),
            ("/orders%", BadEscape),
            ("/orders%2", BadEscape),
            ("/orders%zz", BadEscape),
            ("/ord ers", RawByte(b' ')),
            ("/orders\0", RawByte(0)),
            ("/ordérs", RawByte(0xc3)),
            ("/x%C0%AForders", BadUtf8Escape),
            ("/x%E0%80%AF", BadUtf8Escape),
            ("/x%ED%A0%80", BadUtf8Escape),
            ("/x%80", BadUtf8Escape),
            ("/x%C3", BadUtf8Escape),
            ("/x%C3/", BadUtf8Escape),
            ("/x%C3%20", BadUtf8Escape),
            ("/x%FF", BadUtf8Escape),
            ("/x%F4%90%80%80", BadUtf8Escape),
        ];
        for (p, want) in cases {
            assert_eq!(normalize(p), Err(want), "{p:?}");
        }
    }

    #[test]
    fn shortest_form_utf8_escapes_pass_and_nfkc_is_checked() {
        for p in ["/caf%C3%A9", "/%E2%82%AC%F0%9F%98%80/x", "/%C3%A9%C3%A9"] {
            assert!(normalize(p).is_ok(), "{p}");
            assert!(is_nfkc(p), "{p}");
        }
        // Full-width `o` (U+FF4F) and the `fi` ligature (U+FB01) change under NFKC.
        assert!(normalize("/%EF%BD%8Frders").is_ok());
        assert!(!is_nfkc("/%EF%BD%8Frders"));
        assert!(!is_nfkc("/%EF%AC%81le"));
        assert!(is_nfkc("/orders/7"));
    }

    #[test]
    fn match_key_drops_segment_parameters() {
        assert_eq!(match_key("/orders;jsessionid=1/7"), "/orders/7");
        assert_eq!(match_key("/orders"), "/orders");
        assert_eq!(match_key("/a;x"), "/a");
    }
}
