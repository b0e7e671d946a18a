//! Test support: fake upstreams, an in-process proxy, a proxy process, HTTP clients.
//!
//! Everything binds `127.0.0.1:0`; nothing depends on fixed ports or test order. Each test
//! binary (`tests/<area>/main.rs`) holds many files' tests, run in parallel on threads of one
//! process: nothing here keeps state between tests, but [`serial`].

#![allow(dead_code, unreachable_pub)]

pub mod cases;
pub mod grpc;
pub mod upstream;

#[allow(unused_imports)]
pub use upstream::{upstream, Log, Seen, Upstream};

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use palisade::{Config, Listeners};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

tokio::task_local! {
    /// `[proxy] http1_fast_path` for every proxy the current test starts, set by
    /// [`on_both_paths!`]; unset, the configuration's own value stands.
    pub static FAST_PATH: bool;
}

/// The fast path switch of the running test, if [`on_both_paths!`] set one.
pub fn fast_path() -> Option<bool> {
    FAST_PATH.try_with(|f| *f).ok()
}

/// Runs each named `async fn` as two tests, `NAME::hyper_path` and `NAME::fast_path`: the
/// proxies it starts (in process, or as a process through [`spawn_proxy`]) have
/// `[proxy] http1_fast_path` off, then on. One body, both data paths.
#[allow(unused_macros)]
macro_rules! on_both_paths {
    (@each [$($args:tt)*]) => {};
    (@each [$($args:tt)*] $name:ident $(, $rest:ident)*) => {
        mod $name {
            #[tokio::test($($args)*)]
            async fn hyper_path() {
                crate::support::FAST_PATH.scope(false, super::$name()).await
            }
            #[tokio::test($($args)*)]
            async fn fast_path() {
                crate::support::FAST_PATH.scope(true, super::$name()).await
            }
        }
        crate::support::on_both_paths!(@each [$($args)*] $($rest),*);
    };
    (#[$($args:tt)*] $($name:ident),* $(,)?) => {
        crate::support::on_both_paths!(@each [$($args)*] $($name),*);
    };
    ($($name:ident),* $(,)?) => {
        crate::support::on_both_paths!(@each [flavor = "current_thread"] $($name),*);
    };
}
#[allow(unused_imports)]
pub(crate) use on_both_paths;

/// Runs the tests that hold its guard one at a time within a test binary: those that measure
/// time, CPU or latency windows, and those that load the machine while they run. A binary
/// runs many files' tests on parallel threads; none of the first kind may share the cores
/// with another of either kind. A tokio mutex, since the guard is held across awaits.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// The name libtest gives the test function `name` of the module whose `module_path!()` is
/// `module` (its path below the crate root), to run this binary again on that test alone
/// (`--exact`), as the tests that need a child process do.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_owned(),
    }
}

/// Runs test `name` of `module` (the caller's `module_path!()`) of this test binary as a
/// child process, with `env` set in its environment, and sends what follows `marker` on each
/// line of its standard output to `tx`, tagged with `i` (libtest prints no newline before a
/// test's first line, hence a marker rather than whole lines).
pub fn child_test(
    (module, name): (&str, &str),
    (env, value): (&str, &str),
    marker: &'static str,
    (i, tx): (usize, tokio::sync::mpsc::UnboundedSender<(usize, String)>),
) -> std::process::Child {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &test_name(module, name),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, value)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some((_, l)) = line.split_once(marker) {
                let _ = tx.send((i, l.to_owned()));
            }
        }
    });
    child
}

/// What child processes report through [`child_test`]: every line with its child's index,
/// and who holds what now, as the lines say.
pub struct Reports {
    /// Child -> the token it holds.
    pub holding: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<usize, u64>>>,
    pub lines: std::sync::Arc<std::sync::Mutex<Vec<(usize, String)>>>,
    /// Ends when every child's output has ended.
    pub reader: tokio::task::JoinHandle<()>,
}

