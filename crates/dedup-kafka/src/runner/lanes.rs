//! The per-message loop's state: lanes (a partition, or an ordering key in it, whose messages
//! run one at a time), what a message's task tells the loop, and how the loop places, starts and
//! settles messages, holds partitions with blocked lanes, and counts what is held.
//!
//! A keyed message whose key is under another holder's live lease tells the loop
//! (`Event::Blocked`), and its lane (the head and the messages queued behind it) moves from `held`
//! to `blocked`, out of `max_in_flight`, so other lanes keep flowing; it is retried with the
//! runner's backoff and tells the loop again (`Event::Unblocked`) when its claim is granted,
//! before its handler starts. Blocked messages have their own bound, `max_blocked`: at the bound
//! the partitions of blocked lanes are paused (the rest flow), and that reason is let go when
//! blocked messages fall to half the bound or the partition has no blocked lane left.

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

use dedup_core::{IdempotencyKey, Scope, Store};
use futures_util::FutureExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::job::Inner;
use super::park;
use crate::config::Ordering;
use crate::consumer::{Backpressure, PauseReason, Settled, Shared, Source, Work, lock};
use crate::delivery::{Delivery, KeyError, extract_key, ordering_key};
use crate::handler::{Handler, panic_message};

/// Which messages must wait for each other: one partition (of one ownership), and with
/// `Ordering::PerKey` one ordering key in it (`None`: the partition's messages without one).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(in crate::runner) struct Lane {
    pub(in crate::runner) topic: String,
    pub(in crate::runner) partition: i32,
    pub(in crate::runner) generation: u64,
    pub(in crate::runner) key: Option<Vec<u8>>,
}

#[derive(Debug)]
pub(in crate::runner) struct Job {
    pub(in crate::runner) delivery: Arc<Delivery>,
    pub(in crate::runner) key: Result<IdempotencyKey, KeyError>,
    pub(in crate::runner) revoked: Arc<AtomicBool>,
    pub(in crate::runner) lane: Lane,
    /// The partition's parking epoch when the message started (with parking).
    pub(in crate::runner) park_epoch: Option<i64>,
}

#[derive(Debug)]
pub(in crate::runner) struct Done {
    pub(in crate::runner) lane: Lane,
    pub(in crate::runner) offset: i64,
    pub(in crate::runner) settled: Settled,
    /// The parking epoch the message started under: a count it changes applies only while the
    /// partition is still under that epoch (a new barrier has counted afresh).
    pub(in crate::runner) park_epoch: Option<i64>,
}

/// What a message's task tells the loop.
#[derive(Debug)]
pub(in crate::runner) enum Event {
    /// The message settled (or was left to redelivery).
    Done(Done),
    /// The lane's running message met another holder's live lease: it waits outside the
    /// in-flight bound, and so do the messages queued behind it.
    Blocked(Lane),
    /// The lane's blocked message got its claim (its handler starts now).
    Unblocked(Lane),
    /// Parking's barriers, heads and gauges.
    Park(park::ParkEvent),
    /// The lane's running message is about to park itself (under the epoch given): its key
    /// counts as parked from now.
    Parking(Lane, Option<i64>),
    /// A park announced by `Parking` did not happen (refused for good): the key counts one
    /// message fewer.
    ParkUndone(Lane, Option<i64>),
    /// A message whose park was fenced while its partition is still ours: the loop takes it
    /// back, with its lane, until the partition's epoch is taken again.
    Refenced(Job),
}

/// A lane: its running message (the head) and the messages waiting their turn behind it.
#[derive(Debug, Default)]
pub(in crate::runner) struct LaneState {
    pub(in crate::runner) queue: VecDeque<Job>,
    /// The head is blocked on another holder's lease: the lane counts as blocked, not held.
    pub(in crate::runner) blocked: bool,
}

