//! Why partitions are paused: a set of reasons per partition (of one ownership) and for the
//! whole assignment, applied to the consumer as one decision, so that one reason letting go never
//! resumes a partition another reason still holds; and backpressure, one of those reasons.
//!
//! A partition is paused while any reason holds it: its own (its blocked lanes reached
//! `max_blocked`, a message waits for room in its parked queue) under the ownership they were set
//! in, or one of the whole assignment (backpressure at the in-flight bound, an open kill switch).
//! [`Pauses::apply`] pauses and resumes only the partitions whose answer changed; an assignment
//! is given its state explicitly in the rebalance callback ([`Pauses::assigned`]), since
//! librdkafka keeps an application's pause across a revocation and a new assignment.
//!
//! The loop applies them once per turn (`apply`, the consumer's `apply_pauses`). `Backpressure`
//! stops taking messages at `max_in_flight`, and sets its reason after a second without progress.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{Consumer, ConsumerContext};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{Shared, TopicPartition, lock};
use crate::stats::Counters;

/// One reason to pause a partition.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum PauseReason {
    /// Its blocked lanes' messages reached `max_blocked` (one partition).
    Blocked,
    /// A message waits for room in its parked queue (one partition).
    ParkedFull,
    /// Nothing settled for a while at the in-flight bound (the whole assignment).
    Backpressure,
    /// The kill switch is open (the whole assignment).
    KillSwitch,
}

impl PauseReason {
    const fn bit(self) -> u8 {
        match self {
            Self::Blocked => 1,
            Self::ParkedFull => 2,
            Self::Backpressure => 4,
            Self::KillSwitch => 8,
        }
    }
}

/// A set of [`PauseReason`]s.
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
pub(crate) struct Reasons(u8);

impl Reasons {
    fn set(&mut self, reason: PauseReason, on: bool) -> bool {
        let before = self.0;
        if on {
            self.0 |= reason.bit();
        } else {
            self.0 &= !reason.bit();
        }
        before != self.0
    }

    #[cfg(test)]
    pub(crate) fn contains(self, reason: PauseReason) -> bool {
        self.0 & reason.bit() != 0
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// The reasons partitions are paused for, and what the consumer was last told.
#[derive(Debug, Default)]
pub(crate) struct Pauses {
    /// Reasons that hold every partition of the assignment.
    all: Reasons,
    /// A partition's own reasons, under the ownership (generation) they were set in.
    parts: HashMap<TopicPartition, (u64, Reasons)>,
    /// The partitions this member last paused (and has not resumed since).
    paused: HashSet<TopicPartition>,
    /// Something changed since the last [`apply`](Self::apply).
    dirty: bool,
}

impl Pauses {
    /// Sets or clears a reason for the whole assignment.
    pub(crate) fn set_all(&mut self, reason: PauseReason, on: bool) {
        self.dirty |= self.all.set(reason, on);
    }

    /// Sets or clears a reason for one partition under ownership `generation`. A reason set
    /// under an earlier ownership does not hold the partition now.
    pub(crate) fn set(
        &mut self,
        tp: &TopicPartition,
        generation: u64,
        reason: PauseReason,
        on: bool,
    ) {
        match self.parts.get_mut(tp) {
            Some((g, reasons)) if *g == generation => self.dirty |= reasons.set(reason, on),
            Some((g, _)) if *g > generation => {}
            _ if on => {
                let mut reasons = Reasons::default();
                reasons.set(reason, true);
                self.parts.insert(tp.clone(), (generation, reasons));
                self.dirty = true;
            }
            _ => {}
        }
    }

    /// The reasons holding `tp` under ownership `generation`, the assignment's included.
    pub(crate) fn reasons(&self, tp: &TopicPartition, generation: u64) -> Reasons {
        let own = self
            .parts
            .get(tp)
            .filter(|(g, _)| *g == generation)
            .map_or(0, |(_, r)| r.0);
        Reasons(self.all.0 | own)
    }

    /// Newly assigned partitions under ownership `generation`: reasons of earlier ownerships are
    /// forgotten, and each partition's state is answered (paused or not) for the callback to set
    /// explicitly.
    pub(crate) fn assigned<'a>(
        &mut self,
        tps: impl Iterator<Item = &'a TopicPartition>,
        generation: u64,
    ) -> (Vec<TopicPartition>, Vec<TopicPartition>) {
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        for tp in tps {
            if self.parts.get(tp).is_some_and(|(g, _)| *g != generation) {
                self.parts.remove(tp);
            }
            if self.reasons(tp, generation).is_empty() {
                self.paused.remove(tp);
                resume.push(tp.clone());
            } else {
                self.paused.insert(tp.clone());
                pause.push(tp.clone());
            }
        }
        (pause, resume)
    }

    /// Partitions revoked: nothing of theirs is kept.
    pub(crate) fn revoked<'a>(&mut self, tps: impl Iterator<Item = &'a TopicPartition>) {
        for tp in tps {
            self.parts.remove(tp);
            self.paused.remove(tp);
        }
    }

