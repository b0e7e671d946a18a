//! The status page's routes, resources and marks: the routes in force in the order they are
//! tried, the fixed resources with their marks and drains, and each resource template's
//! entities a page at a time, as the store lists them (`/marks?prefix=` lists them so too).

use std::fmt::Write;

use super::super::html::{esc, query_value};
use super::super::Admin;
use super::{Query, LAST_PAGE, PAGE};
use crate::fence::template::ResourceTemplate;
use crate::proxy::config::{Config, PathMatch, RouteSettings};

impl Admin {
    /// Fixed resources of the routes in force, with their marks and drains.
    pub(super) fn resources(&self, out: &mut String, config: &Config) {
        let mut names: Vec<&str> = guarded(config)
            .filter(|r| r.template.is_none())
            .map(|r| r.resource.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        w!(out, "<section id=\"resources\"><h2>Resources</h2>");
        if names.is_empty() {
            w!(
                out,
                "<p class=\"muted\">No route guards a fixed resource.</p>"
            );
        } else {
            w!(
                out,
                "<table><thead><tr><th>resource</th><th class=\"num\">mark</th><th>routes</th>\
                 <th>drain</th></tr></thead><tbody>\n"
            );
            for name in names {
                let resource = self.admission.resource(name);
                let routes: Vec<String> = guarded(config)
                    .filter(|r| r.template.is_none() && r.resource == name)
                    .map(|r| format!("<code>{}</code>", esc(&r.name)))
                    .collect();
                let drain = match resource.as_ref().and_then(|r| r.draining()) {
                    Some(t) => format!("<span class=\"badge warn\">draining for token {t}</span>"),
                    None => "<span class=\"muted\">none</span>".to_owned(),
                };
                w!(
                    out,
                    "<tr data-resource=\"{0}\"><td class=\"resource\"><code>{0}</code></td>\
                     <td class=\"num mark\">{1}</td><td class=\"routes\">{2}</td>\
                     <td class=\"drain\">{drain}</td></tr>\n",
                    esc(name),
                    resource.map_or_else(|| "?".to_owned(), |r| r.mark().to_string()),
                    routes.join(", ")
                );
            }
            w!(out, "</tbody></table>");
        }
        w!(out, "</section>\n");
    }

    /// Each resource template's entities, a page at a time, as the store lists them.
    pub(super) async fn keyed(&self, out: &mut String, config: &Config, q: &Query) {
        let mut templates: Vec<&ResourceTemplate> = guarded(config)
            .filter_map(|r| r.template.as_ref())
            .collect();
        templates.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        templates.dedup_by(|a, b| a.as_str() == b.as_str());
        if templates.is_empty() {
            return;
        }
        let (cached, loaded, evicted) = self.admission.entity_counts();
        w!(
            out,
            "<section id=\"keyed\"><h2>Templated resources</h2><p class=\"muted\">One mark \
             per entity, as stored, {PAGE} a page. Entities in memory: {cached} ({loaded} \
             loaded from the store, {evicted} evicted).</p>\n"
        );
        for t in templates {
            let page = match &q.template {
                Some(asked) if asked == t.as_str() => q.page,
                _ => 1,
            };
            self.entities(out, config, t, page).await;
        }
        w!(out, "</section>\n");
    }

    async fn entities(&self, out: &mut String, config: &Config, t: &ResourceTemplate, page: usize) {
        let prefix = t.literal_prefix();
        let store = self.admission.store();
        let routes: Vec<String> = guarded(config)
            .filter(|r| {
                r.template
                    .as_ref()
                    .is_some_and(|x| x.as_str() == t.as_str())
            })
            .map(|r| {
                let max = r
                    .max_marks
                    .map_or_else(String::new, |m| format!(" (max_marks {m})"));
                format!("<code>{}</code>{max}", esc(&r.name))
            })
            .collect();
        let count = match store.count(prefix).await {
            Ok(n) => n.to_string(),
            Err(e) => format!("<span class=\"error\">? ({})</span>", esc(&e.to_string())),
        };
        w!(
            out,
            "<div class=\"template\" data-template=\"{0}\"><h3><code>{0}</code></h3>\
             <p class=\"muted\">routes {1} · {count} stored marks under <code>{2}</code></p>",
            esc(t.as_str()),
            routes.join(", "),
            esc(prefix)
        );
        // One more than the page: whether another follows. A prefix that other names share
        // (or none, for `{host}/...`) lists them too: only the template's names are shown.
        let want = page * PAGE + 1;
        match store.list(prefix, want).await {
            Err(e) => {
                w!(
                    out,
                    "<p class=\"error\">cannot list the marks: {}</p>",
                    esc(&e.to_string())
                );
            }
            Ok(listed) => {
                let full = listed.len() >= want;
                let mine: Vec<(String, u64)> = listed
                    .into_iter()
                    .filter(|(n, _)| t.could_produce(n))
                    .collect();
                let shown: Vec<&(String, u64)> =
                    mine.iter().skip((page - 1) * PAGE).take(PAGE).collect();
                if shown.is_empty() {
                    w!(
                        out,
                        "<p class=\"muted\">No stored marks{}.</p>",
                        if page > 1 { " on this page" } else { " yet" }
                    );
                } else {
                    w!(
                        out,
                        "<table class=\"entities\"><thead><tr><th>entity</th>\
                         <th class=\"num\">mark</th></tr></thead><tbody>\n"
                    );
                    for (name, mark) in shown {
                        w!(
                            out,
                            "<tr data-resource=\"{0}\"><td class=\"resource\"><code>{0}</code>\
                             </td><td class=\"num mark\">{mark}</td></tr>\n",
                            esc(name)
                        );
                    }
                    w!(out, "</tbody></table>");
                }
                let more = (mine.len() > page * PAGE || full) && page < LAST_PAGE;
                let link = |n: usize| format!("?template={}&amp;page={n}", query_value(t.as_str()));
                w!(
                    out,
                    "<div class=\"pager\"><span class=\"muted\">page {page}</span>"
                );
                if page > 1 {
                    w!(out, "<a href=\"{}\">‹ previous</a>", link(page - 1));
                }
                if more {
                    w!(
                        out,
                        "<a href=\"{}\" rel=\"next\">next ›</a>",
                        link(page + 1)
                    );
                }
                w!(out, "</div>");
            }
        }
        w!(out, "</div>\n");
    }
}

/// The routes in force, in the order they are tried.
pub(super) fn routes(out: &mut String, config: &Config, admin: &Admin) {
    w!(
        out,
        "<section id=\"routes\"><h2>Routes</h2><p class=\"muted\">In the order they are tried \
         (the first match wins).</p><table><thead><tr><th class=\"num\">#</th><th>route</th>\
         <th>match</th><th>methods</th><th>upstream</th><th>guard</th><th>resource</th>\
         <th class=\"num\">mark</th></tr></thead><tbody>\n"
    );
    for (i, r) in config.routes.iter().enumerate() {
        let (kind, path) = match &r.path {
            PathMatch::Exact(p) => ("path", p.as_str()),
            PathMatch::Prefix(p) => ("path_prefix", p.as_str()),
            PathMatch::Pattern(p) => ("path_pattern", p.as_str()),
        };
        let host = r.host.as_deref().map_or_else(String::new, |h| {
            format!(" <span class=\"muted\">host</span> <code>{}</code>", esc(h))
        });
        let methods = r.methods.as_ref().map_or_else(
            || "<span class=\"muted\">any</span>".to_owned(),
            |m| {
                let list: Vec<&str> = m.iter().map(http::Method::as_str).collect();
                esc(&list.join(", ")).to_string()
            },
        );
        let upstream = config.upstreams.get(r.upstream).map_or("?", |u| &u.name);
        let (guard, resource, mark) = if !r.guard {
            (
                "<span class=\"badge off\">unguarded</span>",
                "<span class=\"muted\">—</span>".to_owned(),
                "—".to_owned(),
            )
        } else {
            let fed = r.epoch.as_ref().map_or_else(String::new, |e| {
                format!(
                    "<br><span class=\"muted\">fed by {} <code>{}</code></span>",
                    format!("{:?}", e.kind).to_lowercase(),
                    esc(e.name.as_str())
                )
            });
            match &r.template {
                Some(t) => (
                    "<span class=\"badge ok\">guarded</span>",
                    format!(
                        "<code>{}</code> <span class=\"muted\">one mark per entity</span>{fed}",
                        esc(t.as_str())
                    ),
                    "<span class=\"muted\">per entity</span>".to_owned(),
                ),
                None => (
                    "<span class=\"badge ok\">guarded</span>",
                    format!("<code>{}</code>{fed}", esc(&r.resource)),
                    admin
                        .admission
                        .resource(&r.resource)
                        .map_or_else(|| "?".to_owned(), |x| x.mark().to_string()),
                ),
            }
        };
        w!(
            out,
            "<tr data-route=\"{name}\"><td class=\"num\">{i}</td><td class=\"route\">\
             <code>{name}</code></td><td class=\"match\" title=\"{title}\"><span class=\"muted\">\
             {kind}</span> <code>{path}</code>{host}</td><td class=\"methods\">{methods}</td>\
             <td><code>{upstream}</code></td><td class=\"guard\">{guard}</td>\
             <td class=\"resource\">{resource}</td><td class=\"num mark\">{mark}</td></tr>\n",
            name = esc(&r.name),
            title = esc(&r.path.describe()),
            path = esc(path),
            upstream = esc(upstream),
        );
    }
    w!(out, "</tbody></table></section>\n");
}

/// The guarded routes of `config`.
fn guarded(config: &Config) -> impl Iterator<Item = &RouteSettings> + '_ {
    config.routes.iter().filter(|r| r.guard)
}
