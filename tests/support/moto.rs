//! A real S3-compatible server for tests: moto's server (PyPI `moto[server]`), started on a
//! free loopback port and killed on drop.
//!
//! `scripts/install-moto` (run by `scripts/test`) installs it into
//! `${XDG_CACHE_HOME:-$HOME/.cache}/palisade/moto`; `$PALISADE_MOTO_SERVER` names another
//! `moto_server`. A missing server fails the test with the install command: never a skip.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use palisade::client::objstore::object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use palisade::client::objstore::object_store::{ClientOptions, ObjectStore, RetryConfig};

fn binary() -> PathBuf {
    let bin = std::env::var_os("PALISADE_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
                    PathBuf::from(home).join(".cache")
                });
            cache.join("palisade/moto/bin/moto_server")
        });
    assert!(
        bin.exists(),
        "moto's S3 server is not installed at {}: install it with `scripts/install-moto` (a \
         venv with `pip install 'moto[server]'`; scripts/test runs it), or set \
         PALISADE_MOTO_SERVER",
        bin.display()
    );
    bin
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Moto {
    child: Child,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Moto {
    /// Starts `moto_server` and waits until it answers HTTP.
    pub fn start() -> Moto {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("moto.log")).unwrap();
        let child = Command::new(binary())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut moto = Moto {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            _dir: dir,
        };
        let started = Instant::now();
        while http(moto.addr, "GET", "/").is_none() {
            if let Some(status) = moto.child.try_wait().unwrap() {
                panic!("moto_server exited with {status}: {}", moto.log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "moto_server did not answer in 30 s: {}",
                moto.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        moto
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Creates a bucket (moto takes unsigned requests).
    pub fn bucket(&self, name: &str) {
        let status = http(self.addr, "PUT", &format!("/{name}"));
        assert_eq!(status, Some(200), "create bucket {name}: {}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("moto.log")).unwrap_or_default()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// object_store's S3 client on `endpoint`/`bucket`, with conditional puts by ETag, path-style
/// requests, and its own retries off and a short timeout: an election bounds its requests
/// itself, and a client retrying a conditional write for minutes would outlive any TTL.
pub fn s3(endpoint: &str, bucket: &str) -> Arc<dyn ObjectStore> {
    let retry = RetryConfig {
        max_retries: 0,
        retry_timeout: Duration::from_secs(1),
        ..RetryConfig::default()
    };
    let client = ClientOptions::new()
        .with_allow_http(true)
        .with_timeout(Duration::from_millis(1500))
        .with_connect_timeout(Duration::from_millis(500));
    let store = AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_virtual_hosted_style_request(false)
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .with_retry(retry)
        .with_client_options(client)
        .build()
        .unwrap();
    Arc::new(store)
}

/// One request with no body; the status, or `None` when nothing answered.
fn http(addr: SocketAddr, method: &str, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}
