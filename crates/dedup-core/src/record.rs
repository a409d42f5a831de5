//! What a store keeps for a key, and the requests and answers that move it.
//!
//! `Record` and its `State`; `FencingToken`; `Timestamp` (µs on the *store's* clock); `Policy`
//! (lease, attempts, retention, result limit); `ClaimRequest`, `Lease` and `ClaimOutcome`; and
//! `OwnerIds`, a holder's owner ids (`<prefix>#<n>`): `Dedup` and transaction mode both claim
//! under one.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::error::InputError;
use crate::key::{Fingerprint, IdempotencyKey};

/// A point in time on the **store's** clock, in microseconds since the Unix epoch.
///
/// Leases are measured on the store's clock (Postgres's `statement_timestamp()`), never on the
/// caller's, so clock skew between consumers cannot shorten or stretch a lease.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The wall clock of this process (used by in-process stores only).
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self(i64::try_from(since.as_micros()).unwrap_or(i64::MAX))
    }

    /// From microseconds since the Unix epoch.
    pub const fn from_micros(micros: i64) -> Self {
        Self(micros)
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> i64 {
        self.0
    }

    /// `self + d`, saturating.
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(micros(d)))
    }

    /// How long from `earlier` to `self`; zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

/// A duration in whole microseconds, saturating (the unit stores and the database use).
pub fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A fencing token: a number the store issues on every claim and takeover of a key.
///
/// Tokens come from one counter per store (a Postgres sequence), so they grow on every claim and
/// takeover and never repeat, not even after a record is purged and its key claimed afresh. Every
/// call that changes a claimed record carries its token and is refused where the token no longer
/// matches.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token.
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Who holds (or held) a lease: one id per claim attempt, so that a claim whose outcome is unknown
/// can be recognised as ours when it is read back.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OwnerId(Arc<str>);

