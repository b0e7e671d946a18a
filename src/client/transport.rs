//! Stamping requests with a fencing token, reading it back, fence requests, and the answers
//! that prove an owner fenced ([`Fenced`]), for HTTP and gRPC.
//!
//! Reading uses the one strict parser of [`crate::token`], shared with the proxy and the guard,
//! so a token a client writes here is read the same way everywhere.

use http::header::{HeaderMap, HeaderName};

use crate::client::owner::Owner;
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

pub use crate::token::MARK_HEADER;

/// A resource's proof that a newer owner exists: it refused the token as stale, below
/// `mark` (palisade's 409, or gRPC ABORTED, with `x-fencing-mark`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("fenced: the resource's mark {mark} is above this owner's token; a newer owner exists")]
pub struct Fenced {
    /// The mark that refused the token.
    pub mark: u64,
}

/// The stale refusal in an answer's status and headers: HTTP 409, or a trailers-only gRPC
/// answer with `grpc-status: 10` (ABORTED), carrying `x-fencing-mark`. Anything else
/// (another refusal, a 409 of the service's own without a mark) is `None`.
pub fn fenced_parts(status: http::StatusCode, headers: &HeaderMap) -> Option<Fenced> {
    let stale = match headers.get("grpc-status") {
        Some(code) => code.as_bytes() == b"10",
        None => status == http::StatusCode::CONFLICT,
    };
    if !stale {
        return None;
    }
    let mark = headers.get(MARK_HEADER)?.to_str().ok()?.parse().ok()?;
    Some(Fenced { mark })
}

/// [`fenced_parts`] of an `http::Response`.
pub fn fenced_response<B>(response: &http::Response<B>) -> Option<Fenced> {
    fenced_parts(response.status(), response.headers())
}

/// Why a fence request did not fence.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError<E> {
    /// The resource already has a newer owner: the token is stale.
    #[error(transparent)]
    Fenced(Fenced),
    /// Refused for another reason (malformed, no guarded route, the store unavailable, ...).
    #[error("the fence request was refused: HTTP {status}{}", grpc.map_or_else(String::new, |g| format!(", grpc-status {g}")))]
    Refused {
        /// The answer's HTTP status.
        status: http::StatusCode,
        /// Its `grpc-status`, for a gRPC answer.
        grpc: Option<u32>,
    },
    /// The request could not be sent, or no answer came.
    #[error("the fence request failed: {0}")]
    Send(#[source] E),
}

/// A fence request for `token` (`x-fencing-fence: 1`, `docs/design.md#fence-requests`):
/// judged like any request on the guarded route `uri` names, answered without reaching the
/// service behind. Use the method the route guards (often `POST`). For a gRPC route use
/// [`grpc::fence_request`].
pub fn fence_request<B: Default>(
    method: http::Method,
    uri: http::Uri,
    token: FencingToken,
) -> http::Request<B> {
    let mut req = http::Request::new(B::default());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    stamp_headers(req.headers_mut(), token);
    token::insert_fence_header(req.headers_mut());
    req
}

