//! How a message ended, in every mode, and the bookkeeping every loop does when one ends: the
//! stats it counts in, and the pending offset it clears so the commit can move past it.
//!
//! `Settled` is the ending; `Shared::settled` the one bookkeeping, for the ownership the message
//! ran under. A message left to redelivery stays pending.

use super::{Shared, TopicPartition};
use crate::stats::Counters;

/// How a message ended. The batch runners use the first four; the others are the per-message
/// runner's parking and hold outcomes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Settled {
    Executed,
    Replayed,
    DeadLettered,
    /// Left unsettled (revoked or shutting down): it will be redelivered.
    Abandoned,
    ProcessedWithoutDedup,
    /// Parked after its in-place runs failed: its key's later messages park behind it.
    Parked,
    /// Parked behind an earlier parked message of its key, without running.
    ParkedBehind,
    /// Found parked already (a replay after a crash or a rebalance).
    ParkedAlready,
    /// To be parked, and not: another owner has the partition, or the runner stops. Left to
    /// redelivery, as `Abandoned`.
    ParkRefused,
    /// To be parked, and the partition's parking epoch had moved on while the partition is
    /// still ours: the loop takes the message back (with its lane) until the epoch is taken
    /// again. Never reported as done.
    ParkFenced,
    /// To be parked, and Postgres refuses its data for good: the caller decides (a failing
    /// message runs on in place; one behind its key is dead-lettered, or stalls under `Hold`).
    ParkImpossible,
    /// Dead-lettered in place under the hold policy, and its row written as its key's held
    /// marker: the key's later messages wait for an operator.
    DeadLetteredHeld,
    /// As `DeadLetteredHeld`, its marker found written before (a replay: the barrier counted it).
    DeadLetteredHeldAgain,
    /// To be parked behind its key, refused for good by Postgres, and dead-lettered instead
    /// (never run ahead of its key's head).
    BehindDeadLettered,
}

impl Settled {
    /// Whether the message is done with: its offset may be committed past. The others are left
    /// to redelivery.
    pub(crate) fn is_done(self) -> bool {
        !matches!(
            self,
            Self::Abandoned | Self::ParkRefused | Self::ParkFenced | Self::ParkImpossible
        )
    }

    /// Counts the message in the runner's stats.
    pub(crate) fn count(self, c: &Counters) {
        match self {
            Self::Executed => c.executed.add(1),
            Self::Replayed => c.replayed.add(1),
            Self::DeadLettered
            | Self::DeadLetteredHeld
            | Self::DeadLetteredHeldAgain
            | Self::BehindDeadLettered => c.dead_lettered.add(1),
            Self::ProcessedWithoutDedup => c.processed_without_dedup.add(1),
            // Counted where they were parked.
            Self::Parked | Self::ParkedBehind | Self::ParkedAlready => {}
            Self::Abandoned | Self::ParkRefused | Self::ParkFenced | Self::ParkImpossible => {
                c.abandoned.add(1);
            }
        }
    }
}

impl Shared {
    /// Messages of `tp` under ownership `generation` ended: each is counted, and each one done
    /// with is no longer pending (the commit may move past it). Work of an earlier ownership
    /// is counted and changes nothing.
    pub(crate) fn settled(
        &mut self,
        tp: &TopicPartition,
        generation: u64,
        ended: impl IntoIterator<Item = (i64, Settled)>,
        counters: &Counters,
    ) {
        let mut part = self
            .parts
            .get_mut(tp)
            .filter(|p| p.generation == generation);
        for (offset, settled) in ended {
            settled.count(counters);
            if settled.is_done()
                && let Some(p) = part.as_deref_mut()
            {
                p.pending.remove(&offset);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::Part;
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    fn shared_with(tp: &TopicPartition, generation: u64, pending: &[i64]) -> Shared {
        let mut s = Shared::default();
        s.parts.insert(
            tp.clone(),
            Part {
                generation,
                revoked: Arc::new(AtomicBool::new(false)),
                pending: pending.iter().copied().collect::<BTreeSet<_>>(),
                next: None,
                committed: None,
            },
        );
        s
    }

    #[test]
    fn only_messages_done_with_leave_pending_and_every_one_is_counted() {
        let tp = ("t".to_owned(), 0);
        let mut s = shared_with(&tp, 7, &[1, 2, 3, 4]);
        let c = Counters::default();
        s.settled(
            &tp,
            7,
            [
                (1, Settled::Executed),
                (2, Settled::Abandoned),
                (3, Settled::DeadLetteredHeld),
                (4, Settled::ParkFenced),
            ],
            &c,
        );
        assert_eq!(s.parts[&tp].pending, BTreeSet::from([2, 4]));
        assert_eq!(c.executed.get(), 1);
        assert_eq!(c.dead_lettered.get(), 1);
        assert_eq!(c.abandoned.get(), 2);
    }

    #[test]
    fn work_of_an_earlier_ownership_is_counted_and_clears_nothing() {
        let tp = ("t".to_owned(), 0);
        let mut s = shared_with(&tp, 8, &[1]);
        let c = Counters::default();
        s.settled(&tp, 7, [(1, Settled::Replayed)], &c);
        assert_eq!(s.parts[&tp].pending, BTreeSet::from([1]));
        assert_eq!(c.replayed.get(), 1);
    }
}
