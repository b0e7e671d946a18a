//! The unread body of a refused HTTP/2 request, read to its end (and discarded) when it is
//! small and arriving, so that the stream ends cleanly.
//!
//! Why: an HTTP/2 server that has answered while the client is still sending ends the stream
//! with `RST_STREAM(NO_ERROR)` (RFC 9113 8.1 allows it), and common clients (curl 7.88 among
//! them) then report a stream error and drop the answer they already had: a zombie's 409
//! never reaches it. Reading the rest lets the client's END_STREAM close the stream instead.
//! Only up to [`MAX_UNREAD_BYTES`] within [`MAX_UNREAD_TIME`]: what is larger or slower is
//! reset as before. The bytes are never forwarded.

use std::time::Duration;

use http::{Request, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Incoming};

/// At most this much of a refused body is read.
pub(super) const MAX_UNREAD_BYTES: u64 = 256 * 1024;
/// For at most this long.
pub(super) const MAX_UNREAD_TIME: Duration = Duration::from_secs(1);

/// Reads what is left of `req`'s body in a task of its own, within the bounds, when it is an
/// HTTP/2 request whose body has not ended; otherwise drops it at once.
pub(super) fn discard(req: Request<Incoming>) {
    if req.version() != Version::HTTP_2 || req.body().is_end_stream() {
        return;
    }
    let announced = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_UNREAD_BYTES) {
        return; // too large to wait for: reset now
    }
    let mut body = req.into_body();
    tokio::spawn(async move {
        let read = async {
            let mut seen = 0u64;
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    seen += data.len() as u64;
                    if seen > MAX_UNREAD_BYTES {
                        return;
                    }
                }
            }
        };
        let _ = tokio::time::timeout(MAX_UNREAD_TIME, read).await;
    });
}