/// Sends a message's [`Done`] when dropped: at the end of its task, or while a panic unwinds it.
pub(in crate::runner) struct Report {
    pub(in crate::runner) tx: Option<mpsc::UnboundedSender<Event>>,
    pub(in crate::runner) lane: Lane,
    pub(in crate::runner) offset: i64,
    pub(in crate::runner) settled: Settled,
    pub(in crate::runner) park_epoch: Option<i64>,
}

impl Drop for Report {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Event::Done(Done {
                lane: self.lane.clone(),
                offset: self.offset,
                settled: self.settled,
                park_epoch: self.park_epoch,
            }));
        }
    }
}

pub(in crate::runner) struct Loop<S, H> {
    pub(in crate::runner) inner: Arc<Inner<S, H>>,
    pub(in crate::runner) source: Source,
    pub(in crate::runner) shared: Arc<Mutex<Shared>>,
    pub(in crate::runner) scope: Scope,
    pub(in crate::runner) lanes: HashMap<Lane, LaneState>,
    /// Messages received and not settled, running or waiting in a lane, except those of blocked
    /// lanes: what `max_in_flight` bounds.
    pub(in crate::runner) held: usize,
    /// Messages of blocked lanes (a head waiting for another holder's lease, and the messages
    /// queued behind it): what `max_blocked` bounds.
    pub(in crate::runner) blocked: usize,
    /// `blocked` per partition and ownership (they do not count against the partition's share).
    pub(in crate::runner) blocked_by: HashMap<(String, i32, u64), usize>,
    /// The partitions (of one ownership) paused because blocked messages reached their bound.
    pub(in crate::runner) blocked_paused: HashSet<(String, i32, u64)>,
    pub(in crate::runner) pressure: Backpressure,
    pub(in crate::runner) done_tx: Option<mpsc::UnboundedSender<Event>>,
    pub(in crate::runner) parks: park::Parks,
    /// With parking, when the parked queue is looked at next.
    pub(in crate::runner) next_park: Option<Instant>,
}

