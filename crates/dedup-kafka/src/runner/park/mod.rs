//! Parking (per-key ordered retries) for the per-message [`Runner`](super::Runner): a message
//! that keeps failing retryably is written to a parked queue in Postgres and its partition moves
//! on; later messages of its ordering key are parked behind it without running; the partition's
//! owner re-runs each key's head with backoff through the same claim, then the next, and the key
//! is free when its queue is empty. docs/PARKING.md has the semantics and the invariants.
//!
//! The loop keeps, per owned partition, how many messages each parked key has (loaded in one
//! query when the partition is assigned, the sync barrier; messages of the partition received
//! before it wait), and keeps it true: a message parked behind a key counts when the loop decides
//! to park it, a head that parked itself counts when it reports, and a head removed after its
//! re-run uncounts. Every write names the partition's epoch, so a revoked instance can neither
//! park into a partition nor drive its keys.
//!
//! Here: `Parking` (`Runner::with_parking`, feature `pg`), `AfterGiveUp`, the `ParkStore` trait
//! the loop calls (so the loop needs no feature; `pg.rs` implements it on `PgStore`), and the
//! loop's state (`Parks`: per owned partition its generation, epoch, parked keys with counts, and
//! the messages waiting for the barrier or for room). The loop's side is `drive.rs` (barriers,
//! admission, parking behind a key) and `heads.rs` (its tick, due heads), a task's side `run.rs`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use dedup_core::{Store, StoreError};

use super::{Handler, Job};
use crate::config::Backoff;
use crate::delivery::Delivery;

mod drive;
mod heads;
mod pg;
mod run;
pub(crate) mod store;

/// What happens to a key's later messages once its head was dead-lettered (its attempts spent,
/// or a permanent failure).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub enum AfterGiveUp {
    /// The next message of the key becomes its head and runs (the default): a key's one bad
    /// message goes to the dead-letter topic with the reason, as a message that fails in place
    /// does, and the key's other messages are not held hostage by it.
    #[default]
    Proceed,
    /// The key's other messages stay parked until an operator releases them (`dedup unpark KEY`)
    /// or dead-letters them (`dedup drop KEY`): for flows where a later message must never run
    /// without an earlier one.
    Hold,
}

/// Parking settings (the consumer builder's `parking`).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Parking {
    /// Runs in place (the first included) before a failing message is parked (default 3).
    /// In-place and parked runs share one attempt budget: the key's dedup record counts every
    /// run, and the policy's `max_attempts` ends them (then the head is dead-lettered), so this
    /// must be below it.
    pub in_place_attempts: u32,
    /// Waits between a parked head's runs: exponential, capped, each drawn between half and all
    /// of it (jitter). Default 1 s doubling to 5 min.
    pub backoff: Backoff,
    /// What a key's later messages do once its head is dead-lettered.
    pub after_give_up: AfterGiveUp,
    /// Messages parked under one key at most (default 10,000); see [`max_parked`](Self::max_parked).
    pub max_per_key: u64,
    /// Messages parked at most over this runner's partitions (default 100,000). At either bound
    /// a message that would be parked is not: a failing one keeps retrying in place (its
    /// partition's commit position waits, as without parking), and one that would join a parked
    /// key waits in memory with its partition paused until the key's queue shrinks. Each time
    /// counts in `RunnerStats::park_full`.
    pub max_parked: u64,
    /// How often the owner looks for due heads (default 250 ms).
    pub poll: Duration,
    /// How long one run of a head may take before another look may pick it again (default 60 s;
    /// the claim still keeps a second run from doubling the effect).
    pub run_bound: Duration,
}

impl Default for Parking {
    fn default() -> Self {
        Self {
            in_place_attempts: 3,
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            after_give_up: AfterGiveUp::default(),
            max_per_key: 10_000,
            max_parked: 100_000,
            poll: Duration::from_millis(250),
            run_bound: Duration::from_secs(60),
        }
    }
}

