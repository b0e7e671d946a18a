//! `[marks.etcd]` as the etcd mark store takes it: plain values, validated by the proxy's
//! configuration (or built by a layer user in code).

use std::path::PathBuf;
use std::time::Duration;

use super::{Consistency, StoreError};

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
