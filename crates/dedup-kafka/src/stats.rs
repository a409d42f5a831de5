//! The runner's counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) received: Counter,
    pub(crate) executed: Counter,
    pub(crate) replayed: Counter,
    pub(crate) dead_lettered: Counter,
    pub(crate) processed_without_dedup: Counter,
    pub(crate) missing_key: Counter,
    pub(crate) bad_key: Counter,
    pub(crate) retries: Counter,
    pub(crate) abandoned: Counter,
    pub(crate) commits: Counter,
    pub(crate) commit_errors: Counter,
    pub(crate) consumer_errors: Counter,
    pub(crate) dead_letter_errors: Counter,
    pub(crate) assigned: Counter,
    pub(crate) revoked: Counter,
    pub(crate) pauses: Counter,
}

/// A live view of a runner's counters.
#[derive(Clone, Debug)]
pub struct StatsHandle(pub(crate) Arc<Counters>);

impl StatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> RunnerStats {
        let c = &self.0;
        RunnerStats {
            received: c.received.get(),
            executed: c.executed.get(),
            replayed: c.replayed.get(),
            dead_lettered: c.dead_lettered.get(),
            processed_without_dedup: c.processed_without_dedup.get(),
            missing_key: c.missing_key.get(),
            bad_key: c.bad_key.get(),
            retries: c.retries.get(),
            abandoned: c.abandoned.get(),
            commits: c.commits.get(),
            commit_errors: c.commit_errors.get(),
            consumer_errors: c.consumer_errors.get(),
            dead_letter_errors: c.dead_letter_errors.get(),
            assigned: c.assigned.get(),
            revoked: c.revoked.get(),
            pauses: c.pauses.get(),
        }
    }
}

/// What a runner has done so far.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub struct RunnerStats {
    /// Messages received from owned partitions.
    pub received: u64,
    /// Messages whose handler ran and completed.
    pub executed: u64,
    /// Duplicates answered with the stored result.
    pub replayed: u64,
    /// Messages written to the dead-letter topic.
    pub dead_lettered: u64,
    /// Keyless messages run without dedup (by configuration).
    pub processed_without_dedup: u64,
    /// Messages that had no key.
    pub missing_key: u64,
    /// Messages whose key was unusable (not JSON, empty, too long).
    pub bad_key: u64,
    /// Retries (handler, store, in-flight waits, dead-letter writes).
    pub retries: u64,
    /// Messages left unsettled on revocation or shutdown (they are redelivered).
    pub abandoned: u64,
    /// Offset commits sent.
    pub commits: u64,
    /// Offset commits that failed.
    pub commit_errors: u64,
    /// Errors the consumer reported (broker down, and so on).
    pub consumer_errors: u64,
    /// Dead-letter writes that failed and were retried.
    pub dead_letter_errors: u64,
    /// Partitions assigned, summed over rebalances.
    pub assigned: u64,
    /// Partitions revoked, summed over rebalances.
    pub revoked: u64,
    /// Times the runner paused for backpressure.
    pub pauses: u64,
}
