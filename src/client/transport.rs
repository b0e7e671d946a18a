//! Stamping requests with a fencing token, and reading it back, for HTTP and gRPC.
//!
//! Reading uses the one strict parser of [`crate::token`], shared with the proxy and the guard,
//! so a token a client writes here is read the same way everywhere.

use http::header::{HeaderMap, HeaderName};

use crate::token::{self, FencingToken, TokenError, DEFAULT_HEADER};

const HEADER: HeaderName = HeaderName::from_static(DEFAULT_HEADER);

/// Sets `x-fencing-token` on `headers`, replacing any token already there.
pub fn stamp_headers(headers: &mut HeaderMap, token: FencingToken) {
    token::insert_header(headers, HEADER, token);
}

/// Sets `x-fencing-token` on an `http::Request`.
pub fn stamp_request<B>(request: &mut http::Request<B>, token: FencingToken) {
    stamp_headers(request.headers_mut(), token);
}

/// Reads `x-fencing-token`: `Ok(None)` when absent.
///
/// # Errors
/// [`TokenError`] for a malformed or repeated header.
pub fn read_headers(headers: &HeaderMap) -> Result<Option<FencingToken>, TokenError> {
    token::from_headers(headers, &HEADER)
}

/// gRPC metadata (feature `grpc`): the key is `x-fencing-token`, as for HTTP.
#[cfg(feature = "grpc")]
pub mod grpc {
    use tonic::metadata::{AsciiMetadataValue, MetadataMap};

    use super::*;

    /// Sets the token on `metadata`, replacing any token already there.
    pub fn stamp_metadata(metadata: &mut MetadataMap, token: FencingToken) {
        let value =
            AsciiMetadataValue::try_from(token.get().to_string()).expect("digits are ASCII");
        metadata.insert(DEFAULT_HEADER, value);
    }

    /// Sets the token on a `tonic::Request`.
    pub fn stamp_request<T>(request: &mut tonic::Request<T>, token: FencingToken) {
        stamp_metadata(request.metadata_mut(), token);
    }

    /// Reads the token: `Ok(None)` when absent.
    ///
    /// # Errors
    /// [`TokenError`] for a malformed or repeated value.
    pub fn read_metadata(metadata: &MetadataMap) -> Result<Option<FencingToken>, TokenError> {
        let mut values = metadata.get_all(DEFAULT_HEADER).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(TokenError::Repeated);
        }
        FencingToken::parse(first.as_encoded_bytes()).map(Some)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn metadata_round_trip_and_strictness() {
            let t = FencingToken::new(51).unwrap();
            let mut req = tonic::Request::new(());
            stamp_request(&mut req, t);
            assert_eq!(read_metadata(req.metadata()), Ok(Some(t)));
            req.metadata_mut()
                .append(DEFAULT_HEADER, "51".parse().unwrap());
            assert_eq!(read_metadata(req.metadata()), Err(TokenError::Repeated));
            let mut m = MetadataMap::new();
            m.insert(DEFAULT_HEADER, "051".parse().unwrap());
            assert_eq!(read_metadata(&m), Err(TokenError::LeadingZero));
            assert_eq!(read_metadata(&MetadataMap::new()), Ok(None));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_round_trip() {
        let t = FencingToken::new(34).unwrap();
        let mut req = http::Request::new(());
        stamp_request(&mut req, t);
        assert_eq!(req.headers()[DEFAULT_HEADER], "34");
        assert_eq!(read_headers(req.headers()), Ok(Some(t)));
        stamp_request(&mut req, FencingToken::new(51).unwrap());
        assert_eq!(
            read_headers(req.headers()).unwrap().unwrap().get(),
            51,
            "replaced, not appended"
        );
    }
}
