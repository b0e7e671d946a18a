//! Resources taken from the request: a path pattern that captures segments, and a resource
//! template filled from the captures, the host, headers and the gRPC service and method. One
//! type for the proxy's routes (`path_pattern`, `resource = "warehouse/{id}"`) and for the
//! layer ([`crate::fence::layer::FenceLayer::with_template`]).
//!
//! Tokens are etcd revisions, global to the cluster: the tokens of two locks interleave, so
//! every entity owned by its own lock or leader needs its own mark. A pattern
//! `/warehouses/{id}/stock/{sku}` with `resource = "warehouse/{id}"` gives each warehouse one.
//!
//! Matching, on the normal-form path ([`PathPattern::captures`]):
//! - segment by segment; a literal segment matches itself exactly (no case folding);
//! - `{name}` captures one whole, non-empty segment, exactly as it came after normalization
//!   (percent escapes included: the normal form has one spelling per name);
//! - a trailing `{*rest}` captures the remaining one or more segments;
//! - a trailing `/` after a full match is ignored, and so is a `.format` suffix on the last
//!   segment (`/warehouses/7.json` is warehouse `7`): frameworks route `7.json` to warehouse 7
//!   (Rails' `(.:format)`), and a resource must name what the upstream writes. Two entities
//!   whose last segments differ only after a dot then share one mark: safe (more refusals,
//!   never fewer).
//!
//! Filling ([`ResourceTemplate::fill`]): a filled resource longer than [`MAX_RESOURCE_BYTES`]
//! is refused, never truncated (two entities could share a truncated name). A missing,
//! repeated or non-ASCII header refuses the request too: a resource is never guessed.
//!
//! `{header.NAME}` is safe only when the upstream picks the entity by that same header:
//! otherwise a zombie could name another entity's resource while writing this one.

use std::fmt;

/// The longest filled resource name, in bytes.
pub const MAX_RESOURCE_BYTES: usize = 1024;

/// One segment of a [`PathPattern`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Capture(String),
    Rest(String),
}

/// A path with `{name}` and a trailing `{*rest}` captures (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    text: String,
    segments: Vec<Segment>,
}

/// Why a pattern or template does not parse; `at` is the byte offset of the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct TemplateError {
    /// Byte offset in the pattern or template text.
    pub at: usize,
    /// What is wrong.
    pub message: String,
}

