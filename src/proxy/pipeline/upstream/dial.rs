//! Dialing an upstream with one or several addresses: round robin, and passive ejection of
//! an address after `max_fails` consecutive connect failures, for `fail_timeout`.
//!
//! A failed connect moves on to the next address at once: nothing of the request was sent, so
//! trying elsewhere cannot deliver it twice. Once connected, a request is never moved.
//! When every address is ejected they are all tried anyway, in order: an upstream that came
//! back is found by the next request instead of after `fail_timeout`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::socket::UpTcp;
use super::tls::{HyperIo, UpIo, UpstreamTls};
use crate::proxy::config::{HealthCheck, UpstreamSettings};

/// Why no connection could be opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// Every address was tried and failed; the last failure is the source.
    #[error(
        "no address of upstream {upstream:?} accepted a connection ({tried} tried); last: {last}"
    )]
    AllFailed {
        upstream: String,
        tried: usize,
        #[source]
        last: AddressError,
    },
}

/// One address's connect failure.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AddressError {
    #[error("{address}: tcp connect error: {source}")]
    Connect {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{address}: tcp connect timed out after {after:?}")]
    Timeout { address: String, after: Duration },
}

struct Address {
    host: String,
    port: u16,
    shown: String,
    /// Consecutive connect failures.
    fails: AtomicU32,
    /// Milliseconds after the dialer's epoch until which the address is skipped.
    ejected_until: AtomicU64,
    /// The last active health check failed.
    down: AtomicBool,
}

/// The addresses of one upstream and their health as seen by connects.
pub(crate) struct Dialer {
    upstream: String,
    addresses: Vec<Address>,
    next: AtomicUsize,
    max_fails: u32,
    fail_timeout: Duration,
    epoch: Instant,
    /// `https` upstreams: the handshake after each connect.
    tls: Option<UpstreamTls>,
}

