//! The second, fixed corpus: upstreams that fail (close without answering, close mid-body,
//! answer garbage, never answer, answer before the request body is read), request bodies of
//! several read chunks, and `Expect: 100-continue`.
//!
//! Deterministic: each failure is the upstream's reaction to the request's `x-resp` (nothing
//! waits for a time except the proxy's own `response_timeout_ms` of 200 ms on the `/slow`
//! route, the only way to reach a 504).

#[allow(clippy::wildcard_imports)]
use super::*;

/// What the upstream does instead of a canned answer, once the whole request arrived.
pub(crate) enum Failure {
    /// Writes these bytes (maybe none) and closes.
    Close(&'static [u8]),
    /// Writes these bytes (maybe none) and keeps reading the connection, answering nothing
    /// more for this request.
    Stay(&'static [u8]),
}

pub(crate) fn failure(kind: &str) -> Option<Failure> {
    Some(match kind {
        // Closes without answering.
        "drop" => Failure::Close(b""),
        // Closes in the middle of a Content-Length body.
        "cutcl" => Failure::Close(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"),
        // Closes in the middle of a chunk, and after a whole chunk without the last one.
        "cutchunked" => {
            Failure::Close(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel")
        }
        "cutchunked2" => {
            Failure::Close(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        }
        // Closes in the middle of the head.
        "cuthead" => Failure::Close(b"HTTP/1.1 200 OK\r\ncontent-le"),
        // Garbage instead of a response, then closes, or keeps the connection open.
        "garbage" => Failure::Close(b"SPDY/9 what is this\r\n\r\n"),
        "garbage2" => Failure::Close(b"HTTP/1.1 2x0 OK\r\ncontent-length: 2\r\n\r\nok"),
        "garbage_open" => Failure::Stay(b"\x16\x03\x01\x00\x05hello garbage\r\n\r\n"),
        // Never answers (the `/slow` route gives up after 200 ms).
        "hang" => Failure::Stay(b""),
        // Starts its head, never ends it.
        "slowhead" => Failure::Stay(b"HTTP/1.1 200 OK\r\nx-a: 1\r\n"),
        _ => return None,
    })
}

/// Answers written as soon as the request head arrived, before its body is read (the body is
/// then read whole, and for `*close` kinds the connection closed).
pub(crate) fn early(kind: &str) -> Option<&'static [u8]> {
    Some(match kind {
        "early413close" => {
            b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 4\r\n\r\nbig!"
        }
        "early413" => b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\n\r\nbig!",
        "early200" => b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nearly",
        _ => return None,
    })
}

/// A request with a Content-Length body (none when `body` is empty and the method is bodiless).
pub(crate) fn req(method: &str, path: &str, extra: &[&str], body: &[u8]) -> Case {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: a.test\r\n");
    for h in extra {
        head.push_str(h);
        head.push_str("\r\n");
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    Case {
        bytes,
        method: method.to_owned(),
    }
}

/// A request with a chunked body, in chunks of at most 10000 bytes.
pub(crate) fn req_chunked(path: &str, extra: &[&str], body: &[u8]) -> Case {
    let mut head =
        format!("POST {path} HTTP/1.1\r\nhost: a.test\r\ntransfer-encoding: chunked\r\n");
    for h in extra {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    for c in body.chunks(10_000) {
        bytes.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        bytes.extend_from_slice(c);
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(b"0\r\n\r\n");
    Case {
        bytes,
        method: "POST".to_owned(),
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A body of `n` bytes, distinct per size (a mix-up of bodies shows in the upstream bytes).
pub(crate) fn body(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[(i + n) % 36])
        .collect()
}

/// The fixed corpus: (name, requests on one connection, `true`: an `Expect: 100-continue`
/// request whose body is written only after an interim 100 arrived).
pub(crate) fn corpus() -> Vec<(String, Vec<Case>, bool)> {
    const TOKEN: &str = "x-fencing-token: 1000000";
    let mut out: Vec<(String, Vec<Case>, bool)> = Vec::new();
    let add = |out: &mut Vec<_>, name: String, reqs: Vec<Case>| out.push((name, reqs, false));
    // On an unguarded route (passthrough) and a guarded one (admitted, the mark advanced once).
    for (path, tok) in [("/free/f", None), ("/orders/f", Some(TOKEN))] {
        let h = |kind: &str| -> Vec<String> {
            let mut h = vec![format!("x-resp: {kind}")];
            h.extend(tok.map(str::to_owned));
            h
        };
        for kind in [
            "drop",
            "cutcl",
            "cutchunked",
            "cutchunked2",
            "cuthead",
            "garbage",
            "garbage2",
            "garbage_open",
        ] {
            let hk = h(kind);
            add(
                &mut out,
                format!("{kind} POST {path}"),
                vec![req("POST", path, &refs(&hk), b"data")],
            );
            add(
                &mut out,
                format!("{kind} GET {path}, then GET"),
                vec![
                    req("GET", path, &refs(&hk), b""),
                    req("GET", path, &refs(&h("plain")), b""),
                ],
            );
        }
        let hk = h("cutcl");
        add(
            &mut out,
            format!("cutcl HEAD {path}"),
            vec![req("HEAD", path, &refs(&hk), b"")],
        );
        // Bodies of several read chunks (16 KiB, 64 KiB and more), then a request after them.
        for n in [16 * 1024 + 1, 64 * 1024 + 1, 300_000] {
            let hp = h("plain");
            add(
                &mut out,
                format!("POST {n} bytes {path}, then GET"),
                vec![
                    req("POST", path, &refs(&hp), &body(n)),
                    req("GET", path, &refs(&hp), b""),
                ],
            );
            add(
                &mut out,
                format!("chunked POST {n} bytes {path}"),
                vec![req_chunked(path, &refs(&hp), &body(n))],
            );
        }
        // Upstream answers before reading the body.
        for kind in ["early413close", "early413", "early200"] {
            let hk = h(kind);
            add(
                &mut out,
                format!("{kind} POST 200000 bytes {path}, then GET"),
                vec![
                    req("POST", path, &refs(&hk), &body(200_000)),
                    req("GET", path, &refs(&h("plain")), b""),
                ],
            );
        }
        // Expect: 100-continue, with the body written at once (as clients that do not wait).
        let mut he = h("plain");
        he.push("expect: 100-continue".to_owned());
        add(
            &mut out,
            format!("expect, body at once, 70000 bytes {path}"),
            vec![req("POST", path, &refs(&he), &body(70_000))],
        );
        // ... and with the body written after the interim 100 only.
        out.push((
            format!("expect, body after 100, 20000 bytes {path}"),
            vec![req("POST", path, &refs(&he), &body(20_000))],
            true,
        ));
    }
    // A body over the route's max_body_bytes (16): refused by palisade, with and without
    // Expect, Content-Length and chunked.
    let tok = "x-fencing-token: 1000000";
    out.push((
        "acct 70000 bytes".to_owned(),
        vec![
            req("POST", "/acct/1", &[tok], &body(70_000)),
            req("GET", "/acct/1", &[tok], b""),
        ],
        false,
    ));
    out.push((
        "acct 70000 bytes, expect".to_owned(),
        vec![req(
            "POST",
            "/acct/1",
            &[tok, "expect: 100-continue"],
            &body(70_000),
        )],
        true,
    ));
    out.push((
        "acct chunked 70000 bytes".to_owned(),
        vec![req_chunked("/acct/1", &[tok], &body(70_000))],
        false,
    ));
    // Never answered: the /slow route's response_timeout_ms (200) gives a 504.
    for (name, reqs) in [
        (
            "hang GET /slow, then GET",
            vec![
                req("GET", "/slow/1", &["x-resp: hang"], b""),
                req("GET", "/slow/1", &[], b""),
            ],
        ),
        (
            "hang POST 70000 bytes /slow",
            vec![req("POST", "/slow/2", &["x-resp: hang"], &body(70_000))],
        ),
        (
            "slowhead GET /slow",
            vec![req("GET", "/slow/3", &["x-resp: slowhead"], b"")],
        ),
    ] {
        out.push((name.to_owned(), reqs, false));
    }
    out
}

/// Runs one case of the fixed corpus like [`run`]; `expect`: the (single) request's head is
/// written first, its body only after an interim 100 came (a final answer ends the case).
pub(crate) async fn run_fixed(side: &Side, reqs: &[Case], expect: bool) -> Outcome {
    if !expect {
        return run(side, reqs, Mode::Sequential).await;
    }
    let before = side.received.lock().unwrap().len();
    let r = &reqs[0];
    let split = find(&r.bytes, b"\r\n\r\n").unwrap() + 4;
    let mut c = Client::connect(side.addr).await;
    side.peers.lock().unwrap().push(c.id());
    let mut out = Vec::new();
    let mut open = c.write(&r.bytes[..split]).await;
    if open {
        match c.message(false).await {
            Some((bytes, 100, true)) => {
                out.extend_from_slice(&bytes);
                open = c.write(&r.bytes[split..]).await && c.response(false, &mut out).await;
            }
            Some((bytes, _, complete)) => {
                out.extend_from_slice(&bytes);
                open = complete;
            }
            None => open = false,
        }
    }
    let mut extra = Vec::new();
    let closed = !open || !c.probe(&mut extra).await;
    if c.ended == Some("TIMEOUT") {
        extra.extend_from_slice(b"<<TIMEOUT>>");
    }
    drop(c);
    let upstream = side.received.lock().unwrap()[before..]
        .iter()
        .filter(|r| !r.starts_with(b"GET /__probe ") && !r.starts_with(b"PARTIAL "))
        .cloned()
        .collect();
    Outcome {
        responses: vec![normalize(&out)],
        extra: normalize(&extra),
        closed,
        upstream,
    }
}