fn err(at: usize, message: impl Into<String>) -> TemplateError {
    TemplateError {
        at,
        message: message.into(),
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl PathPattern {
    /// Parses `/warehouses/{id}/stock/{sku}` or `/files/{*rest}`.
    ///
    /// # Errors
    /// [`TemplateError`] for a pattern that does not start with `/`, an empty segment, a
    /// capture that is not a whole segment, a bad or repeated capture name, or `{*rest}`
    /// anywhere but last.
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let Some(body) = text.strip_prefix('/') else {
            return Err(err(0, "a path pattern starts with '/'"));
        };
        let mut segments = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let mut offset = 1;
        let parts: Vec<&str> = if body.is_empty() {
            Vec::new()
        } else {
            body.split('/').collect()
        };
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            if part.is_empty() {
                if last {
                    break; // a trailing '/' is allowed and ignored
                }
                return Err(err(offset, "empty segment ('//')"));
            }
            let inner = part.strip_prefix('{').and_then(|p| p.strip_suffix('}'));
            let segment = match inner {
                Some(rest) if rest.starts_with('*') => {
                    let name = &rest[1..];
                    if !last {
                        return Err(err(offset, "{*name} must be the last segment"));
                    }
                    Segment::Rest(name.to_owned())
                }
                Some(name) => Segment::Capture(name.to_owned()),
                None if part.contains(['{', '}']) => {
                    return Err(err(
                        offset,
                        format!("{part:?}: a capture must be a whole segment, as {{name}}"),
                    ))
                }
                None => Segment::Literal((*part).to_owned()),
            };
            if let Segment::Capture(n) | Segment::Rest(n) = &segment {
                if !valid_name(n) {
                    return Err(err(
                        offset,
                        format!("{n:?} is not a capture name (letters, digits, '_', '-')"),
                    ));
                }
                if names.contains(n) {
                    return Err(err(offset, format!("capture {n:?} appears twice")));
                }
                if matches!(n.as_str(), "host" | "service" | "method") || n.starts_with("header") {
                    return Err(err(
                        offset,
                        format!("{n:?} is reserved for the request's own placeholders"),
                    ));
                }
                names.push(n.clone());
            }
            segments.push(segment);
            offset += part.len() + 1;
        }
        Ok(Self {
            text: text.to_owned(),
            segments,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The literal start of the pattern, up to its first capture (`/warehouses/` of
    /// `/warehouses/{id}/stock`): every path it matches starts with it.
    pub fn literal_prefix(&self) -> &str {
        self.text.find('{').map_or(&self.text, |i| &self.text[..i])
    }

    /// A path the pattern matches, each capture filled with `fill`.
    pub fn example(&self, fill: &str) -> String {
        let mut out = String::new();
        for s in &self.segments {
            out.push('/');
            out.push_str(match s {
                Segment::Literal(l) => l,
                Segment::Capture(_) | Segment::Rest(_) => fill,
            });
        }
        if out.is_empty() {
            out.push('/');
        }
        out
    }

    /// A path the pattern matches that starts with the segments of `path` (as far as the
    /// pattern's literals agree), the rest filled with `fill`: where a request below `path`
    /// would land under this pattern. `None` when a literal disagrees.
    pub fn overlay(&self, path: &str, fill: &str) -> Option<String> {
        let given: Vec<&str> = path
            .trim_matches('/')
            .split('/')
            .filter(|s| !s.is_empty())
            .collect();
        let mut out = String::new();
        for (i, seg) in self.segments.iter().enumerate() {
            out.push('/');
            match (seg, given.get(i)) {
                (Segment::Literal(l), Some(g)) if l != g => return None,
                (Segment::Literal(l), _) => out.push_str(l),
                (Segment::Capture(_), Some(g)) => out.push_str(g),
                (Segment::Rest(_), Some(_)) => out.push_str(&given[i..].join("/")),
                (Segment::Capture(_) | Segment::Rest(_), None) => out.push_str(fill),
            }
        }
        if out.is_empty() {
            out.push('/');
        }
        Some(out)
    }

    /// A path the pattern matches whose every capture has a value of its own (`fill0`,
    /// `fill1`, ...): filled in, two templates over it tell whether they name the same
    /// entity for the same request.
    pub fn example_distinct(&self, fill: &str) -> String {
        let mut out = String::new();
        let mut n = 0;
        for s in &self.segments {
            out.push('/');
            match s {
                Segment::Literal(l) => out.push_str(l),
                Segment::Capture(_) | Segment::Rest(_) => {
                    out.push_str(&format!("{fill}{n}"));
                    n += 1;
                }
            }
        }
        if out.is_empty() {
            out.push('/');
        }
        out
    }

    /// The names this pattern captures, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> + Clone {
        self.segments.iter().filter_map(|s| match s {
            Segment::Capture(n) | Segment::Rest(n) => Some(n.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// The captures of `path` (a normal-form path without `;parameters`), or `None` when it
    /// does not match (see the module docs).
    pub fn captures<'t, 'p>(&'t self, path: &'p str) -> Option<Captures<'t, 'p>> {
        let mut out = Captures::default();
        self.walk(path, |name, value| out.0.push((name, value)))
            .then_some(out)
    }

    /// Whether `path` matches, with nothing captured (routing asks this of every request).
    pub fn is_match(&self, path: &str) -> bool {
        self.walk(path, |_, _| {})
    }

    /// Matches `path`, handing each capture to `found` in order: false when it does not match
    /// (captures handed out before the mismatch are then meaningless).
    fn walk<'t, 'p>(&'t self, path: &'p str, mut found: impl FnMut(&'t str, &'p str)) -> bool {
        let Some(body) = path.strip_prefix('/') else {
            return false;
        };
        let body = body.strip_suffix('/').unwrap_or(body);
        let mut rest = body;
        let n = self.segments.len();
        for (i, seg) in self.segments.iter().enumerate() {
            let last = i + 1 == n;
            if let Segment::Rest(name) = seg {
                if rest.is_empty() {
                    return false;
                }
                // `.format` on the last segment is the same entity here too.
                let last_start = rest.rfind('/').map_or(0, |i| i + 1);
                let rest = match rest[last_start..].rfind('.') {
                    Some(dot) if dot > 0 => &rest[..last_start + dot],
                    _ => rest,
                };
                found(name, rest);
                return true;
            }
            let (part, after) = match rest.split_once('/') {
                Some((p, a)) => (p, Some(a)),
                None => (rest, None),
            };
            if part.is_empty() {
                return false;
            }
            // `.format` on the last segment is the same entity (see the module docs).
            let part = if last && after.is_none() {
                match part.rfind('.') {
                    Some(dot) if dot > 0 => &part[..dot],
                    _ => part,
                }
            } else {
                part
            };
            match seg {
                Segment::Literal(l) if l == part => {}
                Segment::Literal(_) => return false,
                Segment::Capture(name) => found(name, part),
                Segment::Rest(_) => unreachable!("handled above"),
            }
            match after {
                Some(a) if !last => rest = a,
                None if last => return true,
                _ => return false,
            }
        }
        // An empty pattern ("/") matches only the root.
        body.is_empty()
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// What a path pattern captured: `(name, segment text)`, both borrowed (the names from the
/// pattern, the text from the path): matching allocates only this list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Captures<'t, 'p>(Vec<(&'t str, &'p str)>);

impl<'p> Captures<'_, 'p> {
    /// The segment captured as `name`.
    pub fn get(&self, name: &str) -> Option<&'p str> {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

/// One piece of a [`ResourceTemplate`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Capture(String),
    Host,
    Header(http::HeaderName),
    Service,
    Method,
}

/// A resource name with placeholders: `warehouse/{id}`, `tenant/{header.x-tenant}`,
/// `grpc/{service}` (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceTemplate {
    text: String,
    pieces: Vec<Piece>,
}

/// What a request gives a template besides its path captures.
pub trait RequestParts {
    /// The request's host in normal form (lower case, no port, no trailing dot), if known:
    /// two spellings of one host must fill one resource.
    fn host(&self) -> Option<std::borrow::Cow<'_, str>>;
    /// Every value of header `name`.
    fn header_values(&self, name: &http::HeaderName) -> Vec<&[u8]>;
    /// The request path (for `{service}` and `{method}` of a gRPC call).
    fn path(&self) -> &str;
    /// Whether the request is a gRPC call (its content type is `application/grpc*`).
    fn is_grpc(&self) -> bool;
}

/// Why a request's resource could not be filled in (the request is refused with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FillError {
    /// A header the template names is absent.
    #[error("the resource is chosen by header {0}, which the request lacks")]
    MissingHeader(String),
    /// A header the template names appears more than once.
    #[error("the resource is chosen by header {0}, which the request repeats")]
    RepeatedHeader(String),
    /// A header value that is empty or not visible ASCII.
    #[error("the resource is chosen by header {0}, whose value is empty or not visible ASCII")]
    BadHeader(String),
    /// `{host}` without a host.
    #[error("the resource is chosen by the host, which the request lacks")]
    MissingHost,
    /// `{service}` or `{method}` on a request that is not a gRPC call `/Service/Method`.
    #[error("the resource is chosen by the gRPC service or method, and this is not a gRPC call")]
    NotGrpc,
    /// A header the template reads is named in `Connection`: a proxy would remove it
    /// before the upstream sees it.
    #[error(
        "the resource is chosen by header {0}, which the request's Connection header asks to \
         remove"
    )]
    HopByHop(String),
    /// The name of the lock that feeds the route, filled from the request, is not one the
    /// client library accepts.
    #[error("the lock that feeds this resource cannot be named from this request: {0}")]
    BadLock(String),
    /// The filled name is too long.
    #[error("the filled resource name is {0} bytes, more than the {MAX_RESOURCE_BYTES} allowed")]
    TooLong(usize),
}

impl ResourceTemplate {
    /// Parses `text`; `captures` are the names the route's pattern captures (a capture named
    /// in the template but not there is an error).
    ///
    /// # Errors
    /// [`TemplateError`] for an unknown placeholder, an unclosed `{`, a stray `}`, or a capture
    /// the pattern does not have.
    pub fn parse<'a>(
        text: &str,
        captures: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Result<Self, TemplateError> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        let mut offset = 0;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(err(offset + open, "'}' without '{'"));
            }
            literal.push_str(&rest[..open]);
            let Some(close) = rest[open..].find('}') else {
                return Err(err(offset + open, "'{' without '}'"));
            };
            let name = &rest[open + 1..open + close];
            let at = offset + open;
            if !literal.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut literal)));
            }
            pieces.push(match name {
                "host" => Piece::Host,
                "service" => Piece::Service,
                "method" => Piece::Method,
                n if n.starts_with("header.") => {
                    let h = &n["header.".len()..];
                    let header = http::HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| err(at, format!("{h:?} is not a header name")))?;
                    // Headers a proxy removes or rewrites on the way: the upstream would not
                    // see the value the resource was named by.
                    if matches!(
                        header.as_str(),
                        "host"
                            | "connection"
                            | "keep-alive"
                            | "proxy-connection"
                            | "te"
                            | "trailer"
                            | "transfer-encoding"
                            | "upgrade"
                            | "forwarded"
                            | "x-forwarded-for"
                            | "x-forwarded-proto"
                            | "x-forwarded-host"
                    ) {
                        return Err(err(
                            at,
                            format!(
                                "{{header.{h}}}: a proxy removes or rewrites this header, so the \
                                 upstream would not see it (for the host, use {{host}})"
                            ),
                        ));
                    }
                    Piece::Header(header)
                }
                n if captures.clone().into_iter().any(|c| c == n) => Piece::Capture(n.to_owned()),
                n if valid_name(n) => {
                    let known: Vec<&str> = captures.clone().into_iter().collect();
                    return Err(err(
                        at,
                        if known.is_empty() {
                            format!(
                                "{{{n}}}: unknown placeholder (no path_pattern captures; also \
                                 {{host}}, {{header.NAME}}, {{service}}, {{method}})"
                            )
                        } else {
                            format!(
                                "{{{n}}}: the path_pattern captures no {n:?} (it captures {})",
                                known.join(", ")
                            )
                        },
                    ));
                }
                n => {
                    return Err(err(
                        at,
                        format!(
                            "{{{n}}}: unknown placeholder (captures of path_pattern, {{host}}, \
                             {{header.NAME}}, {{service}}, {{method}})"
                        ),
                    ))
                }
            });
            offset += open + close + 1;
            rest = &rest[open + close + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            pieces.push(Piece::Text(literal));
        }
        if text.is_empty() {
            return Err(err(0, "must not be empty"));
        }
        Ok(Self {
            text: text.to_owned(),
            pieces,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The literal start of every name it fills in (`warehouse/` of `warehouse/{id}`).
    pub fn literal_prefix(&self) -> &str {
        match self.pieces.first() {
            Some(Piece::Text(t)) => t,
            _ => "",
        }
    }

    /// The headers it reads (`{header.NAME}`).
    pub fn headers(&self) -> impl Iterator<Item = &http::HeaderName> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Header(h) => Some(h),
            _ => None,
        })
    }

    /// Whether every placeholder of `self` is also one of `other`'s: filled from one request,
    /// `self` is then a function of `other`'s name (a route's `lock` of its `resource`), so
    /// that one entity is never fed by two primitives.
    pub fn placeholders_within(&self, other: &ResourceTemplate) -> bool {
        self.pieces
            .iter()
            .filter(|p| !matches!(p, Piece::Text(_)))
            .all(|p| other.pieces.contains(p))
    }

    /// Whether it has no placeholder: one fixed resource.
    pub fn is_fixed(&self) -> bool {
        self.pieces.iter().all(|p| matches!(p, Piece::Text(_)))
    }

    /// Whether the fixed name `name` is one this template can produce (its text parts in
    /// order, with something between them): a fixed resource there would share marks with
    /// one of the template's entities.
    pub fn could_produce(&self, name: &str) -> bool {
        let mut rest = name;
        let mut after_placeholder = false;
        for (i, p) in self.pieces.iter().enumerate() {
            match p {
                Piece::Text(t) => {
                    let found = if after_placeholder {
                        // The placeholder takes at least one byte.
                        rest.get(1..)
                            .and_then(|r| r.find(t.as_str()))
                            .map(|f| f + 1)
                    } else if rest.starts_with(t.as_str()) {
                        Some(0)
                    } else {
                        None
                    };
                    let Some(f) = found else { return false };
                    rest = &rest[f + t.len()..];
                    after_placeholder = false;
                    if i + 1 == self.pieces.len() && !rest.is_empty() {
                        return false;
                    }
                }
                _ => after_placeholder = true,
            }
        }
        !after_placeholder || !rest.is_empty()
    }

    /// The resource for a request whose path gave `captures`.
    ///
    /// # Errors
    /// [`FillError`]: the request cannot name a resource, and is refused.
    pub fn fill(
        &self,
        captures: &Captures<'_, '_>,
        req: &impl RequestParts,
    ) -> Result<String, FillError> {
        let mut out = String::with_capacity(self.text.len() + 16);
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Capture(n) => out.push_str(captures.get(n).unwrap_or_default()),
                Piece::Host => out.push_str(&req.host().ok_or(FillError::MissingHost)?),
                Piece::Header(h) => {
                    let values = req.header_values(h);
                    let v = match values.as_slice() {
                        [] => return Err(FillError::MissingHeader(h.to_string())),
                        [v] => *v,
                        _ => return Err(FillError::RepeatedHeader(h.to_string())),
                    };
                    if v.is_empty() || !v.iter().all(|b| b.is_ascii_graphic()) {
                        return Err(FillError::BadHeader(h.to_string()));
                    }
                    out.push_str(
                        std::str::from_utf8(v).map_err(|_| FillError::BadHeader(h.to_string()))?,
                    );
                }
                Piece::Service | Piece::Method => {
                    let (service, method) = grpc_call(req)?;
                    out.push_str(if *p == Piece::Service {
                        service
                    } else {
                        method
                    });
                }
            }
            if out.len() > MAX_RESOURCE_BYTES {
                return Err(FillError::TooLong(out.len()));
            }
        }
        Ok(out)
    }
}