impl<S, H> Loop<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    pub(in crate::runner) fn receive(&mut self, delivery: Delivery) {
        self.inner.counters.received.add(1);
        let tp = (delivery.topic.clone(), delivery.partition);
        let Some((generation, revoked)) = lock(&self.shared).received(&tp, delivery.offset) else {
            return;
        };
        let key = extract_key(&self.inner.config.key, &self.scope, &delivery);
        let lane = Lane {
            topic: tp.0,
            partition: tp.1,
            generation,
            key: match self.inner.config.ordering {
                Ordering::PerKey => ordering_key(&self.inner.config.ordering_key, &delivery),
                _ => None,
            },
        };
        let job = Job {
            delivery: Arc::new(delivery),
            key,
            revoked,
            lane,
            park_epoch: None,
        };
        self.place(job);
    }

    /// Puts a received message in its lane (its lane's head starts at once), unless parking
    /// takes it (it waits for its partition's barrier, or is parked behind its key).
    pub(in crate::runner) fn place(&mut self, job: Job) {
        let Some(job) = self.admit(job) else {
            return;
        };
        let lane = job.lane.clone();
        match self.lanes.get_mut(&lane) {
            Some(state) => {
                if state.blocked {
                    count_blocked(&mut self.blocked, &mut self.blocked_by, &lane, 1);
                    self.inner.counters.max_blocked.max(self.blocked as u64);
                } else {
                    self.held += 1;
                }
                state.queue.push_back(job);
            }
            None => {
                self.held += 1;
                self.lanes.insert(lane, LaneState::default());
                self.start(job);
            }
        }
    }

    pub(in crate::runner) fn on_event(&mut self, event: Event) {
        match event {
            Event::Done(done) => self.settle(done),
            Event::Blocked(lane) => {
                if let Some(state) = self.lanes.get_mut(&lane)
                    && !state.blocked
                {
                    state.blocked = true;
                    let n = 1 + state.queue.len();
                    self.held -= n;
                    count_blocked(
                        &mut self.blocked,
                        &mut self.blocked_by,
                        &lane,
                        n.cast_signed(),
                    );
                    self.inner.counters.max_blocked.max(self.blocked as u64);
                }
            }
            Event::Park(event) => self.on_park_event(event),
            Event::Parking(lane, epoch) => self.on_parking(&lane, epoch),
            Event::ParkUndone(lane, epoch) => self.uncount_parked(&lane, epoch),
            Event::Refenced(job) => self.refence(job),
            Event::Unblocked(lane) => {
                if let Some(state) = self.lanes.get_mut(&lane)
                    && state.blocked
                {
                    state.blocked = false;
                    let n = 1 + state.queue.len();
                    count_blocked(
                        &mut self.blocked,
                        &mut self.blocked_by,
                        &lane,
                        -n.cast_signed(),
                    );
                    self.held += n;
                }
            }
        }
    }

    /// Holds the partitions of blocked lanes paused ([`PauseReason::Blocked`]) once blocked
    /// messages reach `max_blocked` (other partitions keep flowing), and lets go of them once the
    /// blocked messages are down to half the bound or the partition has no blocked lane left.
    pub(in crate::runner) fn pause_blocked(&mut self) {
        let max = self.inner.config.max_blocked;
        if self.blocked * 2 <= max && self.blocked_paused.is_empty() {
            return;
        }
        let blocked_parts: HashSet<(String, i32, u64)> = if self.blocked * 2 > max {
            self.lanes
                .iter()
                .filter(|(_, s)| s.blocked)
                .map(|(l, _)| (l.topic.clone(), l.partition, l.generation))
                .collect()
        } else {
            HashSet::new()
        };
        let want: HashSet<(String, i32, u64)> = if self.blocked >= max {
            blocked_parts
        } else {
            self.blocked_paused
                .intersection(&blocked_parts)
                .cloned()
                .collect()
        };
        // Each partition's reason is set under its ownership: a partition reassigned while
        // paused is in both sets under two generations, and the old one's clearing leaves the new
        // one's alone. Other reasons (a full parked queue, backpressure) keep holding it.
        let mut newly = 0;
        {
            let mut shared = lock(&self.shared);
            for (topic, partition, generation) in self.blocked_paused.difference(&want) {
                let tp = (topic.clone(), *partition);
                shared
                    .pauses
                    .set(&tp, *generation, PauseReason::Blocked, false);
            }
            for (topic, partition, generation) in want.difference(&self.blocked_paused) {
                let tp = (topic.clone(), *partition);
                shared
                    .pauses
                    .set(&tp, *generation, PauseReason::Blocked, true);
                newly += 1;
            }
        }
        if newly > 0 {
            self.inner.counters.blocked_pauses.add(newly);
            debug!(
                partitions = newly,
                blocked = self.blocked,
                "pausing partitions with blocked messages"
            );
        }
        self.blocked_paused = want;
    }

    pub(in crate::runner) fn start(&mut self, job: Job) {
        let mut slot = Some(job);
        if self.parks_instead(&mut slot) {
            return;
        }
        let Some(mut job) = slot else {
            return;
        };
        job.park_epoch = self.park_epoch(&job.lane);
        let inner = self.inner.clone();
        let Some(done_tx) = self.done_tx.clone() else {
            return;
        };
        let events = done_tx.clone();
        tokio::spawn(async move {
            // Whatever happens to this task, the loop hears of the message: a task that dies
            // reports it abandoned (redelivered later), so its lane and the in-flight count go on.
            let mut report = Report {
                tx: Some(done_tx),
                lane: job.lane.clone(),
                offset: job.delivery.offset,
                settled: Settled::Abandoned,
                park_epoch: job.park_epoch,
            };
            // Handler panics are caught where the handler is called (and count as retryable
            // failures); this catches a panic anywhere else in the job, so that the message is
            // still settled (dead-lettered with the reason) and its partition moves on.
            report.settled = match AssertUnwindSafe(inner.run_job(&job, &events))
                .catch_unwind()
                .await
            {
                Ok(settled) => settled,
                Err(panic) => {
                    inner.counters.panics.add(1);
                    let reason = format!("the runner panicked: {}", panic_message(&*panic));
                    warn!(offset = job.delivery.offset, reason, "dead-lettering");
                    // A panic inside a park may have left the key counted: the partition's
                    // parked keys are read again from Postgres.
                    let _ = events.send(Event::Park(park::ParkEvent::Resync(job.lane.clone())));
                    inner.give_up(&job, &reason, 0, &events).await
                }
            };
            if report.settled == Settled::ParkFenced {
                report.tx = None;
                let _ = events.send(Event::Refenced(job));
            }
        });
    }

    pub(in crate::runner) fn settle(&mut self, done: Done) {
        self.on_parked(&done);
        match self.lanes.get_mut(&done.lane) {
            Some(state) if state.blocked => {
                // The blocked head settled without running (replayed, dead-lettered, or left):
                // the messages behind it are no longer blocked.
                state.blocked = false;
                let n = 1 + state.queue.len();
                self.held += state.queue.len();
                count_blocked(
                    &mut self.blocked,
                    &mut self.blocked_by,
                    &done.lane,
                    -n.cast_signed(),
                );
            }
            _ => self.held -= 1,
        }
        let c = &self.inner.counters;
        lock(&self.shared).settled(
            &(done.lane.topic.clone(), done.lane.partition),
            done.lane.generation,
            [(done.offset, done.settled)],
            c,
        );
        // The lane's next message, unless its partition has moved on.
        loop {
            let Some(state) = self.lanes.get_mut(&done.lane) else {
                return;
            };
            let Some(job) = state.queue.pop_front() else {
                self.lanes.remove(&done.lane);
                return;
            };
            if job.revoked.load(AtomicOrdering::Acquire) || *self.inner.stopping.borrow() {
                self.held -= 1;
                c.abandoned.add(1);
                continue;
            }
            self.start(job);
            return;
        }
    }
}

