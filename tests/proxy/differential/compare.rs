//! Comparing two outcomes, and the differences accepted as explained.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The response bytes with each `date` header's value masked (it is the time of the answer).
///
/// The `message` of palisade's own 502 and 504 answers is masked too, with their length: it
/// carries the text of each path's own HTTP client error ("connection closed before message
/// completed" from hyper, "the upstream closed the connection before a response" from the fast
/// path), meant for people. The status, the `error` kind and every other field are compared.
pub(crate) fn normalize(resp: &[u8]) -> Vec<u8> {
    let failed = resp.starts_with(b"HTTP/1.1 502 ") || resp.starts_with(b"HTTP/1.1 504 ");
    let mut out = Vec::with_capacity(resp.len());
    let mut at = 0;
    while at < resp.len() {
        let end = find(&resp[at..], b"\r\n").map_or(resp.len(), |e| at + e + 2);
        let line = &resp[at..end];
        if line.len() > 5 && line[..5].eq_ignore_ascii_case(b"date:") {
            out.extend_from_slice(b"date: <masked>\r\n");
        } else if failed && line.starts_with(b"content-length:") {
            out.extend_from_slice(b"content-length: <masked>\r\n");
        } else if failed && line.starts_with(b"{") {
            out.extend_from_slice(&mask_message(line));
        } else {
            out.extend_from_slice(line);
        }
        at = end;
    }
    out
}

/// A JSON answer with the value of its `"message"` masked.
fn mask_message(body: &[u8]) -> Vec<u8> {
    const KEY: &[u8] = b"\"message\":\"";
    let Some(at) = find(body, KEY) else {
        return body.to_vec();
    };
    let from = at + KEY.len();
    // The value ends at the first quote not escaped.
    let mut end = from;
    while end < body.len() && !(body[end] == b'"' && body[end - 1] != b'\\') {
        end += 1;
    }
    let mut out = body[..from].to_vec();
    out.extend_from_slice(b"<masked>");
    out.extend_from_slice(&body[end.min(body.len())..]);
    out
}

/// Bytes as readable text: CRLF kept as `\r\n` plus a line break, others escaped.
pub(crate) fn show(b: &[u8]) -> String {
    let mut s = String::new();
    let b = if b.len() > 1500 { &b[..1500] } else { b };
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\r' if b.get(i + 1) == Some(&b'\n') => {
                s.push_str("\\r\\n\n        ");
                i += 1;
            }
            b'\n' => s.push_str("\\n"),
            b'\r' => s.push_str("\\r"),
            b'\t' => s.push_str("\\t"),
            c if (0x20..0x7f).contains(&c) => s.push(c as char),
            c => {
                let _ = write!(s, "\\x{c:02x}");
            }
        }
        i += 1;
    }
    s
}

pub(crate) fn describe(o: &Outcome) -> String {
    let mut s = String::new();
    for (i, r) in o.responses.iter().enumerate() {
        let _ = writeln!(s, "    response[{i}]: {}", show(r));
    }
    if !o.extra.is_empty() {
        let _ = writeln!(s, "    extra: {}", show(&o.extra));
    }
    let _ = writeln!(s, "    closed: {}", o.closed);
    if o.upstream.is_empty() {
        let _ = writeln!(s, "    upstream: (nothing)");
    }
    for (i, u) in o.upstream.iter().enumerate() {
        let _ = writeln!(s, "    upstream[{i}]: {}", show(u));
    }
    s
}

/// Records a difference between the fast path's outcome `a` and hyper's `b`, after the
/// normalizations of [`normalize_pair`].
pub(crate) fn compare<'m>(
    mode: &'m str,
    index: usize,
    reqs: &[Case],
    a: &mut Outcome,
    b: &mut Outcome,
    findings: &mut Vec<String>,
    accepted: &mut std::collections::BTreeMap<&'m str, usize>,
) {
    if a == b {
        return;
    }
    // `DIFF_RAW=1`: every difference as observed, none normalized.
    let raw = std::env::var("DIFF_RAW").is_ok();
    for why in if raw {
        Vec::new()
    } else {
        normalize_pair(reqs, a, b)
    } {
        *accepted.entry(why).or_default() += 1;
    }
    if a != b {
        let mut s = format!("{mode} case {index}:\n  request(s):\n");
        for r in reqs {
            let _ = writeln!(s, "    {}", show(&r.bytes));
        }
        let _ = write!(
            s,
            "  fast path:\n{}  hyper path:\n{}",
            describe(a),
            describe(b)
        );
        findings.push(s);
    }
}

