//! The fake upstream as raw HTTP/1.1 on TCP: heads as they came, bodies by their framing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use super::{Answer, Content, Log, Read, ReplyFn, Seen};

pub(super) fn spawn(
    listener: TcpListener,
    reply: ReplyFn,
    idle_close: Option<Duration>,
    log: Log,
    accepted: Arc<AtomicUsize>,
    mut stopped: oneshot::Receiver<()>,
) {
    tokio::spawn(async move {
        loop {
            let (s, peer) = tokio::select! {
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(_) => return,
                },
                _ = &mut stopped => return,
            };
            accepted.fetch_add(1, Ordering::SeqCst);
            let (log, reply) = (log.clone(), Arc::clone(&reply));
            tokio::spawn(async move {
                let mut conn = Conn {
                    s,
                    peer,
                    buf: Vec::new(),
                    last: None,
                };
                conn.serve(&log, &reply, idle_close).await;
                if let Some(i) = conn.last {
                    log.update(i, |s| s.closed = true);
                }
            });
        }
    });
}

/// How a request's body is framed.
#[derive(Clone, Copy)]
enum Framing {
    None,
    Length(usize),
    Chunked,
}

struct Conn {
    s: TcpStream,
    peer: SocketAddr,
    /// Bytes read and not yet taken as a head or a body.
    buf: Vec<u8>,
    /// The connection's latest request.
    last: Option<usize>,
}

impl Conn {
    /// Serves requests one after the other until the connection should end.
    async fn serve(&mut self, log: &Log, reply: &ReplyFn, idle: Option<Duration>) {
        loop {
            let end = loop {
                if let Some(e) = find(&self.buf, b"\r\n\r\n") {
                    break e + 4;
                }
                let more = match idle {
                    Some(limit) => match tokio::time::timeout(limit, self.more()).await {
                        Ok(more) => more,
                        Err(_) => return, // idle too long: close
                    },
                    None => self.more().await,
                };
                if !more {
                    return;
                }
            };
            let head: Vec<u8> = self.buf.drain(..end).collect();
            let seen = parse(String::from_utf8_lossy(&head).into_owned(), self.peer);
            let framing = framing(&seen.headers);
            let reply = reply(&seen);
            let i = log.push(seen);
            self.last = Some(i);
            if reply.read == Read::Early {
                let has_body = !matches!(framing, Framing::None | Framing::Length(0));
                while has_body && self.buf.is_empty() {
                    if !self.more().await {
                        return;
                    }
                }
                if !self.answer(&reply, log, i).await {
                    return;
                }
            }
            if !self.body(framing, log, i).await {
                return;
            }
            if reply.read != Read::Early && !self.answer(&reply, log, i).await {
                return;
            }
        }
    }

    /// Reads more bytes into `buf`; `false` once the connection ended.
    async fn more(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        match self.s.read(&mut chunk).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// Reads request `i`'s body into its record; `false` once the connection ended first.
    async fn body(&mut self, framing: Framing, log: &Log, i: usize) -> bool {
        match framing {
            Framing::None => {}
            Framing::Length(mut left) => loop {
                let n = left.min(self.buf.len());
                let data: Vec<u8> = self.buf.drain(..n).collect();
                log.update(i, |s| s.add_body(&data));
                left -= n;
                if left == 0 {
                    break;
                }
                if !self.more().await {
                    return false;
                }
            },
            Framing::Chunked => loop {
                if let Some(n) = chunked_len(&self.buf) {
                    let data: Vec<u8> = self.buf.drain(..n).collect();
                    log.update(i, |s| s.add_body(&data));
                    break;
                }
                if !self.more().await {
                    let partial = std::mem::take(&mut self.buf);
                    log.update(i, |s| s.add_body(&partial));
                    return false;
                }
            },
        }
        log.update(i, |s| s.complete = true);
        true
    }

    /// Answers request `i` as `reply` says; `false` when the connection should end.
    async fn answer(&mut self, reply: &super::Reply, log: &Log, i: usize) -> bool {
        if let Some(d) = reply.after {
            tokio::time::sleep(d).await;
        }
        let bytes = match &reply.answer {
            Answer::Bytes(b) => b.to_vec(),
            Answer::Response {
                status,
                headers,
                body,
            } => {
                let body = match body {
                    Content::Bytes(b) => b.to_vec(),
                    Content::BodyLen => {
                        let s = log.get(i);
                        if s.complete {
                            s.body_len.to_string().into_bytes()
                        } else {
                            b"incomplete".to_vec()
                        }
                    }
                    Content::Download(_) | Content::Trailers(..) => {
                        panic!("streamed bodies and trailers need palisade's server")
                    }
                };
                let mut out = format!(
                    "HTTP/1.1 {} {}\r\n",
                    status.as_u16(),
                    status.canonical_reason().unwrap_or("")
                )
                .into_bytes();
                for (k, v) in headers {
                    out.extend_from_slice(k.as_str().as_bytes());
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(v.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
                out.extend_from_slice(&body);
                out
            }
            Answer::Never => std::future::pending().await,
            Answer::Close => return false,
        };
        self.s.write_all(&bytes).await.is_ok()
    }
}

/// A request head as it came: the request line, the fields, the empty line.
fn parse(head: String, peer: SocketAddr) -> Seen {
    let mut lines = head.split("\r\n");
    let mut words = lines.next().unwrap_or_default().split(' ');
    let method =
        Method::from_bytes(words.next().unwrap_or_default().as_bytes()).unwrap_or_default();
    let target: http::Uri = words.next().unwrap_or("/").parse().unwrap_or_default();
    let version = match words.next() {
        Some("HTTP/1.0") => http::Version::HTTP_10,
        _ => http::Version::HTTP_11,
    };
    let mut headers = HeaderMap::new();
    for line in lines.take_while(|l| !l.is_empty()) {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.trim().as_bytes()),
            HeaderValue::from_str(v.trim()),
        ) {
            headers.append(k, v);
        }
    }
    Seen {
        method,
        path: target.path().to_owned(),
        query: target.query().map(str::to_owned),
        authority: target.authority().map(|a| a.to_string()),
        version,
        token: headers
            .get("x-fencing-token")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        headers,
        head,
        peer: Some(peer),
        ..Seen::default()
    }
}

fn framing(headers: &HeaderMap) -> Framing {
    let chunked = headers.get_all("transfer-encoding").iter().any(|v| {
        v.to_str()
            .is_ok_and(|v| v.to_ascii_lowercase().contains("chunked"))
    });
    if chunked {
        return Framing::Chunked;
    }
    match headers
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.trim().parse().ok())
    {
        Some(n) => Framing::Length(n),
        None => Framing::None,
    }
}

/// The length of a whole chunked body (trailers included) at the start of `b`.
fn chunked_len(b: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let line = find(&b[at..], b"\r\n")?;
        let size = String::from_utf8_lossy(&b[at..at + line]);
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).ok()?;
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

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
