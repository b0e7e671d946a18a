//! `GET /` on the admin listener: the status page (`docs/operations.md#the-status-page`).
//!
//! One server-rendered page of what an operator asks first: the routes, the resources and
//! their marks (a templated route's entities paged from the store, as `/marks?prefix=` lists
//! them), the last refusals and why, the store's health and latency, drains, the
//! configuration's generation and palisade's version. Plain HTML with one inline style sheet
//! and no script (the answer's Content-Security-Policy allows none), refreshed by
//! `<meta http-equiv="refresh">`; every value from the configuration, the store or a request
//! is escaped ([`esc`]).

/// Writes to the page (a `String`, which cannot fail).
macro_rules! w {
    ($out:expr, $($arg:tt)*) => {
        let _ = write!($out, $($arg)*);
    };
}

mod activity;
mod marks;

use std::fmt::Write;
use std::time::SystemTime;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use super::html::{ago, esc, time, STYLE};
use super::{text, Admin, MARKS_PAGE_MAX};
use crate::fence::marks::StoreError;
use crate::fence::metrics::DrainStats;
use crate::fence::recent::Refusal;
use crate::proxy::config::Config;

/// Entities per page of a templated route.
pub(super) const PAGE: usize = 100;
/// The last page that can be asked for: pages are read from the start of the store's listing.
const LAST_PAGE: usize = MARKS_PAGE_MAX / PAGE;
/// Seconds between the page's refreshes.
const REFRESH_SECS: u32 = 5;

/// No script, no external anything: only the inline style sheet.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// `?template=T&page=N`: which page of template `T`'s entities to show (the others show
/// their first).
#[derive(Debug, Default, PartialEq, Eq)]
struct Query {
    template: Option<String>,
    page: usize,
}

/// What the page reads once and shows twice: in a summary card and in its own section.
struct Seen {
    refusals: Vec<Refusal>,
    /// Drains in progress: resource, token of the advance.
    draining: Vec<(String, u64)>,
    drains: std::collections::BTreeMap<String, DrainStats>,
}

fn parse(query: Option<&str>) -> Result<Query, String> {
    let mut q = Query {
        template: None,
        page: 1,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_encoding::percent_decode_str(&v.replace('+', " "))
            .decode_utf8()
            .map_err(|_| format!("{k}: not UTF-8"))?
            .into_owned();
        match k {
            "template" => q.template = Some(v),
            "page" => match v.parse::<usize>() {
                Ok(n) if (1..=LAST_PAGE).contains(&n) => q.page = n,
                _ => {
                    return Err(format!(
                        "page must be 1..={LAST_PAGE} (further entities: /marks?prefix=P&limit=N)"
                    ))
                }
            },
            other => return Err(format!("unknown parameter {other:?} (template, page)")),
        }
    }
    Ok(q)
}

