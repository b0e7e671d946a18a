//! A configuration change never drops protection: what a reload does with the marks of the
//! requests the running routes guard.
//!
//! Marks belong to resources, and routes send requests to resources. Were a reload to send a
//! guarded route's requests to a resource name with a lower mark, or to an unguarded route,
//! a zombie whose token is below the old mark would reach the upstream again. So for every
//! guarded route of the running configuration whose resource has a mark above 0, the new
//! route table is asked where that route's requests go now: the route's own path and its
//! spellings (`/p`, `/p/`, `/p.json`, a path below it), every path of a new route inside
//! its space, with each method it takes (or a set of common and unusual ones, plus every
//! method the new routes name) and each host (its own, or every host the new routes name and
//! one they do not). Then:
//!
//! - requests that reach no route (404, 405) lose nothing;
//! - requests that reach a guarded route of another resource **carry the mark over**: that
//!   resource's mark is raised to the old one (persisted like an advance) before the new routes
//!   serve, so a renamed resource keeps its protection;
//! - requests that reach an unguarded route are **refused**: the reload changes nothing and
//!   says which resource, with which mark, would lose its guard, which request shows it, and
//!   the two ways forward, unless the resource is listed in `[marks] retired`, the operator's
//!   explicit word in the file, logged at `warn` on every such reload (its mark stays in the
//!   store).
//!
//! `palisade check --config NEW --previous OLD` prints the same plan before a reload.

use std::collections::BTreeSet;

use crate::proxy::config::{pick, Config, MissingToken, PathMatch, Pick, RouteSettings};

/// A mark carried over to the resource that now takes a guarded route's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    /// The running route whose requests now go to `to`.
    pub route: String,
    /// The resource it guarded.
    pub from: String,
    /// The resource that takes its requests now.
    pub to: String,
    /// The mark carried.
    pub mark: u64,
}

/// A resource with a mark whose requests the new configuration would forward unguarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The resource.
    pub resource: String,
    /// Its mark.
    pub mark: u64,
    /// The running route that guarded it.
    pub route: String,
    /// A request that shows it: `POST /orders/x now goes to unguarded route "all"`.
    pub why: String,
}

/// What a change from one configuration to the next does with marks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Marks to carry over before the new routes serve.
    pub carried: Vec<Carried>,
    /// Resources left unguarded on the operator's word (`[marks] retired`).
    pub retired: Vec<Dropped>,
    /// Resources that would lose their guard: the change must be refused.
    pub unprotected: Vec<Dropped>,
    /// Guarded routes, running or removed earlier, some of whose requests reach no route
    /// now: a later change that sends them to an unguarded route must still be refused, so
    /// the reloader remembers them (until they are guarded again or retired).
    pub ghosts: Vec<Ghost>,
}

/// A guarded route remembered after its requests stopped reaching any route.
#[derive(Debug, Clone)]
pub struct Ghost(pub RouteSettings);

impl PartialEq for Ghost {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name && self.0.resource == other.0.resource
    }
}

impl Eq for Ghost {}

/// Methods tried for a route that takes every method: the common ones, and one no route is
/// likely to list.
const METHODS: [&str; 9] = [
    "GET",
    "HEAD",
    "OPTIONS",
    "POST",
    "PUT",
    "PATCH",
    "DELETE",
    "PROPFIND",
    "PALISADE-PROBE",
];
/// A path segment and a host no configuration names.
const PROBE_SEGMENT: &str = "palisade-probe";
const PROBE_HOST: &str = "palisade-probe.invalid";

