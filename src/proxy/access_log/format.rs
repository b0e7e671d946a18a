//! One access log line, formatted as JSON or as `key=value` text into a caller's buffer.
//!
//! Formatting writes into a reused buffer with no allocation; the fields are borrowed from the
//! request and the route table for the length of one call.

use std::io::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::proxy::config::AccessLogFormat;

/// What one request did, as its access log line reports it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line<'a> {
    /// The client's address.
    pub(crate) peer: SocketAddr,
    /// The request method.
    pub(crate) method: &'a str,
    /// The request path as the client sent it (no query: it may carry secrets).
    pub(crate) path: &'a str,
    /// The route that matched; `None` when none did.
    pub(crate) route: Option<&'a str>,
    /// The resource the route guards; `None` on unguarded routes and unrouted requests.
    pub(crate) resource: Option<&'a str>,
    /// The response status palisade sent (the upstream's, or its own refusal's).
    pub(crate) status: u16,
    /// The `outcome` label of `palisade_requests_total` (`admitted`, `stale`, `no_route`...).
    pub(crate) outcome: &'static str,
    /// The fencing token, when the request carried a valid one.
    pub(crate) token: Option<u64>,
    /// The resource's mark when the response head was ready; `None` when unguarded.
    pub(crate) mark: Option<u64>,
    /// The upstream the request was sent to; `None` when palisade answered by itself.
    pub(crate) upstream: Option<&'a str>,
    /// From the request's arrival until its response head was ready (the body's streaming is
    /// not included, as with `palisade_request_duration_seconds`).
    pub(crate) latency: Duration,
}

impl Line<'_> {
    /// Appends the line, with its trailing newline, to `out`, stamped with `now`.
    pub(crate) fn write(&self, format: AccessLogFormat, now: SystemTime, out: &mut Vec<u8>) {
        let mut time = [0u8; 24];
        let time = rfc3339_millis(now, &mut time);
        let latency_us = u64::try_from(self.latency.as_micros()).unwrap_or(u64::MAX);
        match format {
            AccessLogFormat::Json => {
                out.extend_from_slice(b"{\"time\":\"");
                out.extend_from_slice(time);
                let _ = write!(out, "\",\"peer\":\"{}\",\"method\":", self.peer);
                json_str(out, self.method);
                out.extend_from_slice(b",\"path\":");
                json_str(out, self.path);
                out.extend_from_slice(b",\"route\":");
                json_opt_str(out, self.route);
                out.extend_from_slice(b",\"resource\":");
                json_opt_str(out, self.resource);
                let _ = write!(
                    out,
                    ",\"status\":{},\"outcome\":\"{}\",\"token\":",
                    self.status, self.outcome
                );
                json_opt_u64(out, self.token);
                out.extend_from_slice(b",\"mark\":");
                json_opt_u64(out, self.mark);
                out.extend_from_slice(b",\"upstream\":");
                json_opt_str(out, self.upstream);
                let _ = writeln!(out, ",\"latency_us\":{latency_us}}}");
            }
            AccessLogFormat::Text => {
                out.extend_from_slice(b"time=");
                out.extend_from_slice(time);
                let _ = write!(out, " peer={} method=", self.peer);
                text_str(out, Some(self.method));
                out.extend_from_slice(b" path=");
                text_str(out, Some(self.path));
                out.extend_from_slice(b" route=");
                text_str(out, self.route);
                out.extend_from_slice(b" resource=");
                text_str(out, self.resource);
                let _ = write!(
                    out,
                    " status={} outcome={} token=",
                    self.status, self.outcome
                );
                text_u64(out, self.token);
                out.extend_from_slice(b" mark=");
                text_u64(out, self.mark);
                out.extend_from_slice(b" upstream=");
                text_str(out, self.upstream);
                let _ = writeln!(out, " latency_us={latency_us}");
            }
        }
    }
}

fn json_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

fn json_opt_u64(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.extend_from_slice(b"null"),
    }
}

