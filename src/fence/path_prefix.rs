//! Path prefixes that stop at segment boundaries: the one rule the proxy's `path_prefix` and the
//! layer's resource functions share.
//!
//! A plain string prefix `/warehouses/1` also takes `/warehouses/12`, so the requests of
//! warehouse 12 would be judged against warehouse 1's mark. A [`PathPrefix`] matches as
//! Envoy's `path_separated_prefix` does, plus the `.format` suffix that frameworks route to
//! the same handler (Rails' `(.:format)`), as an exact `path` does:
//!
//! | prefix | matches | does not match |
//! |---|---|---|
//! | `/warehouses/1` | `/warehouses/1`, `/warehouses/1/`, `/warehouses/1/stock`, `/warehouses/1.json` | `/warehouses/12`, `/warehouses/1-old`, `/warehouses/1.json/x` |
//! | `/warehouses/1/` | `/warehouses/1/`, `/warehouses/1/stock` | `/warehouses/1`, `/warehouses/12` |
//! | `/orders.v1.` | `/orders.v1.Orders/Create` (a prefix ending in a separator) | `/orders.v2.Orders/Create` |
//! | `/` | every path | |
//!
//! A prefix that ends in anything but a letter or digit (`/`, `.`, `-`, `_`, ...) already
//! ends at a boundary its author chose, and matches every path that starts with it (gRPC
//! package prefixes). Matching is on the normal-form path, byte for byte (no case folding).

/// A route's path prefix, matched at segment boundaries (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PathPrefix(String);

impl PathPrefix {
    /// The prefix `prefix` (a normal-form path starting with `/`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self(prefix.into())
    }

    /// The prefix as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `path` is the prefix itself or lies below it (see the module docs).
    pub fn matches(&self, path: &str) -> bool {
        matches(&self.0, path)
    }
}

impl std::fmt::Display for PathPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// [`PathPrefix::matches`] on borrowed text.
pub fn matches(prefix: &str, path: &str) -> bool {
    let Some(rest) = path.strip_prefix(prefix) else {
        return false;
    };
    // A prefix that ends in a separator (`/`, `/orders/`, `/orders.v1.`) stops at a
    // boundary its author chose.
    prefix
        .as_bytes()
        .last()
        .is_none_or(|b| !b.is_ascii_alphanumeric())
        || rest.is_empty()
        || rest.starts_with('/')
        || (rest.starts_with('.') && !rest.contains('/'))
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn a_prefix_never_takes_a_longer_sibling_segment() {
        let yes = [
            ("/warehouses/1", "/warehouses/1"),
            ("/warehouses/1", "/warehouses/1/"),
            ("/warehouses/1", "/warehouses/1/stock/9"),
            ("/warehouses/1", "/warehouses/1.json"),
            ("/warehouses/1/", "/warehouses/1/stock"),
            ("/warehouses/1/", "/warehouses/1/"),
            ("/", "/anything/at/all"),
            ("/", "/"),
            ("/orders.v1.", "/orders.v1.Orders/Create"),
            ("/api/v1-", "/api/v1-export"),
        ];
        for (p, path) in yes {
            assert!(matches(p, path), "{p} should match {path}");
        }
        let no = [
            ("/warehouses/1", "/warehouses/12"),
            ("/warehouses/1", "/warehouses/1-old"),
            ("/warehouses/1", "/warehouses/1.json/stock"),
            ("/warehouses/1", "/warehouses"),
            ("/warehouses/1/", "/warehouses/1"),
            ("/warehouses/1/", "/warehouses/12/x"),
            ("/Orders", "/orders"),
        ];
        for (p, path) in no {
            assert!(!matches(p, path), "{p} should not match {path}");
        }
    }
}