impl Parking {
    /// Sets the in-place runs before parking.
    #[must_use]
    pub fn with_in_place_attempts(mut self, n: u32) -> Self {
        self.in_place_attempts = n;
        self
    }

    /// Sets the parked runs' backoff.
    #[must_use]
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets what a key's later messages do after its head is dead-lettered.
    #[must_use]
    pub fn with_after_give_up(mut self, after: AfterGiveUp) -> Self {
        self.after_give_up = after;
        self
    }

    /// Sets the bounds: per key, and over the runner's partitions.
    #[must_use]
    pub fn with_bounds(mut self, max_per_key: u64, max_parked: u64) -> Self {
        self.max_per_key = max_per_key;
        self.max_parked = max_parked;
        self
    }

    /// Sets how often due heads are looked for.
    #[must_use]
    pub fn with_poll(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// Sets how long one run of a head may take before another look may pick it again.
    #[must_use]
    pub fn with_run_bound(mut self, bound: Duration) -> Self {
        self.run_bound = bound;
        self
    }

    /// Checks the times (the bounds and `in_place_attempts` are checked against the runner's
    /// policy when the consumer is built): a wait or a bound that
    /// Postgres or the clock cannot hold would fail every parked run of a head, forever.
    ///
    /// # Errors
    /// A [`ConfigError`](crate::ConfigError) naming the setting.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        let check = |setting: &'static str, value: Duration, what: &str| {
            if value.is_zero() || value > MAX_PARKING_WAIT {
                return Err(crate::ConfigError::new(
                    setting,
                    format!("{what} must be above zero and at most 30 days (got {value:?})"),
                ));
            }
            Ok(())
        };
        check("parking.poll", self.poll, "the poll")?;
        check("parking.run_bound", self.run_bound, "the run bound")?;
        check(
            "parking.backoff.initial",
            self.backoff.initial,
            "the first wait",
        )?;
        check("parking.backoff.max", self.backoff.max, "the longest wait")?;
        if self.backoff.max < self.backoff.initial {
            return Err(crate::ConfigError::new(
                "parking.backoff.max",
                "the longest wait must not be below the first",
            ));
        }
        Ok(())
    }

    /// The wait before a head's parked run number `n` (1-based), jittered by `seed`.
    pub(crate) fn delay(&self, n: u32, seed: u64) -> Duration {
        let full = self.backoff.delay(n.max(1));
        // Between half and all of it: a cheap mix of the seed, no random source needed.
        let mixed = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(17)
            .wrapping_mul(0xBF58_476D_1CE4_E5B9);
        #[allow(clippy::cast_precision_loss)]
        let share = 0.5 + (mixed >> 11) as f64 / (1u64 << 53) as f64 / 2.0;
        full.mul_f64(share)
    }
}

/// The longest wait or run bound parking accepts.
const MAX_PARKING_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// A partition's epoch and its parked keys with their message counts (the sync barrier).
pub(crate) type Barrier = (i64, HashMap<Option<Vec<u8>>, u64>);

/// A future the parked-queue store answers.
pub(crate) type StoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A partition of a group, as the parked queue knows it.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PartRef {
    pub(crate) group: String,
    pub(crate) topic: String,
    pub(crate) partition: i32,
}

/// What a park did.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum Parked {
    Written,
    Already,
    Fenced,
    /// Postgres refuses the message's data for good (SQLSTATE class 22, or 54000): no retry
    /// can write it.
    Refused(String),
}

/// What settling a head did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum HeadOutcome {
    Removed,
    /// Kept as the key's held marker (the hold policy).
    Held,
    Gone,
    Fenced,
}

/// What one run of a parked head came to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct HeadRun {
    /// Its row went: the key counts one message fewer.
    pub(crate) removed: bool,
}

impl HeadRun {
    pub(crate) const REMOVED: Self = Self { removed: true };
    pub(crate) const KEPT: Self = Self { removed: false };
}

/// What taking a head did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Taken {
    /// Taken: run it.
    Run,
    Gone,
    Fenced,
}