    /// The partitions to pause and to resume now, given the owned partitions and their
    /// generations, and what the consumer was told before; taken as told.
    fn plan<'a>(
        &mut self,
        owned: impl Iterator<Item = (&'a TopicPartition, u64)>,
    ) -> (Vec<TopicPartition>, Vec<TopicPartition>) {
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        for (tp, generation) in owned {
            let want = !self.reasons(tp, generation).is_empty();
            let is = self.paused.contains(tp);
            if want && !is {
                self.paused.insert(tp.clone());
                pause.push(tp.clone());
            } else if !want && is {
                self.paused.remove(tp);
                resume.push(tp.clone());
            }
        }
        self.dirty = false;
        (pause, resume)
    }
}

fn list(tps: &[TopicPartition]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for (topic, partition) in tps {
        tpl.add_partition(topic, *partition);
    }
    tpl
}

/// Pauses and resumes what the reasons now say, if they changed. A pause or resume the consumer
/// refuses is logged, and tried again at the next change.
pub(crate) fn apply<C: ConsumerContext>(consumer: &impl Consumer<C>, shared: &Mutex<Shared>) {
    let (pause, resume) = {
        let mut shared = lock(shared);
        if !shared.pauses.dirty {
            return;
        }
        let Shared { parts, pauses, .. } = &mut *shared;
        pauses.plan(parts.iter().map(|(tp, p)| (tp, p.generation)))
    };
    if !resume.is_empty() {
        if let Err(e) = consumer.resume(&list(&resume)) {
            warn!(error = %e, partitions = resume.len(), "resuming partitions failed");
            forget(shared, &resume);
        } else {
            debug!(
                partitions = resume.len(),
                "resumed partitions: no reason holds them"
            );
        }
    }
    if !pause.is_empty() {
        if let Err(e) = consumer.pause(&list(&pause)) {
            warn!(error = %e, partitions = pause.len(), "pausing partitions failed");
            forget(shared, &pause);
        } else {
            debug!(partitions = pause.len(), "paused partitions");
        }
    }
}

/// A pause or resume that failed: the next [`apply`] decides those partitions again.
fn forget(shared: &Mutex<Shared>, tps: &[TopicPartition]) {
    let mut shared = lock(shared);
    for tp in tps {
        if !shared.pauses.paused.remove(tp) {
            shared.pauses.paused.insert(tp.clone());
        }
    }
    shared.pauses.dirty = true;
}

/// How long a saturated loop waits for a message to settle before it pauses its partitions.
const STALL: Duration = Duration::from_secs(1);

/// Backpressure. At `max_in_flight` held messages the loop stops taking messages: no pause, so
/// nothing is refetched, and every settled message lets one more in, so `recv` (and with it the
/// rebalance callbacks) keeps running while work completes. If nothing settles for [`STALL`] (a
/// store down, a slow handler), the loop pauses its partitions ([`PauseReason::Backpressure`])
/// and polls again, so rebalances are served during the stall; it lets go of that reason once
/// below the bound (partitions held for other reasons stay paused).
#[derive(Debug, Default)]
pub(crate) struct Backpressure {
    paused: bool,
    /// Since when the held messages have been at the bound without one settling.
    saturated_since: Option<Instant>,
    /// The held count at the last look.
    last_held: usize,
}

impl Backpressure {
    /// Looks at the held count after each turn of the loop.
    pub(crate) fn update(
        &mut self,
        held: usize,
        max: usize,
        shared: &Mutex<Shared>,
        counters: &Counters,
    ) {
        counters.max_held.max(held as u64);
        let progress = held < self.last_held;
        self.last_held = held;
        if held >= max {
            if self.saturated_since.is_none() {
                self.saturated_since = Some(Instant::now());
                counters.saturated.add(1);
            } else if progress && !self.paused {
                // Something settled: a stall is a second without that, not at the bound (a
                // partition's fair share may keep the count above it for a while).
                self.saturated_since = Some(Instant::now());
            }
            return;
        }
        self.saturated_since = None;
        if self.paused {
            self.set_paused(false, shared, counters);
        }
    }

