//! Every zombie example runs as a process: it exits 0 when the zombie's write was refused,
//! and non-zero, reporting the stale write, when the fence in its resource is disabled
//! (`PALISADE_EXAMPLE_UNFENCED=1`: the layer not installed, the token check left out of the
//! SQL, the proxy route unguarded). So each example's success depends on the fence, not on
//! the scheduling.
//!
//! `cargo test` builds the examples next to the test binaries (`target/<profile>/examples/`);
//! the HTTP and gRPC ones need `--features layer,grpc` (`--all-features` in scripts/test).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest an example may run (each takes 1 to 3 s; a loaded CI machine gets slack).
const LIMIT: Duration = Duration::from_secs(60);

struct Run {
    success: bool,
    output: String,
}

fn binary(example: &str) -> PathBuf {
    // Examples are built next to the test binary: target/<profile>/examples/<name>.
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(example);
    let rebuild = "`cargo test --all-features` builds every example; `cargo test --test \
                   examples` alone does not (run `cargo build --all-features --examples` first)";
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is not built: {rebuild}", path.display()));
    // A binary older than its sources would test yesterday's example.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples");
    let main = if example == "demo" {
        "proxy-legacy"
    } else {
        example
    };
    let mut sources = vec![
        root.join(format!("{example}.rs")),
        root.join(format!("{main}.rs")),
    ];
    sources.extend(
        std::fs::read_dir(root.join("common"))
            .into_iter()
            .flatten()
            .map(|e| e.unwrap().path()),
    );
    for source in sources {
        let changed = std::fs::metadata(&source).and_then(|m| m.modified());
        assert!(
            changed.is_ok_and(|c| c <= built),
            "{} is older than {}: {rebuild}",
            path.display(),
            source.display()
        );
    }
    path
}

/// Runs `example` to its end (killed past [`LIMIT`]), fenced or not; stdout and stderr
/// together in `output`.
fn run(example: &str, fenced: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out");
    let out = std::fs::File::create(&out_path).unwrap();
    let mut cmd = Command::new(binary(example));
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .env_remove("RUST_LOG");
    if fenced {
        cmd.env_remove("PALISADE_EXAMPLE_UNFENCED");
    } else {
        cmd.env("PALISADE_EXAMPLE_UNFENCED", "1");
    }
    let mut child = cmd.spawn().unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            child.kill().unwrap();
            child.wait().unwrap();
            let output = std::fs::read_to_string(&out_path).unwrap_or_default();
            panic!("{example} ran past {LIMIT:?}:\n{output}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        success: status.success(),
        output: std::fs::read_to_string(&out_path).unwrap(),
    }
}

/// Fenced: exit 0 and the story says the zombie was refused.
fn refuses_the_zombie(example: &str) -> Run {
    let run = run(example, true);
    assert!(run.success, "{example} failed:\n{}", run.output);
    assert!(
        run.output.contains("OK: the zombie was refused"),
        "{example}:\n{}",
        run.output
    );
    run
}

/// Unfenced: exit non-zero *because* the stale write got through (not a crash).
fn lets_the_stale_write_through(example: &str) {
    let run = run(example, false);
    assert!(
        !run.success,
        "{example} exited 0 without its fence:\n{}",
        run.output
    );
    assert!(
        run.output.contains("FAIL: a stale write got through"),
        "{example} failed for another reason:\n{}",
        run.output
    );
}

#[test]
fn lock_db_keeps_b_s_update_with_the_token_check_and_loses_it_without() {
    let run = refuses_the_zombie("lock-db");
    // Run 1, row lock only: the final row is A's stale value (B's deposit of 50 lost).
    assert!(
        run.output
            .contains("-> 70: A's stale value; B's deposit is lost"),
        "{}",
        run.output
    );
    // Run 2, token checked in the UPDATE: A's write matched no row, B's 150 stays.
    assert!(
        run.output.contains("A: UPDATE changed 0 rows: fenced"),
        "{}",
        run.output
    );
    assert!(run.output.contains("-> 150: B's value"), "{}", run.output);
}