/// The (c) differences, explained, made equal. Returns which were applied.
///
/// - `chunked-verbatim`: the fast path relays a chunked body byte for byte (chunk sizes,
///   extensions and trailers as the upstream sent them, `fast/relay.rs`), hyper re-chunks
///   the data and writes trailers only to a client that sent `TE: trailers`. The same data
///   either way; chunk extensions have no defined meaning and trailers may be dropped by any
///   recipient (RFC 9110 6.5.1). Bodies are compared as their decoded data.
/// - `close-delimited`: a response delimited by the upstream's close is relayed by the fast
///   path with `connection: close` and the client's connection closed after it (it moves
///   bytes, it cannot re-frame), hyper re-chunks it and keeps the connection. The same
///   head and data; the fast path is correct, only less economical.
/// - `early-answer`: the upstream answered before it read the request body (an early 413).
///   The fast path then stops sending the body, closes the upstream connection and relays
///   the answer with `connection: close`, closing the client's connection too (by design,
///   `fast/exchange.rs`, `send`: "relayed, and neither connection is reused"; RFC 9112 9.6
///   lets a client stop sending a body the server declined); hyper's client keeps sending the
///   body and reuses both connections. The client gets the same answer; which happens depends
///   on whether the body was all written when the answer came. Hyper's path, for its part,
///   sometimes relays the early answer and then closes the client connection without
///   `connection: close` (hyper's server drops a request body it could not drain; the
///   next keep-alive request then gets EOF): reported, timing-dependent on both paths, so
///   not a stable comparison. Accepted when the first answers are the same but for a
///   `connection: close`, whatever followed; the upstream's partial request (logged when
///   the proxies shut down) is left out of the partial comparison for `x-resp: early*`.
/// - `request-rechunked`: a chunked request body (which moves the fast path's connection to
///   hyper, with the bytes the fast path had read already) reaches the upstream with other
///   chunk sizes than when hyper read the connection from its start: hyper re-chunks by the
///   reads it happens to get. Chunk boundaries carry no meaning (RFC 9112 7.1); the head and
///   the data must be the same, so the bodies are compared as their decoded data.
/// - `cut-response`: the upstream closed mid-body (`x-resp: cut*`). Both paths close the
///   client connection without a whole response; the fast path has relayed the head and
///   the bytes it got, then resets, while hyper's server usually sends nothing (it had not
///   flushed the head when the body failed). Either way the client sees a cut response.
///   Accepted when both closed and neither sent a whole response.
/// - `unannounced-close`: a refused request whose body was not drained (over
///   `max_body_bytes`): both paths answer the same and close; only the fast path says
///   `connection: close` (hyper's server closes without saying so). Accepted when both
///   closed and the answers are the same but for that field.
pub(crate) fn normalize_pair(reqs: &[Case], a: &mut Outcome, b: &mut Outcome) -> Vec<&'static str> {
    let mut applied = Vec::new();
    if reqs[0]
        .bytes
        .windows(14)
        .any(|w| w == b"x-resp: early4" || w == b"x-resp: early2")
        && String::from_utf8_lossy(&a.responses[0]).replacen("connection: close\r\n", "", 1)
            == String::from_utf8_lossy(&b.responses[0]).replacen("connection: close\r\n", "", 1)
    {
        *a = Outcome {
            responses: b.responses.clone(),
            extra: b.extra.clone(),
            closed: b.closed,
            upstream: b.upstream.clone(),
        };
        applied.push("early-answer");
        return applied;
    }
    let cut = |r: &[u8]| r.is_empty() || r.ends_with(b"<<INCOMPLETE>>");
    if reqs[0].bytes.windows(11).any(|w| w == b"x-resp: cut")
        && a.closed
        && b.closed
        && a.upstream == b.upstream
        && cut(&a.responses[0])
        && cut(&b.responses[0])
    {
        *a = Outcome {
            responses: b.responses.clone(),
            extra: b.extra.clone(),
            closed: b.closed,
            upstream: b.upstream.clone(),
        };
        applied.push("cut-response");
        return applied;
    }
    let unsaid = |r: &[u8]| String::from_utf8_lossy(r).replacen("connection: close\r\n", "", 1);
    if a.closed
        && b.closed
        && a.responses[0] != b.responses[0]
        && unsaid(&a.responses[0]) == unsaid(&b.responses[0])
        && a.responses[0]
            .windows(19)
            .any(|w| w == b"connection: close\r\n")
        && a.upstream == b.upstream
    {
        a.responses[0] = b.responses[0].clone();
        applied.push("unannounced-close");
    }
    for i in 0..a.upstream.len().min(b.upstream.len()) {
        let (ua, ub) = (&a.upstream[i], &b.upstream[i]);
        let (Some((ha, ba)), Some((hb, bb))) = (split_head(ua), split_head(ub)) else {
            continue;
        };
        if ba != bb && ha == hb && ha.contains("\r\ntransfer-encoding: chunked\r\n") {
            if let (Some(da), Some(db)) = (dechunk(ba), dechunk(bb)) {
                if da == db {
                    let mut n = ha.as_bytes().to_vec();
                    n.extend_from_slice(b"<<chunked, decoded:>>");
                    n.extend_from_slice(&da);
                    a.upstream[i] = n.clone();
                    b.upstream[i] = n;
                    applied.push("request-rechunked");
                }
            }
        }
    }
    for i in 0..a.responses.len().min(b.responses.len()) {
        let head_request = reqs.get(i).is_some_and(|r| r.method == "HEAD");
        let ra = final_message(&a.responses[i]).to_vec();
        let rb = final_message(&b.responses[i]).to_vec();
        let (Some((ha, ba)), Some((hb, bb))) = (split_head(&ra), split_head(&rb)) else {
            continue;
        };
        let chunked = |h: &str| h.contains("\r\ntransfer-encoding: chunked\r\n");
        let (mut ha, mut hb) = (ha.to_owned(), hb.to_owned());
        let (mut ba, mut bb) = (ba.to_vec(), bb.to_vec());
        let mut changed = false;
        if !head_request && chunked(&ha) && chunked(&hb) && ba != bb {
            if let (Some(da), Some(db)) = (dechunk(&ba), dechunk(&bb)) {
                ba = da;
                bb = db;
                changed = true;
                applied.push("chunked-verbatim");
            }
        }
        let close_delimited = |h: &str| {
            h.contains("\r\nconnection: close\r\n")
                && !h.contains("\r\ncontent-length:")
                && !h.contains("\r\ntransfer-encoding:")
        };
        if !head_request && close_delimited(&ha) && chunked(&hb) {
            if let Some(db) = dechunk(&bb) {
                // hyper says `connection: close` too when it closes anyway (the client asked).
                if !hb.contains("\r\nconnection: close\r\n") {
                    ha = ha.replacen("\r\nconnection: close\r\n", "\r\n", 1);
                }
                hb = hb.replacen("\r\ntransfer-encoding: chunked\r\n", "\r\n", 1);
                bb = db;
                changed = true;
                a.closed = b.closed;
                // The fast path closed the connection: what followed was never sent there.
                for r in a.responses.iter_mut().skip(i + 1) {
                    *r = b"<<after a close-delimited response>>".to_vec();
                }
                for r in b.responses.iter_mut().skip(i + 1) {
                    *r = b"<<after a close-delimited response>>".to_vec();
                }
                b.upstream.truncate(a.upstream.len());
                applied.push("close-delimited");
            }
        }
        if changed {
            let prefix_a = a.responses[i].len() - ra.len();
            let prefix_b = b.responses[i].len() - rb.len();
            let mut na = a.responses[i][..prefix_a].to_vec();
            na.extend_from_slice(ha.as_bytes());
            na.extend_from_slice(&ba);
            let mut nb = b.responses[i][..prefix_b].to_vec();
            nb.extend_from_slice(hb.as_bytes());
            nb.extend_from_slice(&bb);
            a.responses[i] = na;
            b.responses[i] = nb;
        }
    }
    applied
}

/// The final response of a response's bytes (after any interim ones).
pub(crate) fn final_message(r: &[u8]) -> &[u8] {
    let mut at = 0;
    while r[at..].starts_with(b"HTTP/1.1 1") && !r[at..].starts_with(b"HTTP/1.1 101") {
        match find(&r[at..], b"\r\n\r\n") {
            Some(e) => at += e + 4,
            None => break,
        }
    }
    &r[at..]
}

/// A response's head (as text, through the empty line) and body.
pub(crate) fn split_head(r: &[u8]) -> Option<(&str, &[u8])> {
    let e = find(r, b"\r\n\r\n")? + 4;
    Some((std::str::from_utf8(&r[..e]).ok()?, &r[e..]))
}

/// A chunked body's data.
pub(crate) fn dechunk(b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let line = find(&b[at..], b"\r\n")?;
        let size = String::from_utf8_lossy(&b[at..at + line]);
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        at += line + 2;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(at..at + size)?);
        at += size + 2;
    }
}