/// A head to re-run.
#[derive(Clone, Debug)]
pub(crate) struct Head {
    pub(crate) delivery: Delivery,
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) error: String,
    pub(crate) attempts: u32,
    pub(crate) dropped: bool,
    pub(crate) gave_up: bool,
}

/// The parked queue (Postgres, `dedup_pg`): a trait so that the loop does not depend on the
/// `pg` feature.
pub(crate) trait ParkStore: Send + Sync + 'static {
    /// `None`: `owned` said no right before the bump.
    fn acquire<'a>(
        &'a self,
        part: &'a PartRef,
        owner: &'a str,
        owned: &'a (dyn Fn() -> bool + Send + Sync),
    ) -> StoreFuture<'a, Option<Barrier>>;
    #[allow(clippy::too_many_arguments)]
    fn park<'a>(
        &'a self,
        part: &'a PartRef,
        epoch: i64,
        delivery: &'a Delivery,
        key: Option<Vec<u8>>,
        dedup_key: Option<(String, Vec<u8>)>,
        error: &'a str,
        attempts: u32,
        due_in: Duration,
        marker: bool,
    ) -> StoreFuture<'a, Parked>;
    fn due_heads<'a>(
        &'a self,
        group: &'a str,
        parts: &'a [(String, i32)],
        limit: u32,
    ) -> StoreFuture<'a, Vec<Head>>;
    fn take<'a>(
        &'a self,
        part: &'a PartRef,
        epoch: i64,
        offset: i64,
        bound: Duration,
    ) -> StoreFuture<'a, Taken>;
    fn settle<'a>(
        &'a self,
        part: &'a PartRef,
        epoch: i64,
        offset: i64,
        hold_rest: bool,
    ) -> StoreFuture<'a, HeadOutcome>;
    #[allow(clippy::too_many_arguments)]
    fn defer<'a>(
        &'a self,
        part: &'a PartRef,
        epoch: i64,
        offset: i64,
        error: &'a str,
        attempts: u32,
        due_in: Duration,
    ) -> StoreFuture<'a, bool>;
    fn gauges<'a>(
        &'a self,
        group: &'a str,
        parts: &'a [(String, i32)],
    ) -> StoreFuture<'a, (u64, u64, Duration)>;
}

/// Parking as a runner holds it.
pub(crate) struct ParkCtx {
    pub(crate) store: Arc<dyn ParkStore>,
    pub(crate) cfg: Parking,
    /// Who takes partitions over (the engine's owner prefix).
    pub(crate) owner: String,
    pub(crate) group: String,
    /// Messages parked over the owned partitions, as the loop counts them (read by message tasks
    /// deciding whether they may park).
    pub(crate) total: AtomicU64,
}

impl std::fmt::Debug for ParkCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkCtx")
            .field("cfg", &self.cfg)
            .field("owner", &self.owner)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// One owned partition's parked keys.
#[derive(Debug, Default)]
pub(crate) struct PartParks {
    generation: u64,
    /// Known once the sync barrier answered.
    epoch: Option<i64>,
    keys: HashMap<Option<Vec<u8>>, u64>,
    /// Messages received before the barrier answered, or waiting for room under the bounds.
    waiting: Vec<Job>,
    syncing: bool,
    /// The epoch moved on while the partition is ours: the barrier must run again (under a new
    /// epoch) before the messages waiting are let in.
    stale: bool,
    /// Paused because a message waits for room.
    paused: bool,
}

/// The loop's parking state.
#[derive(Debug, Default)]
pub(crate) struct Parks {
    parts: HashMap<(String, i32), PartParks>,
    /// Keys whose head runs now: (topic, partition, generation, key).
    driving: HashSet<(String, i32, u64, Option<Vec<u8>>)>,
    heads_running: bool,
    ticks: u64,
}

impl Parks {
    fn total(&self) -> u64 {
        self.parts.values().flat_map(|p| p.keys.values()).sum()
    }
}

