//! The runner's counters, and a latency histogram (log buckets, within 12.5%).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn max(&self, n: u64) {
        self.0.fetch_max(n, Ordering::Relaxed);
    }
    /// For a gauge going down.
    pub(crate) fn sub(&self, n: u64) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }

    /// For a gauge.
    pub(crate) fn set(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Per-message latencies in microseconds, in log buckets (8 per power of two: within 12.5%).
#[derive(Debug)]
pub(crate) struct Histogram([AtomicU64; BUCKETS]);

const BUCKETS: usize = 16 + 44 * 8;

impl Default for Histogram {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Histogram {
    fn index(us: u64) -> usize {
        if us < 16 {
            return usize::try_from(us).unwrap_or(0);
        }
        let b = 63 - u64::from(us.leading_zeros());
        let sub = (us >> (b - 3)) & 7;
        let i = 16 + (b - 4) * 8 + sub;
        usize::try_from(i).unwrap_or(BUCKETS - 1).min(BUCKETS - 1)
    }

    /// The upper end of bucket `i`.
    fn upper(i: usize) -> u64 {
        if i < 16 {
            return i as u64;
        }
        let b = (i as u64 - 16) / 8 + 4;
        let sub = (i as u64 - 16) % 8;
        ((8 + sub + 1) << (b - 3)) - 1
    }

    pub(crate) fn record(&self, us: u64) {
        self.0[Self::index(us)].fetch_add(1, Ordering::Relaxed);
    }

    /// The `q` quantile (0..=1), as the upper end of its bucket; 0 when empty.
    fn quantile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self.0.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::upper(i);
            }
        }
        Self::upper(BUCKETS - 1)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) latency: Histogram,
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
    pub(crate) dead_letters_kept: Counter,
    pub(crate) dead_letter_stalls: Counter,
    pub(crate) dead_letter_max_bytes: Counter,
    pub(crate) assigned: Counter,
    pub(crate) revoked: Counter,
    pub(crate) pauses: Counter,
    pub(crate) saturated: Counter,
    pub(crate) max_held: Counter,
    pub(crate) panics: Counter,
    pub(crate) store_errors: Counter,
    pub(crate) batches: Counter,
    pub(crate) blocked: Counter,
    pub(crate) max_blocked: Counter,
    pub(crate) blocked_pauses: Counter,
    pub(crate) parked: Counter,
    pub(crate) parked_retries: Counter,
    pub(crate) parked_dead_lettered: Counter,
    pub(crate) park_full: Counter,
    pub(crate) park_errors: Counter,
    pub(crate) parked_keys: Counter,
    pub(crate) parked_messages: Counter,
    pub(crate) parked_oldest_ms: Counter,
    pub(crate) kill_switch_trips: Counter,
    pub(crate) kill_switch_withdrawn: Counter,
    pub(crate) kill_switch_held: Counter,
    pub(crate) kill_switch_open: Counter,
    pub(crate) partitions: Counter,
    pub(crate) last_turn_ms: Counter,
    pub(crate) dead_letters_failing: Counter,
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
            saturated: c.saturated.get(),
            max_held: c.max_held.get(),
            panics: c.panics.get(),
            store_errors: c.store_errors.get(),
            batches: c.batches.get(),
            blocked: c.blocked.get(),
            max_blocked: c.max_blocked.get(),
            blocked_pauses: c.blocked_pauses.get(),
            parked: c.parked.get(),
            parked_retries: c.parked_retries.get(),
            parked_dead_lettered: c.parked_dead_lettered.get(),
            park_full: c.park_full.get(),
            park_errors: c.park_errors.get(),
            dead_letters_kept: c.dead_letters_kept.get(),
            dead_letter_stalls: c.dead_letter_stalls.get(),
            dead_letter_max_bytes: c.dead_letter_max_bytes.get(),
            parked_keys: c.parked_keys.get(),
            parked_messages: c.parked_messages.get(),
            parked_oldest_ms: c.parked_oldest_ms.get(),
            kill_switch_trips: c.kill_switch_trips.get(),
            kill_switch_withdrawn: c.kill_switch_withdrawn.get(),
            kill_switch_held: c.kill_switch_held.get(),
            kill_switch_open: c.kill_switch_open.get(),
            partitions: c.partitions.get(),
            last_turn_ms: c.last_turn_ms.get(),
            dead_letters_failing: c.dead_letters_failing.get(),
            latency_p50_us: c.latency.quantile(0.5),
            latency_p99_us: c.latency.quantile(0.99),
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
    /// Times the runner paused its partitions because nothing settled for a second at the bound.
    pub pauses: u64,
    /// Times the runner reached `max_in_flight` and stopped taking messages.
    pub saturated: u64,
    /// The most messages held at once (the bound, plus any a stall pause let in).
    pub max_held: u64,
    /// Handler calls (or runner tasks) that panicked. A panic counts as a retryable failure; past
    /// the attempts the message is dead-lettered with the panic's message.
    pub panics: u64,
    /// Passing store errors (a failover, a statement timeout, a pool exhausted) that a message
    /// was retried after; each is also logged as a warning.
    pub store_errors: u64,
    /// Batch transactions committed (transaction mode only).
    pub batches: u64,
    /// Messages that met another holder's live lease (a key run elsewhere, or left by a dead
    /// process whose lease has not ended) and waited for it outside the in-flight bound
    /// (lease mode per message only).
    pub blocked: u64,
    /// The most messages waiting in blocked lanes at once: the blocked message and those queued
    /// behind it (bounded by `max_blocked`, plus what a paused partition had already fetched).
    pub max_blocked: u64,
    /// Times a partition was paused because blocked messages reached `max_blocked`.
    pub blocked_pauses: u64,
    /// Times the kill switch opened (the handler failed too often; see
    /// [`KillSwitch`](crate::KillSwitch)), a failed probe included.
    pub kill_switch_trips: u64,
    /// Handler failures withdrawn (the key given back unspent, the message retried later)
    /// because the kill switch was suspect, open or probing (transaction mode only: lease mode
    /// withdraws nothing).
    pub kill_switch_withdrawn: u64,
    /// Lease mode: final failures held (their lease kept, neither recorded nor run again) while
    /// the kill switch was suspect, open or probing, until it closed.
    pub kill_switch_held: u64,
    /// 1 while the kill switch is open (no messages taken), else 0.
    pub kill_switch_open: u64,
    /// Partitions this member owns now.
    pub partitions: u64,
    /// When the runner's loop last served its commit tick (once per commit interval while the
    /// loop runs), in milliseconds since the Unix epoch; 0 before the first.
    pub last_turn_ms: u64,
    /// Dead letters whose write has failed and that are still being retried (the dead-letter
    /// topic down, refusing, or an operator's to cure): their partitions' offsets wait.
    pub dead_letters_failing: u64,
    /// Messages written to the parked queue (with parking: after their in-place runs, or behind
    /// an earlier parked message of their ordering key).
    pub parked: u64,
    /// Runs of parked heads.
    pub parked_retries: u64,
    /// Parked heads dead-lettered (attempts spent, a permanent failure, or dropped by an
    /// operator); also counted in `dead_lettered`.
    pub parked_dead_lettered: u64,
    /// Times a message was not parked because a bound (`max_per_key`, `max_parked`) was
    /// reached: alert on it.
    pub park_full: u64,
    /// Parks that Postgres refused for good (data it cannot store): the message ran on in place,
    /// was dead-lettered, or (behind a held key) stalls its key. Alert on it.
    pub park_errors: u64,
    /// Dead letters the dead-letter topic refused for good (too large, invalid), kept in
    /// Postgres (`dedup_dead_letters`, `dedup dead-letters`) instead; also in `dead_lettered`.
    pub dead_letters_kept: u64,
    /// Dead-letter writes refused in a way only an operator can cure (authorization, an unknown
    /// topic, or refused for good with no Postgres table to keep it or one Postgres refuses to
    /// keep): the partition waits. Alert on it.
    pub dead_letter_stalls: u64,
    /// The dead-letter topic's `max.message.bytes`, read at start (0: the cluster did not say).
    /// Checked against the source topics' at start: a warning says when it is smaller.
    pub dead_letter_max_bytes: u64,
    /// Parked keys over this runner's partitions (a gauge, refreshed every few polls).
    pub parked_keys: u64,
    /// Parked messages over this runner's partitions (a gauge).
    pub parked_messages: u64,
    /// How long the oldest parked message has waited, in milliseconds (a gauge).
    pub parked_oldest_ms: u64,
    /// Median time from a message's start to its settlement (dedup decision, handler, completion
    /// or dead letter), in microseconds (within 12.5%).
    pub latency_p50_us: u64,
    /// The 99th percentile of the same.
    pub latency_p99_us: u64,
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn buckets_cover_every_value_within_an_eighth() {
        for us in (0..100_000u64).chain([1 << 20, 1 << 33, 1 << 40]) {
            let i = Histogram::index(us);
            let upper = Histogram::upper(i);
            assert!(upper >= us, "{us} -> bucket {i} ending at {upper}");
            assert!(
                upper - us <= us / 8 + 1,
                "{us} -> {upper}: more than 12.5% off"
            );
            if i > 0 {
                assert!(
                    Histogram::upper(i - 1) < us,
                    "{us} belongs below bucket {i}"
                );
            }
        }
    }

    #[test]
    fn quantiles_of_a_known_spread() {
        let h = Histogram::default();
        assert_eq!(h.quantile(0.5), 0);
        for us in 1..=1000 {
            h.record(us);
        }
        let (p50, p99) = (h.quantile(0.5), h.quantile(0.99));
        assert!((500..=563).contains(&p50), "p50 {p50}");
        assert!((990..=1114).contains(&p99), "p99 {p99}");
    }
}