/// Reads the answer to a fence request: the mark (the fence's token, or above) when it was
/// admitted (HTTP 204, or gRPC OK).
///
/// # Errors
/// [`FenceError::Fenced`] when the token is stale, [`FenceError::Refused`] otherwise.
pub fn fence_answer<E>(
    status: http::StatusCode,
    headers: &HeaderMap,
) -> Result<u64, FenceError<E>> {
    if let Some(f) = fenced_parts(status, headers) {
        return Err(FenceError::Fenced(f));
    }
    let grpc = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    let admitted = match grpc {
        Some(code) => status == http::StatusCode::OK && code == 0,
        None => status == http::StatusCode::NO_CONTENT,
    };
    let mark = headers
        .get(MARK_HEADER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match mark {
        Some(m) if admitted => Ok(m),
        _ => Err(FenceError::Refused { status, grpc }),
    }
}

/// Sends `request` (made by [`fence_request`] or [`grpc::fence_request`]) through `service`
/// (a hyper-util client, a tonic `Channel`, any tower service) and reads its answer. The body
/// of the answer is not read: a fence's answer has none.
///
/// # Errors
/// See [`fence_answer`]; also [`FenceError::Fenced`] when the fence was admitted but the mark
/// it reports is already above the request's token (a newer owner came in between);
/// [`FenceError::Send`] when the service failed.
pub async fn fence<S, B, RB>(
    service: &mut S,
    request: http::Request<B>,
) -> Result<u64, FenceError<S::Error>>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>>,
{
    let token = read_headers(request.headers()).ok().flatten();
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .map_err(FenceError::Send)?;
    let resp = service.call(request).await.map_err(FenceError::Send)?;
    let mark = fence_answer(resp.status(), resp.headers())?;
    // Admitted, but a newer owner advanced the mark before the answer was written: this
    // owner is fenced all the same.
    match token {
        Some(t) if mark > t.get() => Err(FenceError::Fenced(Fenced { mark })),
        _ => Ok(mark),
    }
}

/// A tower layer for an owner's HTTP (or gRPC) client: stamps the owner's token on every
/// request, and reads every answer. A stale refusal tells the owner at once
/// ([`Owner::fenced`]: its loss signal fires, `lead` cancels its work); an HTTP one is then
/// returned as [`StampError::Fenced`], a gRPC one passed on as it is (tonic reads it as
/// ABORTED; [`grpc::fenced_status`] gives the [`Fenced`]).
#[derive(Debug, Clone)]
pub struct StampLayer {
    owner: Owner,
}

impl StampLayer {
    /// Stamps `owner`'s token and reports its refusals to it.
    pub fn new(owner: Owner) -> Self {
        Self { owner }
    }
}

impl<S> tower_layer::Layer<S> for StampLayer {
    type Service = Stamped<S>;

    fn layer(&self, inner: S) -> Stamped<S> {
        Stamped {
            inner,
            owner: self.owner.clone(),
        }
    }
}

/// The service [`StampLayer`] makes.
#[derive(Debug, Clone)]
pub struct Stamped<S> {
    inner: S,
    owner: Owner,
}

/// What a [`Stamped`] service fails with.
#[derive(Debug, thiserror::Error)]
pub enum StampError<E> {
    /// A resource refused the owner's token as stale; the owner was told. (The `Fenced` is
    /// also the error's source, where [`grpc::fenced_status`] finds it behind a `Status`.)
    #[error("{0}")]
    Fenced(#[source] Fenced),
    /// The inner service failed.
    #[error(transparent)]
    Service(E),
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for Stamped<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = StampError<S::Error>;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<http::Response<RB>, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(StampError::Service)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        stamp_headers(req.headers_mut(), self.owner.token());
        let call = self.inner.call(req);
        let owner = self.owner.clone();
        Box::pin(async move {
            let resp = call.await.map_err(StampError::Service)?;
            // A refusal whose mark is not above the token proves nothing: passed on as it is.
            if let Some(f) = fenced_response(&resp).filter(|f| f.mark > owner.token().get()) {
                owner.fenced(f.mark);
                if !resp.headers().contains_key("grpc-status") {
                    return Err(StampError::Fenced(f));
                }
            }
            Ok(resp)
        })
    }
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

    /// The stale refusal in a gRPC status: ABORTED with `x-fencing-mark` in its metadata, or
    /// a [`Fenced`] in its source chain (a [`Stamped`] service's error).
    pub fn fenced_status(status: &tonic::Status) -> Option<Fenced> {
        if status.code() == tonic::Code::Aborted {
            let mark = status
                .metadata()
                .get(MARK_HEADER)?
                .to_str()
                .ok()?
                .parse()
                .ok()?;
            return Some(Fenced { mark });
        }
        let mut source = std::error::Error::source(status);
        while let Some(e) = source {
            if let Some(f) = e.downcast_ref::<Fenced>() {
                return Some(*f);
            }
            source = e.source();
        }
        None
    }

    /// A fence request for `token` to the gRPC method `path` (`/package.Service/Method`) of
    /// `authority` (as `host:port`), to send with [`super::fence`] through a tonic `Channel`.
    ///
    /// # Errors
    /// The `http` error when `path` or `authority` is not a valid URI part.
    pub fn fence_request<B: Default>(
        scheme: &str,
        authority: &str,
        path: &str,
        token: FencingToken,
    ) -> Result<http::Request<B>, http::Error> {
        let uri = http::Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query(path)
            .build()?;
        let mut req = super::fence_request(http::Method::POST, uri, token);
        let h = req.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        h.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        Ok(req)
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

        #[test]
        fn a_stamped_services_fenced_error_is_found_behind_a_status() {
            let err = StampError::<std::io::Error>::Fenced(Fenced { mark: 7 });
            let status = tonic::Status::from_error(Box::new(err));
            assert_eq!(fenced_status(&status), Some(Fenced { mark: 7 }));
            assert_eq!(fenced_status(&tonic::Status::aborted("no mark")), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answering(
        status: http::StatusCode,
        mark: &'static str,
    ) -> impl tower_service::Service<
        http::Request<()>,
        Response = http::Response<()>,
        Error = std::convert::Infallible,
        Future = std::future::Ready<Result<http::Response<()>, std::convert::Infallible>>,
    > + Clone {
        tower::service_fn(move |_: http::Request<()>| {
            let mut r = http::Response::new(());
            *r.status_mut() = status;
            r.headers_mut()
                .insert(MARK_HEADER, http::HeaderValue::from_static(mark));
            std::future::ready(Ok(r))
        })
    }

    #[tokio::test]
    async fn a_fence_is_admitted_only_at_its_own_token() {
        let t = |v| FencingToken::new(v).unwrap();
        let req =
            |token| fence_request::<()>(http::Method::POST, "http://x/o".parse().unwrap(), token);
        let mut at_60 = answering(http::StatusCode::NO_CONTENT, "60");
        assert_eq!(fence(&mut at_60, req(t(60))).await.unwrap(), 60);
        // Admitted, but a newer owner's advance came first: fenced all the same.
        assert!(matches!(
            fence(&mut at_60, req(t(50))).await,
            Err(FenceError::Fenced(Fenced { mark: 60 }))
        ));
        let mut stale = answering(http::StatusCode::CONFLICT, "60");
        assert!(matches!(
            fence(&mut stale, req(t(50))).await,
            Err(FenceError::Fenced(Fenced { mark: 60 }))
        ));
        // A 200 is not an admitted fence: the request went somewhere that does not fence.
        let mut forwarded = answering(http::StatusCode::OK, "60");
        assert!(matches!(
            fence(&mut forwarded, req(t(60))).await,
            Err(FenceError::Refused { .. })
        ));
        let r = req(t(60));
        assert_eq!(r.headers()[token::FENCE_HEADER], "1");
        assert_eq!(r.headers()[DEFAULT_HEADER], "60");
    }

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
