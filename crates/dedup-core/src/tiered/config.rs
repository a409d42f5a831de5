//! The tiers' settings and counters.
//!
//! `L1Policy` (LRU by default; TinyLFU suits a small L1 on a skewed stream, docs/PERFORMANCE.md)
//! and `TieredConfig`. `TierStats`, from `TieredStore::stats`, counts hits and misses per tier, L2
//! errors and timeouts, backfills (and refused ones), and the calls that reached the authority.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The L1 eviction policy. Both admit every key whose entry weighs up to 64 KiB (a heavier one
/// may not be held, see `tiered/l1.rs`). L1 (`quick_cache`'s CLOCK-Pro) keeps a share of its
/// capacity for entries read since they came in ("hot") and holds new entries in the rest, first
/// in, first out; a read there moves an entry to the hot share. See docs/PERFORMANCE.md
/// (`l1_policy`) for the measurements behind the default.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum L1Policy {
    /// Frequency first: 97% of L1 for entries read again, so a new key that is not read soon
    /// leaves early. Suits a small L1 on a skewed stream (a few keys repeated often); a replay of
    /// keys seen long before (a rebalance) mostly misses.
    TinyLfu,
    /// Recency first (the default): 95% of L1 holds entries in the order they came, read or not,
    /// so a replay of the last keys seen (up to about 85% of the capacity back) hits.
    Lru,
}

/// How the tiered store is sized and how long it waits for the fast path.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct TieredConfig {
    /// The most entries L1 holds.
    pub l1_max_entries: u64,
    /// The most bytes L1 holds (results and reasons included).
    pub l1_max_bytes: u64,
    /// The longest an L1 entry lives (never longer than the record's retention).
    pub l1_ttl: Duration,
    /// L1's eviction policy.
    pub l1_policy: L1Policy,
    /// How long a fast-path call may take before it counts as a miss.
    pub l2_timeout: Duration,
    /// Below this share of their keys answered by the fast path (after 1,024 keys looked up),
    /// batch claims stop asking it and go straight to the authority, but for one batch in 16
    /// that keeps the share current; a probe of at least 32 keys that meets the share (a replay)
    /// makes every batch ask again at once. 0 always asks; NaN counts as 0, more than 1 as 1.
    /// Single claims always ask.
    pub l2_batch_min_hit_rate: f64,
}

impl Default for TieredConfig {
    /// 100,000 entries or 64 MiB, 10 minutes, LRU, a 50 ms fast-path timeout; batch claims
    /// skip a fast path that answers less than 5% of their keys.
    fn default() -> Self {
        Self {
            l1_max_entries: 100_000,
            l1_max_bytes: 64 << 20,
            l1_ttl: Duration::from_secs(600),
            l1_policy: L1Policy::Lru,
            l2_timeout: Duration::from_millis(50),
            l2_batch_min_hit_rate: 0.05,
        }
    }
}

impl TieredConfig {
    /// Sets the L1 bounds.
    pub fn with_l1_capacity(mut self, max_entries: u64, max_bytes: u64) -> Self {
        self.l1_max_entries = max_entries.max(1);
        self.l1_max_bytes = max_bytes.max(1);
        self
    }

    /// Sets the L1 eviction policy.
    pub fn with_l1_policy(mut self, policy: L1Policy) -> Self {
        self.l1_policy = policy;
        self
    }

    /// Sets the L1 entry lifetime.
    pub fn with_l1_ttl(mut self, ttl: Duration) -> Self {
        self.l1_ttl = ttl;
        self
    }

    /// Sets the fast-path timeout.
    pub fn with_l2_timeout(mut self, t: Duration) -> Self {
        self.l2_timeout = t;
        self
    }

    /// Sets the share of their keys the fast path must answer for batch claims to keep asking
    /// it (clamped to 0..=1; 0 always asks).
    pub fn with_l2_batch_min_hit_rate(mut self, share: f64) -> Self {
        self.l2_batch_min_hit_rate = if share.is_nan() {
            0.0
        } else {
            share.clamp(0.0, 1.0)
        };
        self
    }
}

/// Counters per tier, read with [`TieredStore::stats`](crate::TieredStore::stats).
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct TierStats {
    /// Claims answered by L1.
    pub l1_hits: u64,
    /// Claims L1 could not answer.
    pub l1_misses: u64,
    /// Claims answered by the fast path.
    pub l2_hits: u64,
    /// Claims the fast path could not answer (nothing held, or nothing it may answer).
    pub l2_misses: u64,
    /// Fast-path calls that failed (errors, corrupt data).
    pub l2_errors: u64,
    /// Fast-path calls that timed out.
    pub l2_timeouts: u64,
    /// Claims of batches sent to the authority without asking the fast path, because it was
    /// answering too few batch keys (`TieredConfig::l2_batch_min_hit_rate`).
    pub l2_bypassed: u64,
    /// Copies written to the fast path after the authority had the outcome.
    pub backfills: u64,
    /// Copies the fast path refused (it held a newer token).
    pub backfills_refused: u64,
    /// Copies not known to be written: dropped because the background writer's queue was full,
    /// in a write that timed out, or answered with an error. `backfills + backfills_refused +
    /// backfills_failed` is every copy tried.
    pub backfills_failed: u64,
    /// Claims that reached the authority.
    pub authority_claims: u64,
    /// All calls that reached the authority (claims, completions, failures, heartbeats, reads).
    pub authority_calls: u64,
}

#[derive(Default, Debug)]
pub(super) struct Counters {
    pub(super) l1_hits: AtomicU64,
    pub(super) l1_misses: AtomicU64,
    pub(super) l2_hits: AtomicU64,
    pub(super) l2_misses: AtomicU64,
    pub(super) l2_errors: AtomicU64,
    pub(super) l2_timeouts: AtomicU64,
    pub(super) l2_bypassed: AtomicU64,
    pub(super) backfills: AtomicU64,
    pub(super) backfills_refused: AtomicU64,
    pub(super) backfills_failed: AtomicU64,
    pub(super) authority_claims: AtomicU64,
    pub(super) authority_calls: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
