//! `[access_log]`: one line per request, off unless the table is present
//! (`docs/design.md#configuration-names`).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::{ConfigError, Validator};

/// `[access_log]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogSettings {
    /// `format`: `"json"` (the default) or `"text"`.
    pub format: AccessLogFormat,
    /// `path`: `"-"` (the default) for stderr, else a file opened for appending (relative to
    /// the configuration file's directory) and reopened on SIGUSR1.
    pub target: AccessLogTarget,
}

/// How each access log line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    /// One JSON object per line.
    Json,
    /// `key=value` pairs (logfmt), values quoted when they need it.
    Text,
}

/// Where access log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLogTarget {
    /// `path = "-"`.
    Stderr,
    /// A file, appended to.
    File(PathBuf),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Raw {
    #[serde(default = "default_format")]
    format: AccessLogFormat,
    path: Option<Spanned<String>>,
}

fn default_format() -> AccessLogFormat {
    AccessLogFormat::Json
}

impl Validator<'_> {
    pub(super) fn access_log(&self, raw: Raw) -> Result<AccessLogSettings, ConfigError> {
        let target = match raw.path {
            None => AccessLogTarget::Stderr,
            Some(p) if p.get_ref() == "-" => AccessLogTarget::Stderr,
            Some(p) if p.get_ref().is_empty() => {
                return Err(self.at(&p, "access_log.path", "must not be empty (\"-\" is stderr)"))
            }
            Some(p) if p.get_ref().ends_with('/') => {
                return Err(self.at(
                    &p,
                    "access_log.path",
                    format_args!("{:?} names a directory, not a file", p.get_ref()),
                ))
            }
            Some(p) => {
                let base = self.file.parent().unwrap_or(Path::new(""));
                AccessLogTarget::File(base.join(p.get_ref()))
            }
        };
        Ok(AccessLogSettings {
            format: raw.format,
            target,
        })
    }
}
