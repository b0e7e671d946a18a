use super::*;

const BASE: &str = r#"
[proxy]
listen = "127.0.0.1:0"

[[upstream]]
name = "legacy"
url = "http://127.0.0.1:9000"

[[route]]
name = "orders"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
"#;

fn err(text: &str) -> (usize, usize, String, String) {
    match Config::parse(text, Path::new("p.toml")).unwrap_err() {
        ConfigError::Invalid {
            line,
            column,
            key,
            message,
            ..
        } => (line, column, key, message),
        e => panic!("{e}"),
    }
}

#[test]
fn base_config_is_valid_with_defaults() {
    let c = Config::parse(BASE, Path::new("conf/p.toml")).unwrap();
    assert_eq!(c.routes[0].resource, "orders");
    assert!(c.routes[0].guard);
    assert_eq!(c.routes[0].missing_token, MissingToken::Reject);
    assert_eq!(
        c.marks,
        MarksSettings::File {
            path: PathBuf::from("conf/data/marks.db")
        }
    );
    assert_eq!(c.fencing.header.as_str(), "x-fencing-token");
    assert_eq!(
        c.admin.unwrap().listen.to_string(),
        DEFAULT_ADMIN_LISTEN,
        "admin on loopback by default"
    );
}

#[test]
fn unknown_key_names_line_column_and_key() {
    let text = BASE.replace(
        "methods = [\"POST\"]",
        "methods = [\"POST\"]\ngaurd = false",
    );
    let (line, col, key, msg) = err(&text);
    assert_eq!((line, col), (14, 1));
    assert_eq!(key, "route[0].gaurd");
    assert!(msg.contains("unknown field"), "{msg}");
}

#[test]
fn unknown_upstream_duplicate_route_bad_listen_bad_method() {
    let (line, col, key, _) = err(&BASE.replace("upstream = \"legacy\"", "upstream = \"legcy\""));
    assert_eq!((line, col, key.as_str()), (11, 12, "route[0].upstream"));

    let dup =
        format!("{BASE}\n[[route]]\nname = \"orders\"\nupstream = \"legacy\"\npath = \"/x\"\n");
    let (line, col, key, _) = err(&dup);
    assert_eq!((line, col, key.as_str()), (16, 8, "route[1].name"));

    let (line, col, key, _) = err(&BASE.replace("127.0.0.1:0", "localhost:80"));
    assert_eq!((line, col, key.as_str()), (3, 10, "proxy.listen"));

    let (line, col, key, _) = err(&BASE.replace("[\"POST\"]", "[\"POST\", \"get\"]"));
    assert_eq!((line, col, key.as_str()), (13, 20, "route[0].methods[1]"));
}

#[test]
fn connection_limits_have_defaults_and_refuse_zero() {
    let c = Config::parse(BASE, Path::new("p.toml")).unwrap();
    assert_eq!(c.proxy.max_connections, 10_000);
    assert_eq!(c.proxy.header_read_timeout, Duration::from_secs(10));
    assert_eq!(c.proxy.idle_timeout, Duration::from_secs(60));
    assert_eq!(
        c.proxy.http2_keepalive_interval,
        Some(Duration::from_secs(20))
    );
    for key in [
        "max_connections",
        "header_read_timeout_ms",
        "idle_timeout_ms",
    ] {
        let text = BASE.replace(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"127.0.0.1:0\"\n{key} = 0"),
        );
        let (line, _, k, msg) = err(&text);
        assert_eq!((line, k.as_str()), (4, format!("proxy.{key}").as_str()));
        assert!(msg.contains("at least 1"), "{msg}");
    }
}

