//! The differential test's client: responses read by their framing.

#[allow(clippy::wildcard_imports)]
use super::*;

// ---------------------------------------------------------------------------------------------
// The client side: responses read by their framing.

/// One client connection and the bytes read from it and not consumed yet.
pub(crate) struct Client {
    pub(crate) s: TcpStream,
    pub(crate) buf: Vec<u8>,
    /// Why the connection ended, once it did.
    pub(crate) ended: Option<&'static str>,
    pub(crate) deadline: tokio::time::Instant,
}

impl Client {
    pub(crate) async fn connect(addr: SocketAddr) -> Self {
        Self {
            s: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
            ended: None,
            deadline: tokio::time::Instant::now() + CASE_LIMIT,
        }
    }

    /// The connection's local port (the proxy's access log shows it as the peer's).
    pub(crate) fn port(&self) -> u16 {
        self.s.local_addr().map_or(0, |a| a.port())
    }

    /// Reads more bytes; `false` once the connection ended (EOF, error or the case's limit).
    pub(crate) async fn fill(&mut self) -> bool {
        if self.ended.is_some() {
            return false;
        }
        let mut chunk = [0u8; 16384];
        match tokio::time::timeout_at(self.deadline, self.s.read(&mut chunk)).await {
            Err(_) => self.ended = Some("TIMEOUT"),
            Ok(Ok(0)) => self.ended = Some("EOF"),
            Ok(Err(_)) => self.ended = Some("ERROR"),
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                return true;
            }
        }
        false
    }

    pub(crate) async fn write(&mut self, bytes: &[u8]) -> bool {
        self.s.write_all(bytes).await.is_ok()
    }

    /// One response message (interim ones included, one at a time): its bytes, its status,
    /// and whether it is complete. `None` when nothing at all came.
    pub(crate) async fn message(&mut self, head_request: bool) -> Option<(Vec<u8>, u16, bool)> {
        let end = loop {
            if let Some(e) = find(&self.buf, b"\r\n\r\n") {
                break e + 4;
            }
            if !self.fill().await {
                if self.buf.is_empty() {
                    return None;
                }
                let all = std::mem::take(&mut self.buf);
                return Some((all, 0, false));
            }
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let chunked =
            header(&head, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let body_len =
            if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
                Some(0)
            } else if chunked {
                loop {
                    if let Some(n) = chunked_len(&self.buf[end..]) {
                        break Some(n);
                    }
                    if !self.fill().await {
                        break None;
                    }
                }
            } else if let Some(cl) = header(&head, "content-length") {
                let n: usize = cl.parse().unwrap_or(0);
                loop {
                    if self.buf.len() >= end + n {
                        break Some(n);
                    }
                    if !self.fill().await {
                        break None;
                    }
                }
            } else {
                // Until the connection ends.
                while self.fill().await {}
                Some(self.buf.len() - end)
            };
        match body_len {
            Some(n) => Some((self.buf.drain(..end + n).collect(), status, true)),
            None => Some((std::mem::take(&mut self.buf), status, false)),
        }
    }

    /// A final response (interim ones before it kept in the text), or what came before the
    /// connection ended. `true`: the response is complete and the connection is still usable.
    pub(crate) async fn response(&mut self, head_request: bool, out: &mut Vec<u8>) -> bool {
        loop {
            match self.message(head_request).await {
                None => return false,
                Some((bytes, status, complete)) => {
                    out.extend_from_slice(&bytes);
                    if !complete {
                        out.extend_from_slice(b"<<INCOMPLETE>>");
                        return false;
                    }
                    if (100..200).contains(&status) && status != 101 {
                        continue;
                    }
                    return status != 101;
                }
            }
        }
    }

    /// Writes the probe and reads until its answer: `Ok(())` if the connection was still open;
    /// responses before the probe's (answers to bytes the case left) go to `extra`.
    pub(crate) async fn probe(&mut self, extra: &mut Vec<u8>) -> bool {
        if self.ended.is_some() || !self.write(PROBE).await {
            return false;
        }
        loop {
            let mut one = Vec::new();
            let ok = self.response(false, &mut one).await;
            if one.windows(10).any(|w| w == b"x-probe: 1") {
                return true;
            }
            extra.extend_from_slice(&one);
            if !ok {
                return false;
            }
        }
    }
}
