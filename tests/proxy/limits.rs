//! Connection limits of a real `palisade` process: silent sockets are closed
//! after `header_read_timeout_ms`, `max_connections` accepts and closes the excess, and running
//! out of file descriptors neither spins the accept loop nor locks new clients out for good.
//!
//! Each test runs the binary under a lowered open-files limit and measures it from outside:
//! CPU time from `/proc/<pid>/stat`, peak RSS, limits and descriptors from `/proc/<pid>`, and
//! the `palisade_connections_*` metrics on the admin listener. The tests run one at a time, and
//! never beside another test that measures or loads the machine (`support::serial`), so that
//! their CPU and timing figures are the proxy's alone.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::{get, metric, spawn_proxy_with_nofile, write, ProxyProcess};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
workers = 2
{limits}

[admin]
listen = "127.0.0.1:0"

[marks]
store = "memory"

[[upstream]]
name = "legacy"
url = "http://{upstream}"

[[route]]
name = "reads"
upstream = "legacy"
path_prefix = "/"
methods = ["GET"]
guard = false
"#;

/// A config file for a proxy in front of `upstream` with these `[proxy]` limit keys.
fn config(dir: &Path, upstream: SocketAddr, limits: &str) -> std::path::PathBuf {
    let text = CONFIG
        .replace("{limits}", limits)
        .replace("{upstream}", &upstream.to_string());
    write(dir, "palisade.toml", &text)
}

/// Lets this test process hold thousands of sockets whatever limit it was started with.
fn raise_own_fd_limit(need: u64) {
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap();
    assert!(
        limit >= need,
        "this test needs {need} open files, the hard limit allows {limit}"
    );
}

fn series(name: &str, labels: &str) -> String {
    format!("{name}{{{labels}}}")
}

fn closed_series(reason: &str) -> String {
    series(
        "palisade_connections_closed_total",
        &format!("listener=\"proxy\",reason=\"{reason}\""),
    )
}

fn open_series() -> String {
    series("palisade_connections_open", "listener=\"proxy\"")
}

async fn scrape(p: &ProxyProcess) -> String {
    let admin = p.admin.expect("admin listener");
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        get(&format!("http://{admin}/metrics")),
    )
    .await
    .expect("/metrics answers");
    r.text()
}

/// A metric's value (0 when absent: counters with labels appear on first use).
async fn value(p: &ProxyProcess, series: &str) -> f64 {
    metric(&scrape(p).await, series).unwrap_or(0.0)
}

/// Polls `series` until `ok` holds or `within` passes; returns the last value seen.
async fn wait_metric(
    p: &ProxyProcess,
    series: &str,
    within: Duration,
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + within;
    loop {
        let v = value(p, series).await;
        if ok(v) || Instant::now() >= deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The proxy's CPU time (user + system) at one instant, from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy)]
struct Cpu {
    ticks: u64,
    at: Instant,
}

impl Cpu {
    fn sample(pid: u32) -> Self {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        Self {
            ticks,
            at: Instant::now(),
        }
    }

    /// CPU seconds per wall-clock second since `self` (1.0 = one core busy all the time).
    fn fraction_until(self, later: Self) -> f64 {
        let cpu = (later.ticks - self.ticks) as f64 / clock_ticks_per_second();
        cpu / later.at.duration_since(self.at).as_secs_f64()
    }
}

fn clock_ticks_per_second() -> f64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// `(soft, hard)` open-files limits of a process, from `/proc/<pid>/limits`.
fn nofile_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .unwrap();
    let mut v = line.split_whitespace().map(|n| n.parse().unwrap());
    (v.next().unwrap(), v.next().unwrap())
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Connections waiting in the accept queue of the IPv4 listener on `addr`: for a listening
/// socket, `/proc/net/tcp` shows that queue's length as `rx_queue`.
fn accept_queue(addr: SocketAddr) -> usize {
    let SocketAddr::V4(v4) = addr else {
        panic!("IPv4 only: {addr}")
    };
    let local = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(v4.ip().octets()),
        v4.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Fields: sl, local_address, rem_address, st (0A: LISTEN), tx_queue:rx_queue.
            (f[1] == local && f[3] == "0A").then(|| {
                let rx = f[4].split(':').nth(1).unwrap();
                usize::from_str_radix(rx, 16).unwrap()
            })
        })
        .expect("the listener is in /proc/net/tcp")
}