impl Admin {
    /// The status page; 200 whatever the store's state (that is when it is needed most),
    /// 400 for a query it does not understand.
    pub(super) async fn status(&self, query: Option<&str>) -> Response<Full<Bytes>> {
        let q = match parse(query) {
            Ok(q) => q,
            Err(why) => return text(StatusCode::BAD_REQUEST, format!("{why}\n")),
        };
        let now = SystemTime::now();
        let ready = self.ready().await;
        let config = self.reloader.as_ref().map(|r| r.config());
        let mut out = String::with_capacity(32 * 1024);
        w!(
            out,
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\">\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
             <title>palisade status</title><style>{STYLE}</style></head><body>\n\
             <header><h1>palisade <span class=\"version\" id=\"version\">{}</span></h1>\
             <p class=\"meta\">generated <span id=\"generated\">{}</span> · refreshes every \
             {REFRESH_SECS} s · <a href=\"/metrics\">/metrics</a> · <a href=\"/marks\">/marks\
             </a> · <a href=\"/readyz\">/readyz</a></p></header>\n<main>\n",
            env!("CARGO_PKG_VERSION"),
            time(now)
        );
        let seen = Seen {
            refusals: self.metrics.refusals().newest_first(),
            draining: self.admission.drains_in_progress(),
            drains: self.metrics.drain_stats(),
        };
        self.cards(&mut out, &ready, config.as_deref(), &seen);
        match &config {
            Some(c) => {
                marks::routes(&mut out, c, self);
                self.resources(&mut out, c);
                self.keyed(&mut out, c, &q).await;
            }
            None => {
                w!(
                    out,
                    "<section id=\"routes\"><h2>Routes</h2><p class=\"muted\">This admin \
                     listener serves no configuration.</p></section>\n"
                );
            }
        }
        activity::refusals(&mut out, &seen.refusals, now);
        self.store_ops(&mut out);
        activity::drains(&mut out, &seen);
        w!(
            out,
            "</main><footer>palisade {} · the status page is read-only and asks for no token, \
             like /metrics</footer></body></html>\n",
            env!("CARGO_PKG_VERSION")
        );
        let mut r = Response::new(Full::new(Bytes::from(out)));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        );
        r
    }

    /// The summary cards: the store, the configuration, refusals, drains.
    fn cards(
        &self,
        out: &mut String,
        ready: &Result<(), StoreError>,
        config: Option<&Config>,
        seen: &Seen,
    ) {
        let store = self.admission.store();
        let consistency = format!("{:?}", store.consistency()).to_lowercase();
        w!(
            out,
            "<div class=\"cards\">\n<div class=\"card\" id=\"store\"><h2>Mark store</h2>"
        );
        match ready {
            Ok(()) => {
                w!(
                    out,
                    "<p class=\"big\"><span class=\"badge ok\" id=\"ready\">ready</span></p>"
                );
            }
            Err(e) => {
                w!(
                    out,
                    "<p class=\"big\"><span class=\"badge bad\" id=\"ready\">not ready</span></p>\
                     <p class=\"error\">{}</p>",
                    esc(&e.to_string())
                );
            }
        }
        w!(
            out,
            "<p><code>{}</code> · {consistency} · as <a href=\"/readyz\">/readyz</a> answers</p>\
             </div>\n",
            store.kind()
        );
        w!(
            out,
            "<div class=\"card\" id=\"config\"><h2>Configuration</h2>"
        );
        match (&self.reloader, config) {
            (Some(reloader), Some(c)) => {
                let (ok, failed) = reloader.reloads();
                w!(
                    out,
                    "<p class=\"big\">generation <span id=\"generation\">{}</span></p>\
                     <p>{ok} reloads, <span class=\"{}\">{failed} failed</span></p>\
                     <p>digest <code id=\"digest\" title=\"{}\">{}…</code></p>\
                     <p class=\"muted mono\">{}</p>",
                    ok + 1,
                    if failed > 0 { "error" } else { "muted" },
                    esc(&c.digest),
                    esc(c.digest.get(..12).unwrap_or(&c.digest)),
                    esc(&c.file.display().to_string())
                );
            }
            _ => {
                w!(out, "<p class=\"muted\">not reloadable here</p>");
            }
        }
        w!(out, "</div>\n");
        let refusals = &seen.refusals;
        let stale: u64 = refusals
            .iter()
            .filter(|r| r.reason == "stale_token")
            .map(|r| r.count)
            .sum();
        w!(
            out,
            "<div class=\"card\" id=\"refusal-summary\"><h2>Recent refusals</h2>\
             <p class=\"big\">{}</p><p>stale_token: {stale}</p><p class=\"muted\">{}\
             </p></div>\n",
            refusals.iter().map(|r| r.count).sum::<u64>(),
            refusals.first().map_or_else(
                || "none since start".to_owned(),
                |r| format!("last {}", ago(r.at, SystemTime::now()))
            )
        );
        let draining = seen.draining.len();
        let (timeouts, aborted) = seen
            .drains
            .values()
            .fold((0, 0), |(t, a), s| (t + s.timeouts, a + s.aborted));
        w!(
            out,
            "<div class=\"card\" id=\"drain-summary\"><h2>Drains</h2><p class=\"big\">{draining}\
             </p><p>in progress now</p><p class=\"muted\">{timeouts} ran out of time since \
             start, {aborted} requests aborted</p></div>\n</div>\n"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_one_template_and_a_page_within_reach() {
        assert_eq!(
            parse(None).unwrap(),
            Query {
                template: None,
                page: 1
            }
        );
        assert_eq!(
            parse(Some("template=warehouse%2F%7Bid%7D&page=3")).unwrap(),
            Query {
                template: Some("warehouse/{id}".to_owned()),
                page: 3
            }
        );
        assert!(parse(Some("page=0")).is_err());
        assert!(parse(Some(&format!("page={}", LAST_PAGE + 1))).is_err());
        assert!(parse(Some("after=x"))
            .unwrap_err()
            .contains("unknown parameter"));
    }
}
