//! The differential test's seeded corpus of requests.

#[allow(clippy::wildcard_imports)]
use super::*;

// ---------------------------------------------------------------------------------------------
// The corpus.

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() >> 33) as usize % n
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        (self.next() >> 33) % 100 < percent
    }
    pub(crate) fn pick<'a, T: ?Sized>(&mut self, xs: &[&'a T]) -> &'a T {
        xs[self.below(xs.len())]
    }
}

/// One request of the corpus.
#[derive(Clone)]
pub(crate) struct Case {
    pub(crate) bytes: Vec<u8>,
    /// The method as sent (a response to exactly `HEAD` has no body).
    pub(crate) method: String,
}

/// The generator's idea of the marks (only to make tokens that are likely fresh, equal or
/// stale; both proxies get the same tokens whatever the marks really are).
pub(crate) struct Gen {
    pub(crate) rng: Rng,
    pub(crate) hi: u64,
}

impl Gen {
    pub(crate) fn token_value(&mut self) -> String {
        let r = &mut self.rng;
        match r.below(24) {
            0..=6 => {
                self.hi += 1 + r.below(3) as u64;
                self.hi.to_string()
            }
            7..=9 => self.hi.to_string(),
            10..=11 => self.hi.saturating_sub(1 + r.below(3) as u64).to_string(),
            12 => format!("0{}", self.hi),
            13 => format!("+{}", self.hi),
            14 => format!(" {} ", self.hi),
            15 => format!("{}\t", self.hi + 1),
            16 => "99999999999999999999999".to_owned(),
            17 => "-1".to_owned(),
            18 => format!("{}, {}", self.hi, self.hi + 1),
            19 => String::new(),
            20 => "0".to_owned(),
            21 => "0x10".to_owned(),
            22 => format!("{}abc", self.hi),
            _ => "1e3".to_owned(),
        }
    }

