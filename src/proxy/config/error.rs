//! What is wrong with a configuration file: one problem, or every problem found.

use std::path::PathBuf;

/// A configuration that could not be read or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, or a key is unknown, missing, mistyped or invalid.
    #[error("{}:{line}:{column}: {key}: {message}", file.display())]
    Invalid {
        /// The file.
        file: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// Dotted path of the key, e.g. `route[1].methods[0]`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// More than one problem: every one found, in file order, one per line.
    #[error("{}", several(.0))]
    Several(Vec<ConfigError>),
}

fn several(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

impl ConfigError {
    /// One error as itself, several as [`ConfigError::Several`] sorted by place.
    pub(crate) fn collected(mut errors: Vec<ConfigError>) -> Self {
        let place = |e: &ConfigError| match e {
            ConfigError::Invalid { line, column, .. } => (*line, *column),
            _ => (0, 0),
        };
        errors.sort_by_key(place);
        if errors.len() == 1 {
            errors.pop().expect("one error")
        } else {
            ConfigError::Several(errors)
        }
    }
}
