//! Valid but risky route tables: where an unguarded route lets a method reach guarded paths
//! unchecked.

use http::Method;

use super::*;

impl PathMatch {
    /// Whether some request path could match both.
    pub fn overlaps(&self, other: &PathMatch) -> bool {
        self.covers(other) || other.covers(self) || {
            // Two exact paths, or an exact path and a prefix, also meet on each other's
            // spellings (`/orders/`, `/orders.json`).
            self.matches(other.text()) || other.matches(self.text())
        }
    }

    /// Whether every path `other` matches is matched by `self` too (conservative: `false`
    /// when in doubt).
    pub fn covers(&self, other: &PathMatch) -> bool {
        match (self, other) {
            (PathMatch::Prefix(p), o) => {
                let t = o.text();
                // `other`'s whole space, its spellings included, lies below `p`.
                let plain = p
                    .as_bytes()
                    .last()
                    .is_none_or(|b| !b.is_ascii_alphanumeric());
                t == p || (plain && t.starts_with(p.as_str())) || t.starts_with(&format!("{p}/"))
            }
            (PathMatch::Exact(a), PathMatch::Exact(b)) => a == b,
            (PathMatch::Exact(_) | PathMatch::Pattern(_), _) => false,
        }
    }

    /// What the match takes, in words (for `palisade check`).
    pub fn describe(&self) -> String {
        match self {
            PathMatch::Exact(p) => format!("path {p:?}: also {p}/ and {p}.<format>"),
            PathMatch::Prefix(p)
                if p.as_bytes()
                    .last()
                    .is_none_or(|b| !b.is_ascii_alphanumeric()) =>
            {
                format!("path_prefix {p:?}: every path starting with {p}")
            }
            PathMatch::Prefix(p) => format!(
                "path_prefix {p:?}: {p}, {p}.<format> and everything below {p}/, never a \
                 longer segment such as {p}0"
            ),
            PathMatch::Pattern(p) => format!(
                "path_pattern {:?}: whole segments captured (a trailing / and a .format \
                 suffix on the last segment name the same entity)",
                p.as_str()
            ),
        }
    }

    /// The literal text every matched path starts with.
    pub(crate) fn text(&self) -> &str {
        match self {
            PathMatch::Exact(p) | PathMatch::Prefix(p) => p,
            PathMatch::Pattern(p) => p.literal_prefix(),
        }
    }

    /// A path this match takes (a pattern's captures filled with `fill`).
    pub(crate) fn example(&self, fill: &str) -> String {
        match self {
            PathMatch::Pattern(p) => p.example(fill),
            other => other.text().to_owned(),
        }
    }
}

/// RFC 9110 9.2.1: methods that do not change the resource. With bodies on them refused
/// (`get_bodies`), an unguarded route may forward them to guarded paths.
fn is_safe(m: &Method) -> bool {
    matches!(m.as_str(), "GET" | "HEAD" | "OPTIONS" | "TRACE")
}

