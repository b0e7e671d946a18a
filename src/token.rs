//! Fencing tokens and their one wire form (`docs/design.md#tokens`).
//!
//! Every party parses tokens here: the proxy, the guard middleware and the client helpers. The
//! parser is deliberately strict, because a lenient parser is a way around the guard: if `034`,
//! ` 34` or `+34` were read as 34 by one party and rejected or read differently by another, a
//! zombie could pick whichever spelling slips through.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The default header (and gRPC metadata key) that carries a fencing token
/// (`docs/design.md#tokens`).
pub const DEFAULT_HEADER: &str = "x-fencing-token";

/// A fencing token: a non-zero `u64` that grows with every new owner of a resource.
///
/// Zero is never issued, which lets a mark of 0 mean "nothing accepted yet".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(NonZeroU64);

impl FencingToken {
    /// Wraps a value; `None` for 0, which is never a valid token.
    pub const fn new(value: u64) -> Option<Self> {
        match NonZeroU64::new(value) {
            Some(v) => Some(Self(v)),
            None => None,
        }
    }

    /// The token as a plain integer.
    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// Parses the canonical wire form: 1 to 20 ASCII digits, no sign, no leading zero, no
    /// whitespace, at most `u64::MAX`, not zero.
    ///
    /// # Errors
    /// [`TokenError`] says which rule the input broke.
    pub fn parse(input: &[u8]) -> Result<Self, TokenError> {
        if input.is_empty() {
            return Err(TokenError::Empty);
        }
        if input.len() > 20 {
            return Err(TokenError::TooLong);
        }
        if let Some(&b) = input.iter().find(|b| !b.is_ascii_digit()) {
            return Err(TokenError::NotADigit(b));
        }
        if input[0] == b'0' {
            return Err(if input.len() == 1 {
                TokenError::Zero
            } else {
                TokenError::LeadingZero
            });
        }
        let mut value: u64 = 0;
        for &b in input {
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(b - b'0')))
                .ok_or(TokenError::Overflow)?;
        }
        // The first digit is non-zero, so the value is too.
        Self::new(value).ok_or(TokenError::Zero)
    }

    /// The canonical wire form, ready to be sent as a header value.
    pub fn to_header_value(self) -> HeaderValue {
        HeaderValue::from(self.get())
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for FencingToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.get()
    }
}

/// Why a token on the wire was not accepted as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The header is present but empty.
    #[error("fencing token is empty")]
    Empty,
    /// The literal `0`: never issued by any provider.
    #[error("fencing token 0 is never valid")]
    Zero,
    /// `034` and friends: only the canonical spelling is accepted.
    #[error("fencing token has a leading zero")]
    LeadingZero,
    /// A sign, whitespace, comma, letter or non-ASCII byte.
    #[error("fencing token contains a byte that is not a decimal digit (0x{0:02x})")]
    NotADigit(u8),
    /// More than 20 digits.
    #[error("fencing token is longer than 20 digits")]
    TooLong,
    /// 20 digits above `u64::MAX`.
    #[error("fencing token exceeds the largest 64-bit value")]
    Overflow,
    /// The header appears more than once; picking one would let a client choose.
    #[error("fencing token header appears more than once")]
    Repeated,
}

/// Reads the token from `headers[name]`.
///
/// Returns `Ok(None)` when the header is absent, so the caller decides what a missing token
/// means (the proxy answers 428 by default).
///
/// # Errors
/// [`TokenError`] for any malformed value, and [`TokenError::Repeated`] when the header appears
/// more than once.
pub fn from_headers(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<FencingToken>, TokenError> {
    // A typical head has a handful of fields: comparing names (most are standard names, told
    // apart by their tag alone) is cheaper than hashing ours (FNV, a byte at a time: ~20 ns).
    if headers.keys_len() <= SCAN_UP_TO {
        return from_values(
            headers
                .iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, v)| v.as_bytes()),
        );
    }
    from_values(headers.get_all(name).iter().map(HeaderValue::as_bytes))
}

/// Reads the token from the values of its header, in order, wherever they are held (the
/// proxy's fast path reads them from the client's bytes): the one rule for absent, repeated
/// and malformed tokens.
pub(crate) fn from_values<'a>(
    mut values: impl Iterator<Item = &'a [u8]>,
) -> Result<Option<FencingToken>, TokenError> {
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(TokenError::Repeated);
    }
    FencingToken::parse(first).map(Some)
}

/// The header on a refusal (409, 503) and on an admitted fence that tells the resource's mark.
pub const MARK_HEADER: &str = "x-fencing-mark";

/// The header that makes a request on a guarded route a **fence request**: admitted like any
/// request (an advance is persisted and older requests drained), then answered `204` (gRPC:
/// OK) with the mark, never forwarded. A new owner sends one before anything else, so that
/// its predecessor is refused from then on (see the guide's fence requests).
pub const FENCE_HEADER: &str = "x-fencing-fence";

/// Why an `x-fencing-fence` header does not ask for a fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FenceHeaderError {
    /// A value other than `1`.
    #[error("x-fencing-fence must be exactly 1 (a fence request) or absent")]
    NotOne,
    /// The header appears more than once.
    #[error("x-fencing-fence appears more than once")]
    Repeated,
}

