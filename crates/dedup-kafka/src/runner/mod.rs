//! The consumer loop: receive, dispatch into lanes, settle, commit what is durable.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::typed::CodecError;
use dedup_core::{
    Adoption, AfterHandlerError, Completion, Dedup, Fingerprint, HandlerError, IdempotencyKey,
    LeaseContext, ProcessError, Processed, Scope, Store,
};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep};
use tracing::{Instrument, debug, info, info_span, warn};

use futures_util::FutureExt;

use crate::config::{ConfigError, MissingKey, Ordering, RunnerConfig};
use crate::consumer::{
    Backpressure, Contact, PauseReason, Shared, Source, apply_pauses, clients, commit, lock,
    sleep_until_opt, until_refused,
};
use crate::dead_letter::DeadLetters;
use crate::delivery::{Delivery, KeyError, extract_key, ordering_key};
use crate::kill_switch::Breaker;
use crate::stats::{Counters, RunnerStats, StatsHandle};

mod park;
pub use park::{AfterGiveUp, Parking};

/// What the runner calls for each message.
///
/// `lease` is the dedup lease the message runs under (pass it to a transactional completion such
/// as `PgStore::transact`); it is `None` only for a keyless message under
/// [`MissingKey::ProcessWithoutDedup`]. Any `Fn(Arc<Delivery>, Option<LeaseContext>) -> Future`
/// closure is a handler.
pub trait Handler: Send + Sync + 'static {
    /// The handler's own error.
    type Error: fmt::Display + Send + 'static;

    /// Handles one message.
    fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> impl Future<Output = Result<Completion, HandlerError<Self::Error>>> + Send;

    /// Looks at a keyed message's result, fresh or replayed, before the message settles. An error
    /// dead-letters the message with [`ProcessError::Undecodable`]'s text as the reason (a typed
    /// result that no longer decodes: see [`Typed`](crate::Typed)). The default accepts every
    /// result.
    ///
    /// # Errors
    /// The result cannot be used.
    fn check_result(&self, delivery: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        let _ = (delivery, processed);
        Ok(())
    }
}

impl<F, Fut, E> Handler for F
where
    F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Completion, HandlerError<E>>> + Send,
    E: fmt::Display + Send + 'static,
{
    type Error = E;

    fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> impl Future<Output = Result<Completion, HandlerError<E>>> + Send {
        self(delivery, lease)
    }
}

/// A message is retried until it settles, so a handler's `Withdraw` (give the key back, spend no
/// attempt) would retry it without end: the runner counts it as a retryable failure.
pub(crate) fn no_withdraw<E>(
    r: Result<Completion, HandlerError<E>>,
) -> Result<Completion, HandlerError<E>> {
    match r {
        Err(HandlerError::Withdraw(e)) => Err(HandlerError::Retryable(e)),
        other => other,
    }
}

/// Why a runner could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// The configuration is not usable: the error names the setting.
    #[error("bad runner configuration: {0}")]
    Config(#[from] ConfigError),
    /// The Kafka client failed to start or to subscribe.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The cluster refused this client before it ever joined: a certificate it does not trust
    /// (or one that does not name the broker), or a refused SASL login. The reason names the
    /// broker; retrying without a change of configuration cannot help.
    #[error("the Kafka cluster refused this client (TLS or SASL): {0}")]
    Refused(String),
}

impl RunnerError {
    /// Whether starting again may help (a broker that was down); a bad configuration will not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Kafka(_))
    }
}

/// An idempotent consumer: runs every message through [`Dedup::process`] and commits an offset
/// only once every message before it is settled (completed, replayed, or dead-lettered).
#[derive(Debug)]
pub struct Runner<S, H> {
    config: RunnerConfig,
    scope: Scope,
    dedup: Arc<Dedup<S>>,
    handler: H,
    counters: Arc<Counters>,
    park: Option<Arc<park::ParkCtx>>,
    /// Where dead letters the dead-letter topic refuses for good are kept.
    refused: Option<Arc<dyn crate::dead_letter::RefusedTable>>,
}

