//! `[marks.etcd]`: where the shared marks live when `[marks] store = "etcd"`
//! (`docs/design.md#durability`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{ConfigError, Validator};
use crate::fence::marks::settings::{EtcdSettings, EtcdTls, Password};
use crate::fence::marks::Consistency;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Raw {
    endpoints: Spanned<Vec<Spanned<String>>>,
    prefix: Option<Spanned<String>>,
    #[serde(default)]
    consistency: RawConsistency,
    dial_timeout_ms: Option<Spanned<u64>>,
    request_timeout_ms: Option<Spanned<u64>>,
    username: Option<Spanned<String>>,
    password: Option<Spanned<String>>,
    password_env: Option<Spanned<String>>,
    ca: Option<Spanned<String>>,
    cert: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawConsistency {
    #[default]
    Linearizable,
    Cached,
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
            // Audit records of `palisade marks set` live under /palisade-audit: a prefix
            // that takes that space in would read them as marks.
            Some(p) if "/palisade-audit/".starts_with(p.get_ref().as_str()) => {
                return Err(self.at(
                    &p,
                    k("prefix"),
                    "must not contain the audit key space /palisade-audit (e.g. \"/\" or \
                     \"/palisade\"); use a prefix such as \"/palisade/marks/\"",
                ))
            }
            Some(p) => p.into_inner(),
        };
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
            consistency: match raw.consistency {
                RawConsistency::Linearizable => Consistency::Linearizable,
                RawConsistency::Cached => Consistency::Cached,
            },
            dial_timeout,
            request_timeout,
            username,
            password,
            tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Config, ConfigError, MarksSettings};
    use super::*;

    fn parse(marks: &str) -> Result<Config, ConfigError> {
        let text = format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\n[marks]\nstore = \"etcd\"\n{marks}\n\
             [[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n"
        );
        Config::parse(&text, Path::new("conf/p.toml"))
    }

    fn key_of(e: ConfigError) -> (usize, String, String) {
        match e {
            ConfigError::Invalid {
                line, key, message, ..
            } => (line, key, message),
            e => panic!("{e}"),
        }
    }

    /// Without the `etcd` feature the same file is refused, naming the feature.
    #[test]
    #[cfg(not(feature = "etcd"))]
    fn a_build_without_etcd_refuses_etcd_marks_and_names_the_feature() {
        let (_, key, msg) =
            key_of(parse("[marks.etcd]\nendpoints = [\"http://127.0.0.1:2379\"]").unwrap_err());
        assert_eq!(key, "marks.etcd.endpoints");
        assert!(msg.contains("`etcd` feature"), "{msg}");
    }

    #[test]
    #[cfg(feature = "etcd")]
    fn etcd_settings_have_defaults_and_hide_the_password() {
        let c = parse(
            "[marks.etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\nusername = \"p\"\npassword = \"s3cret\"",
        )
        .unwrap();
        let MarksSettings::Etcd(e) = &c.marks else {
            panic!()
        };
        assert_eq!(e.prefix, "/palisade/marks/");
        assert_eq!(e.consistency, Consistency::Linearizable);
        assert_eq!(e.request_timeout, Duration::from_secs(2));
        assert_eq!(e.password().unwrap(), "s3cret");
        assert!(!format!("{e:?} {c:?}").contains("s3cret"), "never printed");
    }

    #[test]
    fn etcd_settings_errors_name_the_key() {
        let cases = [
            ("[marks.etcd]\nendpoints = []", "marks.etcd.endpoints"),
            ("[marks.etcd]\nendpoints = [\"127.0.0.1:2379\"]", "marks.etcd.endpoints[0]"),
            (
                "[marks.etcd]\nendpoints = [\"https://127.0.0.1:2379\"]",
                "marks.etcd.ca",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nconsistency = \"local\"",
                "marks.etcd.consistency",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nconsistency = \"eventual\"",
                "marks.etcd.consistency",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nusername = \"u\"",
                "marks.etcd.username",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nusername = \"u\"\npassword_env = \"PALISADE_TEST_SURELY_UNSET\"",
                "marks.etcd.password_env",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nca = \"missing.pem\"",
                "marks.etcd.ca",
            ),
            (
                "[marks.etcd]\nendpoints = [\"http://h:1\"]\nrequest_timeout_ms = 0",
                "marks.etcd.request_timeout_ms",
            ),
            ("", "marks.etcd"),
        ];
        for (marks, want) in cases {
            let (_, key, msg) = key_of(parse(marks).unwrap_err());
            assert_eq!(key, want, "{marks}: {msg}");
        }
        // The table without store = "etcd" is a mistake too.
        let text =
            "[proxy]\nlisten = \"127.0.0.1:0\"\n[marks.etcd]\nendpoints = [\"http://h:1\"]\n";
        let (_, key, _) = key_of(Config::parse(text, Path::new("p.toml")).unwrap_err());
        assert_eq!(key, "marks.etcd");
    }
}
