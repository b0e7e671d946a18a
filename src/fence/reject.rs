//! Every refusal palisade answers, and its HTTP and gRPC form, in one table
//! (`docs/design.md#refusals`).
//!
//! Nothing else on the request path builds an error response: the proxy turns each failure into
//! a [`Rejection`] and calls [`Rejection::respond`].

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

use crate::token::{FenceHeaderError, TokenError};

pub use crate::token::MARK_HEADER;

/// Why a request was not forwarded, or failed after it was.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    /// A guarded route with `missing_token = "reject"` got no token.
    #[error("this route requires a fencing token")]
    MissingToken,
    /// The token header is not a canonical token.
    #[error("malformed fencing token: {0}")]
    MalformedToken(#[source] TokenError),
    /// The `x-fencing-fence` header is not one `1`.
    #[error("malformed fence request: {0}")]
    MalformedFence(#[source] FenceHeaderError),
    /// A fence request on a route that keeps no mark (unguarded, or its pattern names no
    /// resource): there is nothing to fence, and forwarding it would tell the owner it was
    /// fenced when nothing was.
    #[error("a fence request (x-fencing-fence) on a route that keeps no mark: nothing to fence")]
    NothingToFence,
    /// The request is ambiguous or unsafe to forward (Host missing, duplicate, conflicting or
    /// malformed; a body on GET).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// `Transfer-Encoding` names a coding other than `chunked` (`gzip, chunked`,
    /// `identity`): palisade does not decode it and will not guess where the body ends.
    #[error("a Transfer-Encoding other than chunked is not implemented")]
    UnsupportedTransferCoding,
    /// A header that CGI-style upstreams read as the token header (`x_fencing_token`) on a
    /// guarded route: the upstream could see a token palisade never checked.
    #[error("the request carries a header that CGI/WSGI servers merge with the fencing token header (e.g. x_fencing_token); send the token only as the configured header")]
    TokenAlias,
    /// The token is above the route's `max_token` ceiling.
    #[error("fencing token {token} is above this route's max_token {max}")]
    AboveMaxToken {
        /// The refused token.
        token: u64,
        /// The ceiling.
        max: u64,
    },
    /// The path matched a guarded route with `other_methods = "reject"`, the method is not one
    /// it lists.
    #[error("this method is not allowed on this route")]
    MethodNotAllowed,
    /// The route takes its resource from the request, and this request names none that
    /// can be used (a header missing or repeated, a name over 1024 bytes, ...).
    #[error("cannot tell which resource this request is for: {0}")]
    BadResource(#[source] crate::fence::template::FillError),
    /// The request path is not in normal form (the proxy's path rules say why).
    #[error("request path is not in normal form: {0}")]
    BadPath(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The token is above the epoch of the lock that feeds the route: it was never issued.
    #[error(
        "fencing token {token} is above the current owner's token {epoch} (the epoch of the \
         lock that feeds this route): it was never issued"
    )]
    Unissued {
        /// The refused token.
        token: u64,
        /// The epoch: the current owner's token, and the mark.
        epoch: u64,
    },
    /// The token is below the resource's mark.
    #[error("fencing token {token} is below the resource's mark {mark}: a newer owner exists")]
    Stale {
        /// The refused token.
        token: u64,
        /// The mark.
        mark: u64,
    },
    /// The mark store failed a step the verdict needed (see [`StoreStep`]); `mark` is the
    /// mark known here, unchanged.
    #[error("{step}{}", mark.map_or_else(String::new, |m| format!("; the mark stays {m}")))]
    StoreUnavailable {
        /// What the store was asked for when it failed.
        step: StoreStep,
        /// The resource's mark as known here (0: none accepted yet); `None` when it was never
        /// loaded.
        mark: Option<u64>,
    },
    /// A new entity of a templated route beyond its `max_marks` stored marks.
    #[error(
        "this route already stores its limit of {limit} marks (max_marks); a new entity is \
         refused: a mark can never be forgotten, so the store would grow without bound"
    )]
    MarksFull {
        /// The route's `max_marks`.
        limit: u64,
    },
    /// No route matches.
    #[error("no route matches this request")]
    NoRoute,
    /// The upstream could not be reached or failed mid-request.
    #[error("upstream failed: {0}")]
    UpstreamFailed(String),
    /// The upstream did not send response headers in time.
    #[error("upstream did not respond within {0:?}")]
    UpstreamTimeout(std::time::Duration),
    /// The request body is larger than the route's `max_body_bytes`.
    #[error("the request body is larger than this route's limit of {limit} bytes")]
    BodyTooLarge {
        /// The route's `max_body_bytes`.
        limit: u64,
    },
}

