use super::*;

fn json(marks: &[(&str, u64)]) -> Vec<u8> {
    let marks: Marks = marks.iter().map(|(n, m)| ((*n).to_owned(), *m)).collect();
    serde_json::to_vec(&serde_json::json!({"format": "palisade-marks/1", "marks": marks})).unwrap()
}

fn all(store: &FileStore) -> Marks {
    store.inner.read(|c| db::list(c, "", usize::MAX)).unwrap()
}

#[test]
fn advances_survive_reopen_and_never_go_down() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    assert_eq!(store.persist_blocking("orders", 51).unwrap(), 51);
    assert_eq!(
        store.persist_blocking("orders", 34).unwrap(),
        51,
        "the higher mark wins"
    );
    store.persist_blocking("billing", 7).unwrap();
    store.persist_blocking("huge", u64::MAX).unwrap();
    store.persist_blocking("huge", u64::MAX - 1).unwrap();
    store.persist_blocking("high", (1 << 63) + 5).unwrap();
    store.persist_blocking("high", 1 << 62).unwrap();
    drop(store);
    let again = FileStore::open(&path).unwrap();
    assert_eq!(
        all(&again),
        Marks::from([
            ("billing".into(), 7),
            ("high".into(), (1 << 63) + 5),
            ("huge".into(), u64::MAX),
            ("orders".into(), 51)
        ])
    );
    assert_eq!(again.mark("orders").unwrap(), 51);
    assert_eq!(again.mark("none").unwrap(), 0);
}

#[test]
fn damaged_or_foreign_files_refuse_to_open_and_are_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    for i in 0..2000 {
        store
            .persist_blocking(&format!("entity/{i:05}"), 10 + i)
            .unwrap();
    }
    drop(store);
    let full = fs::read(&path).unwrap();
    assert!(full.len() > 8 * 4096, "several pages: {}", full.len());
    let other = dir.path().join("other.db");
    {
        let c = Connection::open(&other).unwrap();
        c.execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
            .unwrap();
    }
    let mut flipped = full.clone();
    let at = full.len() / 2;
    for b in &mut flipped[at..at + 4096] {
        *b ^= 0x5a;
    }
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("header cut", full[..10].to_vec()),
        ("half", full[..full.len() / 2].to_vec()),
        ("flipped page", flipped),
        ("garbage", b"\x00\x01not a marks file".to_vec()),
        ("another database", fs::read(&other).unwrap()),
        (
            "bad JSON",
            br#"{"format":"palisade-marks/1","marks":{"orders":-1}}"#.to_vec(),
        ),
        (
            "other JSON format",
            br#"{"format":"other","marks":{}}"#.to_vec(),
        ),
    ];
    for (what, bytes) in cases {
        fs::write(&path, &bytes).unwrap();
        let err = FileStore::open(&path).unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Corrupt { .. } | StoreError::CorruptDatabase { .. }
            ),
            "{what}: {err}"
        );
        assert!(
            err.to_string().contains("refusing to start"),
            "{what}: {err}"
        );
        assert!(
            fs::read(&path).unwrap() == bytes,
            "{what}: the file is left as it was"
        );
        assert!(
            read(&path).is_err(),
            "{what}: `palisade marks` refuses it too"
        );
    }
}

#[test]
fn a_json_marks_file_is_migrated_in_place_and_kept_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.json");
    let before = json(&[("orders", 51), ("warehouse/7", u64::MAX)]);
    fs::write(&path, &before).unwrap();
    assert_eq!(
        read(&path).unwrap().unwrap()["orders"],
        51,
        "read before migration"
    );
    // A migration that crashed half-way left its file behind.
    fs::write(dir.path().join("marks.json.migrating"), b"partial").unwrap();

    let store = FileStore::open(&path).unwrap();
    assert_eq!(db::found(&path).unwrap(), Found::Database);
    assert_eq!(
        fs::read(dir.path().join("marks.json.v1.json")).unwrap(),
        before
    );
    assert_eq!(
        all(&store),
        Marks::from([("orders".into(), 51), ("warehouse/7".into(), u64::MAX)])
    );
    store.persist_blocking("orders", 60).unwrap();
    drop(store);
    assert_eq!(read(&path).unwrap().unwrap()["orders"], 60);
    assert_eq!(FileStore::open(&path).unwrap().mark("orders").unwrap(), 60);
}