/// Client sockets that never send a byte. Each one waits for the proxy to close it and
/// reports how long after its connect that happened.
struct Silent {
    waits: Vec<JoinHandle<Duration>>,
}

impl Silent {
    /// Opens `n` sockets, a batch at a time in parallel (one by one, 2000 connects can take
    /// longer than the timeouts under test on a busy machine). After each batch it waits
    /// until palisade has taken every connection off its listen queue: a client running ahead
    /// of `accept` overflows the queue, and the kernel then delays handshakes by seconds.
    async fn open(addr: SocketAddr, n: usize) -> Self {
        // Below the listen backlog palisade gets from tokio (128).
        const BATCH: usize = 100;
        let mut waits = Vec::with_capacity(n);
        while waits.len() < n {
            let batch: Vec<_> = (0..(n - waits.len()).min(BATCH))
                .map(|_| {
                    tokio::spawn(async move {
                        let s = TcpStream::connect(addr).await;
                        (s, Instant::now())
                    })
                })
                .collect();
            for connecting in batch {
                let (s, connected) = connecting.await.unwrap();
                let mut s = s.unwrap();
                waits.push(tokio::spawn(async move {
                    let mut buf = [0u8; 512];
                    // EOF or a reset; anything the proxy might say first is read and ignored.
                    while let Ok(1..) = s.read(&mut buf).await {}
                    connected.elapsed()
                }));
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while accept_queue(addr) > 0 {
                assert!(Instant::now() < deadline, "palisade stopped accepting");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        Self { waits }
    }

    fn len(&self) -> usize {
        self.waits.len()
    }

    fn closed(&self) -> usize {
        self.waits.iter().filter(|w| w.is_finished()).count()
    }

    /// Polls until at least `want` sockets are closed or `within` passes; returns how many are.
    async fn wait_closed(&self, want: usize, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let n = self.closed();
            if n >= want || Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How long each closed socket stayed open after its connect, sorted; the open ones
    /// are left open.
    async fn lifetimes(&mut self) -> Vec<Duration> {
        let (done, open): (Vec<_>, Vec<_>) =
            self.waits.drain(..).partition(JoinHandle::is_finished);
        self.waits = open;
        let mut out = Vec::with_capacity(done.len());
        for w in done {
            out.push(w.await.unwrap());
        }
        out.sort();
        out
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// How much earlier than its timeout a socket may see its close: the client notes its
/// connect time only when its `connect` returns, which can be after palisade's `accept`.
const CLIENT_LAG: Duration = Duration::from_millis(100);

/// A request through the proxy on a fresh connection, with a bound on how long it may take.
async fn request_status(p: &ProxyProcess) -> StatusCode {
    let url = format!("http://{}/public", p.addr);
    tokio::time::timeout(Duration::from_secs(5), get(&url))
        .await
        .expect("the proxy answers within 5 s")
        .status
}

async fn two_thousand_idle_connections_do_not_lock_out_new_clients() {
    const SILENT: usize = 2000;
    const HEADER_READ: Duration = Duration::from_millis(3000);
    let _serial = support::serial().await;
    raise_own_fd_limit(SILENT as u64 + 500);
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let config = config(
        dir.path(),
        up.addr,
        &format!(
            "header_read_timeout_ms = {}\nidle_timeout_ms = 300",
            HEADER_READ.as_millis()
        ),
    );
    // Started with the usual default soft limit of 1024: without raising it to the hard
    // limit, 2000 silent sockets would exhaust it.
    let p = spawn_proxy_with_nofile(&config, 1024, None).unwrap();
    let pid = p.child.id();
    let (soft, hard) = nofile_limits(pid);
    assert_eq!(
        soft, hard,
        "palisade raises its soft open-files limit to the hard limit"
    );
    assert!(
        soft > SILENT as u64 + 100,
        "hard limit {hard} too low for this test"
    );

    let baseline_kib = p.peak_rss_kib();
    let started = Instant::now();
    let mut silent = Silent::open(p.addr, SILENT).await;
    let connect_time = started.elapsed();
    // Accepted by palisade and held, not merely queued by the kernel.
    let open = wait_metric(&p, &open_series(), Duration::from_secs(2), |v| {
        v >= SILENT as f64
    })
    .await;
    assert!(
        connect_time < HEADER_READ,
        "too slow to test: opening the sockets took {connect_time:?}, longer than the timeout"
    );
    assert_eq!(
        silent.closed(),
        0,
        "too slow to test: sockets timed out already"
    );
    assert_eq!(
        open, SILENT as f64,
        "palisade holds every silent connection"
    );
    assert!(
        open_fds(pid) > SILENT,
        "each one is a descriptor in palisade"
    );

    let idle_start = Cpu::sample(pid);
    assert_eq!(
        request_status(&p).await,
        StatusCode::OK,
        "a new client is served while {SILENT} silent connections are open"
    );
    assert_eq!(
        silent.closed(),
        0,
        "no silent socket closed before its timeout"
    );

    let closed = silent
        .wait_closed(SILENT, HEADER_READ + Duration::from_secs(3))
        .await;
    let idle_end = Cpu::sample(pid);
    assert_eq!(closed, SILENT, "every silent socket is closed");
    let lifetimes = silent.lifetimes().await;
    let (first, median, last) = (
        lifetimes[0],
        lifetimes[lifetimes.len() / 2],
        lifetimes[lifetimes.len() - 1],
    );
    let cpu = idle_start.fraction_until(idle_end);
    let wall = idle_end.at.duration_since(idle_start.at);
    let peak_kib = p.peak_rss_kib();
    eprintln!(
        "{SILENT} silent sockets: connected in {} ms; closed after {}/{}/{} ms \
         (first/median/last, header_read_timeout {} ms); proxy CPU {:.3} of one core over \
         {} ms; peak RSS {} KiB ({} KiB before the sockets)",
        ms(connect_time),
        ms(first),
        ms(median),
        ms(last),
        ms(HEADER_READ),
        cpu,
        ms(wall),
        peak_kib,
        baseline_kib
    );
    assert!(first + CLIENT_LAG >= HEADER_READ, "closed early: {first:?}");
    assert!(
        last <= HEADER_READ + Duration::from_millis(1500),
        "closed late: {last:?}"
    );
    assert!(
        cpu < 0.2,
        "the proxy spins while connections idle: {cpu:.3}"
    );
    assert!(peak_kib < 64 * 1024, "peak RSS {peak_kib} KiB");

    let timed_out = wait_metric(
        &p,
        &closed_series("header_read_timeout"),
        Duration::from_secs(2),
        |v| v >= SILENT as f64,
    )
    .await;
    assert_eq!(timed_out, SILENT as f64);
    assert_eq!(value(&p, &closed_series("max_connections")).await, 0.0);
    // The served client's connection is gone too (closed by the client or idle_timeout).
    let open = wait_metric(&p, &open_series(), Duration::from_secs(2), |v| v == 0.0).await;
    assert_eq!(open, 0.0);
    assert_eq!(request_status(&p).await, StatusCode::OK);
}

async fn max_connections_accepts_and_closes_the_excess() {
    const MAX: usize = 50;
    const EXTRA: usize = 20;
    const HEADER_READ: Duration = Duration::from_millis(2500);
    let _serial = support::serial().await;
    raise_own_fd_limit(1024);
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    let config = config(
        dir.path(),
        up.addr,
        &format!(
            "max_connections = {MAX}\nheader_read_timeout_ms = {}\nidle_timeout_ms = 300",
            HEADER_READ.as_millis()
        ),
    );
    let p = spawn_proxy_with_nofile(&config, 1024, None).unwrap();

    let mut held = Silent::open(p.addr, MAX).await;
    let open = wait_metric(&p, &open_series(), Duration::from_secs(2), |v| {
        v >= MAX as f64
    })
    .await;
    assert_eq!(open, MAX as f64);

    let mut extra = Silent::open(p.addr, EXTRA).await;
    let closed = extra.wait_closed(EXTRA, Duration::from_secs(1)).await;
    assert_eq!(closed, EXTRA, "connections over max_connections are closed");
    let extra_lifetimes = extra.lifetimes().await;
    let slowest = *extra_lifetimes.last().unwrap();
    assert!(
        slowest < Duration::from_millis(500),
        "closed at once, not after a timeout: {slowest:?}"
    );
    assert_eq!(
        held.closed(),
        0,
        "the connections within the limit stay open"
    );
    let refused = wait_metric(
        &p,
        &closed_series("max_connections"),
        Duration::from_secs(2),
        |v| v >= EXTRA as f64,
    )
    .await;
    assert_eq!(refused, EXTRA as f64);
    assert_eq!(value(&p, &open_series()).await, MAX as f64);

    let closed = held
        .wait_closed(MAX, HEADER_READ + Duration::from_secs(3))
        .await;
    assert_eq!(closed, MAX, "the silent connections time out");
    let held_lifetimes = held.lifetimes().await;
    eprintln!(
        "max_connections {MAX}: {EXTRA} extra closed after at most {} ms; \
         the {MAX} held closed after {}..{} ms (header_read_timeout {} ms)",
        ms(slowest),
        ms(held_lifetimes[0]),
        ms(*held_lifetimes.last().unwrap()),
        ms(HEADER_READ)
    );
    assert!(held_lifetimes[0] + CLIENT_LAG >= HEADER_READ);
    // The watchdog closes the socket just before the count goes down: wait for the count.
    let open = wait_metric(&p, &open_series(), Duration::from_secs(2), |v| v == 0.0).await;
    assert_eq!(open, 0.0);
    assert_eq!(request_status(&p).await, StatusCode::OK);
    assert_eq!(
        value(&p, &closed_series("header_read_timeout")).await,
        MAX as f64
    );
}

async fn out_of_descriptors_does_not_spin_and_recovers() {
    const LIMIT: u64 = 256;
    const CLIENTS: usize = 400;
    const TRICKLE_ROUNDS: usize = 12;
    const TRICKLE_EACH: usize = 5;
    const HEADER_READ: Duration = Duration::from_millis(4000);
    let _serial = support::serial().await;
    raise_own_fd_limit(1024);
    let dir = tempfile::tempdir().unwrap();
    let up = support::upstream().await;
    // max_connections far above the descriptor limit: the kernel says no first.
    let config = config(
        dir.path(),
        up.addr,
        &format!(
            "max_connections = 10000\nheader_read_timeout_ms = {}\nidle_timeout_ms = 300",
            HEADER_READ.as_millis()
        ),
    );
    let p = spawn_proxy_with_nofile(&config, LIMIT, Some(LIMIT)).unwrap();
    let pid = p.child.id();
    assert_eq!(nofile_limits(pid), (LIMIT, LIMIT));
    let baseline = open_fds(pid);
    // Once the listeners, the runtime and the reserve are open, this many clients fit.
    let room = LIMIT as usize - baseline;

    // From here until the trickle below ends, palisade is out of descriptors with
    // connections waiting: the window in which a naive accept loop spins.
    let cpu_start = Cpu::sample(pid);
    let started = Instant::now();
    let mut flood = Silent::open(p.addr, CLIENTS).await;
    let excess = CLIENTS - room;
    let closed = flood.wait_closed(excess, Duration::from_secs(2)).await;
    let drained = started.elapsed();

    // Still out of descriptors: keep new clients coming so that accept() always has
    // something to fail on.
    let mut trickle = Vec::new();
    for _ in 0..TRICKLE_ROUNDS {
        trickle.push(Silent::open(p.addr, TRICKLE_EACH).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    for t in &trickle {
        t.wait_closed(t.len(), deadline.saturating_duration_since(Instant::now()))
            .await;
    }
    let cpu_end = Cpu::sample(pid);
    let cpu = cpu_start.fraction_until(cpu_end);
    assert!(
        cpu < 0.2,
        "the accept loop spins out of descriptors: {cpu:.3} of one core"
    );
    assert!(
        started.elapsed() < HEADER_READ,
        "too slow to test: {:?} since the flood, longer than the timeout",
        started.elapsed()
    );

    assert!(
        closed >= excess,
        "the connections beyond the descriptor limit are closed: {closed} of {excess}"
    );
    let flood_closed = flood.lifetimes().await;
    let slowest = *flood_closed.last().unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "closed at once, not after a timeout: {slowest:?}"
    );
    let held = flood.len();
    assert!(held > 0 && held <= room, "{held} held, room for {room}");
    assert!(open_fds(pid) as u64 <= LIMIT);
    let mut trickle_slowest = Duration::ZERO;
    for t in &mut trickle {
        let n = t.len();
        let lifetimes = t.lifetimes().await;
        assert_eq!(
            lifetimes.len(),
            n,
            "a new client while out of descriptors is closed"
        );
        trickle_slowest = trickle_slowest.max(*lifetimes.last().unwrap());
    }
    assert!(
        trickle_slowest < Duration::from_millis(500),
        "closed at once: {trickle_slowest:?}"
    );
    assert_eq!(
        flood.closed(),
        0,
        "the accepted connections stay until their timeout"
    );

    let closed = flood
        .wait_closed(held, HEADER_READ + Duration::from_secs(3))
        .await;
    assert_eq!(closed, held, "the accepted silent connections time out");
    let held_lifetimes = flood.lifetimes().await;
    eprintln!(
        "descriptor limit {LIMIT} ({baseline} in use at start): of {CLIENTS} clients {} closed \
         at once (slowest {} ms, all within {} ms of the first connect), {held} held and \
         closed after {}..{} ms; {} more while out of descriptors closed within {} ms; \
         proxy CPU {:.3} of one core over {} ms (flood and trickle)",
        flood_closed.len(),
        ms(slowest),
        ms(drained),
        ms(held_lifetimes[0]),
        ms(*held_lifetimes.last().unwrap()),
        TRICKLE_ROUNDS * TRICKLE_EACH,
        ms(trickle_slowest),
        cpu,
        ms(cpu_end.at.duration_since(cpu_start.at)),
    );
    assert!(held_lifetimes[0] + CLIENT_LAG >= HEADER_READ);

    let open = wait_metric(&p, &open_series(), Duration::from_secs(2), |v| v == 0.0).await;
    assert_eq!(open, 0.0);
    assert_eq!(
        request_status(&p).await,
        StatusCode::OK,
        "served again once descriptors are free"
    );
    let accept_errors = value(&p, &closed_series("accept_error")).await;
    assert!(
        accept_errors >= (flood_closed.len() + TRICKLE_ROUNDS * TRICKLE_EACH) as f64,
        "every connection closed for want of a descriptor is counted: {accept_errors}"
    );
    assert_eq!(value(&p, &closed_series("max_connections")).await, 0.0);
}

// Every test above runs on hyper's data path and on the HTTP/1.1 fast path.
support::on_both_paths!(
    two_thousand_idle_connections_do_not_lock_out_new_clients,
    max_connections_accepts_and_closes_the_excess,
    out_of_descriptors_does_not_spin_and_recovers,
);
