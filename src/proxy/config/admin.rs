//! `[admin]`: the admin listener's address, the bearer token its mutating endpoints require
//! (`token_env`), and its TLS (`[admin.tls]`, the same keys and checks as `[proxy.tls]`).

use std::net::SocketAddr;

use subtle::ConstantTimeEq;
use toml::Spanned;

use super::*;

/// `[admin]`.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// `listen`: `/metrics`, `/livez`, `/readyz`, `/marks`, `POST /reload`.
    pub listen: SocketAddr,
    /// `token_env`: the bearer token every admin request other than `GET` and `HEAD` must
    /// present (`POST /reload`); `None`: no token asked.
    pub token: Option<AdminToken>,
    /// `[admin.tls]`: terminate TLS on `listen`.
    pub tls: Option<TlsSettings>,
}

/// The admin bearer token, read from the environment variable `[admin] token_env` names when
/// the file is loaded. Only its SHA-256 is kept, and `Debug` shows the variable's name, never
/// the token.
#[derive(Clone)]
pub struct AdminToken {
    env: String,
    sha256: [u8; 32],
}

impl AdminToken {
    /// The token `token`, said to come from the environment variable `env` (for messages).
    pub fn new(env: impl Into<String>, token: &str) -> Self {
        Self {
            env: env.into(),
            sha256: sha256(token.as_bytes()),
        }
    }

    /// The environment variable the token was read from.
    pub fn env(&self) -> &str {
        &self.env
    }

    /// Whether `presented` is the token. The SHA-256 digests of both are compared in constant
    /// time, so how long this takes tells nothing about the token: not how much of it a guess
    /// got right, nor its length.
    pub fn verify(&self, presented: &[u8]) -> bool {
        bool::from(sha256(presented).ct_eq(&self.sha256))
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminToken")
            .field("env", &self.env)
            .field("token", &format_args!("<redacted>"))
            .finish()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().try_into().expect("a SHA-256 digest is 32 bytes")
}

impl Validator<'_> {
    /// `[admin]`, and the warning when it answers beyond this machine with no token.
    pub(super) fn admin(
        &self,
        a: Option<raw::Admin>,
    ) -> Result<(Option<AdminSettings>, Vec<ConfigWarning>), ConfigError> {
        let default = || DEFAULT_ADMIN_LISTEN.parse().expect("valid default");
        let a = match a {
            None => {
                let settings = AdminSettings {
                    listen: default(),
                    token: None,
                    tls: None,
                };
                return Ok((Some(settings), Vec::new()));
            }
            Some(a) if !a.enabled => return Ok((None, Vec::new())),
            Some(a) => a,
        };
        let listen = match &a.listen {
            Some(l) => self.listen(l, "admin.listen")?,
            None => default(),
        };
        let token = a.token_env.as_ref().map(|v| self.token(v)).transpose()?;
        let tls = a.tls.map(|t| self.tls(t, "admin.tls")).transpose()?;
        let mut warnings = Vec::new();
        let clients_checked = tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        if let (Some(at), None, false) = (&a.listen, &token, clients_checked) {
            if !is_loopback(listen) {
                warnings.push(self.warning(
                    at.span().start,
                    "admin.listen",
                    format_args!(
                        "the admin listener on {listen} is reachable from other machines and asks \
                         no token: anyone who reaches it can POST /reload; set token_env = \
                         \"PALISADE_ADMIN_TOKEN\" (the name of an environment variable holding a \
                         bearer token), or listen on loopback (127.0.0.1)"
                    ),
                ));
            }
        }
        Ok((Some(AdminSettings { listen, token, tls }), warnings))
    }

    /// `token_env`: the variable must be set to a token a `Bearer` credential can carry. The
    /// messages name the variable, never its value.
    fn token(&self, var: &Spanned<String>) -> Result<AdminToken, ConfigError> {
        let name = var.get_ref();
        let fail = |why: &str| self.at(var, "admin.token_env", format_args!("{name} {why}"));
        if name.is_empty() {
            return Err(self.at(var, "admin.token_env", "must name an environment variable"));
        }
        let value = match std::env::var_os(name) {
            None => return Err(fail("is not set: it must hold the admin bearer token")),
            Some(v) => v,
        };
        let Some(value) = value.to_str() else {
            return Err(fail("is not UTF-8"));
        };
        if value.is_empty() {
            return Err(fail("is empty: it must hold the admin bearer token"));
        }
        // What an `Authorization: Bearer` header can carry as one credential; a trailing
        // newline from a file would otherwise make a token nobody can ever send.
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(fail(
                "holds a space, a line break, a control character or a non-ASCII character \
                 (a trailing newline?): a bearer token is visible ASCII",
            ));
        }
        Ok(AdminToken::new(name.clone(), value))
    }
}

