//! The raw recording upstream of the differential test.

#[allow(clippy::wildcard_imports)]
use super::*;

// ---------------------------------------------------------------------------------------------
// The raw recording upstream.

/// Every request the upstream received, exact bytes (head and body), in arrival order; bytes
/// left unparsed when a connection ended are logged as `PARTIAL ...`.
pub(crate) type Received = Arc<Mutex<Vec<Vec<u8>>>>;

/// The canned answer for a response kind (the request's `x-resp`); `true`: close after it.
pub(crate) fn canned(kind: &str) -> (&'static [u8], bool) {
    match kind {
        "204" => (b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n", false),
        "204cl" => (b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n", false),
        "304" => (
            b"HTTP/1.1 304 Not Modified\r\netag: \"x\"\r\ncontent-length: 9\r\n\r\n",
            false,
        ),
        "chunked" => (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-t\r\n\r\n5;ext=1\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
            false,
        ),
        "close" => (b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\r\nall of it", true),
        "closecl" => (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
            true,
        ),
        "1xx" => (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            false,
        ),
        "hop" => (
            b"HTTP/1.1 200 OK\r\nConnection: x-foo, keep-alive\r\nx-foo: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nUpgrade: h2c\r\nTE: trailers\r\nTrailer: x-t\r\nx-fencing-token: 77\r\nx-bar: 2\r\ncontent-length: 2\r\n\r\nok",
            false,
        ),
        "order" => (
            b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-Z: 1\r\nset-cookie: b=2\r\nServer: up\r\nX-z: 2\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\nContent-Length: 3\r\n\r\nabc",
            false,
        ),
        "noreason" => (b"HTTP/1.1 404\r\ncontent-length: 2\r\n\r\nok", false),
        "http10" => (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", true),
        "empty" => (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false),
        "empty2" => (
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-after: 1\r\n\r\n",
            false,
        ),
        "clmid" => (
            b"HTTP/1.1 201 Created\r\nx-a: 1\r\ncontent-length: 2\r\nx-b: 2\r\n\r\nok",
            false,
        ),
        "500" => (
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom",
            false,
        ),
        _ => (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello",
            false,
        ),
    }
}

pub(crate) const KINDS: &[&str] = &[
    "plain", "204", "204cl", "304", "chunked", "close", "closecl", "1xx", "hop", "order",
    "noreason", "http10", "empty", "500", "empty2", "clmid",
];

/// [`KINDS`] for the keep-alive and pipelined groups: no close-delimited response (the fast
/// path closes the client connection after one, by design; see `normalize_pair`).
pub(crate) const TAME_KINDS: &[&str] = &[
    "plain", "204", "204cl", "304", "chunked", "closecl", "1xx", "hop", "order", "noreason",
    "http10", "empty", "500", "empty2", "clmid",
];

/// A canned response as sent to a `HEAD` request: its head only.
pub(crate) fn head_only(resp: &[u8]) -> &[u8] {
    let mut at = 0;
    // Skip interim responses.
    loop {
        let end = find(&resp[at..], b"\r\n\r\n").map_or(resp.len(), |e| at + e + 4);
        if resp[at..].starts_with(b"HTTP/1.1 1") && end < resp.len() {
            at = end;
            continue;
        }
        return &resp[..end];
    }
}

/// The number of the upstream's open connections.
pub(crate) type Open = Arc<tokio::sync::watch::Sender<usize>>;

pub(crate) async fn raw_upstream() -> (SocketAddr, Received, Open) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let got = Received::default();
    let log = Arc::clone(&got);
    let open: Open = Arc::new(tokio::sync::watch::channel(0).0);
    let count = Arc::clone(&open);
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            count.send_modify(|n| *n += 1);
            let (log, count) = (Arc::clone(&log), Arc::clone(&count));
            tokio::spawn(async move {
                upstream_conn(s, log).await;
                count.send_modify(|n| *n -= 1);
            });
        }
    });
    (addr, got, open)
}

pub(crate) async fn upstream_conn(mut s: TcpStream, log: Received) {
    let mut buf = Vec::new();
    // The request at the start of `buf` was answered as soon as its head arrived.
    let mut answered_early = false;
    loop {
        if !answered_early {
            if let Some(e) = find(&buf, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..e + 4]).into_owned();
                if let Some(answer) = header(&head, "x-resp").and_then(|k| early(&k)) {
                    answered_early = true;
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            }
        }
        let Some(len) = request_len(&buf) else {
            let mut chunk = [0u8; 8192];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    if !buf.is_empty() {
                        let mut p = b"PARTIAL ".to_vec();
                        p.extend_from_slice(&buf);
                        log.lock().unwrap().push(p);
                    }
                    return;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let req: Vec<u8> = buf.drain(..len).collect();
        let head_end = find(&req, b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&req[..head_end]).into_owned();
        log.lock().unwrap().push(req);
        if head.starts_with("GET /__probe ") {
            let probe = b"HTTP/1.1 200 OK\r\nx-probe: 1\r\ncontent-length: 5\r\n\r\nprobe";
            if s.write_all(probe).await.is_err() {
                return;
            }
            continue;
        }
        let kind = header(&head, "x-resp").unwrap_or_default();
        if std::mem::take(&mut answered_early) {
            // Answered already; the body is read whole (no reset of unread bytes).
            if kind.ends_with("close") {
                return;
            }
            continue;
        }
        match failure(&kind) {
            Some(Failure::Close(bytes)) => {
                let _ = s.write_all(bytes).await;
                return;
            }
            Some(Failure::Stay(bytes)) => {
                if s.write_all(bytes).await.is_err() {
                    return;
                }
                continue;
            }
            None => {}
        }
        let (answer, mut close) = canned(&kind);
        let answer = if head.starts_with("HEAD ") {
            head_only(answer)
        } else {
            answer
        };
        close |=
            header(&head, "connection").is_some_and(|v| v.to_ascii_lowercase().contains("close"));
        if s.write_all(answer).await.is_err() || close {
            return;
        }
    }
}

/// The first value of header `name` in a head.
pub(crate) fn header(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// The length of the whole request at the start of `buf` (head and body), once it is all there.
pub(crate) fn request_len(buf: &[u8]) -> Option<usize> {
    let end = find(buf, b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]);
    let chunked = head.split("\r\n").skip(1).any(|l| {
        l.split_once(':').is_some_and(|(n, v)| {
            n.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
        })
    });
    if chunked {
        return chunked_len(&buf[end..]).map(|n| end + n);
    }
    let len: usize = header(&head, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
    (buf.len() >= end + len).then_some(end + len)
}

/// The length of a whole chunked body (trailers included) at the start of `b`.
pub(crate) fn chunked_len(b: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let line = find(&b[at..], b"\r\n")?;
        let size_text = String::from_utf8_lossy(&b[at..at + line]);
        let size_text = size_text.split(';').next().unwrap_or("").trim().to_owned();
        let size = usize::from_str_radix(&size_text, 16).ok()?;
        at += line + 2;
        if size == 0 {
            // Trailers up to the empty line.
            loop {
                let line = find(&b[at..], b"\r\n")?;
                at += line + 2;
                if line == 0 {
                    return Some(at);
                }
            }
        }
        if b.len() < at + size + 2 {
            return None;
        }
        at += size + 2;
    }
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