/// Follows `rx`: a line `acquired ...` makes its child hold the token in word `token_at`, a
/// line whose first word is in `ends` makes it hold nothing.
pub fn reports(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(usize, String)>,
    token_at: usize,
    ends: &'static [&'static str],
) -> Reports {
    let (holding, lines) = (
        std::sync::Arc::<std::sync::Mutex<std::collections::HashMap<usize, u64>>>::default(),
        std::sync::Arc::<std::sync::Mutex<Vec<(usize, String)>>>::default(),
    );
    let reader = tokio::spawn({
        let (holding, lines) = (holding.clone(), lines.clone());
        async move {
            while let Some((i, l)) = rx.recv().await {
                let w: Vec<&str> = l.split(' ').collect();
                if w[0] == "acquired" {
                    holding
                        .lock()
                        .unwrap()
                        .insert(i, w[token_at].parse().unwrap());
                } else if ends.contains(&w[0]) {
                    holding.lock().unwrap().remove(&i);
                }
                lines.lock().unwrap().push((i, l));
            }
        }
    });
    Reports {
        holding,
        lines,
        reader,
    }
}

/// Substitutes `{upstream}` and `{marks}` in a config template.
pub fn render(template: &str, upstream: SocketAddr, marks: &Path) -> String {
    template
        .replace("{upstream}", &upstream.to_string())
        .replace("{marks}", &marks.display().to_string())
}

/// A proxy running in this process.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Reloads its configuration from the file it names, as SIGHUP does.
    pub reloader: palisade::proxy::reload::Reloader,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Signals shutdown and waits for the drain to finish (and the access log's last write).
    pub async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
    }

    pub async fn metrics(&self) -> String {
        let r = get(&format!("http://{}/metrics", self.admin)).await;
        String::from_utf8(r.body.to_vec()).unwrap()
    }

    pub async fn marks(&self) -> serde_json::Value {
        let r = get(&format!("http://{}/marks", self.admin)).await;
        serde_json::from_slice(&r.body).unwrap()
    }
}

/// Starts palisade in this task's runtime with `config_text` (listen addresses are ignored:
/// both listeners bind port 0). `dir` is where the config pretends to live.
pub async fn proxy(config_text: &str, dir: &Path) -> Proxy {
    start(Config::parse(config_text, &dir.join("palisade.toml")).unwrap()).await
}

/// Starts palisade in this task's runtime with the configuration file at `path` (listen
/// addresses are ignored: both listeners bind port 0); its reloader re-reads that file.
pub async fn proxy_file(path: &Path) -> Proxy {
    start(Config::load(path).unwrap()).await
}

async fn start(mut config: Config) -> Proxy {
    if let Some(on) = fast_path() {
        config.proxy.http1_fast_path = on;
    }
    let listeners = Listeners {
        proxy: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        admin: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
    };
    let addr = listeners.proxy.local_addr().unwrap();
    let admin = listeners.admin.as_ref().unwrap().local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let app = palisade::App::start(config, listeners)
        .await
        .unwrap_or_else(|e| panic!("palisade did not start: {e}"));
    let reloader = app.reloader();
    let task = tokio::spawn(app.serve(async move {
        let _ = stopped.await;
    }));
    Proxy {
        addr,
        admin,
        reloader,
        stop: Some(stop),
        task: Some(task),
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Got {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn http1_client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub fn h2c_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// Sends a request with the given extra headers and reads the whole response.
pub async fn send(
    client: &TestClient,
    method: Method,
    url: &str,
    headers: &[(&str, &[u8])],
    body: &'static [u8],
) -> Got {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, HeaderValue::from_bytes(v).unwrap());
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from_static(body))).unwrap())
        .await
        .unwrap();
    read(resp).await
}

