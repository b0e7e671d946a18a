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

/// How many connections each proxy got from [`Client::connect`] so far.
static CONNECTED: Mutex<Vec<(SocketAddr, u32)>> = Mutex::new(Vec::new());

/// The `n`th source address: every connection of the test has one of its own (127/8 is all
/// loopback), so that the access log's `peer` names the connection. By port, a connection's
/// lines could be taken for a later one's: the kernel reuses a closed connection's port.
fn source(range: u8, n: u32) -> std::net::Ipv4Addr {
    // Each octet in 1..=250.
    let octet = |x: u32| u8::try_from(x % 250 + 1).unwrap();
    std::net::Ipv4Addr::new(127, range + octet(n / 62_500), octet(n / 250), octet(n))
}

impl Client {
    /// A connection to `addr` from the next source address of that proxy's: the `n`th
    /// connection to one proxy comes from the same address as the `n`th to the other (their
    /// `x-forwarded-for` and access log lines are alike).
    pub(crate) async fn connect(addr: SocketAddr) -> Self {
        let n = {
            let mut seen = CONNECTED.lock().unwrap();
            if let Some(e) = seen.iter_mut().find(|e| e.0 == addr) {
                e.1 += 1;
                e.1
            } else {
                seen.push((addr, 0));
                0
            }
        };
        Self::connect_from(addr, source(1, n)).await
    }

    /// A connection to `addr` from an address of a range of its own, for the requests that
    /// bring the two proxies' marks together (sent to one proxy only).
    pub(crate) async fn connect_aside(addr: SocketAddr) -> Self {
        static ASIDE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = ASIDE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self::connect_from(addr, source(100, n)).await
    }

    async fn connect_from(addr: SocketAddr, ip: std::net::Ipv4Addr) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((ip, 0))).unwrap();
        Self {
            s: socket.connect(addr).await.unwrap(),
            buf: Vec::new(),
            ended: None,
            deadline: tokio::time::Instant::now() + CASE_LIMIT,
        }
    }

    /// The connection's own source address (the proxy's access log shows it as the peer's).
    pub(crate) fn id(&self) -> std::net::IpAddr {
        self.s
            .local_addr()
            .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip())
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
