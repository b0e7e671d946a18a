//! `[marks.etcd]`: where the shared marks live when `[marks] store = "etcd"` (DESIGN 4).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{ConfigError, Validator};
use crate::marks::{Consistency, StoreError};

/// `[marks.etcd]`, validated.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// `endpoints`: `http://host:port` (or `https://` with TLS).
    pub endpoints: Vec<String>,
    /// `prefix`: marks live at `<prefix><resource>`. Default `/palisade/marks/`.
    pub prefix: String,
    /// `consistency`: `linearizable` (default) or `cached`.
    pub consistency: Consistency,
    /// `dial_timeout_ms`: the first connection. Default 2000.
    pub dial_timeout: Duration,
    /// `request_timeout_ms`: every request; past it guarded requests get 503. Default 2000.
    pub request_timeout: Duration,
    /// `username`, for etcd's authentication.
    pub username: Option<String>,
    /// Where the password comes from (never logged, never printed by `Debug`).
    pub password: Option<Password>,
    /// `ca`, `cert`, `key`: TLS to etcd.
    pub tls: Option<EtcdTls>,
}

/// The etcd password: given inline (`password`) or named by `password_env`.
#[derive(Clone, PartialEq, Eq)]
pub enum Password {
    /// `password = "..."` in the file.
    Inline(String),
    /// `password_env = "VAR"`: read from the environment at connect time.
    Env(String),
}

/// TLS files for the etcd connection, resolved against the config file's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// `ca`: the CA that signed etcd's certificate.
    pub ca: Option<PathBuf>,
    /// `cert` and `key`: a client certificate.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for EtcdSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdSettings")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("consistency", &self.consistency)
            .field("request_timeout", &self.request_timeout)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl EtcdSettings {
    /// The password, read now (from the environment when so configured).
    ///
    /// # Errors
    /// [`StoreError::Etcd`] when `password_env` names an unset variable, or a username has no
    /// password.
    pub fn password(&self) -> Result<String, StoreError> {
        match &self.password {
            Some(Password::Inline(p)) => Ok(p.clone()),
            Some(Password::Env(var)) => std::env::var(var).map_err(|_| {
                StoreError::Etcd(format!("password_env names {var}, which is not set"))
            }),
            None => Err(StoreError::Etcd("username without a password".to_owned())),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Raw {
    endpoints: Spanned<Vec<Spanned<String>>>,
    prefix: Option<Spanned<String>>,
    #[serde(default = "linearizable")]
    consistency: Spanned<Consistency>,
    dial_timeout_ms: Option<Spanned<u64>>,
    request_timeout_ms: Option<Spanned<u64>>,
    username: Option<Spanned<String>>,
    password: Option<Spanned<String>>,
    password_env: Option<Spanned<String>>,
    ca: Option<Spanned<String>>,
    cert: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
}

fn linearizable() -> Spanned<Consistency> {
    Spanned::new(0..0, Consistency::Linearizable)
}

impl Validator<'_> {
    pub(super) fn etcd(&self, raw: Raw) -> Result<EtcdSettings, ConfigError> {
        let k = |s: &str| format!("marks.etcd.{s}");
        if raw.endpoints.get_ref().is_empty() {
            return Err(self.at(&raw.endpoints, k("endpoints"), "list at least one endpoint"));
        }
        let mut endpoints = Vec::new();
        let mut https = false;
        for (i, e) in raw.endpoints.get_ref().iter().enumerate() {
            let uri: Result<http::Uri, _> = e.get_ref().parse();
            let ok = uri.as_ref().ok().filter(|u| {
                matches!(u.scheme_str(), Some("http" | "https"))
                    && u.authority().is_some_and(|a| a.port_u16().is_some())
                    && matches!(u.path(), "" | "/")
            });
            let Some(uri) = ok else {
                return Err(self.at(
                    e,
                    k(&format!("endpoints[{i}]")),
                    format_args!("{:?} is not http(s)://host:port", e.get_ref()),
                ));
            };
            https |= uri.scheme_str() == Some("https");
            endpoints.push(e.get_ref().clone());
        }
        let prefix = match raw.prefix {
            None => "/palisade/marks/".to_owned(),
            Some(p) if p.get_ref().is_empty() => {
                return Err(self.at(&p, k("prefix"), "must not be empty"))
            }
            Some(p) => p.into_inner(),
        };
        if *raw.consistency.get_ref() == Consistency::Local {
            return Err(self.at(
                &raw.consistency,
                k("consistency"),
                "must be \"linearizable\" or \"cached\"",
            ));
        }
        let ms = |v: Option<Spanned<u64>>, key: &str| -> Result<Duration, ConfigError> {
            Ok(Duration::from_millis(self.positive(v, &k(key), 2_000)?))
        };
        let dial_timeout = ms(raw.dial_timeout_ms, "dial_timeout_ms")?;
        let request_timeout = ms(raw.request_timeout_ms, "request_timeout_ms")?;
        let password = match (raw.password, raw.password_env) {
            (Some(p), Some(_)) => {
                return Err(self.at(&p, k("password"), "set password or password_env, not both"))
            }
            (Some(p), None) => Some(Password::Inline(p.into_inner())),
            (None, Some(v)) => {
                if std::env::var_os(v.get_ref()).is_none() {
                    return Err(self.at(
                        &v,
                        k("password_env"),
                        format_args!("the environment variable {} is not set", v.get_ref()),
                    ));
                }
                Some(Password::Env(v.into_inner()))
            }
            (None, None) => None,
        };
        let username = raw.username.map(Spanned::into_inner);
        if username.is_some() != password.is_some() {
            return Err(self.error(
                raw.endpoints.span().start,
                k("username"),
                "username and password (or password_env) go together",
            ));
        }
        let file = |v: Spanned<String>, key: &str| -> Result<PathBuf, ConfigError> {
            let base = self.file.parent().unwrap_or(Path::new(""));
            let path = base.join(v.get_ref());
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => Ok(path),
                Ok(_) => Err(self.at(&v, k(key), format_args!("{} is not a file", path.display()))),
                Err(e) => Err(self.at(&v, k(key), format_args!("{}: {e}", path.display()))),
            }
        };
        let ca = raw.ca.map(|v| file(v, "ca")).transpose()?;
        let identity = match (raw.cert, raw.key) {
            (Some(c), Some(key)) => Some((file(c, "cert")?, file(key, "key")?)),
            (Some(c), None) => return Err(self.at(&c, k("key"), "cert needs key")),
            (None, Some(key)) => return Err(self.at(&key, k("cert"), "key needs cert")),
            (None, None) => None,
        };
        let tls = (ca.is_some() || identity.is_some()).then_some(EtcdTls { ca, identity });
        if https && tls.is_none() {
            return Err(self.at(
                &raw.endpoints,
                k("ca"),
                "https:// endpoints need `ca` (the CA of etcd's certificate)",
            ));
        }
        if !cfg!(feature = "etcd") {
            return Err(self.at(
                &raw.endpoints,
                k("endpoints"),
                "this palisade was built without the `etcd` feature (cargo build --features etcd)",
            ));
        }
        if tls.is_some() && !cfg!(feature = "etcd-tls") {
            return Err(self.at(
                &raw.endpoints,
                k("ca"),
                "TLS to etcd needs palisade built with the `etcd-tls` feature",
            ));
        }
        Ok(EtcdSettings {
            endpoints,
            prefix,
            consistency: *raw.consistency.get_ref(),
            dial_timeout,
            request_timeout,
            username,
            password,
            tls,
        })
    }
}