impl OwnerId {
    /// Wraps an owner name.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The owner's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The owner ids one holder claims under: a prefix and a counter, `<prefix>#<n>` per claim.
#[derive(Debug)]
pub struct OwnerIds {
    prefix: Arc<str>,
    next: AtomicU64,
}

impl OwnerIds {
    /// A prefix unique to this holder: `pid<pid>-<now in µs, hex>-<n>`, `n` counting the
    /// holders made in this process. Without the count, two holders made within one microsecond
    /// (two `Dedup`s at start-up) would share their owner ids, and each would take the other's
    /// lease in flight for its own (a claim retried after a lost reply adopts its own owner id).
    pub fn for_process() -> Self {
        static MADE: AtomicU64 = AtomicU64::new(0);
        Self::with_prefix(format!(
            "pid{}-{:x}-{}",
            std::process::id(),
            Timestamp::now().as_micros(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Ids under `prefix` (an instance identity's, say).
    pub fn with_prefix(prefix: impl Into<Arc<str>>) -> Self {
        Self {
            prefix: prefix.into(),
            next: AtomicU64::new(0),
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The next claim's owner id.
    pub fn next(&self) -> OwnerId {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        OwnerId::new(format!("{}#{n}", self.prefix))
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({:?})", &*self.0)
    }
}

/// Where a key's record stands.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[non_exhaustive]
pub enum State {
    /// Claimed: a holder runs the effect under a lease.
    InProgress,
    /// A retryable failure released the key; the next delivery may claim it (attempts are kept).
    Released,
    /// Done: the stored result is replayed to every duplicate.
    Completed,
    /// Poison: failed permanently or ran out of attempts. Not retried.
    Failed,
}

impl State {
    /// The name stores persist.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Released => "released",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// Parses a persisted name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "in_progress" => Self::InProgress,
            "released" => Self::Released,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            _ => return None,
        })
    }

    /// Whether the state is final (COMPLETED or FAILED).
    pub const fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a store keeps for one key.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Record {
    /// The key.
    pub key: IdempotencyKey,
    /// Where it stands.
    pub state: State,
    /// The holder of the lease, or the last holder of a released or failed record. `None` for a
    /// completed record: nothing reads its owner once the effect is recorded (a record completed
    /// by a binary older than schema generation 11 may still carry one).
    pub owner: Option<OwnerId>,
    /// The token of the last claim or takeover.
    pub token: FencingToken,
    /// When the current lease ends (IN_PROGRESS only).
    pub lease_until: Option<Timestamp>,
    /// How many times the key was claimed (first claim included).
    pub attempts: u32,
    /// The payload's fingerprint, when the claimer gave one.
    pub fingerprint: Option<Fingerprint>,
    /// The stored result (COMPLETED only).
    pub result: Option<Bytes>,
    /// The last retryable error (RELEASED) or the reason (FAILED).
    pub failure: Option<String>,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
    /// When the record may be purged. A record past it is treated as absent.
    pub expires_at: Timestamp,
}

impl Record {
    /// A record with the given identity and times; owner, lease, fingerprint, result and failure
    /// start empty (set the public fields). For stores that read records from elsewhere.
    pub fn new(
        key: IdempotencyKey,
        state: State,
        token: FencingToken,
        attempts: u32,
        created_at: Timestamp,
        expires_at: Timestamp,
    ) -> Self {
        Self {
            key,
            state,
            owner: None,
            token,
            lease_until: None,
            attempts,
            fingerprint: None,
            result: None,
            failure: None,
            created_at,
            updated_at: created_at,
            expires_at,
        }
    }
}

/// How a key is held and kept. Carried by each claim and by the lease it grants.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Policy {
    /// How long a claim holds the key before another claimer may take it over. The consumer API
    /// extends it in the background while the handler runs.
    pub lease: Duration,
    /// How many claims a key may have in all; a retryable failure or an expired lease past it makes
    /// the key FAILED.
    pub max_attempts: u32,
    /// How long a COMPLETED record (or an abandoned one) is kept. A duplicate delivered after it
    /// runs again: that is the documented contract of any dedup window.
    pub retention: Duration,
    /// How long a FAILED record is kept.
    pub failed_retention: Duration,
    /// The largest result stored for replay.
    pub max_result_bytes: usize,
}

impl Default for Policy {
    /// A 30 s lease, 5 attempts, 7 days of retention (30 for failures), results up to 64 KiB.
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            max_attempts: 5,
            retention: Duration::from_secs(7 * 24 * 3600),
            failed_retention: Duration::from_secs(30 * 24 * 3600),
            max_result_bytes: 64 * 1024,
        }
    }
}

impl Policy {
    /// Sets the lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the attempt limit.
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// Sets the retention of completed records.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the retention of failed records.
    pub fn with_failed_retention(mut self, retention: Duration) -> Self {
        self.failed_retention = retention;
        self
    }

    /// Sets the result size limit.
    pub fn with_max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = max;
        self
    }

    /// Refuses a policy no store can honour.
    pub fn validate(&self) -> Result<(), InputError> {
        const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
        if self.lease < Duration::from_millis(1) {
            return Err(InputError::Policy("the lease must be at least 1 ms"));
        }
        if self.max_attempts == 0 {
            return Err(InputError::Policy("max_attempts must be at least 1"));
        }
        if self.lease > CENTURY || self.retention > CENTURY || self.failed_retention > CENTURY {
            return Err(InputError::Policy("durations must be under 100 years"));
        }
        if i32::try_from(self.max_attempts).is_err() {
            return Err(InputError::Policy("max_attempts must fit in 31 bits"));
        }
        Ok(())
    }

    /// Refuses a result larger than [`max_result_bytes`](Self::max_result_bytes).
    pub fn check_result(&self, result: &[u8]) -> Result<(), InputError> {
        if result.len() > self.max_result_bytes {
            return Err(InputError::ResultTooLarge {
                len: result.len(),
                max: self.max_result_bytes,
            });
        }
        Ok(())
    }
}

/// A request to claim a key.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The key.
    pub key: IdempotencyKey,
    /// The payload's fingerprint; `None` skips the payload check.
    pub fingerprint: Option<Fingerprint>,
    /// Who claims. Use one id per claim attempt (the consumer API does).
    pub owner: OwnerId,
    /// Lease, attempts and retention.
    pub policy: Policy,
}

impl ClaimRequest {
    /// A claim with the default policy and no fingerprint.
    pub fn new(key: IdempotencyKey, owner: OwnerId) -> Self {
        Self {
            key,
            fingerprint: None,
            owner,
            policy: Policy::default(),
        }
    }