#[test]
fn lock_db_without_the_token_check_lets_the_stale_write_win() {
    lets_the_stale_write_through("lock-db");
}

#[test]
fn proxy_legacy_refuses_the_zombie_before_the_legacy_service() {
    let run = refuses_the_zombie("proxy-legacy");
    assert!(run.output.contains("409 Conflict"), "{}", run.output);
}

#[test]
fn proxy_legacy_with_an_unguarded_route_lets_the_stale_write_through() {
    lets_the_stale_write_through("proxy-legacy");
}

#[test]
fn warehouses_refuses_the_zombie_of_one_warehouse_and_no_other_owner() {
    let run = refuses_the_zombie("warehouses");
    assert!(
        run.output.contains("no other warehouse's owner was") && run.output.contains(": 0 refused"),
        "{}",
        run.output
    );
}

#[test]
fn warehouses_unguarded_lets_the_stale_write_through() {
    lets_the_stale_write_through("warehouses");
}

#[test]
fn demo_is_still_the_readme_s_first_command() {
    let run = refuses_the_zombie("demo");
    // Its output went to a file, not a terminal: no colour codes in it.
    assert!(
        !run.output.contains('\u{1b}'),
        "ANSI escapes in redirected output:\n{}",
        run.output
    );
    assert!(run.output.contains("mark advanced"), "{}", run.output);
}

#[cfg(feature = "layer")]
#[test]
fn lock_http_refuses_the_zombie_with_409() {
    let run = refuses_the_zombie("lock-http");
    assert!(run.output.contains("A: -> 409 Conflict"), "{}", run.output);
}

#[cfg(feature = "layer")]
#[test]
fn lock_http_without_the_layer_lets_the_stale_write_through() {
    lets_the_stale_write_through("lock-http");
}

#[cfg(all(feature = "layer", feature = "grpc"))]
#[test]
fn lock_grpc_refuses_the_zombie_with_aborted() {
    let run = refuses_the_zombie("lock-grpc");
    assert!(run.output.contains("A: -> Aborted"), "{}", run.output);
}

#[cfg(all(feature = "layer", feature = "grpc"))]
#[test]
fn lock_grpc_without_the_layer_lets_the_stale_write_through() {
    lets_the_stale_write_through("lock-grpc");
}

#[cfg(feature = "layer")]
#[test]
fn rwlock_fences_the_zombie_writer_with_the_readers_phase_token() {
    let run = refuses_the_zombie("rwlock");
    assert!(
        run.output.contains("B: asks for the write lock; waits"),
        "{}",
        run.output
    );
    assert!(run.output.contains("A: -> 409 Conflict"), "{}", run.output);
}

#[cfg(feature = "layer")]
#[test]
fn rwlock_without_the_layer_lets_the_stale_write_through() {
    lets_the_stale_write_through("rwlock");
}

#[cfg(feature = "layer")]
#[test]
fn election_failover_refuses_the_old_leader_with_409() {
    let run = refuses_the_zombie("election-failover");
    assert!(run.output.contains("A: -> 409 Conflict"), "{}", run.output);
}

#[cfg(feature = "layer")]
#[test]
fn election_failover_without_the_layer_lets_the_stale_write_through() {
    lets_the_stale_write_through("election-failover");
}

#[cfg(all(feature = "layer", feature = "object-store"))]
#[test]
fn objstore_election_refuses_the_old_leader_with_409_and_counts_on_after_release() {
    let run = refuses_the_zombie("objstore-election");
    assert!(run.output.contains("A: -> 409 Conflict"), "{}", run.output);
    assert!(
        run.output.contains("nobody (generation 2 released)"),
        "{}",
        run.output
    );
    assert!(
        run.output
            .contains("A: campaigns again and leads with token 3"),
        "{}",
        run.output
    );
}

#[cfg(all(feature = "layer", feature = "object-store"))]
#[test]
fn objstore_election_without_the_layer_lets_the_stale_write_through() {
    lets_the_stale_write_through("objstore-election");
}
