//! What the status page is written with: HTML escaping, its one inline style sheet, and the
//! formats of times and durations. No external asset: the page works offline.

use std::fmt;
use std::time::SystemTime;

/// `text` HTML-escaped as it is written, for element content and quoted attribute values
/// alike: a resource named `<script>` shows as text.
pub(super) fn esc(text: &str) -> Esc<'_> {
    Esc(text)
}

/// See [`esc`].
pub(super) struct Esc<'a>(&'a str);

impl fmt::Display for Esc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(['&', '<', '>', '"', '\'']) {
            f.write_str(&rest[..at])?;
            f.write_str(match rest.as_bytes()[at] {
                b'&' => "&amp;",
                b'<' => "&lt;",
                b'>' => "&gt;",
                b'"' => "&quot;",
                _ => "&#39;",
            })?;
            rest = &rest[at + 1..];
        }
        f.write_str(rest)
    }
}

/// `value` for a query string (everything but letters and digits percent-encoded); escape
/// the link it goes into too.
pub(super) fn query_value(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// `at` as the access log writes times (`2026-12-01T12:53:53.007Z`).
pub(super) fn time(at: SystemTime) -> String {
    let mut buf = [0u8; 24];
    String::from_utf8_lossy(crate::proxy::access_log::rfc3339_millis(at, &mut buf)).into_owned()
}

/// How long before `now` `at` was, in words (`3 s ago`).
pub(super) fn ago(at: SystemTime, now: SystemTime) -> String {
    let secs = now.duration_since(at).unwrap_or_default().as_secs();
    match secs {
        0..=119 => format!("{secs} s ago"),
        120..=7199 => format!("{} min ago", secs / 60),
        _ => format!("{} h ago", secs / 3600),
    }
}

/// A duration in seconds, in the unit that reads best (`850 µs`, `12.3 ms`, `1.50 s`).
pub(super) fn seconds(s: f64) -> String {
    if s < 0.001 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The page's style sheet, inline.
pub(super) const STYLE: &str = "
:root { color-scheme: light; --ink: #1d2430; --muted: #5b6575; --line: #dde2ea;
  --bg: #f5f7fa; --card: #fff; --ok: #16794c; --bad: #b42318; --warn: #9a6700;
  --accent: #2f5bd3; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
  font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif; }
header { background: #1d2430; color: #fff; padding: 14px 24px; display: flex;
  align-items: baseline; gap: 16px; flex-wrap: wrap; }
header h1 { margin: 0; font-size: 20px; letter-spacing: .02em; }
header .version { color: #aeb8c8; font-weight: normal; font-size: 15px; }
header .meta { color: #c9d1de; margin: 0; }
header a { color: #9fbaff; }
main { padding: 16px 24px 32px; max-width: 1400px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(240px, 1fr));
  gap: 12px; margin-bottom: 16px; }
.card, section { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: 12px 16px; }
section { margin-bottom: 16px; overflow-x: auto; }
h2 { font-size: 15px; margin: 0 0 8px; }
h3 { font-size: 14px; margin: 12px 0 6px; }
.card p { margin: 4px 0; }
.big { font-size: 22px; font-weight: 600; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12px; text-transform: uppercase;
  letter-spacing: .04em; }
tbody tr:nth-child(even) { background: #fafbfc; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .mono { font-family: ui-monospace, 'DejaVu Sans Mono', Menlo, monospace; font-size: 13px; }
.muted { color: var(--muted); }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  font-weight: 600; border: 1px solid transparent; }
.ok { color: var(--ok); background: #e3f4ea; border-color: #b5e0c7; }
.bad { color: var(--bad); background: #fde8e7; border-color: #f5c2bf; }
.warn { color: var(--warn); background: #fff4d6; border-color: #f0d899; }
.off { color: var(--muted); background: #eef1f5; border-color: var(--line); }
.error { color: var(--bad); }
.pager { margin-top: 8px; display: flex; gap: 12px; }
.pager a { color: var(--accent); }
footer { color: var(--muted); padding: 0 24px 24px; }
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_every_character_that_could_open_markup_or_end_an_attribute() {
        assert_eq!(
            esc("tenant/<script>alert('x')</script>&\"").to_string(),
            "tenant/&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
        assert_eq!(esc("orders").to_string(), "orders");
        assert_eq!(query_value("warehouse/{id}"), "warehouse%2F%7Bid%7D");
    }

    #[test]
    fn durations_read_in_their_unit() {
        assert_eq!(seconds(0.000_85), "850 µs");
        assert_eq!(seconds(0.012_34), "12.3 ms");
        assert_eq!(seconds(1.5), "1.50 s");
    }
}
