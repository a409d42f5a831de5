//! Whether a batch claim asks the fast path (`L2Gate`).
//!
//! A batch claim's fast-path lookup pays for itself only when it answers keys: a batch it answers
//! whole never reaches the authority, one it answers in part sends the authority fewer keys. On a
//! stream of mostly new keys, where L1 already catches this instance's own duplicates, it answers
//! almost none, and every batch pays a Redis round trip (on the test machine ~0.9 ms of a
//! 6.5 ms batch) and Redis's work for each key for nothing. The gate watches the share of the
//! keys batch lookups answered (counts halved as they grow, so recent batches weigh most) and,
//! while it is below [`TieredConfig::l2_batch_min_hit_rate`](super::TieredConfig), sends batch
//! claims straight to the authority, except one batch in [`PROBE_EVERY`], which asks as before
//! and keeps the share current. A lookup of at least 32 keys that finds the share met while the
//! counts say it is not (a replay of keys another instance completed, after a rebalance)
//! restarts the count, so the gate opens at once; smaller ones only add to the counts.
//!
//! Skipping the fast path is always correct: the authority answers every claim; the fast path
//! only spares it work. Single claims (`Store::claim`) always ask. The lookups before a batch
//! transaction or a request's transaction (`BatchCache::settled_many`) go through the same gate.

use std::sync::{Mutex, PoisonError};

/// Keys looked up before the gate may close: a fresh store asks.
const WARMUP: u64 = 1_024;
/// The fewest keys of one lookup that may restart the counts on their own.
const SAMPLE: u64 = 32;
/// Counts are halved past this many keys.
const WINDOW: u64 = 8_192;
/// While closed, one batch in this many still asks.
pub(super) const PROBE_EVERY: u32 = 16;

#[derive(Debug, Default)]
struct Counts {
    asked: u64,
    answered: u64,
    skipped: u32,
}

/// The share of batch-looked-up keys the fast path answered, and the decision made from it.
#[derive(Debug)]
pub(super) struct L2Gate {
    /// Below this share the gate closes; 0 keeps it open.
    min_hit_rate: f64,
    counts: Mutex<Counts>,
}

impl L2Gate {
    pub(super) fn new(min_hit_rate: f64) -> Self {
        Self {
            // The config's field is public: NaN or a share past 1 would keep the gate shut.
            min_hit_rate: if min_hit_rate.is_nan() {
                0.0
            } else {
                min_hit_rate.clamp(0.0, 1.0)
            },
            counts: Mutex::default(),
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Held only to read and add counts, never across an await.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `answered` of `asked` keys meet the share.
    fn worth(&self, answered: u64, asked: u64) -> bool {
        answered as f64 >= asked as f64 * self.min_hit_rate
    }

    /// Whether this batch asks the fast path (`false`: straight to the authority).
    pub(super) fn ask(&self) -> bool {
        let mut c = self.counts();
        let open = self.min_hit_rate <= 0.0 || c.asked < WARMUP || self.worth(c.answered, c.asked);
        if open {
            c.skipped = 0;
            return true;
        }
        c.skipped += 1;
        if c.skipped >= PROBE_EVERY {
            c.skipped = 0;
            return true;
        }
        false
    }

    /// A batch lookup asked `asked` keys and the fast path answered `answered` of them.
    pub(super) fn observe(&self, asked: usize, answered: usize) {
        if asked == 0 {
            return;
        }
        let (asked, answered) = (asked as u64, answered as u64);
        let mut c = self.counts();
        if asked >= SAMPLE && self.worth(answered, asked) && !self.worth(c.answered, c.asked) {
            // A lookup large enough to judge by found the fast path worth asking while the
            // counts said it was not (a replay has begun): what came before says little about
            // what comes now, and the gate opens at once.
            c.asked = asked;
            c.answered = answered;
            return;
        }
        c.asked += asked;
        c.answered += answered;
        if c.asked > WINDOW {
            c.asked /= 2;
            c.answered /= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(gate: &L2Gate, n: usize, size: usize, answered: usize) -> usize {
        let mut asked = 0;
        for _ in 0..n {
            if gate.ask() {
                asked += 1;
                gate.observe(size, answered);
            }
        }
        asked
    }

    #[test]
    fn a_fast_path_that_answers_nothing_is_asked_one_batch_in_sixteen() {
        let gate = L2Gate::new(0.05);
        // Warm-up: the first 1,024 keys are always looked up.
        assert_eq!(batches(&gate, 8, 128, 1), 8);
        assert_eq!(batches(&gate, 160, 128, 1), 10);
    }

    #[test]
    fn a_replay_opens_the_gate_at_its_first_probe() {
        let gate = L2Gate::new(0.05);
        batches(&gate, 200, 128, 0);
        assert!(!(0..PROBE_EVERY - 1).all(|_| gate.ask()));
        // The replay: the next probe finds every key; from then on every batch asks.
        let mut until_probe = 0;
        while !gate.ask() {
            until_probe += 1;
        }
        assert!(until_probe < PROBE_EVERY);
        gate.observe(128, 128);
        assert_eq!(batches(&gate, 50, 128, 120), 50);
    }

    #[test]
    fn a_probe_at_the_floor_reopens_the_gate_and_small_batches_do_not_restart_it() {
        let gate = L2Gate::new(0.05);
        batches(&gate, 200, 128, 0);
        // Batches of one key, each answered: they add to the counts, they do not restart them.
        for _ in 0..100 {
            gate.observe(1, 1);
        }
        assert!(!(0..PROBE_EVERY).all(|_| gate.ask()));
        // A probe of 128 keys finding 7 answered (5.5%) opens the gate at once.
        while !gate.ask() {}
        gate.observe(128, 7);
        assert_eq!(batches(&gate, 50, 128, 7), 50);
    }

    #[test]
    fn nan_or_a_share_past_one_is_cleaned_as_the_setter_cleans_it() {
        let nan = L2Gate::new(f64::NAN);
        assert_eq!(batches(&nan, 500, 128, 0), 500, "NaN always asks");
        let all = L2Gate::new(7.0);
        assert_eq!(
            batches(&all, 500, 128, 128),
            500,
            "clamped to 1: a full share is enough"
        );
    }

    #[test]
    fn a_share_at_the_floor_keeps_the_gate_open_and_zero_never_closes_it() {
        let gate = L2Gate::new(0.05);
        // 7 of 128 is 5.5%.
        assert_eq!(batches(&gate, 500, 128, 7), 500);
        let never = L2Gate::new(0.0);
        assert_eq!(batches(&never, 500, 128, 0), 500);
    }
}