/// Whether only this machine can reach `addr` (`127.0.0.0/8`, `::1`, `::ffff:127.x.y.z`).
fn is_loopback(addr: SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[admin]
listen = "{listen}"
{extra}
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:9000"
"#;

    fn parse(listen: &str, extra: &str) -> Result<Config, ConfigError> {
        let text = BASE.replace("{listen}", listen).replace("{extra}", extra);
        Config::parse(&text, Path::new("p.toml"))
    }

    #[test]
    fn verify_accepts_the_token_only() {
        let t = AdminToken::new("V", "correct horse");
        assert!(t.verify(b"correct horse"));
        assert!(!t.verify(b"correct horsf"), "same length, one byte off");
        assert!(!t.verify(b"correct hors"), "a prefix");
        assert!(!t.verify(b"correct horse "), "longer");
        assert!(!t.verify(b""));
        assert!(!t.verify(b"CORRECT HORSE"));
    }

    #[test]
    fn debug_never_shows_the_token() {
        let t = AdminToken::new("PALISADE_ADMIN_TOKEN", "s3cr3t-value");
        let settings = AdminSettings {
            listen: "127.0.0.1:1".parse().unwrap(),
            token: Some(t),
            tls: None,
        };
        let shown = format!("{settings:?} {settings:#?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("<redacted>") && shown.contains("PALISADE_ADMIN_TOKEN"));
    }

    #[test]
    fn an_unset_token_variable_is_an_error_at_its_place() {
        let e = parse(
            "127.0.0.1:9901",
            "token_env = \"PALISADE_TEST_SURELY_UNSET_ADMIN_TOKEN\"\n",
        )
        .unwrap_err();
        let ConfigError::Invalid {
            line,
            column,
            key,
            message,
            ..
        } = e
        else {
            panic!("{e}")
        };
        assert_eq!((line, column, key.as_str()), (7, 13, "admin.token_env"));
        assert!(
            message.contains("PALISADE_TEST_SURELY_UNSET_ADMIN_TOKEN is not set"),
            "{message}"
        );
    }

    #[test]
    fn an_admin_listener_beyond_loopback_without_a_token_is_warned_about() {
        for listen in ["0.0.0.0:9901", "[::]:9901", "10.1.2.3:9901"] {
            let c = parse(listen, "").unwrap();
            assert_eq!(c.warnings.len(), 1, "{listen}: {:?}", c.warnings);
            let w = &c.warnings[0];
            assert_eq!((w.line, w.key.as_str()), (6, "admin.listen"), "{w}");
            assert!(w.message.contains("token_env"), "{w}");
        }
        for listen in [
            "127.0.0.1:9901",
            "127.0.0.2:9901",
            "[::1]:9901",
            "[::ffff:127.0.0.1]:1",
        ] {
            let c = parse(listen, "").unwrap();
            assert!(c.warnings.is_empty(), "{listen}: {:?}", c.warnings);
        }
        let default = Config::parse(
            &BASE.replace("[admin]\nlisten = \"{listen}\"\n{extra}", ""),
            Path::new("p.toml"),
        )
        .unwrap();
        assert!(default.warnings.is_empty(), "{:?}", default.warnings);
        assert!(default.admin.unwrap().token.is_none());
    }

    #[test]
    fn the_digest_is_the_sha256_of_the_text() {
        let text = BASE
            .replace("{listen}", "127.0.0.1:9901")
            .replace("{extra}", "");
        let c = Config::parse(&text, Path::new("p.toml")).unwrap();
        assert_eq!(c.digest.len(), 64);
        assert!(c
            .digest
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let again = Config::parse(&text, Path::new("other.toml")).unwrap();
        assert_eq!(c.digest, again.digest, "the text alone decides");
        let changed =
            Config::parse(&format!("{text}\n# a comment\n"), Path::new("p.toml")).unwrap();
        assert_ne!(c.digest, changed.digest);
        // The empty string's SHA-256, a known value.
        assert_eq!(
            super::super::digest(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