/// Moves `n` messages of `lane` into (or, negative, out of) the blocked count, in all and for
/// its partition and ownership.
pub(in crate::runner) fn count_blocked(
    blocked: &mut usize,
    by: &mut HashMap<(String, i32, u64), usize>,
    lane: &Lane,
    n: isize,
) {
    *blocked = blocked.saturating_add_signed(n);
    let key = (lane.topic.clone(), lane.partition, lane.generation);
    let entry = by.entry(key.clone()).or_default();
    *entry = entry.saturating_add_signed(n);
    if *entry == 0 {
        by.remove(&key);
    }
}

impl<S, H> Work for Loop<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    type Event = Event;

    fn source(&mut self) -> &mut Source {
        &mut self.source
    }

    fn shared(&self) -> &Arc<Mutex<Shared>> {
        &self.shared
    }

    fn pressure(&mut self) -> &mut Backpressure {
        &mut self.pressure
    }

    fn receive(&mut self, delivery: Delivery) {
        Loop::receive(self, delivery);
    }

    fn on_event(&mut self, event: Event) {
        Loop::on_event(self, event);
    }

    fn wake_at(&self) -> Option<Instant> {
        self.next_park
    }

    /// The parking tick: barriers, due heads, gauges, room.
    fn on_wake(&mut self) {
        self.park_tick();
        self.next_park = self
            .inner
            .park
            .as_ref()
            .map(|p| Instant::now() + p.cfg.poll);
    }

    fn after_turn(&mut self) {
        self.pause_blocked();
    }

    fn held(&self) -> usize {
        self.held
    }

    fn not_shared(&self) -> &HashMap<(String, i32, u64), usize> {
        &self.blocked_by
    }

    /// Queued messages are left to redelivery; running ones finish.
    fn drain_start(&mut self) {
        for lane in self.lanes.values_mut() {
            let dropped = std::mem::take(&mut lane.queue).len();
            if lane.blocked {
                // Only the totals: the loop shares nothing any more.
                self.blocked -= dropped;
            } else {
                self.held -= dropped;
            }
            self.inner.counters.abandoned.add(dropped as u64);
        }
        self.drop_waiting();
    }

    fn running(&self) -> usize {
        self.held + self.blocked
    }
}
