//! lock-db: the fencing token stored and checked inside the database, in the same
//! transaction as the write.
//!
//! An account row carries the token of the last owner that wrote it. Two owners take turns on
//! the lock `account-1` (in-memory coordination store, 1 s leases):
//!
//! 1. A takes the lock, reads the balance (100) and computes a withdrawal of 30 (70);
//! 2. A freezes before writing; its keepalive stops and its lease expires;
//! 3. B takes the lock (a higher token), reads 100, deposits 50 and writes 150;
//! 4. A wakes up, still believing it holds the lock, and writes its 70.
//!
//! Every write is its own `BEGIN IMMEDIATE` transaction: SQLite's write lock (what a row lock
//! does in a bigger database) makes each UPDATE atomic, yet A's late UPDATE silently replaces
//! B's: the lost update. The scenario runs twice: without the token check (the final balance
//! is A's stale 70, B's deposit is gone) and with it, where the check sits in the UPDATE
//! itself, `... WHERE id = ?3 AND fencing_token <= ?1`, so A's write matches no row and the
//! balance stays B's 150.
//!
//! Run it with `cargo run --example lock-db`. It exits 0 only if the first run lost B's
//! update (the interleaving happened) and the second kept it (the zombie was refused).
//! `PALISADE_EXAMPLE_UNFENCED=1` drops the token check from the second run too: A's write then
//! gets through and the example exits 1.

#[path = "common/process.rs"]
mod process;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use palisade::{FencingToken, LockService, MemoryProvider, Provider, SessionOptions};
use rusqlite::{params, Connection, TransactionBehavior};

const ACCOUNT: i64 = 1;
const OPENING: i64 = 100;
/// What A writes: its withdrawal of 30, computed from the balance it read before freezing.
const A_STALE: i64 = OPENING - 30;
/// What B writes: its deposit of 50.
const B_VALUE: i64 = OPENING + 50;

/// The write without fencing: the row lock alone.
const UNCHECKED: &str = "UPDATE accounts SET balance = ?2, fencing_token = ?1 WHERE id = ?3";
/// The fenced write: the token is checked and stored by the same statement, so no other
/// write can come between the check and the update.
const CHECKED: &str =
    "UPDATE accounts SET balance = ?2, fencing_token = ?1 WHERE id = ?3 AND fencing_token <= ?1";

type Error = Box<dyn std::error::Error>;

fn open(db: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(db)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    Ok(conn)
}

fn create(db: &Path) -> rusqlite::Result<()> {
    open(db)?.execute_batch(&format!(
        "CREATE TABLE accounts (
             id INTEGER PRIMARY KEY,
             balance INTEGER NOT NULL,
             fencing_token INTEGER NOT NULL DEFAULT 0
         );
         INSERT INTO accounts (id, balance) VALUES ({ACCOUNT}, {OPENING});"
    ))
}

/// The row: (balance, fencing_token).
fn read(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row(
        "SELECT balance, fencing_token FROM accounts WHERE id = ?1",
        [ACCOUNT],
        |row| Ok((row.get(0)?, row.get(1)?)),
    )
}

/// One write in its own IMMEDIATE transaction (the write lock is taken at BEGIN, so nothing
/// interleaves with it). Returns the number of rows changed: 0 means fenced.
fn write(
    conn: &mut Connection,
    sql: &str,
    token: FencingToken,
    balance: i64,
) -> rusqlite::Result<usize> {
    // Tokens are store revisions: positive i64 values.
    let token = i64::try_from(token.get()).expect("a token fits in i64");
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let changed = tx.execute(sql, params![token, balance, ACCOUNT])?;
    tx.commit()?;
    Ok(changed)
}

fn options() -> SessionOptions {
    SessionOptions::new()
        .with_ttl(process::TTL)
        .with_namespace("/lock-db")
}