/// Whether the values of `x-fencing-fence` ask for a fence: `Ok(false)` when absent.
pub(crate) fn fence_from_values<'a>(
    mut values: impl Iterator<Item = &'a [u8]>,
) -> Result<bool, FenceHeaderError> {
    let Some(first) = values.next() else {
        return Ok(false);
    };
    if values.next().is_some() {
        return Err(FenceHeaderError::Repeated);
    }
    if first == b"1" {
        Ok(true)
    } else {
        Err(FenceHeaderError::NotOne)
    }
}

/// Whether `headers` ask for a fence (`x-fencing-fence: 1`): `Ok(false)` when absent.
///
/// # Errors
/// [`FenceHeaderError`] for any other value, or a repeated header.
pub fn fence_from_headers(headers: &HeaderMap) -> Result<bool, FenceHeaderError> {
    fence_from_values(
        headers
            .get_all(FENCE_HEADER)
            .iter()
            .map(HeaderValue::as_bytes),
    )
}

/// Makes the request whose headers are `headers` a fence request (`x-fencing-fence: 1`).
pub fn insert_fence_header(headers: &mut HeaderMap) {
    headers.insert(
        HeaderName::from_static(FENCE_HEADER),
        HeaderValue::from_static("1"),
    );
}

/// Up to this many distinct field names, [`from_headers`] scans instead of hashing.
const SCAN_UP_TO: usize = 16;

/// Puts `token` on `headers[name]`, replacing any token already there.
pub fn insert_header(headers: &mut HeaderMap, name: HeaderName, token: FencingToken) {
    headers.insert(name, token.to_header_value());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_tokens_parse() {
        assert_eq!(FencingToken::parse(b"1").unwrap().get(), 1);
        assert_eq!(FencingToken::parse(b"51").unwrap().get(), 51);
        assert_eq!(
            FencingToken::parse(b"18446744073709551615").unwrap().get(),
            u64::MAX
        );
    }

    #[test]
    fn every_malformed_form_is_rejected() {
        let cases: &[(&[u8], TokenError)] = &[
            (b"", TokenError::Empty),
            (b"0", TokenError::Zero),
            (b"00", TokenError::LeadingZero),
            (b"034", TokenError::LeadingZero),
            (b"+34", TokenError::NotADigit(b'+')),
            (b"-34", TokenError::NotADigit(b'-')),
            (b" 34", TokenError::NotADigit(b' ')),
            (b"3 4", TokenError::NotADigit(b' ')),
            (b"34 ", TokenError::NotADigit(b' ')),
            (b"3\t4", TokenError::NotADigit(b'\t')),
            (b"34,35", TokenError::NotADigit(b',')),
            (b"0x22", TokenError::NotADigit(b'x')),
            ("３４".as_bytes(), TokenError::NotADigit(0xef)),
            (b"18446744073709551616", TokenError::Overflow),
            (b"99999999999999999999", TokenError::Overflow),
            (b"100000000000000000000", TokenError::TooLong),
        ];
        for (input, want) in cases {
            assert_eq!(
                FencingToken::parse(input),
                Err(*want),
                "input {:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn repeated_header_is_malformed_and_absent_is_none() {
        // Small heads are scanned, large ones looked up: both must judge alike.
        for others in [0, 3, SCAN_UP_TO - 1, SCAN_UP_TO, SCAN_UP_TO + 1, 40] {
            let name = HeaderName::from_static(DEFAULT_HEADER);
            let mut h = HeaderMap::new();
            for i in 0..others {
                h.append(
                    HeaderName::try_from(format!("x-other-{i}")).unwrap(),
                    HeaderValue::from_static("1"),
                );
            }
            h.append("x-fencing-tokens", HeaderValue::from_static("9"));
            h.append(http::header::HOST, HeaderValue::from_static("a"));
            assert_eq!(from_headers(&h, &name), Ok(None), "{others}");
            h.append(&name, HeaderValue::from_static("7"));
            assert_eq!(from_headers(&h, &name).unwrap().unwrap().get(), 7);
            h.append(http::header::ACCEPT, HeaderValue::from_static("*/*"));
            h.append(&name, HeaderValue::from_static("7"));
            assert_eq!(
                from_headers(&h, &name),
                Err(TokenError::Repeated),
                "{others}"
            );
        }
    }

    #[test]
    fn header_round_trip() {
        let name = HeaderName::from_static(DEFAULT_HEADER);
        let mut h = HeaderMap::new();
        let t = FencingToken::new(u64::MAX).unwrap();
        insert_header(&mut h, name.clone(), t);
        assert_eq!(from_headers(&h, &name), Ok(Some(t)));
    }

    #[test]
    fn only_one_fence_header_with_the_value_1_asks_for_a_fence() {
        let mut h = HeaderMap::new();
        assert_eq!(fence_from_headers(&h), Ok(false));
        insert_fence_header(&mut h);
        assert_eq!(fence_from_headers(&h), Ok(true));
        for bad in ["0", "true", " 1", "1 ", "", "01", "yes"] {
            let mut h = HeaderMap::new();
            h.insert(FENCE_HEADER, HeaderValue::from_str(bad).unwrap());
            assert_eq!(
                fence_from_headers(&h),
                Err(FenceHeaderError::NotOne),
                "{bad:?}"
            );
        }
        let mut h = HeaderMap::new();
        h.append(FENCE_HEADER, HeaderValue::from_static("1"));
        h.append(FENCE_HEADER, HeaderValue::from_static("1"));
        assert_eq!(fence_from_headers(&h), Err(FenceHeaderError::Repeated));
    }
}