#[test]
fn marks_json_beside_a_missing_marks_db_is_migrated_under_its_own_lock() {
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("marks.json");
    let path = dir.path().join("marks.db");
    fs::write(&old, json(&[("orders", 51)])).unwrap();
    assert_eq!(
        read(&path).unwrap().unwrap()["orders"],
        51,
        "read from beside"
    );

    // An older palisade still running on marks.json holds its lock: no migration.
    let held = take_lock(&old).unwrap();
    let err = FileStore::open(&path).unwrap_err();
    assert!(
        matches!(err, StoreError::Locked { ref lock, .. } if lock.ends_with("marks.json.lock")),
        "{err}"
    );
    assert!(!path.exists() && old.exists());
    drop(held);

    let store = FileStore::open(&path).unwrap();
    assert_eq!(store.mark("orders").unwrap(), 51);
    assert_eq!(
        fs::read(dir.path().join("marks.json.migrated")).unwrap(),
        json(&[("orders", 51)]),
        "kept aside"
    );
    // What is left at marks.json makes palisade 0.1 (and this one) refuse to start on it.
    let err = FileStore::open(&old).unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { .. })
            && err.to_string().contains("moved to the database marks.db"),
        "{err}"
    );
    drop(store);
    assert_eq!(FileStore::open(&path).unwrap().mark("orders").unwrap(), 51);
    // With the database gone, the moved notice stops a start instead of an empty store.
    fs::remove_file(&path).unwrap();
    assert!(matches!(
        FileStore::open(&path),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn a_missing_file_is_created_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/dir/marks.db");
    assert!(read(&path).unwrap().is_none());
    let store = FileStore::open(&path).unwrap();
    assert!(all(&store).is_empty());
    assert_eq!(read(&path).unwrap(), Some(Marks::new()));
}

#[test]
fn concurrent_advances_share_one_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path().join("marks.db")).unwrap();
    let held = store.inner.gate.lock().unwrap();
    let answers: Vec<_> = (0..64u64)
        .map(|i| store.inner.advance(format!("r/{}", i % 16), 100 + i))
        .collect();
    drop(held);
    let results: Vec<u64> = answers
        .into_iter()
        .map(|a| a.blocking_recv().unwrap().unwrap())
        .collect();
    // Each answer is the mark after its own advance, in queue order.
    assert_eq!(results, (100..164).collect::<Vec<_>>());
    let stats = store.stats();
    assert_eq!(stats.changes, 64);
    assert!(stats.commits <= 2, "{stats:?}");
    for i in 0..16u64 {
        assert_eq!(store.mark(&format!("r/{i}")).unwrap(), 100 + 48 + i);
    }
}

#[test]
fn lists_and_counts_by_prefix_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path().join("marks.db")).unwrap();
    for name in [
        "a",
        "a/1",
        "a/2",
        "a\u{10FFFF}",
        "a\u{7f}",
        "ab",
        "b",
        "é/1",
        "é\u{bf}",
    ] {
        store.persist_blocking(name, 5).unwrap();
    }
    let names = |m: Marks| m.into_keys().collect::<Vec<_>>();
    let list = |p: &str, n: usize| store.inner.read(|c| db::list(c, p, n)).unwrap();
    let count = |p: &str| store.inner.read(|c| db::count(c, p)).unwrap();
    assert_eq!(
        names(list("a", 100)),
        ["a", "a/1", "a/2", "ab", "a\u{7f}", "a\u{10FFFF}"]
    );
    assert_eq!(count("a"), 6);
    assert_eq!(names(list("a/", 1)), ["a/1"]);
    assert_eq!(count("é"), 2);
    assert_eq!(count(""), 9);
    assert_eq!(count("c"), 0);
    assert_eq!(names(list("", 2)), ["a", "a/1"]);
    let file = read_list(store.path(), "a/", 10).unwrap().unwrap();
    assert_eq!(names(file), ["a/1", "a/2"]);
}