/// Which messages must wait for each other: one partition (of one ownership), and with
/// `Ordering::PerKey` one ordering key in it (`None`: the partition's messages without one).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Lane {
    topic: String,
    partition: i32,
    generation: u64,
    key: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Job {
    delivery: Arc<Delivery>,
    key: Result<IdempotencyKey, KeyError>,
    revoked: Arc<AtomicBool>,
    lane: Lane,
    /// The partition's parking epoch when the message started (with parking).
    park_epoch: Option<i64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Settled {
    Executed,
    Replayed,
    DeadLettered,
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
    /// Left unsettled (revoked or shutting down): it will be redelivered.
    Abandoned,
}

#[derive(Debug)]
struct Done {
    lane: Lane,
    offset: i64,
    settled: Settled,
    /// The parking epoch the message started under: a count it changes applies only while the
    /// partition is still under that epoch (a new barrier has counted afresh).
    park_epoch: Option<i64>,
}

/// What a message's task tells the loop.
#[derive(Debug)]
enum Event {
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
struct LaneState {
    queue: VecDeque<Job>,
    /// The head is blocked on another holder's lease: the lane counts as blocked, not held.
    blocked: bool,
}

/// Sends a message's [`Done`] when dropped: at the end of its task, or while a panic unwinds it.
struct Report {
    tx: Option<mpsc::UnboundedSender<Event>>,
    lane: Lane,
    offset: i64,
    settled: Settled,
    park_epoch: Option<i64>,
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

struct Inner<S, H> {
    config: RunnerConfig,
    dedup: Arc<Dedup<S>>,
    handler: H,
    dead_letters: DeadLetters,
    counters: Arc<Counters>,
    stopping: watch::Receiver<bool>,
    park: Option<Arc<park::ParkCtx>>,
    breaker: Breaker,
}

impl<S, H> Runner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// A runner over `dedup` calling `handler`. Every setting is checked here
    /// ([`RunnerConfig::validate`]), so a configuration that could fail at run time is refused
    /// now, with the setting named.
    pub fn new(
        config: RunnerConfig,
        dedup: Arc<Dedup<S>>,
        handler: H,
    ) -> Result<Self, RunnerError> {
        config.validate()?;
        let scope = scope_of(&config)?;
        Ok(Self {
            config,
            scope,
            dedup,
            handler,
            counters: Arc::new(Counters::default()),
            park: None,
            refused: None,
        })
    }

    /// Keeps the dead letters that the dead-letter topic refuses for good (larger than it
    /// accepts, invalid) in `store`'s `dedup_dead_letters` table (`dedup dead-letters`), instead
    /// of stalling their partition. With parking, its Postgres store keeps them already.
    #[cfg(feature = "pg")]
    #[must_use]
    pub fn with_dead_letter_table(mut self, store: dedup_pg::PgStore) -> Self {
        self.refused = Some(Arc::new(store));
        self
    }

    /// A handle to the runner's counters, readable while it runs.
    pub fn stats(&self) -> StatsHandle {
        StatsHandle(self.counters.clone())
    }

    /// Consumes until `shutdown` completes, then drains, commits and leaves the group.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<RunnerStats, RunnerError> {
        let scope = self.scope.clone();
        let shared = Arc::new(Mutex::new(Shared::default()));
        adopt_at_start(&self.dedup).await;
        let contact = Arc::new(Contact::default());
        let (source, dead_letters) = clients(
            &self.config,
            &shared,
            &self.counters,
            None,
            &contact,
            self.refused,
        )?;
        let (shutdown, refused) = until_refused(shutdown, &contact);

        let (stop_tx, stop_rx) = watch::channel(false);
        let breaker = Breaker::new(self.config.kill_switch, self.counters.clone());
        let inner = Arc::new(Inner {
            config: self.config,
            dedup: self.dedup,
            handler: self.handler,
            dead_letters,
            counters: self.counters.clone(),
            stopping: stop_rx,
            park: self.park,
            breaker,
        });
        let mut lp = Loop {
            inner: inner.clone(),
            source,
            shared,
            scope,
            lanes: HashMap::new(),
            held: 0,
            blocked: 0,
            blocked_by: HashMap::new(),
            blocked_paused: HashSet::new(),
            pressure: Backpressure::default(),
            done_tx: None,
            parks: park::Parks::default(),
        };
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        lp.done_tx = Some(done_tx);

        let mut commit_tick = tokio::time::interval(inner.config.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let parking = inner.park.is_some();
        let mut park_tick = tokio::time::interval(
            inner
                .park
                .as_ref()
                .map_or(Duration::from_secs(3600), |p| p.cfg.poll),
        );
        park_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(event) = done_rx.recv() => lp.on_event(event),
                _ = commit_tick.tick() => lp.commit(CommitMode::Async),
                _ = park_tick.tick(), if parking => lp.park_tick(),
                () = sleep_until_opt(lp.pressure.stall_deadline()), if lp.pressure.stall_deadline().is_some() => {
                    lp.pressure.set_paused(true, &lp.shared, &inner.counters);
                }
                // The kill switch opened, or its pause is over: the pause reason follows it.
                () = inner.breaker.opened() => {}
                () = sleep_until_opt(inner.breaker.open_until()), if inner.breaker.is_open() => {}
                d = lp.source.recv(&inner.counters), if lp.pressure.taking() => {
                    if let Some(d) = d {
                        lp.receive(d);
                    }
                }
            }
            lp.pressure.update(
                lp.held,
                inner.config.max_in_flight,
                &lp.shared,
                &inner.counters,
            );
            lp.pause_blocked();
            lock(&lp.shared)
                .pauses
                .set_all(PauseReason::KillSwitch, inner.breaker.is_open());
            apply_pauses(&*lp.source.consumer, &lp.shared);
            lp.source
                .share(&lp.shared, inner.config.max_in_flight, &lp.blocked_by);
        }

        // Shutdown: running messages finish (their retries stop), queued ones are left to
        // redelivery, settled offsets are committed.
        info!(held = lp.held, blocked = lp.blocked, "runner draining");
        let _ = stop_tx.send(true);
        lp.source.stop();
        for lane in lp.lanes.values_mut() {
            let dropped = std::mem::take(&mut lane.queue).len();
            if lane.blocked {
                lp.blocked -= dropped;
                // Not read again: the loop stops sharing.
            } else {
                lp.held -= dropped;
            }
            inner.counters.abandoned.add(dropped as u64);
        }
        lp.drop_waiting();
        let deadline = Instant::now() + inner.config.drain_timeout;
        while lp.held + lp.blocked > 0 {
            tokio::select! {
                Some(event) = done_rx.recv() => lp.on_event(event),
                // Keep serving rebalance callbacks; new messages are not taken.
                _ = lp.source.consumer.recv() => {}
                () = tokio::time::sleep_until(deadline) => {
                    warn!(held = lp.held, blocked = lp.blocked, "drain timed out; the rest will be redelivered");
                    break;
                }
            }
        }
        lp.commit(CommitMode::Sync);
        lp.source.stop();
        lp.source.consumer.unsubscribe();
        if let Err(e) = inner.dead_letters.flush(Duration::from_secs(10)) {
            warn!(error = %e, "dead-letter producer flush");
        }
        info!("runner stopped");
        if let Some(reason) = refused.get() {
            return Err(RunnerError::Refused(reason.clone()));
        }
        Ok(StatsHandle(inner.counters.clone()).snapshot())
    }
}

