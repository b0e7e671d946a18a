//! `palisade lock|elect NAME -- CMD...`: the `palisade` binary against real etcd processes,
//! running real shell jobs.

use crate::etcd;

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_palisade");

/// `palisade <sub> --endpoints .. --namespace <ns> <extra..> <name> -- sh -c <script>`, with
/// `LOG` and `D` (a scratch directory) in the job's environment.
fn palisade(
    sub: &str,
    etcd: &etcd::Etcd,
    ns: &str,
    extra: &[&str],
    name: &str,
    dir: &Path,
    script: &str,
) -> Command {
    let mut c = Command::new(BIN);
    c.arg(sub)
        .args([
            "--endpoints",
            &etcd.endpoints().join(","),
            "--namespace",
            ns,
        ])
        .args(extra)
        .args([name, "--", "sh", "-c", script])
        .env("LOG", dir.join("log"))
        .env("D", dir)
        .stdin(Stdio::null());
    c
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("log")).unwrap_or_default()
}

async fn wait_for_log(dir: &Path, needle: &str, within: Duration) {
    let started = Instant::now();
    while !log(dir).contains(needle) {
        assert!(
            started.elapsed() < within,
            "no {needle:?} in the log within {within:?}: {}",
            log(dir)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_exit(child: &mut Child, within: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if started.elapsed() > within {
            let _ = child.kill();
            panic!("palisade did not exit within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn kill(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// The job of the overlap tests: it claims `$D/inside` with `mkdir` (which fails if the other
/// job holds it), logs its start and end with its token, and works for a while in between.
const JOB: &str = r#"mkdir "$D/inside" || echo "OVERLAP $JOB" >> "$LOG"
echo "start $JOB $PALISADE_FENCING_TOKEN $PALISADE_LEASE_ID" >> "$LOG"
sleep 0.3
echo "end $JOB $PALISADE_FENCING_TOKEN" >> "$LOG"
rmdir "$D/inside""#;

/// Two shell loops, each running `palisade <sub> ... -- JOB` `rounds` times, at once.
async fn two_shell_jobs(sub: &str, ns: &str) {
    const ROUNDS: usize = 4;
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    // Each loop is a shell job too: `palisade` run again and again, as from cron.
    let script = format!(
        r#"for i in $(seq {ROUNDS}); do "$BIN" {sub} --endpoints "$EP" --namespace {ns} --ttl 5 jobs -- sh -c "$SCRIPT" || exit 1; done"#
    );
    let started = Instant::now();
    let mut loops: Vec<Child> = ["a", "b"]
        .iter()
        .map(|name| {
            Command::new("sh")
                .args(["-c", &script])
                .env("BIN", BIN)
                .env("EP", etcd.endpoints().join(","))
                .env("SCRIPT", JOB)
                .env("JOB", name)
                .env("LOG", dir.path().join("log"))
                .env("D", dir.path())
                .stdin(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for l in &mut loops {
        let s = wait_exit(l, Duration::from_secs(60)).await;
        assert!(s.success(), "{script}: {s}\n{}", log(dir.path()));
    }
    let text = log(dir.path());
    assert!(!text.contains("OVERLAP"), "the jobs overlapped:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4 * ROUNDS, "{text}");
    let mut last = 0u64;
    let mut jobs = std::collections::HashSet::new();
    for pair in lines.chunks(2) {
        // Never interleaved: every start is followed by the same job's end, same token.
        let start: Vec<&str> = pair[0].split(' ').collect();
        let end: Vec<&str> = pair[1].split(' ').collect();
        assert_eq!(start[0], "start", "{text}");
        assert_eq!(end[0], "end", "{text}");
        assert_eq!(start[1..3], end[1..3], "{text}");
        assert!(!start[3].is_empty(), "PALISADE_LEASE_ID is set: {text}");
        let token: u64 = start[2].parse().unwrap();
        assert!(token > last, "each run sees a higher token: {text}");
        last = token;
        jobs.insert(start[1].to_owned());
    }
    assert_eq!(jobs.len(), 2, "both jobs ran: {text}");
    eprintln!(
        "{sub}: {} runs of 0.3 s in {:?}, tokens increasing:\n{text}",
        2 * ROUNDS,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_two_shell_jobs_never_overlap_and_each_sees_a_higher_token() {
    two_shell_jobs("lock", "/cli-lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_two_shell_jobs_never_lead_at_once_and_each_term_has_a_higher_token() {
    two_shell_jobs("elect", "/cli-elect").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_lease_is_lost_because_etcd_stopped_past_the_ttl_is_terminated() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let script = r#"trap 'echo TERM >> "$LOG"; exit 143' TERM
echo "started $PALISADE_FENCING_TOKEN" >> "$LOG"
while :; do sleep 0.1; done"#;
    let mut p = palisade(
        "lock",
        &etcd,
        "/cli-lost",
        &["--ttl", "2", "--grace", "3s"],
        "lost",
        dir.path(),
        script,
    )
    .spawn()
    .unwrap();
    wait_for_log(dir.path(), "started", Duration::from_secs(10)).await;
    let pid = etcd.pid(0).unwrap();
    kill("-STOP", pid);
    let stopped = Instant::now();
    // The session's local deadline passes at most one TTL after the last acknowledged
    // keepalive was sent; then SIGTERM, which this job obeys.
    let status = wait_exit(&mut p, Duration::from_secs(2 + 3 + 2)).await;
    let took = stopped.elapsed();
    kill("-CONT", pid);
    assert_eq!(status.code(), Some(143), "CMD's status: {status}");
    assert!(log(dir.path()).contains("TERM"), "{}", log(dir.path()));
    assert!(
        took < Duration::from_secs(2) + Duration::from_millis(1500),
        "terminated within TTL + 1.5 s of the freeze, took {took:?}"
    );
    eprintln!("etcd frozen: the job was terminated after {took:?} (TTL 2 s)");

    // etcd is back: the next holder gets a higher token.
    let before: u64 = log(dir.path())
        .lines()
        .find_map(|l| l.strip_prefix("started "))
        .unwrap()
        .parse()
        .unwrap();
    let out = palisade(
        "lock",
        &etcd,
        "/cli-lost",
        &["--ttl", "2"],
        "lost",
        dir.path(),
        "echo $PALISADE_FENCING_TOKEN",
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let after: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(after > before, "{after} after {before}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ignores_sigterm_after_a_loss_is_killed_after_the_grace() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    // `trap '' TERM` is inherited by the loop's `sleep`s too: the whole group ignores it.
    let script = r#"trap '' TERM
echo started >> "$LOG"
while :; do sleep 0.1; done"#;
    let mut p = palisade(
        "lock",
        &etcd,
        "/cli-kill",
        &["--ttl", "5", "--grace", "1s"],
        "k",
        dir.path(),
        script,
    )
    .spawn()
    .unwrap();
    wait_for_log(dir.path(), "started", Duration::from_secs(10)).await;
    // An operator deletes the queue entry: the grant no longer owns anything.
    let mut c = etcd.client().await;
    c.delete(
        "/cli-kill/lock/k/q/",
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
    let deleted = Instant::now();
    let status = wait_exit(&mut p, Duration::from_secs(10)).await;
    let took = deleted.elapsed();
    assert_eq!(status.code(), Some(128 + 9), "SIGKILLed: {status}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(4),
        "killed after the 1 s grace, took {took:?}"
    );
    eprintln!("entry deleted: the job ignoring SIGTERM was SIGKILLed after {took:?} (grace 1 s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_gets_its_token_signals_are_forwarded_and_its_status_is_palisades() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    // The endpoints come from ETCD_ENDPOINTS here.
    let run = |script: &str| {
        let mut c = Command::new(BIN);
        c.args([
            "lock",
            "--namespace",
            "/cli-st",
            "st",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("ETCD_ENDPOINTS", etcd.endpoints().join(","))
        .env("LOG", dir.path().join("log"))
        .env("D", dir.path())
        .stdin(Stdio::null());
        c
    };
    let out = run("exit 7").output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let out = run("kill -USR2 $$").output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 12), "{out:?}");
    let out = run(
        r#"test -n "$PALISADE_FENCING_TOKEN" && test "$PALISADE_NAME" = st && test -n "$PALISADE_KEY_REVISION" && echo "$PALISADE_KEY""#,
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("/cli-st/lock/st/q/"),
        "{out:?}"
    );
    let mut missing = Command::new(BIN);
    missing
        .args(["lock", "--endpoints", &etcd.endpoint(), "x", "--"])
        .arg(dir.path().join("no-such-command"));
    assert_eq!(missing.output().unwrap().status.code(), Some(127));

    let script = r#"trap 'echo USR1 >> "$LOG"' USR1
trap 'echo HUP >> "$LOG"; exit 3' HUP
echo ready >> "$LOG"
while :; do sleep 0.1; done"#;
    let mut p = run(script).spawn().unwrap();
    wait_for_log(dir.path(), "ready", Duration::from_secs(10)).await;
    kill("-USR1", p.id());
    wait_for_log(dir.path(), "USR1", Duration::from_secs(5)).await;
    kill("-HUP", p.id());
    let status = wait_exit(&mut p, Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(3), "{status}\n{}", log(dir.path()));
    // Released: no queue entry is left behind.
    assert_eq!(etcd.keys("/cli-st/lock/st/q/").await, Vec::<String>::new());

    // A signal while waiting for the lock ends the wait and leaves no entry either.
    let mut holder = run("echo holding >> \"$LOG\"; sleep 30").spawn().unwrap();
    wait_for_log(dir.path(), "holding", Duration::from_secs(10)).await;
    let mut waiter = run("echo WAITER-RAN >> \"$LOG\"").spawn().unwrap();
    let started = Instant::now();
    while etcd.keys("/cli-st/lock/st/q/").await.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter queues"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    kill("-TERM", waiter.id());
    let status = wait_exit(&mut waiter, Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(128 + 15), "{status}");
    assert_eq!(etcd.keys("/cli-st/lock/st/q/").await.len(), 1);
    kill("-TERM", holder.id());
    let status = wait_exit(&mut holder, Duration::from_secs(5)).await;
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "sleep died of the forwarded SIGTERM"
    );
    assert!(!log(dir.path()).contains("WAITER-RAN"));
}

/// Whether process `pid` still exists (a zombie not yet reaped counts as gone).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_never_outlives_its_supervisor_killed_with_sigkill() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    // The job writes with its token every 20 ms and has a child of its own in the background.
    let script = r#"sleep 300 &
echo "pids $$ $!" >> "$LOG"
while :; do echo "write $PALISADE_FENCING_TOKEN" >> "$LOG"; sleep 0.02; done"#;
    let mut p = palisade(
        "elect",
        &etcd,
        "/cli-orphan",
        &[],
        "wh7",
        dir.path(),
        script,
    )
    .spawn()
    .unwrap();
    wait_for_log(dir.path(), "write", Duration::from_secs(10)).await;
    let pids: Vec<u32> = log(dir.path())
        .lines()
        .find_map(|l| l.strip_prefix("pids "))
        .unwrap()
        .split(' ')
        .map(|p| p.parse().unwrap())
        .collect();
    assert!(pids.iter().all(|p| alive(*p)), "{pids:?}");
    kill("-KILL", p.id());
    let _ = p.wait();
    let killed = Instant::now();
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "the job's processes {pids:?} outlived palisade's SIGKILL by a second:\n{}",
            log(dir.path())
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let gone_after = killed.elapsed();
    let writes = log(dir.path())
        .lines()
        .filter(|l| l.starts_with("write"))
        .count();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = log(dir.path())
        .lines()
        .filter(|l| l.starts_with("write"))
        .count();
    assert_eq!(
        later, writes,
        "the job went on writing after its supervisor died"
    );
    eprintln!("palisade SIGKILLed: the job's group was gone {gone_after:?} later");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recampaign_runs_the_job_again_under_a_new_token_after_an_etcd_outage() {
    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let script = r#"trap 'echo "stopped $PALISADE_FENCING_TOKEN" >> "$LOG"; exit 143' TERM
echo "started $PALISADE_FENCING_TOKEN" >> "$LOG"
while :; do sleep 0.05; done"#;
    let mut p = palisade(
        "elect",
        &etcd,
        "/cli-again",
        &["--ttl", "2", "--grace", "2s", "--recampaign"],
        "wh7",
        dir.path(),
        script,
    )
    .spawn()
    .unwrap();
    wait_for_log(dir.path(), "started", Duration::from_secs(10)).await;
    // etcd frozen past the TTL: the leadership is lost and the job stopped ...
    let pid = etcd.pid(0).unwrap();
    kill("-STOP", pid);
    wait_for_log(dir.path(), "stopped", Duration::from_secs(8)).await;
    assert!(
        p.try_wait().unwrap().is_none(),
        "palisade stays to campaign again"
    );
    kill("-CONT", pid);
    // ... and once etcd is back, palisade campaigns again and reruns it with a newer token.
    let started = Instant::now();
    let tokens = loop {
        let tokens: Vec<u64> = log(dir.path())
            .lines()
            .filter_map(|l| l.strip_prefix("started "))
            .map(|t| t.parse().unwrap())
            .collect();
        if tokens.len() == 2 {
            break tokens;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no second term:\n{}",
            log(dir.path())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(tokens[1] > tokens[0], "{tokens:?}");
    // SIGTERM ends it for good: the job gets it, palisade exits with its status.
    kill("-TERM", p.id());
    let status = wait_exit(&mut p, Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(143), "{status}\n{}", log(dir.path()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        log(dir.path()).matches("started").count(),
        2,
        "no third term after SIGTERM"
    );
}

/// A free loopback port, for a process that takes its address on the command line.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` at `addr`: the body, or `None` while nothing answers there.
async fn scrape(addr: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: palisade\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.ok()?;
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n")?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    Some(body.to_owned())
}

/// The value of `series` (name and labels exactly as rendered) in a scrape.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let value = l.strip_prefix(series)?.strip_prefix(' ')?;
        Some(value.trim().parse().unwrap())
    })
}

/// Scrapes `addr` until `series` reads `want`; returns that scrape.
async fn scrape_until(addr: &str, series: &str, want: f64, within: Duration) -> String {
    let started = Instant::now();
    loop {
        let text = scrape(addr).await;
        if let Some(t) = &text {
            if sample(t, series) == Some(want) {
                return t.clone();
            }
        }
        assert!(
            started.elapsed() < within,
            "{series} not {want} at {addr} within {within:?}; last scrape:\n{}",
            text.unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_addr_serves_the_hold_and_a_revoked_lease_as_a_loss_while_palisade_stays_up() {
    use palisade::client::provider::etcd::EtcdProvider;
    use palisade::{LockService, Provider, SessionOptions};

    let etcd = etcd::Etcd::single().await;
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    // --recampaign: after its loss palisade queues again instead of exiting, and keeps serving.
    let mut p = palisade(
        "lock",
        &etcd,
        "/cli-metrics",
        &[
            "--ttl",
            "5",
            "--grace",
            "1s",
            "--recampaign",
            "--metrics-addr",
            &addr,
        ],
        "m",
        dir.path(),
        r#"echo "started $PALISADE_LEASE_ID" >> "$LOG"; exec sleep 60"#,
    )
    .spawn()
    .unwrap();
    let held = r#"palisade_owner_held{name="m"}"#;
    let acquisitions = r#"palisade_owner_acquisitions_total{name="m"}"#;
    let revoked = r#"palisade_owner_losses_total{name="m",reason="revoked"}"#;
    let lease_left = "palisade_session_lease_remaining_seconds";
    let text = scrape_until(&addr, held, 1.0, Duration::from_secs(10)).await;
    assert_eq!(sample(&text, acquisitions), Some(1.0), "{text}");
    assert_eq!(sample(&text, revoked), Some(0.0), "{text}");
    assert!(
        sample(&text, lease_left).is_some_and(|s| s > 0.0 && s <= 5.0),
        "{text}"
    );
    assert!(
        text.contains(r#"palisade_owner_acquire_seconds_bucket{name="m",le="+Inf"} 1"#),
        "a histogram with buckets: {text}"
    );
    wait_for_log(dir.path(), "started", Duration::from_secs(10)).await;
    let lease = log(dir.path())
        .lines()
        .find_map(|l| l.strip_prefix("started "))
        .map(|hex| i64::from_str_radix(hex, 16).unwrap())
        .unwrap();

    // This test's own session queues behind palisade: once palisade's lease is gone the lock
    // is this test's, and palisade, campaigning again, waits behind it (held stays 0).
    let mut client = etcd.client().await;
    let s = EtcdProvider::new(&client)
        .session(SessionOptions::new().with_namespace("/cli-metrics"))
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        let grant = s.lock("m").await.unwrap();
        (s, grant)
    });
    let started = Instant::now();
    while etcd.keys("/cli-metrics/lock/m/q/").await.len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the test queues"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.lease_revoke(lease).await.unwrap();
    let text = scrape_until(&addr, revoked, 1.0, Duration::from_secs(10)).await;
    assert_eq!(sample(&text, held), Some(0.0), "{text}");
    assert_eq!(sample(&text, acquisitions), Some(1.0), "{text}");
    for reason in ["expired", "fenced", "closed", "error"] {
        let series = format!(r#"palisade_owner_losses_total{{name="m",reason="{reason}"}}"#);
        assert_eq!(sample(&text, &series), Some(0.0), "{series}:\n{text}");
    }
    assert!(p.try_wait().unwrap().is_none(), "palisade is still up");
    let (s, grant) = waiting.await.unwrap();

    // Let go: palisade holds the name again under a new session, on the same endpoint.
    grant.unlock().await.unwrap();
    let text = scrape_until(&addr, held, 1.0, Duration::from_secs(10)).await;
    assert_eq!(sample(&text, acquisitions), Some(2.0), "{text}");
    assert_eq!(sample(&text, revoked), Some(1.0), "{text}");
    assert!(
        sample(&text, lease_left).is_some_and(|s| s > 0.0),
        "the new session's lease: {text}"
    );
    s.close().await.unwrap();
    kill("-TERM", p.id());
    let status = wait_exit(&mut p, Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(143), "{status}\n{}", log(dir.path()));
}
