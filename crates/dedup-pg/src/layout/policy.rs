//! How the ranges of the partitioned table are kept ([`RangePolicy`]) and what a round of
//! [`maintain_ranges`](super::maintain_ranges)(super::maintain_ranges) did ([`RangeReport`]).

use std::time::Duration;

/// The most days ahead ranges are made (each range ahead is one more partition for every
/// statement to set up).
pub(super) const MOST_AHEAD: Duration = Duration::from_secs(31 * 86_400);

/// How the ranges of the partitioned table are kept ([`maintain_ranges`](super::maintain_ranges)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangePolicy {
    /// Days per range. Longer ranges mean fewer partitions (each costs every statement a little
    /// planning and executor set-up), shorter ones give the disk back sooner.
    pub days: u32,
    /// How far ahead of now the ranges are made: new keys land in `future` (and are moved, under
    /// the lock, when their range is made) only once maintenance has not run for this long.
    pub ahead: Duration,
    /// How long after a range's last day it is dropped: at least the longest retention of any
    /// policy, plus the longest a key's first delivery may lag its time. A record still live at
    /// the drop is moved, not lost, so a short `keep` costs moves, never correctness.
    pub keep: Duration,
    /// The most records one change may move under the lock; a range that would take a drop
    /// past it goes in a drop of its own, and a change that alone would move more is held back
    /// (and reported) instead of holding every claim that long.
    pub max_move: u64,
    /// The most heap pages of the ranges one drop may read under the lock to find what is still
    /// live in them (through each one's BRIN index on `expires_at`, whose summaries cover 128
    /// pages each): a range that would take a drop past it goes in a drop of its own, and one
    /// that alone would read more (live records spread through it) is held back (and reported)
    /// until they expire. 8 kB each: 16,384 by default, 128 MB, about 0.1 s from
    /// memory.
    pub max_read_pages: u64,
    /// How long after a range's last day it may be frozen, once (`VACUUM (FREEZE)`, one range a
    /// round, and only once half its `autovacuum_freeze_max_age` has passed: `freeze.rs`);
    /// None never.
    pub freeze_after: Option<Duration>,
}

impl Default for RangePolicy {
    /// Weeks, made 3 days ahead, dropped 8 days after their end (a 7-day retention and a day of
    /// lag), frozen from a day after it if they near their anti-wraparound vacuum, up to
    /// 100,000 records moved and 16,384 pages read under the lock.
    fn default() -> Self {
        Self {
            days: 7,
            ahead: Duration::from_secs(3 * 86_400),
            keep: Duration::from_secs(8 * 86_400),
            max_move: 100_000,
            max_read_pages: 16_384,
            freeze_after: Some(Duration::from_secs(86_400)),
        }
    }
}

impl RangePolicy {
    /// Sets the days per range (1 to 366).
    pub fn with_days(mut self, days: u32) -> Self {
        self.days = days.clamp(1, 366);
        self
    }

    /// Sets how far ahead of now ranges are made (at most 31 days).
    pub fn with_ahead(mut self, ahead: Duration) -> Self {
        self.ahead = ahead.min(MOST_AHEAD);
        self
    }

    /// Sets how long after its last day a range is dropped.
    pub fn with_keep(mut self, keep: Duration) -> Self {
        self.keep = keep;
        self
    }

    /// Sets the most records one change may move under the lock.
    pub fn with_max_move(mut self, max_move: u64) -> Self {
        self.max_move = max_move;
        self
    }

    /// Sets the most heap pages of the ranges one drop may read under the lock.
    pub fn with_max_read_pages(mut self, pages: u64) -> Self {
        self.max_read_pages = pages;
        self
    }

    /// Sets how long after its last day a range is frozen (None: never).
    pub fn with_freeze_after(mut self, after: Option<Duration>) -> Self {
        self.freeze_after = after;
        self
    }
}

/// What [`maintain_ranges`](super::maintain_ranges) did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangeReport {
    /// Whether `dedup_records` is partitioned by the key's time (if not, nothing was done).
    pub partitioned: bool,
    /// Ranges made, by name.
    pub made: Vec<String>,
    /// Ranges dropped, by name.
    pub dropped: Vec<String>,
    /// Ranges frozen, by name (at most one a call).
    pub frozen: Vec<String>,
    /// Records moved under the lock (out of `future` into a range made, or out of a range
    /// dropped into `late`).
    pub moved: u64,
    /// Days from now to the first day without a range of its own (`future`'s first day): under
    /// a day, new keys are about to land in `future`.
    pub margin_days: Option<i64>,
    /// Why a change, or the freeze of a cold range, was held back this round, if one was (every
    /// reason, in the order met, joined by `; `).
    pub held_back: Option<String>,
    /// The days the ranges cover, `[first, end)` in days since the Unix epoch: the bounded
    /// DELETE leaves them alone, a change held back or not (a range goes whole; until it goes,
    /// its expired records count as absent and only take disk). None where the table is not
    /// partitioned by the key's time.
    pub ranged_days: Option<(i32, i32)>,
}