#[test]
fn route_hosts_max_token_and_method_policies_are_validated() {
    let (_, _, key, msg) = err(&BASE.replace(
        "methods = [\"POST\"]",
        "methods = [\"POST\"]\nhost = \"u@api.example.com\"",
    ));
    assert_eq!(key, "route[0].host");
    assert!(msg.contains("letters, digits"), "{msg}");
    let (_, _, key, _) = err(&BASE.replace(
        "methods = [\"POST\"]",
        "methods = [\"POST\"]\nmax_token = 0",
    ));
    assert_eq!(key, "route[0].max_token");
    let (_, _, key, _) = err(&BASE.replace(
        "methods = [\"POST\"]",
        "methods = [\"POST\"]\nguard = false\nmax_token = 9",
    ));
    assert_eq!(key, "route[0].max_token");
    let (_, _, key, _) = err(&BASE.replace(
        "methods = [\"POST\"]",
        "methods = [\"POST\"]\nother_methods = \"drop\"",
    ));
    assert_eq!(key, "route[0].other_methods");
    let c = Config::parse(
        &BASE.replace(
            "methods = [\"POST\"]",
            "methods = [\"POST\"]\nhost = \"API.Example.com.\"\nget_bodies = \"forward\"",
        ),
        Path::new("p.toml"),
    )
    .unwrap();
    assert_eq!(c.routes[0].host.as_deref(), Some("api.example.com"));
    assert_eq!(c.routes[0].get_bodies, GetBodies::Forward);
}

#[test]
fn route_paths_must_be_normal() {
    let (_, _, key, msg) = err(&BASE.replace("\"/orders\"", "\"/a/../orders\""));
    assert_eq!(key, "route[0].path_prefix");
    assert!(msg.contains("normal-form"), "{msg}");
}

#[test]
fn exact_paths_match_with_trailing_slash_or_format_suffix() {
    let m = PathMatch::Exact("/exact".into());
    assert!(m.matches("/exact") && m.matches("/exact/") && m.matches("/exact.json"));
    assert!(!m.matches("/exactly") && !m.matches("/exact/x") && !m.matches("/exact.d/x"));
}

#[test]
fn access_log_is_off_by_default_and_validated() {
    assert_eq!(
        Config::parse(BASE, Path::new("p.toml")).unwrap().access_log,
        None
    );
    let on = |table: &str| format!("{BASE}\n[access_log]\n{table}");
    let c = Config::parse(&on(""), Path::new("conf/p.toml")).unwrap();
    assert_eq!(
        c.access_log,
        Some(AccessLogSettings {
            format: AccessLogFormat::Json,
            target: AccessLogTarget::Stderr
        })
    );
    let c = Config::parse(
        &on("format = \"text\"\npath = \"logs/access.log\""),
        Path::new("conf/p.toml"),
    )
    .unwrap();
    assert_eq!(
        c.access_log,
        Some(AccessLogSettings {
            format: AccessLogFormat::Text,
            target: AccessLogTarget::File(PathBuf::from("conf/logs/access.log"))
        })
    );
    let (line, col, key, msg) = err(&on("format = \"xml\""));
    assert_eq!((line, col, key.as_str()), (16, 10, "access_log.format"));
    assert!(msg.contains("json") && msg.contains("text"), "{msg}");
    let (line, col, key, msg) = err(&on("path = \"-\"\nrotate = true"));
    assert_eq!((line, col, key.as_str()), (17, 1, "access_log.rotate"));
    assert!(msg.contains("unknown field"), "{msg}");
    let (line, col, key, _) = err(&on("path = \"\""));
    assert_eq!((line, col, key.as_str()), (16, 8, "access_log.path"));
}

