//! The loop's side of parking, its messages: barriers, admission, parking behind a key, the
//! counts, and refencing (the tick and due heads are `heads.rs`).
//!
//! `admit` (in `place`, before a lane) holds a message back until its partition's barrier
//! answered (`sync`), or behind messages waiting for room; every other message goes to its lane,
//! and `parks_instead` (in `start`) parks a lane's next message when its key has anything parked,
//! so a key's parks are written one at a time, in offset order (past a bound the lane's head and
//! queue wait for room with the partition paused for that reason, whatever else lets go). Counts
//! go up when a park is decided (`Event::Parking` for a message that parks itself, before its
//! row) and down when a head's row is removed (`heads.rs`), a park is refused
//! (`Settled::ParkRefused`) or finds its row written before (`Settled::ParkedAlready`, a replay),
//! or a park announced is refused for good (`Event::ParkUndone`). The barrier bumps the epoch only
//! while the partition is still owned (`acquire_parked_while`).
//!
//! A park fenced while the partition is still owned (`Settled::ParkFenced`) hands its message back
//! (`Event::Refenced`): `refence` puts it and its lane's queue first in line to wait, and the
//! partition's barrier runs again under a new epoch (`resync`; also after a task panicked past a
//! count). The partition is then `stale`: it keeps its old epoch for messages already in lanes
//! (their parks are fenced and handed back in turn), lets nothing waiting in until a barrier
//! started after the last fence answers, and every count change carries the epoch it was made
//! under (applied only under that epoch: a newer barrier counted the rows afresh).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};

use dedup_core::Store;
use tracing::warn;

use super::super::{Done, Event, Handler, Job, Lane, Loop, Report, Settled};
use super::{ParkCtx, ParkEvent, PartParks, PartRef};
use crate::consumer::{PauseReason, lock};

