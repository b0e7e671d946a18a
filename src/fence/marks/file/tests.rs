use super::*;

#[test]
fn advances_survive_reopen_and_never_go_down() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.json");
    let store = FileStore::open(&path).unwrap();
    store.inner.persist("orders", 51).unwrap();
    store.inner.persist("orders", 34).unwrap();
    store.inner.persist("billing", 7).unwrap();
    drop(store);
    let again = FileStore::open(&path).unwrap();
    let marks = again.inner.marks.lock().unwrap().clone();
    assert_eq!(marks.get("orders"), Some(&51));
    assert_eq!(marks.get("billing"), Some(&7));
}

#[test]
fn truncated_or_corrupt_files_refuse_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.json");
    FileStore::open(&path)
        .unwrap()
        .inner
        .persist("orders", 51)
        .unwrap();
    let full = fs::read(&path).unwrap();
    for cut in [0, 1, full.len() / 2, full.len() - 3] {
        fs::write(&path, &full[..cut]).unwrap();
        let err = FileStore::open(&path).unwrap_err();
        assert!(
            matches!(err, StoreError::Corrupt { .. }),
            "cut at {cut}: {err}"
        );
    }
    fs::write(
        &path,
        br#"{"format":"palisade-marks/1","marks":{"orders":-1}}"#,
    )
    .unwrap();
    assert!(matches!(
        FileStore::open(&path),
        Err(StoreError::Corrupt { .. })
    ));
    fs::write(&path, br#"{"format":"other","marks":{}}"#).unwrap();
    assert!(matches!(
        FileStore::open(&path),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn a_failed_write_keeps_the_previous_state() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("d");
    let path = sub.join("marks.json");
    let store = FileStore::open(&path).unwrap();
    store.inner.persist("orders", 5).unwrap();
    fs::remove_dir_all(&sub).unwrap();
    assert!(store.inner.persist("orders", 9).is_err());
    assert_eq!(store.inner.marks.lock().unwrap().get("orders"), Some(&5));
}

#[test]
fn a_second_open_is_refused_while_the_first_holds_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.json");
    let first = FileStore::open(&path).unwrap();
    first.inner.persist("orders", 51).unwrap();
    let err = FileStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("marks.json.lock"), "{msg}");
    assert_eq!(
        first.marks().get("orders"),
        Some(&51),
        "the holder is untouched"
    );
    drop(first);
    let again = FileStore::open(&path).unwrap();
    assert_eq!(again.marks().get("orders"), Some(&51));
}

#[test]
fn overwrite_lowers_raises_and_removes_durably() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("marks.json");
    let store = FileStore::open(&path).unwrap();
    store.inner.persist("orders", u64::MAX).unwrap();
    store.inner.persist("billing", 7).unwrap();
    assert_eq!(store.overwrite("orders", 51).unwrap(), u64::MAX);
    assert_eq!(store.overwrite("billing", 0).unwrap(), 7);
    assert_eq!(store.overwrite("new", 3).unwrap(), 0);
    drop(store);
    let marks = FileStore::open(&path).unwrap().marks();
    assert_eq!(
        marks,
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
    let path = dir.path().join("marks.json");
    let store = FileStore::open(&path).unwrap();
    let probe = dir.path().join("marks.json.probe");

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
    let store = FileStore::open(sub.join("marks.json")).unwrap();
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
    let store = FileStore::open(dir.path().join("marks.json")).unwrap();
    let (a, b, c, d) = tokio::join!(store.ready(), store.ready(), store.ready(), store.ready());
    for r in [a, b, c, d] {
        r.unwrap();
    }
    assert_eq!(probes(&store), 1);
}
