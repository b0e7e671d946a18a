//! TLS to `https://` upstreams: the client configuration (the upstream's `ca`, or the system's
//! trusted roots; ALPN by protocol) and the connection type that is either plain or TLS.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use super::socket::{Check, UpTcp};
use crate::proxy::config::{Protocol, UpstreamSettings};

/// The TLS side of an `https` upstream.
#[derive(Clone)]
pub(crate) struct UpstreamTls {
    connector: tokio_rustls::TlsConnector,
}

impl UpstreamTls {
    /// `None` for `http` upstreams. The CA file was checked by the config; a file that went
    /// bad since, or a system store that cannot be read, leaves no roots: every handshake then
    /// fails (502) rather than trusting anything.
    pub(crate) fn new(settings: &UpstreamSettings) -> Option<Self> {
        if settings.scheme != http::uri::Scheme::HTTPS {
            return None;
        }
        let mut roots = RootCertStore::empty();
        match &settings.ca {
            Some(ca) => match CertificateDer::pem_file_iter(ca) {
                Ok(certs) => {
                    for c in certs.flatten() {
                        let _ = roots.add(c);
                    }
                }
                Err(e) => {
                    tracing::error!(upstream = %settings.name, ca = %ca.display(), error = %e, "cannot read the upstream's CA file")
                }
            },
            None => {
                let native = rustls_native_certs::load_native_certs();
                for e in &native.errors {
                    tracing::warn!(upstream = %settings.name, error = %e, "reading the system's trusted roots");
                }
                roots.add_parsable_certificates(native.certs);
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = match settings.protocol {
            Protocol::H2 | Protocol::H2c => vec![b"h2".to_vec()],
            Protocol::Http1 => vec![b"http/1.1".to_vec()],
        };
        Some(Self {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    /// The TLS handshake on `tcp`, sending `host` as SNI and checking the certificate for it.
    pub(crate) async fn connect(&self, host: &str, tcp: UpTcp) -> io::Result<UpIo> {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let s = self.connector.connect(name, tcp).await?;
        Ok(UpIo::Tls(Box::new(s)))
    }
}

/// A connection to an upstream, plain or TLS.
pub(crate) enum UpIo {
    Plain(UpTcp),
    Tls(Box<TlsStream<UpTcp>>),
}

impl UpIo {
    /// The handle that checks the connection's socket while hyper owns it.
    pub(crate) fn check(&self) -> Check {
        match self {
            UpIo::Plain(s) => s.check(),
            UpIo::Tls(s) => s.get_ref().0.check(),
        }
    }
}

impl AsyncRead for UpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpIo::Plain(s) => s.is_write_vectored(),
            UpIo::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_flush(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// [`UpIo`] for hyper: what the pooled HTTP/2 client's connector returns.
pub(crate) struct HyperIo(pub(crate) TokioIo<UpIo>);

impl Connection for HyperIo {
    fn connected(&self) -> Connected {
        let c = Connected::new();
        match self.0.inner() {
            UpIo::Tls(s) if s.get_ref().1.alpn_protocol() == Some(b"h2") => c.negotiated_h2(),
            _ => c,
        }
    }
}

impl hyper::rt::Read for HyperIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for HyperIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        hyper::rt::Write::is_write_vectored(&self.0)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}