fn hosts_overlap(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

impl Validator<'_> {
    /// A warning at byte `offset` of the file, about `key`.
    pub(super) fn warning(
        &self,
        offset: usize,
        key: impl Into<String>,
        message: impl fmt::Display,
    ) -> ConfigWarning {
        let ConfigError::Invalid {
            file,
            line,
            column,
            key,
            message,
        } = self.error(offset, key, message)
        else {
            unreachable!("error() builds Invalid")
        };
        ConfigWarning {
            file,
            line,
            column,
            key,
            message,
        }
    }

    /// Warns where an unguarded route forwards, to a guarded route's paths, an unsafe method
    /// the guarded route does not list (so a zombie could use it unchecked), and where an
    /// earlier unguarded route takes every request a guarded route was meant to check.
    pub(super) fn method_warnings(
        &self,
        routes: &[RouteSettings],
        upstreams: &[UpstreamSettings],
        spans: &[usize],
    ) -> Vec<ConfigWarning> {
        let mut out = Vec::new();
        let warn =
            |i: usize, message: String| self.warning(spans[i], format!("route[{i}]"), message);
        for (i, r) in routes.iter().enumerate() {
            if !r.allow_unguarded_tunnel {
                continue;
            }
            if let Some(guarded) = super::validate::tunnel_around(routes, upstreams, i) {
                out.push(warn(
                    i,
                    format!(
                        "{} (allow_unguarded_tunnel = true accepts this)",
                        super::validate::tunnel_risk(r, &guarded)
                    ),
                ));
            }
        }
        // A fixed resource that a template can also fill in: two routes would share a mark
        // without saying so.
        for (fi, f) in routes.iter().enumerate() {
            if !f.guard || f.template.is_some() {
                continue;
            }
            let filler = routes.iter().find(|t| {
                t.guard
                    && t.template
                        .as_ref()
                        .is_some_and(|t| t.could_produce(&f.resource))
            });
            if let Some(t) = filler {
                out.push(warn(
                    fi,
                    format!(
                        "resource {:?} of route {:?} is also a name that template {:?} of route \
                         {:?} fills in: requests of both share that mark; rename one if they \
                         are different entities",
                        f.resource, f.name, t.resource, t.name
                    ),
                ));
            }
        }
        // A route that an earlier one matches whole is never reached (routes are tried in
        // file order). The unguarded-before-guarded case gets its own message below.
        for (j, later) in routes.iter().enumerate() {
            let earlier = routes[..j].iter().enumerate().find(|(_, e)| {
                (e.host.is_none() || e.host == later.host)
                    && e.path.covers(&later.path)
                    && match (&e.methods, &later.methods) {
                        (None, _) => true,
                        (Some(_), None) => false,
                        (Some(em), Some(lm)) => lm.iter().all(|m| em.contains(m)),
                    }
            });
            if let Some((i, e)) = earlier.filter(|(_, e)| !later.guard || e.guard) {
                out.push(warn(
                    j,
                    format!(
                        "route {:?} is never reached: route[{i}] {:?} comes before it and matches \
                         every request it would match ({})",
                        later.name,
                        e.name,
                        e.path.describe()
                    ),
                ));
            }
        }
        for (gi, g) in routes.iter().enumerate().filter(|(_, g)| g.guard) {
            for (ri, r) in routes
                .iter()
                .enumerate()
                .filter(|(ri, r)| *ri != gi && !r.guard)
            {
                if !hosts_overlap(g.host.as_deref(), r.host.as_deref()) {
                    continue;
                }
                if ri < gi {
                    let shadowed = r.path.covers(&g.path)
                        && match (&r.methods, &g.methods) {
                            (None, _) => true,
                            (Some(rm), None) => rm.iter().any(|m| !is_safe(m)),
                            (Some(rm), Some(gm)) => gm.iter().any(|m| rm.contains(m)),
                        };
                    if shadowed {
                        out.push(warn(
                            ri,
                            format!(
                                "unguarded route {:?} comes before guarded route {:?} and matches \
                                 all of its paths, so requests meant for the guard reach the \
                                 upstream unchecked; move it after route[{gi}]",
                                r.name, g.name
                            ),
                        ));
                    }
                    continue;
                }
                let Some(listed) = &g.methods else { continue };
                if g.other_methods == OtherMethods::Reject || !g.path.overlaps(&r.path) {
                    continue;
                }
                let leaked = match &r.methods {
                    None => {
                        "every method it does not list (PROPFIND, MKCOL, MOVE, unknown ones...)"
                            .to_owned()
                    }
                    Some(rm) => {
                        let unsafe_unlisted: Vec<&str> = rm
                            .iter()
                            .filter(|m| !is_safe(m) && !listed.contains(m))
                            .map(Method::as_str)
                            .collect();
                        if unsafe_unlisted.is_empty() {
                            continue;
                        }
                        unsafe_unlisted.join(", ")
                    }
                };
                out.push(warn(
                    ri,
                    format!(
                        "unguarded route {:?} also matches paths of guarded route {:?}, so {leaked} \
                         sent there reaches the upstream without a token check; list only safe \
                         methods (GET, HEAD, OPTIONS) on this route, or set other_methods = \
                         \"reject\" on route[{gi}]",
                        r.name, g.name
                    ),
                ));
            }
        }
        out
    }
}
