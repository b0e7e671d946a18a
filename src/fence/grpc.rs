//! Telling gRPC requests apart by their content type: refusals of gRPC requests take gRPC's
//! trailers-only form, and templates can name a gRPC call's service and method.

use http::{header, HeaderValue};

/// The request's content type if it is gRPC: `application/grpc`, `application/grpc-web` or
/// `application/grpc-web-text`, alone or followed by `+` (a codec) or `;` (parameters), in any
/// case. `application/grpcfoo` or `application/grpc-other` are not gRPC. Rejections of gRPC
/// requests take the trailers-only form, with this content type echoed.
pub fn grpc_content_type(headers: &http::HeaderMap) -> Option<HeaderValue> {
    let v = headers.get(header::CONTENT_TYPE)?;
    is_grpc_content_type(v.as_bytes()).then(|| v.clone())
}

/// Whether a `Content-Type` value is gRPC's (`application/grpc`, `-web`, `-web-text`, with
/// an optional `+format` or parameters), whatever holds the value.
pub(crate) fn is_grpc_content_type(b: &[u8]) -> bool {
    let prefix = b"application/grpc";
    if b.len() < prefix.len() || !b[..prefix.len()].eq_ignore_ascii_case(prefix) {
        return false;
    }
    let mut rest = &b[prefix.len()..];
    for sub in [&b"-web-text"[..], b"-web"] {
        if rest.len() >= sub.len() && rest[..sub.len()].eq_ignore_ascii_case(sub) {
            rest = &rest[sub.len()..];
            break;
        }
    }
    matches!(rest.first(), None | Some(b'+' | b';'))
}