/// The requests that stand for everything route `r` takes: (method, host, path key). The
/// caller keeps those the running table really gives to `r`.
fn probes(r: &RouteSettings, running: &Config, next: &Config) -> Vec<(String, String, String)> {
    let all = || running.routes.iter().chain(&next.routes);
    let base = r.path.example(PROBE_SEGMENT);
    let mut paths = BTreeSet::new();
    let trimmed = base.trim_end_matches('/');
    paths.insert(base.clone());
    paths.insert(format!("{trimmed}/"));
    paths.insert(format!("{trimmed}.json"));
    paths.insert(format!("{trimmed}/{PROBE_SEGMENT}"));
    for n in all() {
        let p = n.path.example(PROBE_SEGMENT);
        paths.insert(format!("{}/{PROBE_SEGMENT}", p.trim_end_matches('/')));
        paths.insert(p);
        // Where this route's own paths land under a deeper pattern (`/warehouses/7` under
        // `/warehouses/{id}/stock/{sku}`: `/warehouses/7/stock/palisade-probe`).
        if let PathMatch::Pattern(pattern) = &n.path {
            if let Some(o) = pattern.overlay(&base, PROBE_SEGMENT) {
                paths.insert(o);
            }
        }
    }
    paths.retain(|p| r.path.matches(p));
    let methods: BTreeSet<String> = match &r.methods {
        Some(ms) => ms.iter().map(|m| m.as_str().to_owned()).collect(),
        None => METHODS
            .iter()
            .map(|m| (*m).to_owned())
            .chain(all().flat_map(|n| n.methods.iter().flatten().map(|m| m.as_str().to_owned())))
            .collect(),
    };
    let hosts: BTreeSet<String> = match &r.host {
        Some(h) => [h.clone()].into(),
        None => all()
            .filter_map(|n| n.host.clone())
            .chain([PROBE_HOST.to_owned()])
            .collect(),
    };
    let mut out = Vec::new();
    for m in &methods {
        for h in &hosts {
            for p in &paths {
                out.push((m.clone(), h.clone(), p.clone()));
            }
        }
    }
    out
}

/// Whether two routes with the same template text name different entities for one request
/// (their patterns bind the captures to other segments).
fn renames_entities(old: &RouteSettings, new: &RouteSettings) -> bool {
    let (Some(t_old), Some(t_new)) = (&old.template, &new.template) else {
        return false;
    };
    let (PathMatch::Pattern(p_old), PathMatch::Pattern(p_new)) = (&old.path, &new.path) else {
        return false;
    };
    if p_old.as_str() == p_new.as_str() {
        return false;
    }
    let path = p_old.example_distinct("p");
    let name = |p: &crate::fence::template::PathPattern,
                t: &crate::fence::template::ResourceTemplate| {
        p.captures(&path).and_then(|c| {
            t.fill(
                &c,
                &Probe {
                    host: PROBE_HOST,
                    path: &path,
                },
            )
            .ok()
        })
    };
    match (name(p_old, t_old), name(p_new, t_new)) {
        (Some(a), Some(b)) => a != b,
        // The new pattern does not take this request: its other probes decide.
        (Some(_), None) => false,
        _ => true,
    }
}

/// A probe request as a resource template sees it: a host and a path, no headers.
struct Probe<'a> {
    host: &'a str,
    path: &'a str,
}

impl crate::fence::template::RequestParts for Probe<'_> {
    fn host(&self) -> Option<std::borrow::Cow<'_, str>> {
        (self.host != PROBE_HOST).then_some(std::borrow::Cow::Borrowed(self.host))
    }
    fn header_values(&self, _: &http::HeaderName) -> Vec<&[u8]> {
        Vec::new()
    }
    fn path(&self) -> &str {
        self.path
    }
    fn is_grpc(&self) -> bool {
        false
    }
}

/// The plan for changing from `running` to `next`, with `mark` giving a resource's current
/// mark (0: none; a resource without a mark loses nothing).
pub fn plan(running: &Config, next: &Config, mark: impl Fn(&str) -> u64) -> Plan {
    plan_with(running, &[], next, mark)
}