pub async fn read(resp: Response<Incoming>) -> Got {
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Got {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

pub async fn get(url: &str) -> Got {
    send(&http1_client(), Method::GET, url, &[], b"").await
}

/// A POST with an optional token over HTTP/1.1.
pub async fn post(url: &str, token: Option<&str>) -> Got {
    let headers: Vec<(&str, &[u8])> = token
        .map(|t| ("x-fencing-token", t.as_bytes()))
        .into_iter()
        .collect();
    send(&http1_client(), Method::POST, url, &headers, b"payload").await
}

/// The value of one sample in a Prometheus text exposition, e.g.
/// `metric(&text, "palisade_mark{resource=\"orders\"}")`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The palisade binary, run as a child process, killed on drop.
pub struct ProxyProcess {
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    /// Its stderr lines (JSON logs) after the listening line, as they come.
    pub logs: std::sync::mpsc::Receiver<String>,
    /// Its stderr up to and including the listening line.
    pub started: String,
}

/// Starts `palisade run --config <path>` and waits until it reports its listening address.
/// Returns the child's stderr text instead when it exits before listening.
pub fn spawn_proxy(config: &Path) -> Result<ProxyProcess, (Option<i32>, String)> {
    spawn_proxy_with_env(config, &[])
}

/// [`spawn_proxy`] with `env` added to the child's environment (tests never set their own).
pub fn spawn_proxy_with_env(
    config: &Path,
    env: &[(&str, &str)],
) -> Result<ProxyProcess, (Option<i32>, String)> {
    let config = &with_fast_path(config);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_palisade"));
    cmd.args(["--log-format", "json", "run", "--config"])
        .arg(config)
        .envs(env.iter().copied());
    spawn_command(cmd)
}

/// `config`, or under [`on_both_paths!`] a copy beside it with `[proxy] http1_fast_path` set.
fn with_fast_path(config: &Path) -> PathBuf {
    let Some(on) = fast_path() else {
        return config.to_owned();
    };
    let text = std::fs::read_to_string(config).unwrap();
    assert!(
        text.contains("[proxy]\n"),
        "the config needs a [proxy] table"
    );
    let text = text.replacen(
        "[proxy]\n",
        &format!("[proxy]\nhttp1_fast_path = {on}\n"),
        1,
    );
    let copy = config.with_extension(if on { "fast.toml" } else { "hyper.toml" });
    std::fs::write(&copy, text).unwrap();
    copy
}

/// Spawns `cmd` (which must end up running `palisade --log-format json run ...`) and waits
/// until it reports its listening address, as [`spawn_proxy`] does.
fn spawn_command(mut cmd: Command) -> Result<ProxyProcess, (Option<i32>, String)> {
    let mut child = cmd
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    let mut admin = None;
    loop {
        let Some(Ok(line)) = lines.next() else {
            let status = child.wait().unwrap();
            return Err((status.code(), seen));
        };
        seen.push_str(&line);
        seen.push('\n');
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let fields = &v["fields"];
        match fields["message"].as_str() {
            Some("admin listening") => admin = fields["addr"].as_str().and_then(|a| a.parse().ok()),
            Some("palisade listening") => {
                let addr = fields["addr"].as_str().unwrap().parse().unwrap();
                // Keep draining stderr so the child never blocks on a full pipe; lines go to
                // `logs` for tests that wait for one (nobody reading them is fine).
                let (tx, logs) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    for line in lines.map_while(Result::ok) {
                        let _ = tx.send(line);
                    }
                });
                return Ok(ProxyProcess {
                    child,
                    addr,
                    admin,
                    logs,
                    started: seen,
                });
            }
            _ => {}
        }
    }
}

impl ProxyProcess {
    /// Sends `signal` (e.g. `"HUP"`, `"USR1"`, `"TERM"`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits (at most `limit`) for a JSON log line whose message is `message` and returns its
    /// fields; panics with the lines seen when it does not come.
    pub fn wait_log(&self, message: &str, limit: Duration) -> serde_json::Value {
        self.wait_json(limit, |v| v["fields"]["message"] == message)["fields"].clone()
    }

    /// Waits (at most `limit`) for a JSON line on stderr that `wanted` accepts.
    pub fn wait_json(
        &self,
        limit: Duration,
        wanted: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = match self.logs.recv_timeout(left) {
                Ok(l) => l,
                Err(e) => panic!("no such line on stderr ({e}); seen:\n{}", seen.join("\n")),
            };
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if wanted(&v) {
                    return v;
                }
            }
            seen.push(line);
        }
    }

    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Peak resident set size in KiB (VmHWM).
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// [`spawn_proxy`] with the open-files limit set first, as `ulimit -S -n soft` (and
/// `ulimit -H -n hard`) in a shell that then `exec`s palisade: the child's pid is palisade's.
/// `soft` must not exceed `hard` (nor the current hard limit).
pub fn spawn_proxy_with_nofile(
    config: &Path,
    soft: u64,
    hard: Option<u64>,
) -> Result<ProxyProcess, (Option<i32>, String)> {
    let config = &with_fast_path(config);
    // Soft first: lowering the hard limit below the current soft limit would fail.
    let mut script = format!("ulimit -S -n {soft}");
    if let Some(hard) = hard {
        script.push_str(&format!(" && ulimit -H -n {hard}"));
    }
    script.push_str(" && exec \"$0\" \"$@\"");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_palisade"))
        .args(["--log-format", "json", "run", "--config"])
        .arg(config);
    spawn_command(cmd)
}

/// Reads until EOF or error; `true` when the peer closed within `limit`.
pub async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}
