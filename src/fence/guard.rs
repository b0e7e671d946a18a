//! The admission rule (`docs/design.md#admission`), pure: no I/O, no async, no locks.
//!
//! A [`Watermark`] is the highest token a resource has accepted. [`Watermark::check`] classifies
//! an incoming token; only an [`Verdict::Advance`] needs the (slow, fallible) mark store, and
//! the caller publishes the new mark with [`Watermark::publish`] once it is durable. Keeping the
//! rule free of I/O lets it be tested exhaustively and shared by the proxy and the middleware.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::token::FencingToken;

/// What a guarded route does with a request that carries no token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    /// 428 Precondition Required (gRPC INVALID_ARGUMENT).
    Reject,
    /// Forward it unchecked, counted as `outcome="missing"`.
    Allow,
}

/// What the guard decided about one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `token == mark`: admit with no write. The fast path: one atomic load.
    Admit,
    /// `token > mark`: the token must be made durable, then published, then admitted.
    Advance {
        /// The mark seen when the check ran (0 if nothing was accepted yet).
        from: u64,
    },
    /// `token < mark`: reject; the mark is unchanged.
    Stale {
        /// The mark that made the token stale.
        mark: u64,
    },
}

/// The high-water mark of one resource: the highest token it has accepted.
///
/// 0 means nothing has been accepted yet (tokens are never 0).
#[derive(Debug, Default)]
pub struct Watermark(AtomicU64);

impl Watermark {
    /// A mark that starts at `initial` (loaded from a mark store).
    pub const fn new(initial: u64) -> Self {
        Self(AtomicU64::new(initial))
    }

    /// The current mark.
    pub fn get(&self) -> u64 {
        // Acquire pairs with the Release in `publish`: whoever sees the new mark also sees
        // everything the publisher did before it (the durable write it waited for).
        self.0.load(Ordering::Acquire)
    }

    /// Classifies `token` against the current mark.
    pub fn check(&self, token: FencingToken) -> Verdict {
        let mark = self.get();
        let t = token.get();
        match t.cmp(&mark) {
            std::cmp::Ordering::Equal => Verdict::Admit,
            std::cmp::Ordering::Greater => Verdict::Advance { from: mark },
            std::cmp::Ordering::Less => Verdict::Stale { mark },
        }
    }

    /// Raises the mark to `token` if it is higher, and returns the mark after the call.
    ///
    /// Call this only once `token` is durable. A mark never moves down: a lower publish (from a
    /// racing advance that lost) leaves the higher mark in place.
    pub fn publish(&self, token: FencingToken) -> u64 {
        // AcqRel: Release publishes the durable write to readers of `get`; Acquire orders this
        // advance after any higher one it observes.
        let prev = self.0.fetch_max(token.get(), Ordering::AcqRel);
        prev.max(token.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: u64) -> FencingToken {
        FencingToken::new(v).unwrap()
    }

    #[test]
    fn fresh_mark_advances_on_any_token() {
        let w = Watermark::default();
        assert_eq!(w.check(t(1)), Verdict::Advance { from: 0 });
        assert_eq!(w.get(), 0, "check never mutates");
    }

    #[test]
    fn equal_admits_lower_is_stale_higher_advances() {
        let w = Watermark::new(51);
        assert_eq!(w.check(t(51)), Verdict::Admit);
        assert_eq!(w.check(t(34)), Verdict::Stale { mark: 51 });
        assert_eq!(w.check(t(52)), Verdict::Advance { from: 51 });
        assert_eq!(w.get(), 51);
    }

    #[test]
    fn publish_never_lowers_the_mark() {
        let w = Watermark::new(10);
        assert_eq!(w.publish(t(20)), 20);
        assert_eq!(w.publish(t(15)), 20);
        assert_eq!(w.get(), 20);
        assert_eq!(w.check(t(15)), Verdict::Stale { mark: 20 });
    }
}