#[test]
fn a_removed_file_is_written_back_once_its_directory_exists_again() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("d");
    let path = sub.join("marks.db");
    let store = FileStore::open(&path).unwrap();
    for i in 0..100 {
        store.persist_blocking(&format!("e/{i}"), 5).unwrap();
    }
    fs::remove_dir_all(&sub).unwrap();
    assert!(
        store.persist_blocking("e/1", 9).is_err(),
        "no directory: refused"
    );
    assert_eq!(
        store.mark("e/1").unwrap(),
        5,
        "nothing of the refused advance"
    );
    fs::create_dir(&sub).unwrap();
    assert_eq!(store.persist_blocking("e/1", 9).unwrap(), 9);
    drop(store);
    let again = FileStore::open(&path).unwrap();
    assert_eq!(again.mark("e/1").unwrap(), 9);
    assert_eq!(
        again.mark("e/99").unwrap(),
        5,
        "marks never advanced since came back too"
    );
    assert_eq!(all(&again).len(), 100);

    // Only the file removed (the lock file stays): written back at once.
    fs::remove_file(&path).unwrap();
    assert_eq!(again.persist_blocking("e/2", 9).unwrap(), 9);
    assert_eq!(read(&path).unwrap().unwrap().len(), 100);
    assert!(
        matches!(FileStore::open(&path), Err(StoreError::Locked { .. })),
        "still held"
    );
}

#[test]
fn a_file_replaced_while_open_is_never_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    store.persist_blocking("orders", 5).unwrap();
    fs::rename(&path, dir.path().join("aside.db")).unwrap();
    fs::write(&path, json(&[("orders", 1)])).unwrap();
    let err = store.persist_blocking("orders", 9).unwrap_err();
    assert!(err.to_string().contains("replaced the marks file"), "{err}");
    assert_eq!(fs::read(&path).unwrap(), json(&[("orders", 1)]));
}

#[test]
fn a_second_open_is_refused_while_the_first_holds_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let first = FileStore::open(&path).unwrap();
    first.persist_blocking("orders", 51).unwrap();
    let err = FileStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("marks.db.lock"), "{msg}");
    assert_eq!(first.mark("orders").unwrap(), 51, "the holder is untouched");
    assert_eq!(
        read(&path).unwrap().unwrap()["orders"],
        51,
        "others may read"
    );
    drop(first);
    let again = FileStore::open(&path).unwrap();
    assert_eq!(again.mark("orders").unwrap(), 51);
}

#[test]
fn overwrite_lowers_raises_and_removes_durably() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    store.persist_blocking("orders", u64::MAX).unwrap();
    store.persist_blocking("billing", 7).unwrap();
    assert_eq!(store.overwrite("orders", 51).unwrap(), u64::MAX);
    assert_eq!(store.overwrite("billing", 0).unwrap(), 7);
    assert_eq!(store.overwrite("new", 3).unwrap(), 0);
    drop(store);
    let store = FileStore::open(&path).unwrap();
    assert_eq!(
        all(&store),
        Marks::from([("orders".into(), 51), ("new".into(), 3)])
    );
}

fn probes(store: &FileStore) -> usize {
    store
        .inner
        .probes_started
        .load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test(start_paused = true)]
async fn readiness_is_a_real_write_whose_result_is_reused_for_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    let probe = dir.path().join("marks.db.probe");

    store.ready().await.unwrap();
    assert_eq!(probes(&store), 1);
    assert!(!probe.exists(), "the probe file is removed again");

    // A directory where the probe file goes: creating it fails, whoever runs the test.
    fs::create_dir(&probe).unwrap();
    store.ready().await.unwrap();
    assert_eq!(
        probes(&store),
        1,
        "within the interval the last result is reused"
    );

    tokio::time::advance(PROBE_INTERVAL).await;
    let err = store.ready().await.unwrap_err();
    assert_eq!(probes(&store), 2);
    match &err {
        StoreError::Io { path, op, .. } => {
            assert_eq!((path, *op), (&probe, "probe create"), "{err}");
        }
        other => panic!("not an I/O error: {other}"),
    }

    fs::remove_dir(&probe).unwrap();
    let again = store.ready().await.unwrap_err();
    assert_eq!(
        again.to_string(),
        err.to_string(),
        "a failure is reused too"
    );
    assert_eq!(probes(&store), 2);

    tokio::time::advance(PROBE_INTERVAL).await;
    store.ready().await.unwrap();
    assert_eq!(probes(&store), 3);
}