/// What the parking tasks tell the loop.
#[derive(Debug)]
pub(crate) enum ParkEvent {
    /// A partition's sync barrier answered.
    Synced {
        tp: (String, i32),
        generation: u64,
        result: Result<Option<Barrier>, StoreError>,
    },
    /// The due heads.
    Heads(Result<Vec<Head>, StoreError>),
    /// A head's run ended.
    HeadDone {
        tp: (String, i32),
        generation: u64,
        /// The epoch the run was started under.
        epoch: i64,
        key: Option<Vec<u8>>,
        run: HeadRun,
    },
    /// Parked keys, messages, oldest.
    Gauges((u64, u64, Duration)),
    /// A lane's partition's parked keys are to be read again (a message task panicked after
    /// its key may have been counted).
    Resync(super::Lane),
}

impl<S, H> super::Runner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// Parks messages that keep failing (see [`Parking`]) in `store`'s parked queue
    /// (`dedup_parked`, scoped by the consumer group), so that their partition moves on while
    /// their key's later messages wait behind them. Needs [`Ordering::PerKey`](crate::Ordering)
    /// (under partition order every later message of the partition would wait behind the parked
    /// one) and `in_place_attempts` from 1 to below the policy's `max_attempts` (the runs share one
    /// budget); otherwise a [`ConfigError`](crate::ConfigError) naming the setting.
    pub(crate) fn with_parking(
        mut self,
        store: dedup_pg::PgStore,
        parking: Parking,
    ) -> Result<Self, crate::ConfigError> {
        if self.config.ordering != crate::Ordering::PerKey {
            return Err(crate::ConfigError::new(
                "ordering",
                "parking needs Ordering::PerKey",
            ));
        }
        let max = self.dedup.policy().max_attempts;
        if parking.in_place_attempts == 0 || parking.in_place_attempts >= max {
            return Err(crate::ConfigError::new(
                "parking.in_place_attempts",
                "must be at least 1 and below the policy's max_attempts (the runs share one budget)",
            ));
        }
        parking.validate()?;
        if parking.max_per_key == 0 || parking.max_parked == 0 {
            return Err(crate::ConfigError::new(
                "parking.max_parked",
                "the bounds must be at least 1",
            ));
        }
        if self.refused.is_none() {
            self.refused = Some(Arc::new(store.clone()));
        }
        self.park = Some(Arc::new(ParkCtx {
            store: Arc::new(store),
            cfg: parking,
            owner: self.dedup.owner_prefix().to_owned(),
            group: self.config.group_id.clone(),
            total: AtomicU64::new(0),
        }));
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parking setting that would fail or panic on every parked run is refused when it is
    /// set, naming the setting.
    #[test]
    fn parking_times_are_checked_and_named() {
        assert!(Parking::default().validate().is_ok());
        let bad = [
            (
                Parking::default().with_backoff(Backoff::new(Duration::ZERO, Duration::ZERO)),
                "parking.backoff.initial",
            ),
            (
                Parking::default()
                    .with_backoff(Backoff::new(Duration::from_secs(1), Duration::MAX)),
                "parking.backoff.max",
            ),
            (
                Parking::default().with_run_bound(Duration::MAX),
                "parking.run_bound",
            ),
            (
                Parking::default().with_run_bound(Duration::ZERO),
                "parking.run_bound",
            ),
            (Parking::default().with_poll(Duration::ZERO), "parking.poll"),
        ];
        for (parking, setting) in bad {
            let Err(err) = parking.validate() else {
                panic!("{setting} was accepted");
            };
            assert_eq!(err.setting, setting, "{err}");
        }
        // The longest accepted wait draws a delay without overflowing.
        let p =
            Parking::default().with_backoff(Backoff::new(Duration::from_secs(1), MAX_PARKING_WAIT));
        assert!(p.validate().is_ok());
        assert!(p.delay(u32::MAX, u64::MAX) <= MAX_PARKING_WAIT);
    }
}
