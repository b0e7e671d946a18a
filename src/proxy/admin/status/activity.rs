//! The status page's record of what happened: the recent refusals, the store's operations
//! (count, mean and quantiles of their latency) and the drains, in progress and since start.

use std::fmt::Write;
use std::time::SystemTime;

use super::super::html::{ago, esc, seconds, time};
use super::super::Admin;
use super::Seen;
use crate::fence::recent::{Refusal, RECENT_REFUSALS};

impl Admin {
    /// Store operations: how many, how long (from the histogram's buckets), how many failed.
    pub(super) fn store_ops(&self, out: &mut String) {
        w!(
            out,
            "<section id=\"latency\"><h2>Store operations</h2><p class=\"muted\">confirm: the \
             read a linearizable admission waits for; persist: an advance made durable; load: \
             marks read at start and on an entity's first use. Quantiles are estimated from \
             palisade_store_operation_duration_seconds' buckets, since start.</p>\
             <table><thead><tr><th>store</th><th>operation</th><th class=\"num\">count</th>\
             <th class=\"num\">mean</th><th class=\"num\">p50</th><th class=\"num\">p99</th>\
             <th class=\"num\">errors</th></tr></thead><tbody>\n"
        );
        let or_dash = |v: Option<f64>| v.map_or_else(|| "—".to_owned(), seconds);
        for l in self.metrics.store_latencies() {
            w!(
                out,
                "<tr data-op=\"{0}\"><td><code>{1}</code></td><td class=\"op\">{0}</td>\
                 <td class=\"num count\">{2}</td><td class=\"num\">{3}</td>\
                 <td class=\"num\">{4}</td><td class=\"num\">{5}</td>\
                 <td class=\"num errors{6}\">{7}</td></tr>\n",
                esc(&l.op),
                esc(&l.store),
                l.count,
                or_dash(l.mean()),
                or_dash(l.quantile(0.5)),
                or_dash(l.quantile(0.99)),
                if l.errors > 0 { " error" } else { "" },
                l.errors
            );
        }
        w!(out, "</tbody></table></section>\n");
    }
}

/// The ring of recent refusals, newest first.
pub(super) fn refusals(out: &mut String, refusals: &[Refusal], now: SystemTime) {
    w!(
        out,
        "<section id=\"refusals\"><h2>Recent refusals</h2><p class=\"muted\">The last \
         {RECENT_REFUSALS} refusals of requests that matched a route, newest first; a \
         refusal repeated in a row (same route, resource, token, mark, reason and client \
         host) counts in one row. Every request is in the access log and in \
         palisade_requests_total.</p>"
    );
    if refusals.is_empty() {
        w!(
            out,
            "<p id=\"no-refusals\">None since start.</p></section>\n"
        );
        return;
    }
    w!(
        out,
        "<table><thead><tr><th>time</th><th>route</th><th>resource</th>\
         <th class=\"num\">token</th><th class=\"num\">mark</th><th>reason</th>\
         <th class=\"num\">status</th><th>peer</th><th class=\"num\">times</th></tr></thead>\
         <tbody>\n"
    );
    let or_dash = |v: Option<u64>| v.map_or_else(|| "—".to_owned(), |v| v.to_string());
    for r in refusals {
        let badge = match r.reason {
            "stale_token" | "unissued" => "bad",
            "store_unavailable" | "marks_full" => "warn",
            _ => "off",
        };
        let resource = r.resource.as_deref().map_or_else(
            || "<span class=\"muted\">—</span>".to_owned(),
            |n| format!("<code>{}</code>", esc(n)),
        );
        w!(
            out,
            "<tr class=\"refusal\" data-reason=\"{reason}\"><td class=\"time\">{}<br>\
             <span class=\"muted\">{}</span></td><td class=\"route\"><code>{}</code></td>\
             <td class=\"resource\">{resource}</td><td class=\"num token\">{}</td>\
             <td class=\"num mark\">{}</td><td class=\"reason\"><span class=\"badge \
             {badge}\">{reason}</span></td><td class=\"num status\">{}</td>\
             <td class=\"peer\"><code>{}</code></td><td class=\"num count\">{}</td></tr>\n",
            time(r.at),
            ago(r.at, now),
            esc(&r.route),
            or_dash(r.token),
            or_dash(r.mark),
            r.status,
            r.peer,
            r.count,
            reason = r.reason,
        );
    }
    w!(out, "</tbody></table></section>\n");
}

/// Drains in progress now, and what every resource's drains did since start.
pub(super) fn drains(out: &mut String, seen: &Seen) {
    w!(out, "<section id=\"drains\"><h2>Drains</h2>");
    let now = &seen.draining;
    if now.is_empty() {
        w!(
            out,
            "<p id=\"no-drains\" class=\"muted\">None in progress: no advance is waiting \
             for older owners' requests.</p>"
        );
    } else {
        w!(
            out,
            "<table id=\"draining\"><thead><tr><th>resource</th><th class=\"num\">advancing \
             to token</th></tr></thead><tbody>\n"
        );
        for (name, token) in now {
            w!(
                out,
                "<tr><td><code>{}</code></td><td class=\"num\">{token}</td></tr>\n",
                esc(name)
            );
        }
        w!(out, "</tbody></table>");
    }
    w!(
        out,
        "<h3>Since start</h3><table><thead><tr><th>resource</th><th class=\"num\">drains\
         </th><th class=\"num\">mean wait</th><th class=\"num\">ran out of time</th>\
         <th class=\"num\">requests aborted</th></tr></thead><tbody>\n"
    );
    for (name, s) in &seen.drains {
        let mean = if s.drains > 0 {
            seconds(s.waited / s.drains as f64)
        } else {
            "—".to_owned()
        };
        w!(
            out,
            "<tr data-resource=\"{0}\"><td><code>{0}</code></td><td class=\"num\">{1}</td>\
             <td class=\"num\">{mean}</td><td class=\"num\">{2}</td><td class=\"num\">{3}\
             </td></tr>\n",
            esc(name),
            s.drains,
            s.timeouts,
            s.aborted
        );
    }
    w!(out, "</tbody></table></section>\n");
}