/// `/package.Service/Method` of a gRPC call.
fn grpc_call(req: &impl RequestParts) -> Result<(&str, &str), FillError> {
    if !req.is_grpc() {
        return Err(FillError::NotGrpc);
    }
    let body = req.path().strip_prefix('/').ok_or(FillError::NotGrpc)?;
    match body.split_once('/') {
        Some((s, m)) if !s.is_empty() && !m.is_empty() && !m.contains('/') => Ok((s, m)),
        _ => Err(FillError::NotGrpc),
    }
}

impl fmt::Display for ResourceTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl RequestParts for http::request::Parts {
    fn host(&self) -> Option<std::borrow::Cow<'_, str>> {
        let raw = self.uri.host().or_else(|| {
            self.headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(|h| match h.find(']') {
                    // `[::1]:8080`: the brackets hold the host.
                    Some(end) if h.starts_with('[') => &h[..=end],
                    _ => h.rsplit_once(':').map_or(h, |(host, _)| host),
                })
        })?;
        let raw = raw.strip_suffix('.').unwrap_or(raw);
        Some(if raw.bytes().any(|b| b.is_ascii_uppercase()) {
            std::borrow::Cow::Owned(raw.to_ascii_lowercase())
        } else {
            std::borrow::Cow::Borrowed(raw)
        })
    }

    fn header_values(&self, name: &http::HeaderName) -> Vec<&[u8]> {
        self.headers
            .get_all(name)
            .iter()
            .map(http::HeaderValue::as_bytes)
            .collect()
    }

    fn path(&self) -> &str {
        self.uri.path()
    }

    fn is_grpc(&self) -> bool {
        crate::fence::grpc::grpc_content_type(&self.headers).is_some()
    }
}

#[cfg(test)]
mod tests;