impl Dialer {
    pub(crate) fn new(settings: &UpstreamSettings) -> Self {
        let addresses = settings
            .addresses
            .iter()
            .map(|a| Address {
                host: a
                    .host()
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
                port: a.port_u16().unwrap_or(80),
                shown: a.to_string(),
                fails: AtomicU32::new(0),
                ejected_until: AtomicU64::new(0),
                down: AtomicBool::new(false),
            })
            .collect();
        Self {
            upstream: settings.name.clone(),
            addresses,
            next: AtomicUsize::new(0),
            max_fails: settings.max_fails,
            fail_timeout: settings.fail_timeout,
            epoch: Instant::now(),
            tls: UpstreamTls::new(settings),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Opens a connection to the next live address, moving on after each failure; for an
    /// `https` upstream, with its TLS handshake (within the same timeout).
    pub(crate) async fn connect(&self, timeout: Duration) -> Result<UpIo, DialError> {
        let n = self.addresses.len();
        let start = if n == 1 {
            0
        } else {
            self.next.fetch_add(1, Ordering::Relaxed) % n
        };
        let now = self.now_ms();
        let live = |a: &Address| {
            !a.down.load(Ordering::Relaxed) && a.ejected_until.load(Ordering::Relaxed) <= now
        };
        let any_live = self.addresses.iter().any(live);
        let mut last = None;
        let mut tried = 0;
        for i in 0..n {
            let a = &self.addresses[(start + i) % n];
            if any_live && !live(a) {
                continue;
            }
            tried += 1;
            let attempt = tokio::time::timeout(timeout, self.open(a));
            let err = match attempt.await {
                Ok(Ok(s)) => {
                    a.fails.store(0, Ordering::Relaxed);
                    a.ejected_until.store(0, Ordering::Relaxed);
                    return Ok(s);
                }
                Ok(Err(source)) => AddressError::Connect {
                    address: a.shown.clone(),
                    source,
                },
                Err(_) => AddressError::Timeout {
                    address: a.shown.clone(),
                    after: timeout,
                },
            };
            let fails = a.fails.fetch_add(1, Ordering::Relaxed).saturating_add(1);
            if fails >= self.max_fails {
                let until = self.now_ms().saturating_add(
                    u64::try_from(self.fail_timeout.as_millis()).unwrap_or(u64::MAX),
                );
                a.ejected_until.store(until, Ordering::Relaxed);
                tracing::warn!(upstream = %self.upstream, address = %a.shown, error = %err, fails, eject_for = ?self.fail_timeout, "upstream address ejected");
            } else {
                tracing::warn!(upstream = %self.upstream, address = %a.shown, error = %err, "upstream connect failed");
            }
            last = Some(err);
        }
        Err(DialError::AllFailed {
            upstream: self.upstream.clone(),
            tried,
            last: last.expect("an upstream has at least one address"),
        })
    }
}

impl Dialer {
    async fn open(&self, a: &Address) -> std::io::Result<UpIo> {
        let tcp = TcpStream::connect((a.host.as_str(), a.port)).await?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => Ok(UpIo::Plain(UpTcp::new(tcp))),
            // Boxed: a TLS handshake's state is several kilobytes, and this future is part of
            // every request's future (which hyper moves whole), TLS or not.
            Some(tls) => Box::pin(tls.connect(&a.host, UpTcp::new(tcp))).await,
        }
    }
}

/// Checks every address of `dialer` every `check.interval` until the dialer is dropped.
pub(crate) fn spawn_health_checks(dialer: &Arc<Dialer>, check: HealthCheck, connect: Duration) {
    let weak: Weak<Dialer> = Arc::downgrade(dialer);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(check.interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Some(dialer) = weak.upgrade() else {
                return; // the configuration that had this upstream is gone
            };
            for a in &dialer.addresses {
                let limit = connect + check.interval;
                let verdict = match tokio::time::timeout(
                    limit,
                    probe(&dialer, a, &check.path, connect),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {limit:?}")),
                };
                match verdict {
                    Ok(()) => {
                        if a.down.swap(false, Ordering::Relaxed) {
                            tracing::info!(upstream = %dialer.upstream, address = %a.shown, "upstream address passes its health check again");
                        }
                        a.fails.store(0, Ordering::Relaxed);
                        a.ejected_until.store(0, Ordering::Relaxed);
                    }
                    Err(why) => {
                        if !a.down.swap(true, Ordering::Relaxed) {
                            tracing::warn!(upstream = %dialer.upstream, address = %a.shown, error = %why, "upstream address fails its health check; skipped");
                        }
                    }
                }
            }
        }
    });
}

/// `GET path` on one address: Ok for a 2xx or 3xx status line.
async fn probe(dialer: &Dialer, a: &Address, path: &str, connect: Duration) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = match tokio::time::timeout(connect, dialer.open(a)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(format!("connect: {e}")),
        Err(_) => return Err(format!("connect timed out after {connect:?}")),
    };
    let req = format!(
        "GET {path} HTTP/1.1\r\nhost: {}\r\nuser-agent: palisade-health-check\r\nconnection: close\r\n\r\n",
        a.shown
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut head = Vec::with_capacity(64);
    let mut buf = [0u8; 256];
    while !head.contains(&b'\n') && head.len() < 1024 {
        let n = s.read(&mut buf).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let status = line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse::<u16>().ok());
    match status {
        Some(200..=399) => Ok(()),
        Some(code) => Err(format!("status {code}")),
        None => Err(format!(
            "not an HTTP/1.x answer: {:?}",
            line.lines().next().unwrap_or("")
        )),
    }
}

/// The h2c pooled client's connector: dials through the shared [`Dialer`] whatever
/// authority the request URI carries (which, for h2c, is the client's, sent on as
/// :authority).
#[derive(Clone)]
pub(crate) struct Dial {
    pub(crate) dialer: Arc<Dialer>,
    pub(crate) timeout: Duration,
}

impl tower_service::Service<Uri> for Dial {
    type Response = HyperIo;
    type Error = DialError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, DialError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), DialError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let (dialer, timeout) = (Arc::clone(&self.dialer), self.timeout);
        Box::pin(async move {
            dialer
                .connect(timeout)
                .await
                .map(|io| HyperIo(TokioIo::new(io)))
        })
    }
}