    /// Sets the payload fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Sets the policy.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }
}

/// A granted claim: the right to run the key's effect while the token holds.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Lease {
    /// The key.
    pub key: IdempotencyKey,
    /// The fencing token every later call must carry.
    pub token: FencingToken,
    /// The holder.
    pub owner: OwnerId,
    /// When the lease ends unless extended (store clock).
    pub lease_until: Timestamp,
    /// Which attempt this is (1 for a first claim).
    pub attempts: u32,
    /// The fingerprint the record holds (caches copy it, so they refuse a reused key as the
    /// store would).
    pub fingerprint: Option<Fingerprint>,
    /// The policy the key was claimed with.
    pub policy: Policy,
}

impl Lease {
    /// The lease an IN_PROGRESS `record` stands for (with the default policy: the record does not
    /// keep the one it was claimed with), or `None` for a record in another state.
    pub fn of_record(record: &Record) -> Option<Self> {
        if record.state != State::InProgress {
            return None;
        }
        Some(Self {
            key: record.key.clone(),
            token: record.token,
            owner: record.owner.clone()?,
            lease_until: record.lease_until?,
            attempts: record.attempts,
            fingerprint: record.fingerprint,
            policy: Policy::default(),
        })
    }

    /// The lease that `record` (IN_PROGRESS, just written by `req`'s claim) grants.
    pub fn granted(record: &Record, req: &ClaimRequest) -> Self {
        Self {
            key: record.key.clone(),
            token: record.token,
            owner: req.owner.clone(),
            lease_until: record.lease_until.unwrap_or(record.updated_at),
            attempts: record.attempts,
            fingerprint: record.fingerprint,
            policy: req.policy,
        }
    }
}

/// What a claim answers.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The caller owns the key: run the effect, then complete or fail with this lease.
    Acquired(Lease),
    /// The key was done before: replay this result, do not run the effect.
    Completed {
        /// The stored result.
        result: Bytes,
        /// The token that completed it.
        token: FencingToken,
        /// The fingerprint the record holds (so a cache can copy it exactly).
        fingerprint: Option<Fingerprint>,
    },
    /// Someone holds a live lease. Back off, or wait for it to finish.
    InFlight {
        /// The holder, where the store knows it (a transactional claim blocked by an uncommitted
        /// one does not).
        owner: Option<OwnerId>,
        /// When that lease ends, where known.
        lease_until: Option<Timestamp>,
    },
    /// The key is poison (failed permanently or out of attempts). Do not retry; dead-letter it.
    Failed {
        /// Why.
        reason: String,
        /// How many attempts were made.
        attempts: u32,
    },
    /// The key was used before with a different payload: a producer bug or a key collision.
    PayloadMismatch,
}

/// Where a retryable failure left the key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum AfterFailure {
    /// Released: the next delivery may claim it.
    Released {
        /// Attempts made so far.
        attempts: u32,
    },
    /// Out of attempts: FAILED.
    Failed {
        /// Attempts made in all.
        attempts: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::OwnerIds;

    /// Holders made back to back (within one microsecond, as two `Dedup`s at start-up are) never
    /// share owner ids.
    #[test]
    fn holders_made_at_once_have_owner_ids_of_their_own() {
        let (a, b) = (OwnerIds::for_process(), OwnerIds::for_process());
        assert_ne!(a.prefix(), b.prefix());
        assert_ne!(a.next(), b.next());
    }
}
