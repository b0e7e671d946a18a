//! Keys that take effect only at start: listeners (and the admin token), the mark store, the
//! runtime and the connection limits of the accept loop. A reload that changes one keeps the running value
//! and says so, instead of failing the whole reload or half-applying it.

use std::fmt;

use crate::proxy::config::Config;

/// A key whose new value waits for a restart; the running value stays in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptKey {
    /// The key, e.g. `proxy.listen`.
    pub key: &'static str,
    /// The value in force (kept).
    pub running: String,
    /// The value in the file.
    pub configured: String,
}

impl fmt::Display for KeptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: changed from {} to {}, which takes a restart; {} stays in force",
            self.key, self.running, self.configured, self.running
        )
    }
}

/// Compares the start-only keys of `next` with `running`, puts the running values back into
/// `next` and reports each one that differed.
pub(super) fn keep(running: &Config, next: &mut Config) -> Vec<KeptKey> {
    let mut kept = Vec::new();
    let mut check = |key: &'static str, r: String, n: String| {
        if r != n {
            kept.push(KeptKey {
                key,
                running: r,
                configured: n,
            });
        }
    };
    let (r, n) = (&running.proxy, &next.proxy);
    check("proxy.listen", r.listen.to_string(), n.listen.to_string());
    check(
        "proxy.workers",
        show_workers(r.workers),
        show_workers(n.workers),
    );
    check(
        "proxy.shutdown_grace_ms",
        ms(r.shutdown_grace),
        ms(n.shutdown_grace),
    );
    check(
        "proxy.max_connections",
        r.max_connections.to_string(),
        n.max_connections.to_string(),
    );
    check(
        "proxy.header_read_timeout_ms",
        ms(r.header_read_timeout),
        ms(n.header_read_timeout),
    );
    check(
        "proxy.idle_timeout_ms",
        ms(r.idle_timeout),
        ms(n.idle_timeout),
    );
    check(
        "proxy.http2_keepalive_interval_ms",
        r.http2_keepalive_interval
            .map_or_else(|| "0".to_owned(), ms),
        n.http2_keepalive_interval
            .map_or_else(|| "0".to_owned(), ms),
    );
    check(
        "proxy.http1_fast_path",
        r.http1_fast_path.to_string(),
        n.http1_fast_path.to_string(),
    );
    check(
        "proxy.max_header_bytes",
        r.max_header_bytes.to_string(),
        n.max_header_bytes.to_string(),
    );
    let tls = |t: &Option<crate::proxy::config::TlsSettings>| {
        if t.is_some() { "on" } else { "off" }.to_owned()
    };
    check("proxy.tls", tls(&r.tls), tls(&n.tls));
    let admin = |c: &Config| {
        c.admin
            .as_ref()
            .map_or_else(|| "off".to_owned(), |a| a.listen.to_string())
    };
    check("admin.listen", admin(running), admin(next));
    // The variable's name only: its value is the token.
    let token = |c: &Config| {
        c.admin
            .as_ref()
            .and_then(|a| a.token.as_ref())
            .map_or_else(|| "none".to_owned(), |t| format!("${}", t.env()))
    };
    check("admin.token_env", token(running), token(next));
    let admin_tls = |c: &Config| {
        let on = c.admin.as_ref().is_some_and(|a| a.tls.is_some());
        if on { "on" } else { "off" }.to_owned()
    };
    check("admin.tls", admin_tls(running), admin_tls(next));
    // Only the kind is shown: etcd settings may hold a password.
    if running.marks != next.marks {
        kept.push(KeptKey {
            key: "marks",
            running: format!("the running {} store", store_kind(running)),
            configured: format!("another {} store", store_kind(next)),
        });
    }
    // `require_nfkc_paths` is read per request, and TLS certificates per new connection:
    // the `[proxy]` keys a reload applies (TLS only while it stays on: turning it on or off
    // changes the listener).
    let nfkc = next.proxy.require_nfkc_paths;
    let certificates = next
        .proxy
        .tls
        .take()
        .filter(|_| running.proxy.tls.is_some());
    next.proxy = running.proxy.clone();
    next.proxy.require_nfkc_paths = nfkc;
    if certificates.is_some() {
        next.proxy.tls = certificates;
    }
    // Likewise the admin listener's certificates, while its TLS stays on.
    let admin_certificates = next
        .admin
        .as_mut()
        .and_then(|a| a.tls.take())
        .filter(|_| running.admin.as_ref().is_some_and(|a| a.tls.is_some()));
    next.admin = running.admin.clone();
    if let (Some(admin), Some(tls)) = (next.admin.as_mut(), admin_certificates) {
        admin.tls = Some(tls);
    }
    next.marks = running.marks.clone();
    kept
}

fn ms(d: std::time::Duration) -> String {
    d.as_millis().to_string()
}

fn show_workers(w: Option<usize>) -> String {
    w.map_or_else(|| "one per core".to_owned(), |w| w.to_string())
}

fn store_kind(c: &Config) -> &'static str {
    match c.marks {
        crate::proxy::config::MarksSettings::Memory => "memory",
        crate::proxy::config::MarksSettings::File { .. } => "file",
        crate::proxy::config::MarksSettings::Etcd(_) => "etcd",
    }
}