#[tokio::test(start_paused = true)]
async fn readiness_fails_when_the_marks_directory_is_gone_or_not_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("d");
    let store = FileStore::open(sub.join("marks.db")).unwrap();
    store.ready().await.unwrap();

    fs::remove_dir_all(&sub).unwrap();
    fs::write(&sub, b"not a directory").unwrap();
    tokio::time::advance(PROBE_INTERVAL).await;
    let err = store.ready().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Io { source, .. } if source.kind() == io::ErrorKind::NotADirectory),
        "{err}"
    );

    fs::remove_file(&sub).unwrap();
    tokio::time::advance(PROBE_INTERVAL).await;
    let err = store.ready().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound),
        "{err}"
    );

    fs::create_dir(&sub).unwrap();
    tokio::time::advance(PROBE_INTERVAL).await;
    store.ready().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn concurrent_readiness_checks_share_one_probe() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path().join("marks.db")).unwrap();
    let (a, b, c, d) = tokio::join!(store.ready(), store.ready(), store.ready(), store.ready());
    for r in [a, b, c, d] {
        r.unwrap();
    }
    assert_eq!(probes(&store), 1);
}

#[test]
fn a_clean_close_leaves_every_mark_in_the_file_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    for i in 0..500 {
        store.persist_blocking(&format!("e/{i}"), 7).unwrap();
    }
    assert!(
        db::sidecar(&path, "-wal").exists(),
        "advances are in the log first"
    );
    drop(store);
    assert!(
        !db::sidecar(&path, "-wal").exists(),
        "folded into the file at close"
    );
    let copy = dir.path().join("copy.db");
    fs::copy(&path, &copy).unwrap();
    assert_eq!(
        read(&copy).unwrap().unwrap().len(),
        500,
        "the file alone is the store"
    );
}

#[test]
fn a_log_left_without_its_database_is_never_applied_to_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a/marks.db");
    let store = FileStore::open(&a).unwrap();
    for i in 0..300 {
        store.persist_blocking(&format!("e/{i}"), 9).unwrap();
    }
    // Another store's log, where a marks file was removed while no proxy ran.
    let b = dir.path().join("b/marks.db");
    fs::create_dir_all(b.parent().unwrap()).unwrap();
    fs::copy(db::sidecar(&a, "-wal"), db::sidecar(&b, "-wal")).unwrap();
    let fresh = FileStore::open(&b).unwrap();
    assert!(all(&fresh).is_empty());
    fresh.persist_blocking("x", 1).unwrap();
    drop(fresh);
    assert_eq!(read(&b).unwrap().unwrap(), Marks::from([("x".into(), 1)]));
    drop(store);
}

#[test]
fn the_copy_of_an_interrupted_write_back_is_used_when_the_file_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    drop({
        let s = FileStore::open(&path).unwrap();
        s.persist_blocking("orders", 51).unwrap();
        s
    });
    fs::rename(&path, db::sidecar(&path, ".restore")).unwrap();
    let store = FileStore::open(&path).unwrap();
    assert_eq!(store.mark("orders").unwrap(), 51);
    assert!(!db::sidecar(&path, ".restore").exists());
}

#[test]
fn a_large_database_removed_while_open_is_written_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.db");
    let store = FileStore::open(&path).unwrap();
    // Many pages, rewritten out of order: the copy's layout differs from the open file's.
    for round in 0..3u64 {
        let answers: Vec<_> = (0..20_000u64)
            .map(|i| {
                let i = (i * 7919 + round) % 20_000;
                store
                    .inner
                    .advance(format!("entity/{i}"), 10 + round * 20_000 + i)
            })
            .collect();
        for a in answers {
            a.blocking_recv().unwrap().unwrap();
        }
    }
    // Only the file (its -wal and -shm stay, in use by the open connections).
    fs::remove_file(&path).unwrap();
    assert_eq!(
        store.persist_blocking("entity/1", 1_000_000).unwrap(),
        1_000_000
    );
    assert_eq!(store.mark("entity/2").unwrap(), 10 + 2 * 20_000 + 2);
    drop(store);
    let again = FileStore::open(&path).unwrap();
    let marks = all(&again);
    assert_eq!(marks.len(), 20_000);
    assert_eq!(marks["entity/1"], 1_000_000);
    for i in 2..20_000u64 {
        assert_eq!(
            marks[&format!("entity/{i}")],
            10 + 2 * 20_000 + i,
            "entity/{i}"
        );
    }
}
