//! `palisade marks list|set` on `store = "etcd"` (see the parent module's docs).

use std::io::Write;
use std::path::Path;
use std::time::SystemTime;

use super::audit::{self, Who};
use super::{guarded, CliError, MarksCommand};
use palisade::fence::marks::etcd::{EtcdStore, Found};
use palisade::proxy::config::{Config, MarksSettings};

/// Runs `command` if its configuration names an etcd store; `None` leaves it to the file
/// store's code (which also reports configuration errors).
pub(super) fn execute(
    command: &MarksCommand,
    out: &mut impl Write,
) -> Option<Result<(), CliError>> {
    let path = match command {
        MarksCommand::List { config, .. } | MarksCommand::Set { config, .. } => config,
    };
    let config = Config::load(path).ok()?;
    let MarksSettings::Etcd(settings) = &config.marks else {
        return None;
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return Some(Err(CliError::Output(e))),
    };
    Some(rt.block_on(async {
        let store = EtcdStore::connect(settings).await?;
        match command {
            MarksCommand::List { prefix, limit, .. } => {
                list(&config, &store, prefix, super::limit_of(*limit), out).await
            }
            MarksCommand::Set {
                resource,
                value,
                force,
                ..
            } => set(&config, &store, resource, *value, *force, out).await,
        }
    }))
}

fn describe(config: &Config) -> String {
    match &config.marks {
        MarksSettings::Etcd(e) => format!("etcd {} prefix {}", e.endpoints.join(","), e.prefix),
        _ => String::new(),
    }
}

async fn list(
    config: &Config,
    store: &EtcdStore,
    prefix: &str,
    limit: usize,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let marks = store.list_for_repair(prefix, limit).await?;
    if marks.is_empty() {
        writeln!(out, "no marks in {}", describe(config)).map_err(CliError::Output)?;
        return Ok(());
    }
    let width = marks.iter().map(|(n, _)| n.len()).max().unwrap_or(0).max(8);
    let mut text = format!("{:<width$}  {:<20}  NOTE\n", "RESOURCE", "MARK");
    for (resource, found) in &marks {
        let note = match (found, guarded(config, resource)) {
            (Found::Corrupt(_), _) => {
                "not an 8-byte mark: guarded requests fail closed (503) until `palisade marks \
                 set` repairs it"
            }
            (_, false) => "no route guards it",
            (_, true) => "",
        };
        text.push_str(format!("{resource:<width$}  {:<20}  {note}", found.to_string()).trim_end());
        text.push('\n');
    }
    out.write_all(text.as_bytes()).map_err(CliError::Output)
}

async fn set(
    config: &Config,
    store: &EtcdStore,
    resource: &str,
    value: u64,
    force: bool,
    out: &mut impl Write,
) -> Result<(), CliError> {
    if !force {
        let current = store
            .list_for_repair(resource, usize::MAX)
            .await
            .ok()
            .and_then(|l| l.into_iter().find(|(n, _)| n == resource))
            .map_or(Some(0), |(_, f)| match f {
                Found::Mark(m) => Some(m),
                Found::Corrupt(_) => None,
            });
        return Err(CliError::NotForced {
            resource: resource.to_owned(),
            value,
            current,
        });
    }
    let who = Who::current();
    let now = SystemTime::now();
    let time = audit::rfc3339_utc(now);
    let audit_key = format!("{time}-{}-{resource}", std::process::id());
    let config_file = std::path::absolute(&config.file)
        .as_deref()
        .unwrap_or(Path::new(&config.file))
        .display()
        .to_string();
    let record = |found: Found| {
        serde_json::json!({
            "time": time,
            "event": "marks.set",
            "resource": resource,
            "old": match found { Found::Mark(m) => serde_json::json!(m), Found::Corrupt(n) => serde_json::json!(format!("corrupt ({n} bytes)")) },
            "new": value,
            "user": who.user,
            "uid": who.uid,
            "host": who.host,
            "pid": std::process::id(),
            "store": describe(config),
            "config": config_file,
        })
        .to_string()
    };
    let found = store
        .overwrite_audited(resource, value, &audit_key, record)
        .await?;
    let trail = format!("{}{audit_key}", store.audit_prefix());
    tracing::warn!(
        resource,
        old = %found,
        new = value,
        user = who.user.as_deref().unwrap_or("?"),
        uid = %who.uid.map_or_else(|| "?".to_owned(), |u| u.to_string()),
        host = who.host.as_deref().unwrap_or("?"),
        store = %describe(config),
        audit = %trail,
        "mark set by an operator"
    );
    let mut text = format!("{resource}: {found} -> {value} (audited in etcd at {trail})\n");
    let lowered = match found {
        Found::Mark(m) => value < m,
        Found::Corrupt(_) => true,
    };
    if lowered {
        text.push_str(
            "note: running replicas keep the higher mark they know until they restart; \
             restart every replica for the lower mark to take effect\n",
        );
    }
    if !guarded(config, resource) {
        text.push_str(&format!(
            "note: no route of {} guards {resource:?}; check the resource name\n",
            config.file.display()
        ));
    }
    out.write_all(text.as_bytes()).map_err(CliError::Output)
}