/// The mark store step that failed, for a 503's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreStep {
    /// Reading the stored mark after the request arrived (a linearizable confirmation).
    Confirm,
    /// Making a higher token durable (an advance).
    Persist {
        /// The token that would have become the mark.
        token: u64,
    },
    /// Reading the mark of a resource seen for the first time.
    Load,
    /// Reading the epoch of the lock that feeds the resource (missing, or gone back).
    Epoch,
}

impl std::fmt::Display for StoreStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreStep::Confirm => f.write_str(
                "the mark store could not confirm the mark (its read after this request \
                 arrived failed); refusing rather than judging on a copy that may be stale",
            ),
            StoreStep::Persist { token } => write!(
                f,
                "the mark store could not persist token {token} as the new mark in time; \
                 refusing rather than risking a lost mark (a write that timed out may still \
                 land later, which only raises the mark)"
            ),
            StoreStep::Epoch => f.write_str(
                "the epoch of the lock that feeds this resource is missing or went back \
                 (deleted, or etcd restored from an older snapshot); refusing rather than \
                 judging on a mark that may be too low",
            ),
            StoreStep::Load => f.write_str(
                "the mark store could not load this resource's mark; refusing rather than \
                 guessing it",
            ),
        }
    }
}

/// What is known about the request being refused, for the response body and logs.
#[derive(Debug, Default, Clone, Copy)]
pub struct Context<'a> {
    /// The matched route's name.
    pub route: Option<&'a str>,
    /// The route's resource, when guarded.
    pub resource: Option<&'a str>,
    /// The token, when one parsed.
    pub token: Option<u64>,
}

// gRPC status codes (grpc/doc/statuscodes.md).
const INVALID_ARGUMENT: u8 = 3;
const DEADLINE_EXCEEDED: u8 = 4;
const RESOURCE_EXHAUSTED: u8 = 8;
const PERMISSION_DENIED: u8 = 7;
const ABORTED: u8 = 10;
const UNIMPLEMENTED: u8 = 12;
const UNAVAILABLE: u8 = 14;

// grpc-message is percent-encoded: everything outside printable ASCII, and '%' itself.
const GRPC_MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