/// [`plan`], also for `ghosts`: guarded routes of earlier configurations whose requests
/// reached no route (see [`Plan::ghosts`]).
pub fn plan_with(
    running: &Config,
    ghosts: &[Ghost],
    next: &Config,
    mark: impl Fn(&str) -> u64,
) -> Plan {
    let mut out = Plan::default();
    let mut carried = BTreeSet::new();
    let mut dropped = BTreeSet::new();
    // A token sent in the old header is no token at all once the header changes.
    let header_changed = running.fencing.header != next.fencing.header;
    let live = running
        .routes
        .iter()
        .filter(|r| r.guard)
        .map(|r| (r, false));
    for (r, ghost) in live.chain(ghosts.iter().map(|g| (&g.0, true))) {
        // A templated route holds one mark per entity: assume they exist.
        let keyed = r.template.is_some();
        let m = if keyed { 0 } else { mark(&r.resource) };
        if m == 0 && !keyed {
            continue;
        }
        let mut leak = None;
        let mut nowhere = false;
        for (method, host, path) in probes(r, running, next) {
            // Only the requests the running table gives this route are its to lose (a
            // ghost's reach no route now: all of them).
            match pick(&running.routes, |o| o, &method, &host, &path) {
                Pick::To(o) if std::ptr::eq(o, r) => {}
                _ if ghost => {}
                _ => continue,
            }
            if matches!(
                pick(&next.routes, |n| n, &method, &host, &path),
                Pick::Nowhere | Pick::MethodNotAllowed(_)
            ) {
                nowhere = true;
            }
            let shown = || {
                if host == PROBE_HOST || r.host.is_none() {
                    format!("{method} {path}")
                } else {
                    format!("{method} {path} (host {host})")
                }
            };
            match pick(&next.routes, |n| n, &method, &host, &path) {
                Pick::Nowhere | Pick::MethodNotAllowed(_) => {}
                Pick::To(n) if n.guard => {
                    let tokenless = n.missing_token == MissingToken::Allow
                        && (header_changed || r.missing_token != MissingToken::Allow);
                    if tokenless && leak.is_none() {
                        leak = Some(format!(
                            "{} would go to route {:?}, which forwards requests without a token \
                             (missing_token = \"allow\"{})",
                            shown(),
                            n.name,
                            if header_changed {
                                ", and the token header changed"
                            } else {
                                ""
                            }
                        ));
                    }
                    if n.resource == r.resource && !renames_entities(r, n) {
                        continue;
                    }
                    if n.resource == r.resource {
                        if leak.is_none() {
                            leak = Some(format!(
                                "{} would go to route {:?}, whose pattern binds the captures \
                                 of {:?} to other segments: the same request would name \
                                 another entity",
                                shown(),
                                n.name,
                                r.resource
                            ));
                        }
                        continue;
                    }
                    if keyed {
                        if leak.is_none() {
                            leak = Some(format!(
                                "{} would go to route {:?} of resource {:?}: the marks of \
                                 template {:?}, one per entity, cannot be carried over",
                                shown(),
                                n.name,
                                n.resource,
                                r.resource
                            ));
                        }
                        continue;
                    }
                    let to = match &n.template {
                        None => n.resource.clone(),
                        // The entity this request names under the new template.
                        Some(t) => {
                            let filled = match &n.path {
                                PathMatch::Pattern(p) => p.captures(&path).and_then(|c| {
                                    t.fill(
                                        &c,
                                        &Probe {
                                            host: &host,
                                            path: &path,
                                        },
                                    )
                                    .ok()
                                }),
                                _ => t
                                    .fill(
                                        &Default::default(),
                                        &Probe {
                                            host: &host,
                                            path: &path,
                                        },
                                    )
                                    .ok(),
                            };
                            match filled {
                                // One entity, named by the old route's own path.
                                Some(f) if !f.contains(PROBE_SEGMENT) => f,
                                Some(_) => {
                                    if leak.is_none() {
                                        leak = Some(format!(
                                            "{} would go to route {:?}, whose template {:?} \
                                             gives every entity its own mark: the one mark \
                                             that covered them all cannot be carried over",
                                            shown(),
                                            n.name,
                                            n.resource
                                        ));
                                    }
                                    continue;
                                }
                                None => {
                                    if leak.is_none() {
                                        leak = Some(format!(
                                            "{} would go to route {:?}, whose resource {:?} \
                                             depends on the request (its host, headers or gRPC \
                                             call): the mark cannot be carried over",
                                            shown(),
                                            n.name,
                                            n.resource
                                        ));
                                    }
                                    continue;
                                }
                            }
                        }
                    };
                    if carried.insert((r.resource.clone(), to.clone())) {
                        out.carried.push(Carried {
                            route: r.name.clone(),
                            from: r.resource.clone(),
                            to,
                            mark: m,
                        });
                    }
                }
                Pick::To(n) if leak.is_none() => {
                    leak = Some(format!(
                        "{} would go to unguarded route {:?}",
                        shown(),
                        n.name
                    ));
                }
                Pick::To(_) => {}
            }
        }
        let Some(why) = leak else {
            if nowhere
                && !next.retired.contains(&r.resource)
                && !out
                    .ghosts
                    .iter()
                    .any(|g| g.0.name == r.name && g.0.resource == r.resource)
            {
                out.ghosts.push(Ghost(r.clone()));
            }
            continue;
        };
        if !dropped.insert(r.resource.clone()) {
            continue; // one line per resource
        }
        let d = Dropped {
            resource: r.resource.clone(),
            mark: m,
            route: r.name.clone(),
            why,
        };
        if next.retired.contains(&r.resource) {
            out.retired.push(d);
        } else {
            out.unprotected.push(d);
        }
    }
    out
}