/// Owner A: locks, reads, freezes, then writes what it computed before the freeze.
async fn owner_a(
    provider: MemoryProvider,
    db: PathBuf,
    sql: &'static str,
    mut freezer: process::Freezer,
) -> Result<usize, String> {
    let session = provider
        .session(options())
        .await
        .map_err(|e| e.to_string())?;
    let grant = session.lock("account-1").await.map_err(|e| e.to_string())?;
    let token = grant.token();
    let mut conn = open(&db).map_err(|e| e.to_string())?;
    let (balance, _) = read(&conn).map_err(|e| e.to_string())?;
    let new = balance - 30;
    println!("  A: locks account-1 (token {token}), reads balance {balance}, will write {new}");
    println!("  A: freezes before its write; its keepalive stops with it");
    freezer.freeze();
    println!("  A: wakes up, still believes it holds the lock, writes {new} with token {token}");
    let changed = write(&mut conn, sql, token, new).map_err(|e| e.to_string())?;
    Ok(changed)
}

/// One run of the interleaving; returns the final balance.
async fn run(sql: &'static str) -> Result<i64, Error> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("bank.db");
    create(&db)?;
    let provider = MemoryProvider::new();
    // B's session first: the store's lease reaper runs on the runtime of its first lease
    // (see common/process.rs), and this one is never frozen.
    let b = provider.session(options()).await?;
    let mut a = process::spawn("owner-a", {
        let (provider, db) = (provider.connect(), db.clone());
        move |freezer| owner_a(provider, db, sql, freezer)
    });
    if !a.frozen().await {
        return Err(format!("A ended before freezing: {:?}", a.join().await).into());
    }
    let waited = Instant::now();
    let grant = b.lock("account-1").await?;
    let token = grant.token();
    let mut conn = open(&db)?;
    let (balance, _) = read(&conn)?;
    println!(
        "  B: locks account-1 after {:.1} s (A's lease expired), token {token}; reads {balance}, writes {}",
        waited.elapsed().as_secs_f64(),
        balance + 50
    );
    let changed = write(&mut conn, sql, token, balance + 50)?;
    println!("  B: UPDATE changed {changed} row");
    let a_changed = a.join().await?;
    let (balance, stored) = read(&conn)?;
    match a_changed {
        0 => println!("  A: UPDATE changed 0 rows: fenced, the row carries token {stored}"),
        n => println!("  A: UPDATE changed {n} row: the stale write went in"),
    }
    println!("  final row: balance {balance}, fencing_token {stored}");
    grant.unlock().await?;
    Ok(balance)
}

#[tokio::main]
async fn main() -> Result<ExitCode, Error> {
    println!("lock-db: balance {OPENING}; A withdraws 30, B deposits 50, A freezes in between\n");
    println!("every write is its own BEGIN IMMEDIATE transaction: SQLite's write lock, a row lock's job\n");
    println!("run 1, row lock only:\n  {UNCHECKED}");
    let lost = run(UNCHECKED).await?;
    let lost_ok = lost == A_STALE;
    if lost_ok {
        println!("  -> {lost}: A's stale value; B's deposit is lost\n");
    } else {
        println!("  -> {lost}: expected A's stale {A_STALE}; the interleaving did not happen\n");
    }

    let unfenced = process::unfenced();
    let sql = if unfenced { UNCHECKED } else { CHECKED };
    println!("run 2, token checked in the same statement:\n  {sql}");
    if unfenced {
        println!("  (PALISADE_EXAMPLE_UNFENCED=1: the token check is left out)");
    }
    let kept = run(sql).await?;
    let kept_ok = kept == B_VALUE;
    if kept_ok {
        println!("  -> {kept}: B's value; A's write was refused and A knows it (0 rows)");
        println!("     A must lock again and re-read before it withdraws.");
    } else {
        println!("  -> {kept}: expected B's {B_VALUE}");
        println!("FAIL: a stale write got through: A's UPDATE replaced B's");
    }
    if !lost_ok {
        println!("FAIL: run 1 should have lost B's update ({A_STALE}), got {lost}");
    }
    if lost_ok && kept_ok {
        println!("OK: the zombie was refused; without the token check its stale write won");
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}
