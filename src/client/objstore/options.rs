//! Timing and naming of an object-store election, validated once.

use std::time::Duration;

use super::error::Error;

/// How an [`Elector`](super::Elector) names its records and paces its requests.
///
/// All durations are measured on each process's own monotonic clock; no two clocks are ever
/// compared. With `ttl = T` (default 10 s):
///
/// - a **follower** takes the record over only after it has seen the same version (ETag)
///   unchanged for `T` since the *answer* to the read that first showed it (the write that
///   made that version started before that answer), confirmed by `If-Match` on that version;
/// - a **leader** renews every `renew_every` (default `T/3`) and stops acting (its
///   [`LossSignal`](super::LossSignal) fires) at `T - margin` after the *start* of its last
///   successful write (default margin `T/10`). Between the two, `margin` plus the time the
///   follower's first read took is the slack that absorbs a difference in clock *rates*
///   (not offsets) between the machines and the time the leader's work needs to notice the
///   signal. A 10 % margin tolerates rates apart by far more than NTP-disciplined clocks are;
/// - followers read every `poll_every` (default `T/4`), so a takeover comes at most
///   `T + poll_every` plus two round trips after the leader's last write landed;
/// - every store request gives up after `request_timeout` (default `T/4`; a leader's
///   renewal also never waits past its deadline). Set the store client's own timeouts and
///   retries below it too (object_store's S3 client retries for minutes by default).
///
/// Rules (checked by [`Elector::new`](super::Elector::new), [`Error::InvalidOptions`]):
/// `ttl >= 100 ms`; `0 < margin < ttl`; `0 < renew_every` and `renew_every +
/// request_timeout <= ttl - margin` (one renewal can fail or time out and another still
/// fits); `0 < poll_every <= ttl`; `request_timeout > 0`.
#[derive(Debug, Clone)]
pub struct ElectorOptions {
    pub(super) prefix: String,
    pub(super) holder: String,
    pub(super) ttl: Duration,
    pub(super) renew_every: Option<Duration>,
    pub(super) poll_every: Option<Duration>,
    pub(super) margin: Option<Duration>,
    pub(super) request_timeout: Option<Duration>,
}

impl Default for ElectorOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl ElectorOptions {
    /// Records under `palisade/elections/`, holder `pid-<pid>`, `ttl` 10 s, the rest derived
    /// from the TTL as described above.
    pub fn new() -> Self {
        Self {
            prefix: "palisade/elections".to_owned(),
            holder: format!("pid-{}", std::process::id()),
            ttl: Duration::from_secs(10),
            renew_every: None,
            poll_every: None,
            margin: None,
            request_timeout: None,
        }
    }

    /// The folder (object key prefix) of the records: election `NAME` lives at
    /// `PREFIX/NAME`. Every candidate of an election must use the same.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// What the record says about its leader (a host name, an address): shown to observers
    /// by [`Elector::current`](super::Elector::current), never used for decisions.
    pub fn with_holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = holder.into();
        self
    }

    /// The lease's duration; the other durations default to fractions of it.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often a leader rewrites its record (default TTL/3).
    pub fn with_renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// How often a follower reads the record (default TTL/4).
    pub fn with_poll_every(mut self, every: Duration) -> Self {
        self.poll_every = Some(every);
        self
    }

    /// How long before its TTL a leader stops acting (default TTL/10).
    pub fn with_margin(mut self, margin: Duration) -> Self {
        self.margin = Some(margin);
        self
    }

    /// The longest any one store request may take (default TTL/4).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    pub(super) fn validate(&self) -> Result<Timing, Error> {
        let ttl = self.ttl;
        let t = Timing {
            ttl,
            renew_every: self.renew_every.unwrap_or(ttl / 3),
            poll_every: self.poll_every.unwrap_or(ttl / 4),
            margin: self.margin.unwrap_or(ttl / 10),
            request_timeout: self.request_timeout.unwrap_or(ttl / 4),
        };
        let zero = Duration::ZERO;
        let check = |ok: bool, why: &'static str| {
            if ok {
                Ok(())
            } else {
                Err(Error::InvalidOptions(why))
            }
        };
        check(
            ttl >= Duration::from_millis(100),
            "ttl must be at least 100 ms",
        )?;
        check(
            t.margin > zero && t.margin < ttl,
            "margin must be above zero and below ttl",
        )?;
        check(t.renew_every > zero, "renew_every must be above zero")?;
        check(
            t.request_timeout > zero,
            "request_timeout must be above zero",
        )?;
        check(
            t.renew_every + t.request_timeout <= ttl - t.margin,
            "renew_every + request_timeout must not exceed ttl - margin",
        )?;
        check(
            t.poll_every > zero && t.poll_every <= ttl,
            "poll_every must be above zero and at most ttl",
        )?;
        check(!self.prefix.is_empty(), "prefix must not be empty")?;
        object_store::path::Path::parse(&self.prefix)
            .map_err(|_| Error::InvalidOptions("prefix must be a valid object path"))?;
        Ok(t)
    }
}

/// The validated durations.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub(super) ttl: Duration,
    pub(super) renew_every: Duration,
    pub(super) poll_every: Duration,
    pub(super) margin: Duration,
    pub(super) request_timeout: Duration,
}

impl Timing {
    /// How long a leader may act after the start of a successful write.
    pub(super) fn acting(&self) -> Duration {
        self.ttl - self.margin
    }
}