    /// A request; `tame`: a well-formed HTTP/1.1 request that keeps its connection open
    /// (mostly), for the keep-alive and pipelined groups.
    pub(crate) fn case(&mut self, tame: bool) -> Case {
        let wild = if tame { 0 } else { 100 };
        let r = &mut self.rng;
        let method = if r.chance(80) || tame {
            r.pick(&[
                "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "POST", "GET",
            ])
        } else {
            r.pick(&[
                "get", "Post", "head", "pUt", "FOO", "M-SEARCH", "TRACE", "CONNECT", "G@T",
                "delete", "PROPFIND",
            ])
        }
        .to_owned();
        let mut target = r
            .pick(&[
                "/orders",
                "/orders/7",
                "/orders/a/b",
                "/acct",
                "/acct/x",
                "/exact",
                "/h/1",
                "/",
                "/free/a",
                "/ordersx",
            ])
            .to_owned();
        if r.chance(wild * 35 / 100) {
            target = match r.below(18) {
                0 => format!("/{target}"),
                1 => target.replacen('/', "/./", 1),
                2 => format!("/x/..{target}"),
                3 => target.replacen('o', "%6F", 1),
                4 => target.replacen('o', "%6f", 1),
                5 => format!("{target}%2Fx"),
                6 => format!("/%2e%2e{target}"),
                7 => format!("{target}/%2e/y"),
                8 => target.to_uppercase(),
                9 => format!("{target}/"),
                10 => format!("{target}//z"),
                11 => format!("{target}/%C3%A9"),
                12 => format!("{target}/é"),
                13 => format!("{target}/%zz"),
                14 => format!("{target}/%00"),
                15 => format!("{target};p=1"),
                16 => format!("/a/../../{target}"),
                _ => format!("{target}/.."),
            };
        }
        if r.chance(25) {
            target.push_str(r.pick(&["?a=1", "?a=1&b=%2F", "?", "?x=/../orders", "?q=%41&q=é"]));
        }
        if r.chance(wild * 4 / 100) {
            target.push_str("#frag");
        }
        let mut absolute = None;
        if r.chance(wild * 10 / 100) {
            target = match r.below(7) {
                0 => "*".to_owned(),
                1 => String::new(),
                2 => {
                    let a = r.pick(&["a.test", "api.example.com", "other.test", "API.example.com"]);
                    absolute = Some(a.to_owned());
                    format!("http://{a}{target}")
                }
                3 => format!("HTTP://a.test{target}"),
                4 => "a.test:80".to_owned(),
                5 => format!("https://a.test{target}"),
                _ => "/a\x7fb".to_owned(),
            };
        }
        let version = if tame || r.chance(86) {
            "HTTP/1.1"
        } else {
            r.pick(&[
                "HTTP/1.0", "HTTP/1.0", "HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "HTTP/0.9", "http/1.1",
            ])
        };
        let mut headers: Vec<String> = Vec::new();
        // Host.
        let host = if target.starts_with("/h") || r.chance(15) {
            "api.example.com"
        } else {
            "a.test"
        };
        if r.chance(wild * 18 / 100) {
            match r.below(12) {
                0 => {}
                1 => {
                    headers.push(format!("host: {host}"));
                    headers.push(format!("host: {host}"));
                }
                2 => {
                    headers.push(format!("host: {host}"));
                    headers.push("Host: other.test".to_owned());
                }
                3 => headers.push(format!("Host: {host}:8080")),
                4 => headers.push(format!("HOST: {}", host.to_uppercase())),
                5 => headers.push(format!("host: {host}.")),
                6 => headers.push("host: ".to_owned()),
                7 => headers.push("host: a..b".to_owned()),
                8 => headers.push("host: [::1]:80".to_owned()),
                9 => headers.push(format!("host: {host}:99999")),
                10 => headers.push("host: a b".to_owned()),
                _ => headers.push(format!("host: {host}.:81")),
            }
        } else if let Some(a) = &absolute {
            // Conflicting with the absolute-form authority, or agreeing.
            if r.chance(50) {
                headers.push(format!("host: {a}"));
            } else {
                headers.push("host: other.test".to_owned());
            }
        } else {
            headers.push(format!("{}: {host}", r.pick(&["host", "host", "Host"])));
        }
        // The fencing token.
        if r.chance(80) {
            let name = if r.chance(wild * 10 / 100) {
                self.rng.pick(&[
                    "X-Fencing-Token",
                    "X-FENCING-TOKEN",
                    "x_fencing_token",
                    "x-fencing_token",
                ])
            } else {
                "x-fencing-token"
            };
            let v = if tame {
                // Fresh or equal only in the groups, so that they stay on the fast path.
                if self.rng.chance(50) {
                    self.hi += 1;
                }
                self.hi.to_string()
            } else {
                self.token_value()
            };
            headers.push(format!("{name}: {v}"));
            if self.rng.chance(wild * 8 / 100) {
                let v2 = if self.rng.chance(50) {
                    v.clone()
                } else {
                    self.token_value()
                };
                headers.push(format!("x-fencing-token: {v2}"));
            }
        }
        let r = &mut self.rng;
        // The body and its framing.
        // Small bodies, in the head's own segment. Not larger ones: whether the connection
        // stays open after a refusal that left a large body unread depends on how much of it
        // had arrived (see the report: hyper drains what is readable, the fast path only what
        // it has buffered), which no deterministic test can pin down.
        let n = r.below(20);
        let payload: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
        let mut body: Vec<u8> = Vec::new();
        let with_body =
            matches!(method.as_str(), "POST" | "PUT" | "PATCH" | "Post" | "pUt") || r.chance(10);
        if with_body || r.chance(wild * 15 / 100) {
            let k = if r.chance(wild * 25 / 100) {
                r.below(14)
            } else {
                0
            };
            match k {
                0 => {
                    headers.push(format!("content-length: {n}"));
                    body = payload.clone();
                }
                1 => headers.push("content-length: 0".to_owned()),
                2 => {
                    headers.push(format!("content-length: {n}"));
                    headers.push(format!("content-length: {n}"));
                    body = payload.clone();
                }
                3 => {
                    headers.push(format!("content-length: {n}"));
                    headers.push(format!("Content-Length: {}", n + 1));
                    body = payload.clone();
                    body.push(b'z');
                }
                4 => {
                    headers.push(format!("content-length: +{n}"));
                    body = payload.clone();
                }
                5 => {
                    headers.push(format!("content-length:   {n}  "));
                    body = payload.clone();
                }
                6 => {
                    headers.push(format!("content-length: {n}, {n}"));
                    body = payload.clone();
                }
                7 => {
                    headers.push(format!("content-length: 0{n}"));
                    body = payload.clone();
                }
                8 => {
                    headers.push("transfer-encoding: chunked".to_owned());
                    body = chunked(&payload);
                }
                9 => {
                    headers.push(format!("content-length: {n}"));
                    headers.push("transfer-encoding: chunked".to_owned());
                    body = chunked(&payload);
                }
                10 => {
                    headers.push("Transfer-Encoding: Chunked".to_owned());
                    body = chunked(&payload);
                }
                11 => {
                    headers.push(
                        r.pick(&[
                            "transfer-encoding: gzip, chunked",
                            "transfer-encoding: identity, chunked",
                            "transfer-encoding: chunked, chunked",
                            "transfer-encoding: identity",
                        ])
                        .to_owned(),
                    );
                    body = chunked(&payload);
                }
                12 => {
                    headers.push("transfer-encoding: chunked".to_owned());
                    headers.push(
                        r.pick(&[
                            "transfer-encoding: chunked",
                            format!("content-length: {n}").as_str(),
                        ])
                        .to_owned(),
                    );
                    body = chunked(&payload);
                }
                _ => {
                    headers.push("content-length: 99999999999999999999".to_owned());
                }
            }
        }
        // Connection and other hop-by-hop headers.
        if r.chance(if tame { 5 } else { 25 }) {
            let c = if tame {
                r.pick(&["keep-alive", "x-foo, keep-alive", "te"])
            } else {
                r.pick(&[
                    "close",
                    "keep-alive",
                    "x-foo, keep-alive",
                    "close, x-fencing-token",
                    "host",
                    "content-length",
                    "Upgrade",
                    "te",
                    "keep-alive, x-resp",
                    "x-forwarded-for",
                    "CLOSE",
                    "x-foo,,close",
                ])
            };
            headers.push(format!("{}: {c}", r.pick(&["connection", "Connection"])));
            if c.contains("x-foo") {
                headers.push("x-foo: 1".to_owned());
            }
        }
        if r.chance(20) {
            headers.push(
                r.pick(&[
                    "Keep-Alive: timeout=5",
                    "Proxy-Connection: keep-alive",
                    "TE: trailers",
                    "te: gzip",
                    "TE: trailers;q=1, deflate",
                    "Proxy-Authorization: Basic eDp5",
                    "Trailer: x-t",
                    "Upgrade: websocket",
                    "upgrade: h2c",
                ])
                .to_owned(),
            );
        }
        if r.chance(wild * 5 / 100) {
            headers.push(r.pick(&["Expect: 100-continue", "expect: foo"]).to_owned());
        }
        if r.chance(20) {
            match r.below(5) {
                0 => headers.push("x-forwarded-for: 1.2.3.4".to_owned()),
                1 => headers.push("X-Forwarded-For: 1.2.3.4, 5.6.7.8".to_owned()),
                2 => {
                    headers.push("x-forwarded-for: 1.2.3.4".to_owned());
                    headers.push("x-forwarded-for: 9.9.9.9".to_owned());
                }
                3 => headers.push("x-forwarded-for:".to_owned()),
                _ => headers.push("x-forwarded-proto: https".to_owned()),
            }
        }
        if r.chance(30) {
            headers.push(format!(
                "x-resp: {}",
                r.pick(if tame { TAME_KINDS } else { KINDS })
            ));
        }
        if r.chance(25) {
            headers.push(
                r.pick(&[
                    "X-A: 1",
                    "x-a: 2",
                    "User-Agent: diff/1",
                    "accept: */*",
                    "X-Odd!#$%&'*+-.^_`|~: v",
                    "x-tab: a\tb",
                    "x-obs: caf\u{e9}",
                    "Content-Type: application/json",
                    "cookie: a=1",
                ])
                .to_owned(),
            );
        }
        if r.chance(wild * 3 / 100) {
            headers.push("content-type: application/grpc".to_owned());
        }
        if r.chance(wild * 3 / 100) {
            headers.push(format!("x-long: {}", "v".repeat(8000)));
        }
        // Shuffle (Fisher-Yates): order of groups and of a name's fields both matter.
        for i in (1..headers.len()).rev() {
            let j = r.below(i + 1);
            headers.swap(i, j);
        }
        let mut head = format!("{method} {target} {version}\r\n");
        for h in &headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        let mut bytes = head.into_bytes();
        // Malformed heads (after the shuffle, at a random line).
        if r.chance(wild * 6 / 100) {
            let bad: &[u8] = match r.below(8) {
                0 => b"x-fold: 1\r\n  folded\r\n",
                1 => b"x-lf: 1\n",
                2 => b"x-a : 1\r\n",
                3 => b"x-nul: a\0b\r\n",
                4 => b"x-\xc3\xb8dd: 1\r\n",
                5 => b": empty\r\n",
                6 => b"x-cr: a\rb\r\n",
                _ => b"x-big: 1\r\n",
            };
            bytes.extend_from_slice(bad);
            if bad == b"x-big: 1\r\n" {
                bytes.extend_from_slice(format!("x-huge: {}\r\n", "h".repeat(70_000)).as_bytes());
            }
        }
        if r.chance(wild / 100) {
            // A bare LF request line.
            if let Some(p) = find(&bytes, b"\r\n") {
                bytes.remove(p);
            }
        }
        bytes.extend_from_slice(b"\r\n");
        bytes.extend_from_slice(&body);
        Case { bytes, method }
    }
}

pub(crate) fn chunked(payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    if !payload.is_empty() {
        b.extend_from_slice(format!("{:x}\r\n", payload.len()).as_bytes());
        b.extend_from_slice(payload);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(b"0\r\n\r\n");
    b
}
