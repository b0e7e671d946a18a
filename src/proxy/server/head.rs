//! `max_header_bytes` for every HTTP/1.x request hyper reads, not only a connection's first.
//!
//! hyper's `max_buf_size` is a bound on its read buffer, checked while a head is still
//! incomplete: the first head of a connection over the limit gets 431, but a later one that
//! arrives whole in one read (the buffer has grown by then) was parsed and served. An operator's
//! limit must hold for every request, as it does on the HTTP/1.1 fast path, so the head hyper
//! parsed is measured again here: the request line and the fields as they were on the wire,
//! less optional whitespace (which hyper does not keep). HTTP/2 heads are bounded by h2's
//! `max_header_list_size`.

use http::{Request, Response, StatusCode, Version};

use super::body::ActiveBody;

/// Whether the head of `req` took more than `max` bytes on the wire (a lower bound of its
/// size: `METHOD target HTTP/1.1`, each `name:value` with its line end, the empty line).
pub(super) fn over_limit<B>(req: &Request<B>, max: usize) -> bool {
    if req.version() > Version::HTTP_11 {
        return false;
    }
    let uri = req.uri();
    let target = uri.scheme_str().map_or(0, |s| s.len() + 3)
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len());
    let mut len = req.method().as_str().len() + 1 + target + " HTTP/1.1\n".len() + 1;
    for (name, value) in req.headers() {
        len += name.as_str().len() + 1 + value.len() + 1;
        if len > max {
            return true;
        }
    }
    len > max
}

/// The answer to such a head, as hyper gives it for a first one: 431, empty, and the
/// connection closed after it.
pub(super) fn refused<B>() -> Response<ActiveBody<B>> {
    let mut resp = Response::new(ActiveBody::empty());
    *resp.status_mut() = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_measured_as_sent() {
        let req = |v: &str| {
            Request::get("/items/1")
                .header("host", "api.test")
                .header("x-big", v)
                .body(())
                .unwrap()
        };
        // "GET /items/1 HTTP/1.1\r\n" = 23, "host: api.test\r\n" = 16, "x-big: ..\r\n" = 9 + n,
        // "\r\n" = 2: without the optional space and the CRs, 22 + 14 + (7 + n) + 1.
        let n = 100;
        let lower_bound = 22 + 14 + 7 + n + 1;
        assert!(!over_limit(&req(&"a".repeat(n)), lower_bound));
        assert!(over_limit(&req(&"a".repeat(n)), lower_bound - 1));
        let h2 = Request::get("/")
            .version(Version::HTTP_2)
            .header("x", "a".repeat(500));
        assert!(
            !over_limit(&h2.body(()).unwrap(), 100),
            "HTTP/2 is h2's to bound"
        );
    }
}
