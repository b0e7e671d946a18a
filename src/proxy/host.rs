//! Hosts in one strict form, so a host-scoped route cannot be skipped by another spelling.
//!
//! A request's Host header or URI authority is accepted only as `host[:port]` where host is
//!
//! - a DNS-style name: dot-separated labels of ASCII letters, digits, `-` and `_`, each 1 to 63
//!   bytes, 253 bytes in all, with at most one trailing dot (`api.example.com.`), which is
//!   removed for matching *and* forwarding;
//! - a dotted-quad IPv4 address (a name whose last label is numeric must be one, so `127.1` or
//!   `0x7f.0.0.1`, which resolvers read as addresses, are refused);
//! - an IPv6 literal in brackets (`[::1]`), without zone or IPvFuture forms;
//!
//! and port, when present, is 1 to 5 digits up to 65535. Everything else (userinfo `u@h`,
//! `h:80:80`, `h/x`, `h, other`, empty labels, percent-escapes, RFC 3986's other sub-delims)
//! is a 400: palisade refuses what it cannot be sure the upstream reads the same way.

use std::net::{Ipv4Addr, Ipv6Addr};

/// A validated `host[:port]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HostPort<'a> {
    /// The host without its trailing dot (brackets kept for IPv6).
    pub(crate) host: &'a str,
    /// The port digits, if any.
    pub(crate) port: Option<&'a str>,
    /// Whether the original had a trailing dot (then it must be forwarded without one).
    pub(crate) trailing_dot: bool,
}

/// Validates an authority (Host header value or URI authority).
///
/// # Errors
/// Why it is not a `host[:port]` in the form above.
pub(crate) fn parse(raw: &str) -> Result<HostPort<'_>, &'static str> {
    if raw.is_empty() {
        return Err("the host is empty");
    }
    let (host, port) = if raw.starts_with('[') {
        let end = raw.find(']').ok_or("an IPv6 literal lacks its ']'")?;
        let (h, rest) = raw.split_at(end + 1);
        let inner = &h[1..h.len() - 1];
        if inner.parse::<Ipv6Addr>().is_err() {
            return Err("the bracketed host is not an IPv6 address");
        }
        match rest {
            "" => (h, None),
            r => (
                h,
                Some(r.strip_prefix(':').ok_or("junk after an IPv6 literal")?),
            ),
        }
    } else {
        let mut parts = raw.splitn(3, ':');
        let h = parts.next().unwrap_or_default();
        let p = parts.next();
        if parts.next().is_some() {
            return Err("the host has more than one ':'");
        }
        (h, p)
    };
    if let Some(p) = port {
        let ok = (1..=5).contains(&p.len())
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u32>().is_ok_and(|n| n <= 65_535);
        if !ok {
            return Err("the port is not a number up to 65535");
        }
    }
    if host.starts_with('[') {
        return Ok(HostPort {
            host,
            port,
            trailing_dot: false,
        });
    }
    let (name, trailing_dot) = match host.strip_suffix('.') {
        Some(n) => (n, true),
        None => (host, false),
    };
    check_name(name)?;
    Ok(HostPort {
        host: name,
        port,
        trailing_dot,
    })
}

/// Validates a route's `host` key: a host without port, returned lower-cased without a
/// trailing dot.
///
/// # Errors
/// Why it is not a host in the form above.
pub(crate) fn parse_route_host(raw: &str) -> Result<String, &'static str> {
    let hp = parse(raw)?;
    if hp.port.is_some() {
        return Err("must be a bare host name without port");
    }
    Ok(hp.host.to_ascii_lowercase())
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("the host is empty");
    }
    if name.len() > 253 {
        return Err("the host name is longer than 253 bytes");
    }
    let mut last = "";
    for label in name.split('.') {
        if label.is_empty() {
            return Err("the host has an empty label ('..' or a leading '.')");
        }
        if label.len() > 63 {
            return Err("a host label is longer than 63 bytes");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("the host has a character other than letters, digits, '-', '_' and '.'");
        }
        last = label;
    }
    // Resolvers read `127.1`, `0x7f.1` or `2130706433` as addresses: a numeric-looking last
    // label is only accepted as part of a canonical dotted quad.
    let numeric = last.bytes().all(|b| b.is_ascii_digit())
        || (last.len() > 2 && last[..2].eq_ignore_ascii_case("0x"));
    if numeric && name.parse::<Ipv4Addr>().is_err() {
        return Err("a numeric host must be a dotted-quad IPv4 address");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_hosts_and_their_normal_form() {
        let ok = |raw: &str, host: &str, port: Option<&str>, dot: bool| {
            assert_eq!(
                parse(raw),
                Ok(HostPort {
                    host,
                    port,
                    trailing_dot: dot
                }),
                "{raw}"
            );
        };
        ok("api.example.com", "api.example.com", None, false);
        ok(
            "API.example.com:8080",
            "API.example.com",
            Some("8080"),
            false,
        );
        ok("api.example.com.", "api.example.com", None, true);
        ok("api.example.com.:80", "api.example.com", Some("80"), true);
        ok("localhost", "localhost", None, false);
        ok("my_host-1", "my_host-1", None, false);
        ok("127.0.0.1:9000", "127.0.0.1", Some("9000"), false);
        ok("[::1]:443", "[::1]", Some("443"), false);
        ok("[2001:db8::7]", "[2001:db8::7]", None, false);
    }

    #[test]
    fn ambiguous_hosts_are_refused() {
        for raw in [
            "",
            ".",
            "api.example.com..",
            ".api.example.com",
            "api..example.com",
            "api.example.com:80:80",
            "u@api.example.com",
            "api.example.com, other",
            "api.example.com,other",
            "api.example.com/x",
            "api.example.com:",
            "api.example.com:http",
            "api.example.com:65536",
            "api.example.com:123456",
            "api%2eexample.com",
            "api example.com",
            "[::1",
            "[::1]x",
            "[v1.fe]",
            "[fe80::1%25eth0]",
            "127.1",
            "0x7f.0.0.1",
            "2130706433",
            "1.2.3.256",
            "01.2.3.4",
            "ex\u{e4}mple.com",
        ] {
            assert!(parse(raw).is_err(), "{raw:?} should be refused");
        }
    }

    #[test]
    fn route_hosts_are_lower_case_without_port_or_dot() {
        assert_eq!(
            parse_route_host("API.Example.com.").as_deref(),
            Ok("api.example.com")
        );
        assert!(parse_route_host("api.example.com:80").is_err());
    }
}