/// The refusal's text: every resource that would lose its guard, and what to do.
pub fn explain(unprotected: &[Dropped]) -> String {
    let list: Vec<String> = unprotected
        .iter()
        .map(|d| {
            let mark = if d.mark == 0 {
                "one mark per entity".to_owned()
            } else {
                format!("mark {}", d.mark)
            };
            format!(
                "resource {:?} ({mark}, route {:?}) would lose its guard: {}",
                d.resource, d.route, d.why
            )
        })
        .collect();
    format!(
        "refusing a configuration that drops protection, nothing changed: {}. Tokens below \
         those marks would reach the upstream again. Keep such requests on a guarded route \
         (a renamed resource gets the old mark carried over), or, to stop guarding a \
         resource on purpose, list it in [marks] retired = [...] (its mark stays in the store)",
        list.join("; ")
    )
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.carried.is_empty() && self.retired.is_empty() && self.unprotected.is_empty() {
            return f.write_str("marks: every guarded resource stays guarded");
        }
        let mut first = true;
        let mut line = |f: &mut std::fmt::Formatter<'_>, s: String| {
            if !first {
                f.write_str("\n")?;
            }
            first = false;
            f.write_str(&s)
        };
        for c in &self.carried {
            line(
                f,
                format!(
                    "marks: requests of route {:?} (resource {:?}) now go to resource {:?}: \
                     mark {} carried over",
                    c.route, c.from, c.to, c.mark
                ),
            )?;
        }
        for d in &self.retired {
            line(
                f,
                format!(
                    "marks: resource {:?} (mark {}) retired, as [marks] retired says: {}",
                    d.resource, d.mark, d.why
                ),
            )?;
        }
        if !self.unprotected.is_empty() {
            line(f, format!("error: {}", explain(&self.unprotected)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(routes: &str) -> Config {
        let text = format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\n[marks]\nstore = \"memory\"\n[[upstream]]\nname = \"legacy\"\nurl = \
             \"http://127.0.0.1:9\"\n{routes}"
        );
        Config::parse(&text, std::path::Path::new("t.toml")).unwrap()
    }

    const WH7: &str = r#"
[[route]]
name = "wh7"
upstream = "legacy"
path_prefix = "/warehouses/7"
resource = "warehouse-7"
"#;
    const CATCH_ALL: &str = r#"
[[route]]
name = "all"
upstream = "legacy"
path_prefix = "/"
guard = false
"#;

    fn marks_of_all(_: &str) -> u64 {
        110
    }

    fn marks(r: &str) -> u64 {
        match r {
            "warehouse-7" => 110,
            _ => 0,
        }
    }

    #[test]
    fn a_renamed_resource_gets_the_old_mark_carried_over() {
        let old = config(WH7);
        let new = config(&WH7.replace("\"warehouse-7\"", "\"wh/7\""));
        let p = plan(&old, &new, marks);
        assert!(p.unprotected.is_empty(), "{p}");
        assert_eq!(
            p.carried,
            [Carried {
                route: "wh7".into(),
                from: "warehouse-7".into(),
                to: "wh/7".into(),
                mark: 110
            }]
        );
        // Route and resource renamed together: the requests still reach a guarded route.
        let both = config(
            &WH7.replace("\"warehouse-7\"", "\"wh/7\"")
                .replace("\"wh7\"", "\"w-7\""),
        );
        assert_eq!(plan(&old, &both, marks).carried[0].to, "wh/7");
    }

    #[test]
    fn requests_that_would_reach_an_unguarded_route_refuse_the_change() {
        let old = config(&format!("{WH7}{CATCH_ALL}"));
        for new in [
            config(CATCH_ALL),
            config(&format!(
                "{}{CATCH_ALL}",
                WH7.replace("/warehouses/7", "/wh/7")
            )),
            config(&format!(
                "{}{CATCH_ALL}",
                WH7.replace("resource", "methods = [\"POST\"]\nresource")
            )),
        ] {
            let p = plan(&old, &new, marks);
            assert_eq!(p.unprotected.len(), 1, "{p}");
            assert!(
                p.unprotected[0].why.contains("unguarded route \"all\""),
                "{p}"
            );
            assert!(p.to_string().contains("mark 110"), "{p}");
        }
        // Retired: the operator's word.
        let retired = config(CATCH_ALL).tap_retired("warehouse-7");
        let p = plan(&old, &retired, marks);
        assert!(p.unprotected.is_empty() && p.retired.len() == 1, "{p}");
    }

    #[test]
    fn removing_a_route_whose_requests_then_find_no_route_loses_nothing() {
        let old = config(WH7);
        let p = plan(&old, &config(""), marks);
        assert!(p.unprotected.is_empty() && p.carried.is_empty(), "{p}");
        assert_eq!(p.ghosts.len(), 1, "remembered for later reloads");
        // A resource without a mark has nothing to lose.
        let p = plan(
            &config(&format!("{WH7}{CATCH_ALL}")),
            &config(CATCH_ALL),
            |_| 0,
        );
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn reloading_the_same_file_changes_nothing() {
        let carve_out = r#"
[[route]]
name = "public"
upstream = "legacy"
path_prefix = "/warehouses/7/public"
guard = false
[[route]]
name = "stock"
upstream = "legacy"
path_prefix = "/warehouses/7/stock"
resource = "stock-7"
"#;
        let configs = [
            format!("{WH7}{CATCH_ALL}"),
            format!("{carve_out}{WH7}{CATCH_ALL}"),
            format!("{carve_out}{WH7}"),
            WH7.to_owned(),
        ];
        let all_marked = |_: &str| 110;
        for c in &configs {
            let c = config(c);
            assert_eq!(plan(&c, &c, all_marked), Plan::default(), "{c:?}");
        }
    }

    #[test]
    fn a_route_that_would_take_requests_without_a_token_loses_protection() {
        let old = config(WH7);
        let lenient = config(&WH7.replace("resource", "missing_token = \"allow\"\nresource"));
        let p = plan(&old, &lenient, marks);
        assert_eq!(p.unprotected.len(), 1, "{p}");
        assert!(p.unprotected[0].why.contains("without a token"), "{p}");
        // An unusual method that a guarded route does not list reaches the catch-all.
        let listed = WH7.replace(
            "resource",
            "methods = [\"GET\", \"HEAD\", \"OPTIONS\", \"POST\", \"PUT\", \"PATCH\", \"DELETE\", \"PROPFIND\"]\nresource",
        );
        let p = plan(&old, &config(&format!("{listed}{CATCH_ALL}")), marks);
        assert_eq!(p.unprotected.len(), 1, "{p}");
    }

    #[test]
    fn carries_do_not_depend_on_route_order_when_a_resource_is_retired() {
        let api = r#"
[[route]]
name = "wh7api"
upstream = "legacy"
path_prefix = "/api/warehouses/7"
resource = "warehouse-7"
"#;
        let moved = api.replace("\"warehouse-7\"", "\"wh/7\"");
        for old in [
            format!("{WH7}{api}{CATCH_ALL}"),
            format!("{api}{WH7}{CATCH_ALL}"),
        ] {
            let old = config(&old);
            let new = config(&format!("{moved}{CATCH_ALL}")).tap_retired("warehouse-7");
            let p = plan(&old, &new, marks);
            assert_eq!(p.retired.len(), 1, "{p}");
            assert_eq!(p.carried.len(), 1, "{p}");
            assert_eq!(p.carried[0].to, "wh/7");
        }
    }

    #[test]
    fn templated_routes_keep_their_entities_marks_or_refuse() {
        let keyed = r#"
[[route]]
name = "stock"
upstream = "legacy"
path_pattern = "/warehouses/{id}"
resource = "warehouse/{id}"
"#;
        let old = config(&format!("{keyed}{CATCH_ALL}"));
        assert_eq!(plan(&old, &old, |_| 0), Plan::default(), "same file");
        // Gone, or moved to another template: its per-entity marks would be lost.
        for new in [
            config(CATCH_ALL),
            config(&format!(
                "{}{CATCH_ALL}",
                keyed.replace("warehouse/{id}", "wh/{id}")
            )),
        ] {
            let p = plan(&old, &new, |_| 0);
            assert_eq!(p.unprotected.len(), 1, "{p}");
            assert!(p.to_string().contains("one mark per entity"), "{p}");
        }
        // The same template text over a pattern that binds its capture elsewhere: refused.
        let swapped = r#"
[[route]]
name = "stock"
upstream = "legacy"
path_pattern = "/t/{id}/o/{x}"
resource = "t/{id}"
"#;
        let old_sw = config(swapped);
        let new_sw = config(&swapped.replace("/t/{id}/o/{x}", "/t/{x}/o/{id}"));
        let p = plan(&old_sw, &new_sw, |_| 0);
        assert_eq!(p.unprotected.len(), 1, "{p}");
        assert!(p.to_string().contains("another entity"), "{p}");
        // A fixed route replaced by a template: the mark goes to the entity it names.
        let p = plan(&config(WH7), &config(keyed), marks);
        assert!(p.unprotected.is_empty(), "{p}");
        assert_eq!(p.carried.len(), 1, "{p}");
        assert_eq!(p.carried[0].to, "warehouse/7");
        // A deeper pattern takes the old route's writes too: carried to the entity.
        let deep = keyed.replace("/warehouses/{id}", "/warehouses/{id}/stock/{sku}");
        let reads = "[[route]]\nname = \"reads\"\nupstream = \"legacy\"\npath_prefix = \"/\"\nmethods = [\"GET\"]\nguard = false\n";
        let p = plan(&config(WH7), &config(&format!("{deep}{reads}")), marks);
        assert_eq!(p.carried.len(), 1, "{p:?}");
        assert_eq!(p.carried[0].to, "warehouse/7");
        // One mark for every warehouse cannot become one per warehouse.
        let all = WH7.replace("/warehouses/7", "/warehouses");
        let p = plan(&config(&all), &config(keyed), marks_of_all);
        assert_eq!(p.unprotected.len(), 1, "{p}");
        assert!(p.to_string().contains("cannot be carried over"), "{p}");
    }

    #[test]
    fn a_route_removed_to_nowhere_is_remembered_by_later_reloads() {
        let reads = r#"
[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/"
methods = ["GET"]
guard = false
"#;
        let t1 = config(&format!("{WH7}{reads}"));
        // The guarded route removed, and the reads narrowed: its requests reach no route.
        let t2 = config(&reads.replace("path_prefix = \"/\"", "path_prefix = \"/static\""));
        let t3 = config(CATCH_ALL);
        let p12 = plan(&t1, &t2, marks);
        assert!(
            p12.unprotected.is_empty(),
            "nothing reaches the upstream: {p12}"
        );
        assert_eq!(p12.ghosts.len(), 1, "{p12:?}");
        let p23 = plan_with(&t2, &p12.ghosts, &t3, marks);
        assert_eq!(p23.unprotected.len(), 1, "{p23}");
        assert!(
            p23.unprotected[0].why.contains("unguarded route \"all\""),
            "{p23}"
        );
        // Guarded again: no longer a ghost.
        let p = plan_with(&t2, &p12.ghosts, &config(WH7), marks);
        assert!(p.unprotected.is_empty() && p.ghosts.is_empty(), "{p:?}");
    }

    trait Retire {
        fn tap_retired(self, r: &str) -> Self;
    }
    impl Retire for Config {
        fn tap_retired(mut self, r: &str) -> Self {
            self.retired.push(r.to_owned());
            self
        }
    }
}