/// A JSON string: quotes, backslashes and control characters escaped (RFC 8259 7).
fn json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

fn escape_into(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f | 0x7f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{b:04x}");
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

/// A logfmt value: as is when it is a plain word, else quoted and escaped as in JSON, so a
/// path or route name cannot forge another field or another line. Absent values are `-`.
fn text_str(out: &mut Vec<u8>, s: Option<&str>) {
    let Some(s) = s else {
        out.push(b'-');
        return;
    };
    let plain = !s.is_empty()
        && s != "-"
        && s.bytes()
            .all(|b| b > b' ' && b != b'"' && b != b'=' && b != b'\\' && b != 0x7f);
    if plain {
        out.extend_from_slice(s.as_bytes());
    } else {
        json_str(out, s);
    }
}

fn text_u64(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push(b'-'),
    }
}

/// `now` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC), written into `buf` (also the admin's status
/// page's time format).
pub(crate) fn rfc3339_millis(now: SystemTime, buf: &mut [u8; 24]) -> &[u8] {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let mut w = &mut buf[..];
    let _ = write!(
        w,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_millis()
    );
    let left = w.len();
    &buf[..24 - left]
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>() -> Line<'a> {
        Line {
            peer: "127.0.0.1:4242".parse().unwrap(),
            method: "POST",
            path: "/orders/1",
            route: Some("orders-write"),
            resource: Some("orders"),
            status: 409,
            outcome: "stale",
            token: Some(34),
            mark: Some(51),
            upstream: None,
            latency: Duration::from_micros(1234),
        }
    }

    fn written(l: &Line<'_>, f: AccessLogFormat) -> String {
        let mut out = Vec::new();
        let at = UNIX_EPOCH + Duration::from_millis(1_764_593_633_007);
        l.write(f, at, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn json_lines_parse_and_carry_every_field() {
        let s = written(&line(), AccessLogFormat::Json);
        assert!(s.ends_with("}\n") && s.matches('\n').count() == 1, "{s}");
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["time"], "2025-12-01T12:53:53.007Z");
        assert_eq!(v["peer"], "127.0.0.1:4242");
        assert_eq!(v["method"], "POST");
        assert_eq!(v["path"], "/orders/1");
        assert_eq!(v["route"], "orders-write");
        assert_eq!(v["resource"], "orders");
        assert_eq!(v["status"], 409);
        assert_eq!(v["outcome"], "stale");
        assert_eq!(v["token"], 34);
        assert_eq!(v["mark"], 51);
        assert_eq!(v["upstream"], serde_json::Value::Null);
        assert_eq!(v["latency_us"], 1234);
    }

    #[test]
    fn text_lines_quote_what_could_forge_a_field_or_a_line() {
        let mut l = line();
        assert_eq!(
            written(&l, AccessLogFormat::Text),
            "time=2025-12-01T12:53:53.007Z peer=127.0.0.1:4242 method=POST path=/orders/1 \
             route=orders-write resource=orders status=409 outcome=stale token=34 mark=51 \
             upstream=- latency_us=1234\n"
        );
        l.route = Some("a b\"=\n");
        l.path = "/x\u{7f}";
        l.resource = Some("-");
        let s = written(&l, AccessLogFormat::Text);
        assert!(s.contains(r#"route="a b\"=\n" resource="-""#), "{s}");
        assert!(s.contains(r#"path="/x\u007f""#), "{s}");
        assert_eq!(s.matches('\n').count(), 1);
        let v: serde_json::Value =
            serde_json::from_str(&written(&l, AccessLogFormat::Json)).unwrap();
        assert_eq!(v["route"], "a b\"=\n");
    }

    #[test]
    fn dates_are_proleptic_gregorian_utc() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_423), (2025, 12, 1));
        let mut buf = [0u8; 24];
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400 + 86_399);
        assert_eq!(rfc3339_millis(t, &mut buf), b"2000-02-29T23:59:59.000Z");
    }
}