impl<S, H> Loop<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    pub(super) fn park_ctx(&self) -> Option<Arc<ParkCtx>> {
        self.inner.park.clone()
    }

    /// The epoch under which `lane`'s partition is owned, once its barrier answered.
    pub(in crate::runner) fn park_epoch(&self, lane: &Lane) -> Option<i64> {
        // Every message starts through here: without parking, no lookup (and no key to build).
        self.inner.park.as_ref()?;
        self.parks
            .parts
            .get(&(lane.topic.clone(), lane.partition))
            .filter(|p| p.generation == lane.generation)
            .and_then(|p| p.epoch)
    }

    /// At shutdown: messages waiting for a barrier or for room are left to redelivery.
    pub(in crate::runner) fn drop_waiting(&mut self) {
        for p in self.parks.parts.values_mut() {
            let n = std::mem::take(&mut p.waiting).len();
            self.held -= n;
            self.inner.counters.abandoned.add(n as u64);
        }
    }

    /// Sends a parking event to the loop.
    pub(super) fn park_event(&self) -> Option<tokio::sync::mpsc::UnboundedSender<Event>> {
        self.done_tx.clone()
    }

    /// Starts `tp`'s sync barrier for `generation` unless it runs or ran.
    pub(super) fn sync(&mut self, tp: &(String, i32), generation: u64) {
        let Some(ctx) = self.park_ctx() else {
            return;
        };
        let entry = self.parks.parts.entry(tp.clone()).or_default();
        if entry.generation == generation
            && (entry.syncing || (entry.epoch.is_some() && !entry.stale))
        {
            return;
        }
        if entry.generation != generation {
            self.held -= entry.waiting.len();
            self.inner
                .counters
                .abandoned
                .add(entry.waiting.len() as u64);
            *entry = PartParks {
                generation,
                ..PartParks::default()
            };
        }
        entry.syncing = true;
        entry.stale = false;
        // The bump happens only while this ownership stands: one that waited past its revocation
        // must not fence the next owner out.
        let revoked = lock(&self.shared)
            .parts
            .get(tp)
            .filter(|p| p.generation == generation)
            .map_or_else(|| Arc::new(AtomicBool::new(true)), |p| p.revoked.clone());
        let Some(tx) = self.park_event() else {
            return;
        };
        let tp = tp.clone();
        tokio::spawn(async move {
            let part = PartRef {
                group: ctx.group.clone(),
                topic: tp.0.clone(),
                partition: tp.1,
            };
            let owned = move || !revoked.load(AtomicOrdering::Acquire);
            let result = ctx.store.acquire(&part, &ctx.owner, &owned).await;
            let _ = tx.send(Event::Park(ParkEvent::Synced {
                tp,
                generation,
                result,
            }));
        });
    }

    /// Lets in the messages that waited for a barrier or for room: each goes through
    /// [`admit`](Self::admit) again, in the order received.
    pub(super) fn let_waiting_in(&mut self) {
        let Some(ctx) = self.park_ctx() else {
            return;
        };
        let total = self.parks.total();
        let ready: Vec<(String, i32)> = self
            .parks
            .parts
            .iter()
            .filter(|(_, p)| p.epoch.is_some() && !p.syncing && !p.stale && !p.waiting.is_empty())
            .map(|(tp, _)| tp.clone())
            .collect();
        for tp in ready {
            let Some(p) = self.parks.parts.get_mut(&tp) else {
                continue;
            };
            if p.paused {
                // Waiting for room: only once the first in line fits under the bounds.
                let n = p.keys.get(&p.waiting[0].lane.key).copied().unwrap_or(0);
                if n >= ctx.cfg.max_per_key || total >= ctx.cfg.max_parked {
                    continue;
                }
            }
            let jobs = std::mem::take(&mut p.waiting);
            let was_paused = std::mem::replace(&mut p.paused, false);
            self.held -= jobs.len();
            for job in jobs {
                self.place(job);
            }
            let still = self.parks.parts.get(&tp).is_some_and(|p| p.paused);
            if was_paused && !still {
                // Its other reasons (blocked lanes, backpressure) may still hold it.
                let generation = self.parks.parts.get(&tp).map_or(0, |p| p.generation);
                lock(&self.shared)
                    .pauses
                    .set(&tp, generation, PauseReason::ParkedFull, false);
            }
        }
    }

    /// Decides a received message's way before its lane: it waits for its partition's barrier
    /// (or behind messages waiting for room), or (answered back) goes to its lane. A message of
    /// a parked key is parked when its turn in the lane comes (`parks_instead`), so a key's parks
    /// are written one at a time, in offset order.
    pub(in crate::runner) fn admit(&mut self, job: Job) -> Option<Job> {
        if self.park_ctx().is_none() {
            return Some(job);
        }
        let tp = (job.lane.topic.clone(), job.lane.partition);
        let generation = job.lane.generation;
        self.sync(&tp, generation);
        // `sync` made the entry for this generation; anything else runs as without parking.
        let Some(p) = self
            .parks
            .parts
            .get_mut(&tp)
            .filter(|p| p.generation == generation)
        else {
            return Some(job);
        };
        if p.epoch.is_none() || !p.waiting.is_empty() {
            // Before the barrier, or behind messages waiting for room: in order, after them.
            self.held += 1;
            p.waiting.push(job);
            return None;
        }
        Some(job)
    }

    /// A lane's next message is about to start: if its key is parked, it is parked behind it
    /// instead (answered true).
    pub(in crate::runner) fn parks_instead(&mut self, job: &mut Option<Job>) -> bool {
        let Some(ctx) = self.park_ctx() else {
            return false;
        };
        let Some(j) = job.as_ref() else {
            return false;
        };
        let tp = (j.lane.topic.clone(), j.lane.partition);
        let Some(p) = self.parks.parts.get(&tp) else {
            return false;
        };
        if p.generation != j.lane.generation || p.keys.get(&j.lane.key).copied().unwrap_or(0) == 0 {
            return false;
        }
        if let Some(j) = job.take() {
            let lane = j.lane.clone();
            if !self.park_behind(&ctx, j)
                && let Some(state) = self.lanes.remove(&lane)
                && let Some(p) = self.parks.parts.get_mut(&tp)
            {
                // Past a bound the head waits for room, and its lane's queue with it, in
                // order; they stay counted as held.
                p.waiting.extend(state.queue);
            }
        }
        true
    }

    /// Parks `job` behind its key (counted now, so the key cannot look free before its row is
    /// written), or, past a bound, keeps it waiting with its partition paused (answered false).
    fn park_behind(&mut self, ctx: &Arc<ParkCtx>, mut job: Job) -> bool {
        let tp = (job.lane.topic.clone(), job.lane.partition);
        let total = self.parks.total();
        let Some(p) = self.parks.parts.get_mut(&tp) else {
            return true;
        };
        let n = p.keys.entry(job.lane.key.clone()).or_default();
        if *n >= ctx.cfg.max_per_key || total >= ctx.cfg.max_parked {
            self.inner.counters.park_full.add(1);
            warn!(topic = %tp.0, partition = tp.1, parked = *n, total, "parked queue full: the message waits, its partition paused");
            p.waiting.push(job);
            if !p.paused {
                p.paused = true;
                lock(&self.shared)
                    .pauses
                    .set(&tp, p.generation, PauseReason::ParkedFull, true);
            }
            return false;
        }
        *n += 1;
        job.park_epoch = p.epoch;
        ctx.total.store(total + 1, AtomicOrdering::Relaxed);
        let inner = self.inner.clone();
        let Some(done_tx) = self.done_tx.clone() else {
            return true;
        };
        let done_tx_back = done_tx.clone();
        tokio::spawn(async move {
            let mut report = Report {
                tx: Some(done_tx),
                lane: job.lane.clone(),
                offset: job.delivery.offset,
                settled: Settled::ParkRefused,
                park_epoch: job.park_epoch,
            };
            report.settled = match inner
                .park(&job, "parked behind an earlier message of its key", 0, true)
                .await
            {
                // Refused for good (only under `Proceed`: under `Hold` it stalls inside the
                // park): dead-lettered, never run ahead of its key's head.
                Settled::ParkImpossible => match inner
                    .dead_letter(
                        &job,
                        "could not be parked behind an earlier message of its key (Postgres refuses its data)",
                        0,
                    )
                    .await
                {
                    Settled::DeadLettered => Settled::BehindDeadLettered,
                    _ => Settled::ParkRefused,
                },
                settled => settled,
            };
            if report.settled == Settled::ParkFenced {
                report.tx = None;
                let _ = done_tx_back.send(Event::Refenced(job));
            }
        });
        true
    }

    /// A lane's running message is about to park itself (its in-place runs spent): its key
    /// counts as parked from now, before its row is written, so that neither its lane's next
    /// message nor a head's removal can find the key free while it is being parked.
    pub(in crate::runner) fn on_parking(&mut self, lane: &Lane, epoch: Option<i64>) {
        let tp = (lane.topic.clone(), lane.partition);
        // Under an older epoch the park is fenced (and the message handed back): not counted.
        if let Some(p) = self.parks.parts.get_mut(&tp)
            && p.generation == lane.generation
            && p.epoch == epoch
        {
            *p.keys.entry(lane.key.clone()).or_default() += 1;
        }
    }

    /// A park that was counted when decided and then refused, or found parked before (a replay:
    /// the barrier counted its row), uncounts.
    pub(in crate::runner) fn on_parked(&mut self, done: &Done) {
        if matches!(
            done.settled,
            Settled::ParkRefused
                | Settled::ParkedAlready
                | Settled::DeadLetteredHeldAgain
                | Settled::BehindDeadLettered
        ) {
            self.uncount_parked(&done.lane, done.park_epoch);
        }
    }

    /// `lane`'s key counts one parked message fewer, if it was counted under `epoch` (a newer
    /// barrier counted the rows afresh).
    pub(in crate::runner) fn uncount_parked(&mut self, lane: &Lane, epoch: Option<i64>) {
        let tp = (lane.topic.clone(), lane.partition);
        if let Some(p) = self.parks.parts.get_mut(&tp)
            && p.generation == lane.generation
            && p.epoch == epoch
            && let Some(n) = p.keys.get_mut(&lane.key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                p.keys.remove(&lane.key);
            }
        }
    }

    /// A park fenced while the partition is still ours (its epoch moved on: a bump that was
    /// late, say): the message goes back to wait, with the rest of its lane, ahead of what
    /// waits already, and the partition's epoch and parked keys are taken again. Once they are,
    /// the message goes through its key's order again: parked behind the key if it has parked
    /// messages, run again otherwise. Its offset stays pending meanwhile, then moves.
    pub(in crate::runner) fn refence(&mut self, job: Job) {
        let lane = job.lane.clone();
        let mut jobs = vec![job];
        if let Some(state) = self.lanes.remove(&lane) {
            if state.blocked {
                // Not while parking (a park follows a granted claim, which unblocks the lane),
                // but kept true if it were: the head and its queue counted as blocked.
                let n = 1 + state.queue.len();
                super::super::count_blocked(
                    &mut self.blocked,
                    &mut self.blocked_by,
                    &lane,
                    -n.cast_signed(),
                );
                self.held += n;
            }
            jobs.extend(state.queue);
        }
        self.resync(&lane, jobs);
    }

    /// Reads `lane`'s partition's parked keys again under a new epoch; `jobs` (counted in
    /// `held`) wait for it, first in line.
    pub(super) fn resync(&mut self, lane: &Lane, jobs: Vec<Job>) {
        let tp = (lane.topic.clone(), lane.partition);
        match self.parks.parts.get_mut(&tp) {
            Some(p) if p.generation == lane.generation => {
                // The epoch is kept until the new one answers: messages already in lanes go on
                // (a park of theirs under the old epoch is fenced and handed back in turn); new
                // ones wait behind `jobs`, and nothing waiting is let in before the new barrier.
                p.stale = true;
                let rest = std::mem::take(&mut p.waiting);
                p.waiting = jobs;
                p.waiting.extend(rest);
                self.sync(&tp, lane.generation);
            }
            _ => {
                // The partition moved on: its messages are redelivered to whoever owns it.
                self.held -= jobs.len();
                self.inner.counters.abandoned.add(jobs.len() as u64);
            }
        }
    }
}