#[test]
fn websocket_tunnels_that_bypass_a_guard_are_refused() {
    let guarded_ws = |extra: &str| {
        format!(
            "{BASE}[[route]]\nname = \"chat\"\nupstream = \"twin\"\npath_prefix = \"/chat\"\nwebsocket = true\n{extra}\n\
             [[upstream]]\nname = \"twin\"\nurl = \"http://LOCALHOST.invalid:9000\"\n"
        )
        .replace("url = \"http://127.0.0.1:9000\"", "url = \"http://localhost.invalid\"")
    };
    // Same address (case and default port aside): a tunnel of another resource, a tokenless
    // one, and an unguarded one all reach "orders" unchecked.
    for (extra, how) in [
        ("resource = \"chat\"", "route of another resource"),
        (
            "resource = \"orders\"\nmissing_token = \"allow\"",
            "missing_token = \"allow\"",
        ),
        ("guard = false", "unguarded route"),
    ] {
        let text = guarded_ws(extra).replace(":9000\"\n", ":80\"\n");
        let e = Config::parse(&text, Path::new("p.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("route[1].websocket") && e.contains(how),
            "{extra}: {e}"
        );
    }
    // Guarded by the same resource, with a token required: fine.
    let text = guarded_ws("resource = \"orders\"").replace(":9000\"\n", ":80\"\n");
    Config::parse(&text, Path::new("p.toml")).unwrap();
}

#[test]
fn resource_templates_are_checked_with_their_place() {
    let route = |pattern: &str, resource: &str| {
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\n[[upstream]]\nname = \"legacy\"\nurl = \
             \"http://127.0.0.1:9000\"\n[[route]]\nname = \"stock\"\nupstream = \"legacy\"\n\
             path_pattern = \"{pattern}\"\nresource = \"{resource}\"\n"
        )
    };
    let ok = Config::parse(
        &route("/warehouses/{id}/stock/{sku}", "warehouse/{id}"),
        Path::new("p.toml"),
    )
    .unwrap();
    assert!(ok.routes[0].template.is_some());
    // A capture the pattern does not have: line 10, the column of its `{`.
    let (line, column, key, message) = err(&route("/warehouses/{id}", "warehouse/{wh}"));
    assert_eq!(
        (line, column, key.as_str()),
        (10, 23, "route[0].resource"),
        "{message}"
    );
    assert!(message.contains("captures no \"wh\""), "{message}");
    let (line, column, key, message) = err(&route("/warehouses/{id}", "w/{bogus.x}"));
    assert_eq!(
        (line, column, key.as_str()),
        (10, 15, "route[0].resource"),
        "{message}"
    );
    assert!(message.contains("unknown placeholder"), "{message}");
    let (line, column, key, _) = err(&route("/warehouses/w{id}", "w/{id}"));
    assert_eq!(
        (line, column, key.as_str()),
        (9, 29, "route[0].path_pattern")
    );
    // A fixed resource inside a template's space is flagged.
    let fixed = format!(
        "{}[[route]]\nname = \"seven\"\nupstream = \"legacy\"\npath_prefix = \"/w7\"\nresource = \"warehouse/7\"\n",
        route("/warehouses/{id}", "warehouse/{id}")
    );
    let c = Config::parse(&fixed, Path::new("p.toml")).unwrap();
    assert!(
        c.warnings
            .iter()
            .any(|w| w.key == "route[1]" && w.message.contains("share that mark")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn loopback_spellings_are_one_upstream_for_the_tunnel_check() {
    for alias in [
        "localhost.",
        "LOCALHOST",
        "[::1]",
        "127.0.0.2",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
    ] {
        let text = format!(
            "{BASE}[[route]]\nname = \"ws\"\nupstream = \"twin\"\npath_prefix = \"/ws\"\nwebsocket = true\nguard = false\n\
             [[upstream]]\nname = \"twin\"\nurl = \"http://{alias}:9000\"\n"
        );
        let e = Config::parse(&text, Path::new("p.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("route[1].websocket"), "{alias}: {e}");
    }
}

#[test]
fn a_route_path_with_a_query_or_fragment_is_refused() {
    for p in ["/a?x", "/a#"] {
        let (_, _, key, message) = err(&BASE.replace(
            "path_prefix = \"/orders\"",
            &format!("path_prefix = \"{p}\""),
        ));
        assert_eq!(key, "route[0].path_prefix", "{p}");
        assert!(message.contains("'?' or '#'"), "{message}");
    }
}

#[test]
fn a_route_fed_by_a_lock_is_checked_against_its_store_and_resource() {
    let etcd = |consistency: &str| {
        format!(
            "{BASE}[marks]\nstore = \"etcd\"\n[marks.etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n\
             consistency = \"{consistency}\"\n"
        )
    };
    let with = |text: &str, keys: &str| {
        text.replace(
            "methods = [\"POST\"]",
            &format!("methods = [\"POST\"]\n{keys}"),
        )
    };
    let c = Config::parse(
        &with(&etcd("linearizable"), "lock = \"locks/orders\""),
        Path::new("p.toml"),
    )
    .unwrap();
    let feed = c.routes[0].epoch.as_ref().unwrap();
    assert!(Config::parse(
        &with(&etcd("cached"), "lock = \"orders\""),
        Path::new("p.toml")
    )
    .is_ok());
    assert_eq!(
        feed.fixed_key.as_deref(),
        Some("/palisade/lock/locks%2Forders/epoch")
    );
    let c = Config::parse(
        &with(
            &etcd("linearizable"),
            "election = \"leader\"\nlock_namespace = \"/apps\"",
        ),
        Path::new("p.toml"),
    )
    .unwrap();
    assert_eq!(
        c.routes[0].epoch.as_ref().unwrap().fixed_key.as_deref(),
        Some("/apps/election/leader/epoch")
    );
    // The key layout is the client library's own.
    assert_eq!(
        palisade_key(),
        crate::client::session::epoch_key(
            "/palisade",
            crate::client::session::EpochOf::Lock,
            "locks/orders"
        )
        .unwrap()
    );
    for (text, key, says) in [
        (
            with(BASE, "lock = \"orders\""),
            "route[0].lock",
            "store = \"etcd\"",
        ),
        (
            with(&etcd("linearizable"), "lock = \"a\"\nrwlock = \"b\""),
            "route[0].rwlock",
            "set one of",
        ),
        (
            with(&etcd("linearizable"), "lock_namespace = \"/x\""),
            "route[0].lock_namespace",
            "only used with",
        ),
        (
            with(
                &etcd("linearizable"),
                "lock = \"a\"\nlock_namespace = \"/ns/lock/x\"",
            ),
            "route[0].lock_namespace",
            "namespace",
        ),
        (
            with(&etcd("linearizable"), "lock = \"a\"\nguard = false"),
            "route[0].lock",
            "guarded",
        ),
        (
            with(&etcd("linearizable"), "lock = \"locks/{id}\""),
            "route[0].lock",
            "id",
        ),
    ] {
        let (_, _, k, msg) = err(&text);
        assert_eq!(k, key, "{text}: {msg}");
        assert!(msg.contains(says), "{key}: {msg}");
    }
    // Two routes of one resource name the same lock, or none.
    let two = format!(
        "{}\n[[route]]\nname = \"orders-put\"\nupstream = \"legacy\"\npath_prefix = \"/o2\"\n\
         resource = \"orders\"\nlock = \"other\"\n",
        with(&etcd("linearizable"), "lock = \"orders\"")
    );
    let (_, _, k, msg) = err(&two);
    assert_eq!(k, "route[1].lock");
    assert!(msg.contains("same lock"), "{msg}");
    let same = two.replace("lock = \"other\"", "lock = \"orders\"");
    assert!(Config::parse(&same, Path::new("p.toml")).is_ok());
    // Templated: the lock may use the resource's placeholders only.
    let pattern = |lock: &str| {
        etcd("linearizable").replace(
            "path_prefix = \"/orders\"\nmethods = [\"POST\"]",
            &format!(
                "path_pattern = \"/w/{{id}}/{{sku}}\"\nresource = \"warehouse/{{id}}\"\nlock = \"{lock}\""
            ),
        )
    };
    let c = Config::parse(&pattern("locks/warehouse/{id}"), Path::new("p.toml")).unwrap();
    assert!(c.routes[0].epoch.as_ref().unwrap().fixed_key.is_none());
    let (_, _, k, msg) = err(&pattern("locks/{sku}"));
    assert_eq!(k, "route[0].lock");
    assert!(msg.contains("placeholders of resource"), "{msg}");
    // A semaphore feeds one slot per entity: the route captures {slot} and its resource uses it.
    let sem = |resource: &str| {
        etcd("linearizable").replace(
            "path_prefix = \"/orders\"\nmethods = [\"POST\"]",
            &format!(
                "path_pattern = \"/jobs/{{slot}}/run\"\nresource = \"{resource}\"\nsemaphore = \"jobs\""
            ),
        )
    };
    let c = Config::parse(&sem("jobs/{slot}"), Path::new("p.toml")).unwrap();
    assert!(c.routes[0].epoch.as_ref().unwrap().fixed_key.is_none());
    assert_eq!(
        crate::client::session::slot_epoch_key("/palisade", "jobs", 3).unwrap(),
        "/palisade/semaphore/jobs/epoch/3"
    );
    let (_, _, k, msg) = err(&sem("jobs"));
    assert_eq!(k, "route[0].semaphore");
    assert!(msg.contains("{slot}"), "{msg}");
    // One lock for every entity (one owner writes them all) is allowed.
    let c = Config::parse(&pattern("locks/all"), Path::new("p.toml")).unwrap();
    assert!(c.routes[0].epoch.as_ref().unwrap().fixed_key.is_some());
}

/// What `palisade lock locks/orders` writes as its epoch key (the queue's own format).
fn palisade_key() -> String {
    "/palisade/lock/locks%2Forders/epoch".to_owned()
}
