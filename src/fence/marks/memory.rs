//! An in-process mark store: for tests and throwaway runs. Marks die with the process.

use std::sync::Mutex;

use super::{BoxFuture, MarkStore, Marks, StoreError};

/// Keeps marks in memory only.
///
/// A restart forgets every mark, so a zombie holding any token is admitted again afterwards.
/// Construction logs a warning saying so.
#[derive(Debug, Default)]
pub struct MemoryStore {
    marks: Mutex<Marks>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        tracing::warn!(
            "mark store is `memory`: marks are lost when the process exits; \
             use `file` or `etcd` for anything that matters"
        );
        Self::default()
    }

    /// A store pre-loaded with `marks`.
    pub fn with_marks(marks: Marks) -> Self {
        let s = Self::new();
        *s.marks.lock().unwrap_or_else(|e| e.into_inner()) = marks;
        s
    }
}

impl MarkStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>> {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Box::pin(async move { Ok(marks) })
    }

    fn load_named<'a>(&'a self, names: &'a [String]) -> BoxFuture<'a, Result<Marks, StoreError>> {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        let found = names
            .iter()
            .filter_map(|n| marks.get(n).map(|m| (n.clone(), *m)))
            .collect();
        Box::pin(async move { Ok(found) })
    }

    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        let slot = marks.entry(resource.to_owned()).or_default();
        *slot = (*slot).max(mark);
        let stored = *slot;
        Box::pin(async move { Ok(stored) })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
}
