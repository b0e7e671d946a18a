//! `[proxy.tls]` and `[admin.tls]`: a listener's certificate chain and key, and optionally the
//! CA that client certificates must chain to. The files are read and checked here, so that
//! `palisade check` and a bad config at startup fail with the key and the reason, not at the
//! first handshake.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, server::WebPkiClientVerifier, RootCertStore, ServerConfig};
use toml::Spanned;

use super::*;

/// `[proxy.tls]` or `[admin.tls]`, with the files loaded into a ready server configuration.
#[derive(Clone)]
pub struct TlsSettings {
    /// `cert`: PEM certificate chain, leaf first (relative paths: to the config file).
    pub cert: PathBuf,
    /// `key`: PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// `client_ca`: PEM CA certificates; when set, every client must present a certificate
    /// that chains to one of them.
    pub client_ca: Option<PathBuf>,
    /// The rustls configuration built from the files, ALPN `h2` and `http/1.1`.
    pub server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("client_ca", &self.client_ca)
            .finish_non_exhaustive()
    }
}

impl Validator<'_> {
    /// The table `table` (`proxy.tls` or `admin.tls`, for messages).
    pub(super) fn tls(&self, raw: raw::Tls, table: &str) -> Result<TlsSettings, ConfigError> {
        let base = self.file.parent().unwrap_or(Path::new(""));
        let path = |s: &Spanned<String>| base.join(s.get_ref());
        let (cert, key) = (path(&raw.cert), path(&raw.key));
        let (cert_key, key_key, ca_key) = (
            format!("{table}.cert"),
            format!("{table}.key"),
            format!("{table}.client_ca"),
        );
        let chain: Vec<CertificateDer<'static>> = self.pem_certs(&raw.cert, &cert, &cert_key)?;
        let private = PrivateKeyDer::from_pem_file(&key).map_err(|e| {
            self.at(
                &raw.key,
                &key_key,
                format_args!("{}: no usable private key: {e}", key.display()),
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions");
        let client_ca = raw.client_ca.as_ref().map(path);
        let builder = match (&raw.client_ca, &client_ca) {
            (Some(spanned), Some(ca)) => {
                let mut roots = RootCertStore::empty();
                for c in self.pem_certs(spanned, ca, &ca_key)? {
                    roots.add(c).map_err(|e| {
                        self.at(
                            spanned,
                            &ca_key,
                            format_args!("{}: not a usable CA certificate: {e}", ca.display()),
                        )
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| {
                            self.at(spanned, &ca_key, format_args!("{}: {e}", ca.display()))
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut server = builder.with_single_cert(chain, private).map_err(|e| {
            // rustls checks that the key belongs to the leaf certificate.
            self.at(
                &raw.key,
                &key_key,
                format_args!(
                    "{} does not go with the certificate {}: {e}",
                    key.display(),
                    cert.display()
                ),
            )
        })?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsSettings {
            cert,
            key,
            client_ca,
            server: Arc::new(server),
        })
    }

    pub(super) fn pem_certs(
        &self,
        at: &Spanned<String>,
        file: &Path,
        key: &str,
    ) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
        let text = std::fs::read(file)
            .map_err(|e| self.at(at, key, format_args!("cannot read {}: {e}", file.display())))?;
        let certs: Vec<_> = CertificateDer::pem_slice_iter(&text)
            .collect::<Result<_, _>>()
            .map_err(|e| self.at(at, key, format_args!("{}: bad PEM: {e}", file.display())))?;
        if certs.is_empty() {
            return Err(self.at(
                at,
                key,
                format_args!("{} holds no PEM certificate", file.display()),
            ));
        }
        Ok(certs)
    }
}
