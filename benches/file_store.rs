//! The file mark store under concurrent advances: the database store (`FileStore`) beside
//! the JSON store it replaced (palisade 0.1), in one run on the same disk.
//!
//! Method: the store holds N marks (1, 10^3, 10^6: `entity/0` .. `entity/N-1`), then 64 tasks
//! advance for DURATION seconds (default 3): each takes the next token from one shared counter
//! and advances `entity/(its index + 64 k) mod N`, waiting for each advance to be durable
//! before the next, as 64 clients waiting for their requests would. Reported: advances per
//! second and fsyncs per advance. For the JSON store two per advance (the temp file and its
//! directory, counted as it writes); for the database, commits per advance (each commit is
//! one fsync of the write-ahead log; a checkpoint, about one per 1000 pages of log, adds two).
//! The JSON store below is 0.1's write path: the whole map serialized to `<path>.tmp`, fsync,
//! rename over `<path>`, fsync of the directory, one advance at a time, on the blocking pool.
//!
//! Run: `cargo bench --bench file_store` (`DURATION=10`, `SIZES="1 1000"` to change).
//! `cargo test --benches` runs it once briefly (1 and 10^3 marks, 0.2 s) so it keeps working.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use palisade::{FileStore, MarkStore};

const CLIENTS: u64 = 64;

/// Palisade 0.1's marks file: every advance rewrites the whole map.
struct JsonStore {
    path: PathBuf,
    tmp: PathBuf,
    dir: PathBuf,
    marks: Mutex<BTreeMap<String, u64>>,
    fsyncs: AtomicU64,
}

impl JsonStore {
    fn create(dir: &Path, marks: BTreeMap<String, u64>) -> Self {
        let s = Self {
            path: dir.join("marks.json"),
            tmp: dir.join("marks.json.tmp"),
            dir: dir.to_path_buf(),
            marks: Mutex::new(BTreeMap::new()),
            fsyncs: AtomicU64::new(0),
        };
        s.write(&marks);
        *s.marks.lock().unwrap() = marks;
        s.fsyncs.store(0, Relaxed);
        s
    }

    fn write(&self, marks: &BTreeMap<String, u64>) {
        let doc = serde_json::json!({"format": "palisade-marks/1", "marks": marks});
        let mut bytes = serde_json::to_vec_pretty(&doc).unwrap();
        bytes.push(b'\n');
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.tmp)
            .unwrap();
        f.write_all(&bytes).unwrap();
        f.sync_all().unwrap();
        drop(f);
        fs::rename(&self.tmp, &self.path).unwrap();
        File::open(&self.dir).unwrap().sync_all().unwrap();
        self.fsyncs.fetch_add(2, Relaxed);
    }

    fn persist(&self, resource: &str, mark: u64) -> u64 {
        let mut current = self.marks.lock().unwrap();
        if let Some(&m) = current.get(resource).filter(|&&m| m >= mark) {
            return m;
        }
        let mut next = current.clone();
        next.insert(resource.to_owned(), mark);
        self.write(&next);
        *current = next;
        mark
    }
}

fn names(n: u64) -> BTreeMap<String, u64> {
    (0..n).map(|i| (format!("entity/{i}"), 1)).collect()
}

/// Runs 64 advancing clients for `duration` on `advance`; advances per second.
async fn drive<F, Fut>(n: u64, duration: Duration, advance: F) -> (u64, f64)
where
    F: Fn(String, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let advance = Arc::new(advance);
    let tokens = Arc::new(AtomicU64::new(10));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (advance, tokens, done) = (advance.clone(), tokens.clone(), done.clone());
            tokio::spawn(async move {
                let mut k = 0;
                while Instant::now() < deadline {
                    let name = format!("entity/{}", (c + CLIENTS * k) % n);
                    advance(name, tokens.fetch_add(1, Relaxed)).await;
                    done.fetch_add(1, Relaxed);
                    k += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let count = done.load(Relaxed);
    (count, count as f64 / started.elapsed().as_secs_f64())
}

async fn json_run(n: u64, duration: Duration) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(JsonStore::create(dir.path(), names(n)));
    let s = store.clone();
    let (count, rate) = drive(n, duration, move |r, m| {
        let s = s.clone();
        async move {
            tokio::task::spawn_blocking(move || s.persist(&r, m))
                .await
                .unwrap();
        }
    })
    .await;
    (rate, store.fsyncs.load(Relaxed) as f64 / count as f64)
}

async fn db_run(n: u64, duration: Duration) -> (f64, f64, Duration) {
    let dir = tempfile::tempdir().unwrap();
    // Seeded as an upgrade would: a 0.1 JSON file beside the database, migrated at open.
    JsonStore::create(dir.path(), names(n));
    let opened = Instant::now();
    let store = Arc::new(FileStore::open(dir.path().join("marks.db")).unwrap());
    let open_time = opened.elapsed();
    assert_eq!(store.count("entity/").await.unwrap(), n);
    let s = store.clone();
    let (count, rate) = drive(n, duration, move |r, m| {
        let s = s.clone();
        async move {
            s.persist(&r, m).await.unwrap();
        }
    })
    .await;
    let stats = store.stats();
    (rate, stats.commits as f64 / count as f64, open_time)
}

#[tokio::main]
async fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let duration = if bench {
        Duration::from_secs_f64(
            std::env::var("DURATION")
                .ok()
                .and_then(|d| d.parse().ok())
                .unwrap_or(3.0),
        )
    } else {
        Duration::from_millis(200)
    };
    let default_sizes = if bench { "1 1000 1000000" } else { "1 1000" };
    let sizes: Vec<u64> = std::env::var("SIZES")
        .unwrap_or_else(|_| default_sizes.to_owned())
        .split_whitespace()
        .map(|s| s.parse().expect("SIZES: numbers"))
        .collect();
    println!(
        "file mark store, {CLIENTS} concurrent advancing clients, {:.1} s per run, {} cores",
        duration.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>9} | {:>16} {:>14} | {:>16} {:>14} {:>12} | {:>8}",
        "marks", "json adv/s", "fsyncs/adv", "database adv/s", "commits/adv", "open", "db/json"
    );
    for n in sizes {
        let (json_rate, json_fsyncs) = json_run(n, duration).await;
        let (db_rate, db_commits, open) = db_run(n, duration).await;
        println!(
            "{n:>9} | {json_rate:>16.0} {json_fsyncs:>14.2} | {db_rate:>16.0} {db_commits:>14.3} {:>10.0}ms | {:>7.1}x",
            open.as_secs_f64() * 1000.0,
            db_rate / json_rate
        );
    }
}