    /// Whether the loop takes messages now.
    pub(crate) fn taking(&self) -> bool {
        self.saturated_since.is_none() || self.paused
    }

    /// When a saturated loop pauses its partitions, if nothing settles before.
    pub(crate) fn stall_deadline(&self) -> Option<Instant> {
        match self.saturated_since {
            Some(t) if !self.paused => Some(t + STALL),
            _ => None,
        }
    }

    /// Sets or clears the backpressure reason (applied with the loop's next [`apply`]).
    pub(crate) fn set_paused(&mut self, pause: bool, shared: &Mutex<Shared>, counters: &Counters) {
        self.paused = pause;
        lock(shared)
            .pauses
            .set_all(PauseReason::Backpressure, pause);
        if pause {
            counters.pauses.add(1);
        }
        debug!(pause, "backpressure");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> TopicPartition {
        ("t".to_owned(), p)
    }

    fn plan(pauses: &mut Pauses, owned: &[(i32, u64)]) -> (Vec<i32>, Vec<i32>) {
        let owned: Vec<(TopicPartition, u64)> = owned.iter().map(|&(p, g)| (tp(p), g)).collect();
        let (pause, resume) = pauses.plan(owned.iter().map(|(t, g)| (t, *g)));
        (
            pause.into_iter().map(|t| t.1).collect(),
            resume.into_iter().map(|t| t.1).collect(),
        )
    }

    #[test]
    fn a_partition_resumes_only_when_no_reason_holds_it() {
        let mut p = Pauses::default();
        p.set(&tp(0), 1, PauseReason::ParkedFull, true);
        p.set(&tp(0), 1, PauseReason::Blocked, true);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![0], vec![]));
        // The blocked lanes drain: the full parked queue still holds it.
        p.set(&tp(0), 1, PauseReason::Blocked, false);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![], vec![]));
        // And the other way round.
        p.set(&tp(0), 1, PauseReason::Blocked, true);
        p.set(&tp(0), 1, PauseReason::ParkedFull, false);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![], vec![]));
        p.set(&tp(0), 1, PauseReason::Blocked, false);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![], vec![0]));
    }

    #[test]
    fn the_whole_assignment_letting_go_leaves_a_partitions_own_reasons() {
        let mut p = Pauses::default();
        p.set(&tp(1), 1, PauseReason::ParkedFull, true);
        p.set_all(PauseReason::Backpressure, true);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![0, 1], vec![]));
        p.set_all(PauseReason::KillSwitch, true);
        p.set_all(PauseReason::Backpressure, false);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![], vec![]));
        p.set_all(PauseReason::KillSwitch, false);
        assert_eq!(plan(&mut p, &[(0, 1), (1, 1)]), (vec![], vec![0]));
        assert!(p.reasons(&tp(1), 1).contains(PauseReason::ParkedFull));
    }

    #[test]
    fn reasons_of_an_earlier_ownership_do_not_hold_a_new_one() {
        let mut p = Pauses::default();
        p.set(&tp(0), 1, PauseReason::Blocked, true);
        assert_eq!(plan(&mut p, &[(0, 1)]), (vec![0], vec![]));
        // Revoked and assigned again (generation 2): it starts resumed.
        p.revoked([tp(0)].iter());
        let (pause, resume) = p.assigned([tp(0)].iter(), 2);
        assert!(pause.is_empty() && resume == [tp(0)]);
        // A late clear or set from the old ownership changes nothing.
        p.set(&tp(0), 1, PauseReason::Blocked, true);
        assert!(p.reasons(&tp(0), 2).is_empty());
        assert_eq!(plan(&mut p, &[(0, 2)]), (vec![], vec![]));
        // Assigned while the whole assignment is held: it starts paused.
        p.set_all(PauseReason::Backpressure, true);
        let (pause, _) = p.assigned([tp(3)].iter(), 3);
        assert_eq!(pause, [tp(3)]);
        assert_eq!(plan(&mut p, &[(0, 2), (3, 3)]), (vec![0], vec![]));
    }
}