impl Rejection {
    /// The table: HTTP status, gRPC status and the machine-readable `error` string.
    pub fn classify(&self) -> (StatusCode, u8, &'static str) {
        match self {
            Rejection::MissingToken => (
                StatusCode::PRECONDITION_REQUIRED,
                INVALID_ARGUMENT,
                "missing_token",
            ),
            Rejection::MalformedToken(_) => {
                (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "malformed_token")
            }
            Rejection::MalformedFence(_) => {
                (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "malformed_fence")
            }
            Rejection::NothingToFence => (
                StatusCode::BAD_REQUEST,
                INVALID_ARGUMENT,
                "nothing_to_fence",
            ),
            Rejection::BadPath(_) => (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "bad_path"),
            Rejection::BadResource(_) => {
                (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "bad_resource")
            }
            Rejection::BadRequest(_) => (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "bad_request"),
            Rejection::TokenAlias => (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "token_alias"),
            Rejection::UnsupportedTransferCoding => (
                StatusCode::NOT_IMPLEMENTED,
                UNIMPLEMENTED,
                "unsupported_transfer_coding",
            ),
            Rejection::AboveMaxToken { .. } => {
                (StatusCode::BAD_REQUEST, INVALID_ARGUMENT, "token_above_max")
            }
            Rejection::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                UNIMPLEMENTED,
                "method_not_allowed",
            ),
            Rejection::Stale { .. } => (StatusCode::CONFLICT, ABORTED, "stale_token"),
            Rejection::Unissued { .. } => (StatusCode::FORBIDDEN, PERMISSION_DENIED, "unissued"),
            Rejection::StoreUnavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
                "store_unavailable",
            ),
            Rejection::MarksFull { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                RESOURCE_EXHAUSTED,
                "marks_full",
            ),
            Rejection::NoRoute => (StatusCode::NOT_FOUND, UNIMPLEMENTED, "no_route"),
            Rejection::UpstreamFailed(_) => {
                (StatusCode::BAD_GATEWAY, UNAVAILABLE, "upstream_unavailable")
            }
            Rejection::UpstreamTimeout(_) => (
                StatusCode::GATEWAY_TIMEOUT,
                DEADLINE_EXCEEDED,
                "upstream_timeout",
            ),
            Rejection::BodyTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                RESOURCE_EXHAUSTED,
                "body_too_large",
            ),
        }
    }

    /// The response: JSON for HTTP, trailers-only for gRPC. `grpc` is the request's content
    /// type when it is `application/grpc*` (echoed, so gRPC-web clients get their own type).
    pub fn respond(&self, ctx: Context<'_>, grpc: Option<&HeaderValue>) -> Response<Full<Bytes>> {
        let (status, grpc_status, code) = self.classify();
        let message = self.to_string();
        let mark = match self {
            Rejection::Stale { mark, .. } => Some(*mark),
            Rejection::Unissued { epoch, .. } => Some(*epoch),
            Rejection::StoreUnavailable { mark, .. } => *mark,
            _ => None,
        };
        let mut resp = if let Some(content_type) = grpc {
            // Trailers-only: HTTP 200, status in the headers, no body, END_STREAM on HEADERS.
            let mut r = Response::new(Full::new(Bytes::new()));
            let h = r.headers_mut();
            h.insert(header::CONTENT_TYPE, content_type.clone());
            h.insert("grpc-status", HeaderValue::from(u16::from(grpc_status)));
            let encoded = utf8_percent_encode(&message, GRPC_MESSAGE).to_string();
            if let Ok(v) = HeaderValue::from_str(&encoded) {
                h.insert("grpc-message", v);
            }
            r
        } else {
            let body = serde_json::json!({
                "error": code,
                "message": message,
                "route": ctx.route,
                "resource": ctx.resource,
                "token": ctx.token,
                "mark": mark,
            });
            let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
            *r.status_mut() = status;
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        };
        if let Some(m) = mark {
            resp.headers_mut().insert(MARK_HEADER, HeaderValue::from(m));
        }
        resp
    }
}

/// The answer to an admitted fence request, the table's last row: `204 No Content` with
/// `x-fencing-mark` (the mark now, the fence's token), or for gRPC a trailers-only OK that
/// carries it as metadata. Never forwarded: the upstream does not see fences.
pub fn fence_admitted(mark: u64, grpc: Option<&HeaderValue>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    let h = r.headers_mut();
    if let Some(content_type) = grpc {
        h.insert(header::CONTENT_TYPE, content_type.clone());
        h.insert("grpc-status", HeaderValue::from_static("0"));
    } else {
        *r.status_mut() = StatusCode::NO_CONTENT;
    }
    r.headers_mut().insert(MARK_HEADER, HeaderValue::from(mark));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_http_has_json_and_mark_header() {
        let ctx = Context {
            route: Some("w"),
            resource: Some("orders"),
            token: Some(34),
        };
        let r = Rejection::Stale {
            token: 34,
            mark: 51,
        }
        .respond(ctx, None);
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[MARK_HEADER], "51");
    }

    #[test]
    fn an_admitted_fence_is_204_with_the_mark_or_grpc_ok() {
        let r = fence_admitted(51, None);
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        assert_eq!(r.headers()[MARK_HEADER], "51");
        assert!(http_body::Body::is_end_stream(r.body()));
        let grpc = HeaderValue::from_static("application/grpc");
        let r = fence_admitted(51, Some(&grpc));
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "0");
        assert_eq!(r.headers()[MARK_HEADER], "51");
    }

    #[test]
    fn grpc_form_is_trailers_only() {
        let web = HeaderValue::from_static("application/grpc-web+proto");
        let r = Rejection::Stale {
            token: 34,
            mark: 51,
        }
        .respond(Context::default(), Some(&web));
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "10");
        assert_eq!(
            r.headers()["content-type"],
            "application/grpc-web+proto",
            "the request's type is echoed"
        );
        assert!(http_body::Body::is_end_stream(r.body()));
    }
}
