use super::*;

struct Req {
    host: Option<&'static str>,
    headers: Vec<(&'static str, &'static str)>,
    path: &'static str,
    grpc: bool,
}

impl RequestParts for Req {
    fn host(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.host.map(std::borrow::Cow::Borrowed)
    }
    fn header_values(&self, name: &http::HeaderName) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| *n == name.as_str())
            .map(|(_, v)| v.as_bytes())
            .collect()
    }
    fn path(&self) -> &str {
        self.path
    }
    fn is_grpc(&self) -> bool {
        self.grpc
    }
}

fn req(path: &'static str) -> Req {
    Req {
        host: Some("api.example.com"),
        headers: vec![("x-tenant", "acme")],
        path,
        grpc: false,
    }
}

#[test]
fn a_pattern_captures_whole_segments() {
    let p = PathPattern::parse("/warehouses/{id}/stock/{sku}").unwrap();
    let c = p.captures("/warehouses/7/stock/9").unwrap();
    assert_eq!((c.get("id"), c.get("sku")), (Some("7"), Some("9")));
    // A trailing slash and a `.format` suffix on the last segment are the same entity.
    assert_eq!(
        p.captures("/warehouses/7/stock/9/").unwrap().get("sku"),
        Some("9")
    );
    assert_eq!(
        p.captures("/warehouses/7/stock/9.json").unwrap().get("sku"),
        Some("9")
    );
    for no in [
        "/warehouses/7/stock",
        "/warehouses/7/stock/9/x",
        "/warehouses//stock/9",
        "/Warehouses/7/stock/9",
        "/warehouses/7/stocks/9",
    ] {
        assert!(p.captures(no).is_none(), "{no}");
    }
    // Escapes are kept as the normal form has them: one spelling per entity.
    let c = p.captures("/warehouses/caf%C3%A9/stock/1").unwrap();
    assert_eq!(c.get("id"), Some("caf%C3%A9"));
    let rest = PathPattern::parse("/files/{*path}").unwrap();
    assert_eq!(
        rest.captures("/files/a/b/c").unwrap().get("path"),
        Some("a/b/c")
    );
    assert!(rest.captures("/files/").is_none());
    assert!(rest.captures("/files").is_none());
}

#[test]
fn matching_without_captures_agrees_with_capturing() {
    let root = PathPattern::parse("/").unwrap();
    let patterns = [
        PathPattern::parse("/warehouses/{id}/stock/{sku}").unwrap(),
        PathPattern::parse("/files/{*path}").unwrap(),
        PathPattern::parse("/w/{id}").unwrap(),
        root,
    ];
    let paths = [
        "/",
        "",
        "/w",
        "/w/",
        "/w/7",
        "/w/7/",
        "/w/7.json",
        "/w/7/x",
        "/w//",
        "/files",
        "/files/",
        "/files/a",
        "/files/a/b.c",
        "/warehouses/7/stock/9",
        "/warehouses/7/stock/9/x",
        "/warehouses//stock/9",
        "warehouses/7/stock/9",
    ];
    let mut matched = 0;
    for p in &patterns {
        for path in paths {
            let captured = p.captures(path).is_some();
            assert_eq!(p.is_match(path), captured, "{p} on {path:?}");
            matched += usize::from(captured);
        }
    }
    // Both answers occur: the agreement is not all-false.
    assert!(
        matched >= 6 && matched < patterns.len() * paths.len(),
        "{matched}"
    );
}

#[test]
fn bad_patterns_say_where() {
    for (text, at) in [
        ("warehouses/{id}", 0),
        ("/a//b", 3),
        ("/w-{id}", 1),
        ("/{*rest}/x", 1),
        ("/{id}/{id}", 6),
        ("/{host}", 1),
        ("/{a b}", 1),
    ] {
        let e = PathPattern::parse(text).unwrap_err();
        assert_eq!(e.at, at, "{text}: {e}");
    }
}

#[test]
fn a_template_is_filled_from_captures_host_headers_and_grpc() {
    let p = PathPattern::parse("/warehouses/{id}").unwrap();
    let t = ResourceTemplate::parse("{host}/warehouse/{id}/{header.x-tenant}", p.names()).unwrap();
    let c = p.captures("/warehouses/7").unwrap();
    assert_eq!(
        t.fill(&c, &req("/warehouses/7")).unwrap(),
        "api.example.com/warehouse/7/acme"
    );
    let mut r = req("/warehouses/7");
    r.headers.push(("x-tenant", "evil"));
    assert!(matches!(t.fill(&c, &r), Err(FillError::RepeatedHeader(_))));
    r.headers.clear();
    assert!(matches!(t.fill(&c, &r), Err(FillError::MissingHeader(_))));

    let g = ResourceTemplate::parse("grpc/{service}/{method}", std::iter::empty()).unwrap();
    let mut call = req("/inventory.Stock/Reserve");
    assert_eq!(g.fill(&Captures::default(), &call), Err(FillError::NotGrpc));
    call.grpc = true;
    assert_eq!(
        g.fill(&Captures::default(), &call).unwrap(),
        "grpc/inventory.Stock/Reserve"
    );
}

#[test]
fn a_long_resource_is_refused_never_truncated() {
    let p = PathPattern::parse("/w/{id}").unwrap();
    let t = ResourceTemplate::parse("warehouse/{id}", p.names()).unwrap();
    let long: &'static str = Box::leak(format!("/w/{}", "x".repeat(1020)).into_boxed_str());
    let c = p.captures(long).unwrap();
    assert_eq!(t.fill(&c, &req(long)), Err(FillError::TooLong(1030)));
    let fits: &'static str = Box::leak(format!("/w/{}", "x".repeat(1014)).into_boxed_str());
    let c = p.captures(fits).unwrap();
    assert_eq!(t.fill(&c, &req(fits)).unwrap().len(), 1024);
}

#[test]
fn template_errors_name_the_placeholder() {
    let p = PathPattern::parse("/warehouses/{id}").unwrap();
    let e = ResourceTemplate::parse("warehouse/{wh}", p.names()).unwrap_err();
    assert_eq!(e.at, 10);
    assert!(
        e.message.contains("captures no \"wh\"") && e.message.contains("id"),
        "{e}"
    );
    let e = ResourceTemplate::parse("w/{header.}", p.names()).unwrap_err();
    assert!(e.message.contains("header name"), "{e}");
    let e = ResourceTemplate::parse("w/{id", p.names()).unwrap_err();
    assert_eq!(e.at, 2);
    let e = ResourceTemplate::parse("w/{x y}", p.names()).unwrap_err();
    assert!(e.message.contains("unknown placeholder"), "{e}");
}

#[test]
fn a_fixed_name_in_a_templates_space_is_detected() {
    let t = ResourceTemplate::parse("warehouse/{id}", ["id"]).unwrap();
    assert!(t.could_produce("warehouse/7"));
    assert!(!t.could_produce("warehouse/"));
    assert!(!t.could_produce("warehouses"));
    assert!(!t.could_produce("orders"));
    let t = ResourceTemplate::parse("w/{a}/s/{b}", ["a", "b"]).unwrap();
    assert!(t.could_produce("w/1/s/2"));
    assert!(!t.could_produce("w/1/s/"));
    assert!(!t.is_fixed());
    assert!(ResourceTemplate::parse("orders", ["id"])
        .unwrap()
        .is_fixed());
}