struct Loop<S, H> {
    inner: Arc<Inner<S, H>>,
    source: Source,
    shared: Arc<Mutex<Shared>>,
    scope: Scope,
    lanes: HashMap<Lane, LaneState>,
    /// Messages received and not settled, running or waiting in a lane, except those of blocked
    /// lanes: what `max_in_flight` bounds.
    held: usize,
    /// Messages of blocked lanes (a head waiting for another holder's lease, and the messages
    /// queued behind it): what `max_blocked` bounds.
    blocked: usize,
    /// `blocked` per partition and ownership (they do not count against the partition's share).
    blocked_by: HashMap<(String, i32, u64), usize>,
    /// The partitions (of one ownership) paused because blocked messages reached their bound.
    blocked_paused: HashSet<(String, i32, u64)>,
    pressure: Backpressure,
    done_tx: Option<mpsc::UnboundedSender<Event>>,
    parks: park::Parks,
}

impl<S, H> Loop<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    fn receive(&mut self, delivery: Delivery) {
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
    fn place(&mut self, job: Job) {
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

    fn on_event(&mut self, event: Event) {
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
    fn pause_blocked(&mut self) {
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

    fn start(&mut self, job: Job) {
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

    fn settle(&mut self, done: Done) {
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
        match done.settled {
            Settled::Executed => c.executed.add(1),
            Settled::Replayed => c.replayed.add(1),
            Settled::DeadLettered
            | Settled::DeadLetteredHeld
            | Settled::DeadLetteredHeldAgain
            | Settled::BehindDeadLettered => c.dead_lettered.add(1),
            Settled::ProcessedWithoutDedup => c.processed_without_dedup.add(1),
            // Counted where they were parked.
            Settled::Parked | Settled::ParkedBehind | Settled::ParkedAlready => {}
            Settled::Abandoned
            | Settled::ParkRefused
            | Settled::ParkFenced
            | Settled::ParkImpossible => c.abandoned.add(1),
        }
        if !matches!(
            done.settled,
            Settled::Abandoned
                | Settled::ParkRefused
                | Settled::ParkFenced
                | Settled::ParkImpossible
        ) {
            let mut shared = lock(&self.shared);
            if let Some(part) = shared
                .parts
                .get_mut(&(done.lane.topic.clone(), done.lane.partition))
                && part.generation == done.lane.generation
            {
                part.pending.remove(&done.offset);
            }
        }
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

impl<S, H> Loop<S, H> {
    fn commit(&self, mode: CommitMode) {
        commit(
            &self.source.consumer,
            &self.shared,
            &self.inner.counters,
            mode,
        );
    }
}

impl<S, H> Inner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    fn abandoned(&self, job: &Job) -> bool {
        job.revoked.load(AtomicOrdering::Acquire) || *self.stopping.borrow()
    }

    /// Waits while the kill switch is open; false if the job should be abandoned instead.
    async fn wait_while_open(&self, job: &Job) -> bool {
        if self.breaker.is_open() {
            let mut stopping = self.stopping.clone();
            tokio::select! {
                () = self.breaker.wait_until_shut() => {}
                _ = stopping.wait_for(|s| *s) => {}
            }
        }
        !self.abandoned(job)
    }

    /// Waits before retry `n`; false if the job should be abandoned instead.
    async fn wait_retry(&self, job: &Job, n: u32) -> bool {
        self.counters.retries.add(1);
        let mut stopping = self.stopping.clone();
        tokio::select! {
            () = sleep(self.config.backoff.delay(n)) => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
        !self.abandoned(job)
    }

    async fn run_job(&self, job: &Job, events: &mpsc::UnboundedSender<Event>) -> Settled {
        let d = &job.delivery;
        let span = info_span!(
            "dedup.kafka.message",
            "messaging.system" = "kafka",
            "messaging.destination.name" = %d.topic,
            "messaging.kafka.partition" = d.partition,
            "messaging.kafka.offset" = d.offset,
            outcome = tracing::field::Empty,
        );
        crate::trace::set_parent(&span, d);
        let started = Instant::now();
        let settled = async {
            match &job.key {
                Ok(key) => self.run_keyed(job, key, events).await,
                Err(KeyError::Missing(why)) => {
                    self.counters.missing_key.add(1);
                    match self.config.missing_key {
                        MissingKey::DeadLetter => {
                            warn!(topic = %d.topic, partition = d.partition, offset = d.offset, why, "message without an idempotency key: dead-lettered");
                            self.give_up(job, &format!("no idempotency key: {why}"), 0, events)
                                .await
                        }
                        MissingKey::ProcessWithoutDedup => {
                            warn!(topic = %d.topic, partition = d.partition, offset = d.offset, why, "message without an idempotency key: processed without dedup");
                            self.run_unkeyed(job).await
                        }
                    }
                }
                Err(e) => {
                    self.counters.bad_key.add(1);
                    warn!(topic = %d.topic, partition = d.partition, offset = d.offset, error = %e, "bad idempotency key: dead-lettered");
                    self.give_up(job, &e.to_string(), 0, events).await
                }
            }
        }
        .instrument(span.clone())
        .await;
        span.record("outcome", format!("{settled:?}").to_lowercase());
        if settled != Settled::Abandoned {
            self.counters
                .latency
                .record(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        }
        settled
    }

    /// Runs a keyed message until it settles. A key another holder runs is not waited for
    /// inside the claim: the message tells the loop it is blocked (its lane leaves the in-flight
    /// bound for the blocked one) and tries again with backoff; it tells the loop again when its
    /// claim is granted, before its handler starts.
    async fn run_keyed(
        &self,
        job: &Job,
        key: &IdempotencyKey,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Settled {
        let fingerprint = self
            .config
            .check_payload
            .then(|| Fingerprint::of(job.delivery.payload_bytes()));
        let mut retry = 0;
        let mut failed_runs = 0;
        let mut blocked = false;
        // Postgres refused to park it for good: it runs on in place.
        let mut unparkable = false;
        loop {
            // An open kill switch starts no handler until its pause is over.
            if !self.wait_while_open(job).await {
                return Settled::Abandoned;
            }
            let delivery = job.delivery.clone();
            let handler = &self.handler;
            let breaker = &self.breaker;
            let granted = AtomicBool::new(false);
            let granted_ref = &granted;
            let unblock = blocked.then(|| (events.clone(), job.lane.clone()));
            let out = self
                .dedup
                .try_process(key, fingerprint, move |lease| {
                    granted_ref.store(true, AtomicOrdering::Relaxed);
                    if let Some((events, lane)) = unblock {
                        let _ = events.send(Event::Unblocked(lane));
                    }
                    handler
                        .handle(delivery, Some(lease))
                        .map(no_withdraw)
                        .map(|r| breaker.judge(r))
                })
                .await;
            if matches!(out, Err(ProcessError::Panicked { .. })) {
                self.breaker.failure();
            }
            if granted.load(AtomicOrdering::Relaxed) {
                blocked = false;
            }
            if let Err(ProcessError::InFlight { owner, .. }) = &out
                && !blocked
            {
                blocked = true;
                self.counters.blocked.add(1);
                debug!(key = %key, owner = ?owner, "held by another holder: blocked");
                let _ = events.send(Event::Blocked(job.lane.clone()));
            }
            let err = match out {
                Ok(processed) => {
                    // A panicking check is the user's code failing on this result: given up
                    // with the reason, as the parked-head path does (never a loop of panics).
                    let check = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        self.handler.check_result(&job.delivery, &processed)
                    }));
                    match check {
                        Ok(Ok(())) if processed.executed() => return Settled::Executed,
                        Ok(Ok(())) => return Settled::Replayed,
                        Ok(Err(source)) => ProcessError::Undecodable {
                            key: key.clone(),
                            source,
                        },
                        Err(panic) => {
                            self.counters.panics.add(1);
                            let reason =
                                format!("checking the result panicked: {}", panic_message(&*panic));
                            warn!(key = %key, reason, "dead-lettering");
                            return self.give_up(job, &reason, retry + 1, events).await;
                        }
                    }
                }
                Err(e) => e,
            };
            if matches!(err, ProcessError::Panicked { .. }) {
                self.counters.panics.add(1);
            }
            if err.is_retryable() {
                retry += 1;
                // Runs that failed: not a wait for another holder, nor a store that is down.
                if !matches!(err, ProcessError::InFlight { .. } | ProcessError::Store(_)) {
                    failed_runs += 1;
                }
                if !unparkable && self.should_park(&err, failed_runs) {
                    let attempts = attempts_of(&err, retry);
                    let _ = events.send(Event::Parking(job.lane.clone(), job.park_epoch));
                    match self.park(job, &err.to_string(), attempts, false).await {
                        Settled::ParkImpossible => {
                            // The key's head: it keeps its place and retries in place, as
                            // without parking, until its attempts are spent.
                            unparkable = true;
                            let _ =
                                events.send(Event::ParkUndone(job.lane.clone(), job.park_epoch));
                        }
                        settled => return settled,
                    }
                }
                if let ProcessError::Store(e) = &err {
                    self.counters.store_errors.add(1);
                    warn!(key = %key, error = %e, retry, "store unavailable; retrying");
                } else {
                    debug!(key = %key, error = %err, retry, "retrying");
                }
                if !self.wait_retry(job, retry).await {
                    return Settled::Abandoned;
                }
                continue;
            }
            let attempts = attempts_of(&err, retry + 1);
            warn!(key = %key, error = %err, attempts, "dead-lettering");
            return self.give_up(job, &err.to_string(), attempts, events).await;
        }
    }

    async fn run_unkeyed(&self, job: &Job) -> Settled {
        let max = self.dedup.policy().max_attempts;
        let mut attempt = 0;
        loop {
            if !self.wait_while_open(job).await {
                return Settled::Abandoned;
            }
            attempt += 1;
            let call = AssertUnwindSafe(
                self.handler
                    .handle(job.delivery.clone(), None)
                    .map(no_withdraw),
            );
            let out = call.catch_unwind().await;
            // Judged by the kill switch: a failure it withdraws spends no attempt.
            if matches!(out, Ok(Ok(_))) {
                self.breaker.success();
            } else if self.breaker.failure() {
                attempt -= 1;
                if !self.wait_retry(job, attempt.max(1)).await {
                    return Settled::Abandoned;
                }
                continue;
            }
            let out = match out {
                Ok(out) => out,
                Err(panic) => {
                    self.counters.panics.add(1);
                    let msg = format!("handler panicked: {}", panic_message(&*panic));
                    if attempt >= max {
                        return self.dead_letter(job, &msg, attempt).await;
                    }
                    warn!(attempt, msg, "retrying a keyless message");
                    if !self.wait_retry(job, attempt).await {
                        return Settled::Abandoned;
                    }
                    continue;
                }
            };
            let reason = match out {
                Ok(_) => return Settled::ProcessedWithoutDedup,
                Err(HandlerError::Permanent(e)) => format!("the handler failed permanently: {e}"),
                Err(HandlerError::Retryable(e)) if attempt >= max => {
                    format!("the handler failed {attempt} time(s); last: {e}")
                }
                Err(HandlerError::Store(e)) if !e.is_retryable() || attempt >= max => {
                    format!("the handler's store call failed: {e}")
                }
                Err(e) => {
                    debug!(attempt, error = %DisplayHandlerError(&e), "retrying a keyless message");
                    if !self.wait_retry(job, attempt).await {
                        return Settled::Abandoned;
                    }
                    continue;
                }
            };
            return self.dead_letter(job, &reason, attempt).await;
        }
    }

    /// Gives the message up to the dead-letter topic (or, refused there for good, to Postgres)
    /// and waits until it is there: the offset must not move past a message that is nowhere.
    async fn dead_letter(&self, job: &Job, reason: &str, attempts: u32) -> Settled {
        let delivered = self
            .dead_letters
            .deliver(
                &job.delivery,
                reason,
                attempts,
                job.key.as_ref().ok(),
                &self.counters,
                &self.config.backoff,
                &self.stopping,
                &|| self.abandoned(job),
            )
            .await;
        match delivered {
            Some(_) => Settled::DeadLettered,
            None => Settled::Abandoned,
        }
    }
}

/// With an instance identity, ends the leases an earlier incarnation of it left behind, before
/// anything is consumed (their messages are redelivered to us, or to whoever owns them now, and
/// taken over at once). A failure only leaves those leases to run out.
pub(crate) async fn adopt_at_start<S: Store>(dedup: &Dedup<S>) {
    match dedup.adopt().await {
        Ok(Adoption::Adopted(records)) => {
            info!(adopted = records.len(), instance = ?dedup.instance(), "adopted the leases of earlier incarnations");
        }
        Ok(Adoption::HeldElsewhere) => {
            warn!(instance = ?dedup.instance(), "another live process has this instance identity: its leases are left to run out");
        }
        Ok(_) => {}
        Err(e) => {
            warn!(error = %e, "adopting earlier incarnations' leases failed: they run out as usual")
        }
    }
}

/// Moves `n` messages of `lane` into (or, negative, out of) the blocked count, in all and for
/// its partition and ownership.
fn count_blocked(
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

/// The attempts an error says were made, or `otherwise`.
pub(crate) fn attempts_of<E>(err: &ProcessError<E>, otherwise: u32) -> u32 {
    match err {
        ProcessError::Failed { attempts, .. } => *attempts,
        ProcessError::Handler {
            after: AfterHandlerError::Failed { attempts },
            ..
        }
        | ProcessError::Panicked {
            after: AfterHandlerError::Failed { attempts },
            ..
        } => *attempts,
        _ => otherwise,
    }
}

/// The dedup scope of a runner: the configured one, or the group id.
pub(crate) fn scope_of(config: &RunnerConfig) -> Result<Scope, ConfigError> {
    Scope::new(config.scope.as_deref().unwrap_or(&config.group_id)).map_err(|e| ConfigError {
        setting: if config.scope.is_some() {
            "scope"
        } else {
            "group_id"
        },
        problem: format!("not usable as a dedup scope: {e}"),
    })
}

/// A panic's message, where it has one.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

pub(crate) struct DisplayHandlerError<'a, E>(pub(crate) &'a HandlerError<E>);

impl<E: fmt::Display> fmt::Display for DisplayHandlerError<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            HandlerError::Retryable(e) => write!(f, "retryable: {e}"),
            HandlerError::Permanent(e) => write!(f, "permanent: {e}"),
            HandlerError::Withdraw(e) => write!(f, "withdrawn: {e}"),
            HandlerError::Store(e) => write!(f, "store: {e}"),
            _ => f.write_str("handler error"),
        }
    }
}
