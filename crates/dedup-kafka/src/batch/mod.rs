//! The runners of batches: each partition's received messages are queued and taken in batches
//! (up to a size, or a short wait), one batch per partition at a time, partitions concurrently;
//! the loop here (`run_loop`) is shared by transaction mode ([`TxRunner`], `tx/`) and lease mode
//! ([`LeaseRunner`], `lease.rs`), which differ only in how they run a batch (`exec.rs`: `Exec`).
//!
//! Within a batch the messages of one ordering group (the partition under
//! [`Ordering::PerPartition`], the ordering key under [`Ordering::PerKey`]) keep their order: once
//! one does not settle, the group's later messages wait for it, and the next batch takes them
//! after it.
//!
//! A batch runs when its partition has `Batching::size` (500) messages waiting or its oldest has
//! waited `Batching::wait` (5 ms). A partition's running batch is remembered with its generation:
//! after a revocation and a reassignment the new ownership waits for the old batch to end, then
//! goes on.

mod batching;
mod exec;
mod lease;
mod tx;

pub use batching::{Batching, MAX_BATCH};
pub(crate) use lease::LeaseRunner;
pub use tx::{Acquired, MAX_ASSIGNMENT_WAIT};
pub(crate) use tx::{BatchHandler, TxRunner};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{Fingerprint, IdempotencyKey, Scope};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::warn;

use crate::config::Ordering;
use crate::consumer::{Backpressure, Drive, Settled, Shared, Source, TopicPartition, Work, lock};
use crate::delivery::{Delivery, KeyError, extract_key, ordering_key};
use crate::stats::{RunnerStats, StatsHandle};
use exec::Exec;

/// The loop of a runner of batches: receive, queue per partition, run batches, settle, commit;
/// then drain, commit and leave the group.
pub(crate) async fn run_loop<X: Exec>(
    inner: Arc<X>,
    source: Source,
    shared: Arc<Mutex<Shared>>,
    scope: Scope,
    stop_tx: watch::Sender<bool>,
    shutdown: impl Future<Output = ()>,
) -> RunnerStats {
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut lp = Loop {
        inner: inner.clone(),
        source,
        shared,
        scope,
        parts: HashMap::new(),
        held: 0,
        running: 0,
        pressure: Backpressure::default(),
        done_tx,
        stored: Arc::new(Mutex::new(HashMap::new())),
        storing: None,
        none: HashMap::new(),
    };
    let common = inner.common();
    Drive {
        counters: &common.counters,
        breaker: &common.breaker,
        dead_letters: &common.dead_letters,
        max_in_flight: common.config.max_in_flight,
        commit_interval: common.config.commit_interval,
        drain_timeout: common.config.drain_timeout,
    }
    .run(&mut lp, &mut done_rx, &stop_tx, shutdown)
    .await;
    StatsHandle(common.counters.clone()).snapshot()
}

impl<X: Exec> Work for Loop<X> {
    type Event = Done;

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

    fn on_event(&mut self, done: Done) {
        self.settle(done);
    }

    fn wake_at(&self) -> Option<Instant> {
        self.next_batch_at()
    }

    /// A batch is due: `after_turn` starts it.
    fn on_wake(&mut self) {}

    fn after_turn(&mut self) {
        self.dispatch_ready();
    }

    fn on_commit(&mut self) {
        self.store_moved();
    }

    fn held(&self) -> usize {
        self.held
    }

    fn not_shared(&self) -> &HashMap<(String, i32, u64), usize> {
        &self.none
    }

    /// Queued messages are left to redelivery; running batches finish (their dead-letter
    /// retries stop).
    fn drain_start(&mut self) {
        let queued: usize = self
            .parts
            .values_mut()
            .map(|p| std::mem::take(&mut p.queue).len())
            .sum();
        self.held -= queued;
        self.inner.common().counters.abandoned.add(queued as u64);
    }

    fn running(&self) -> usize {
        self.running
    }

    /// The positions last: after any write under way, whatever moved since.
    async fn finish(&mut self) {
        if let Some(under_way) = self.storing.take() {
            let _ = under_way.await;
        }
        if let Some(last) = self.store_positions() {
            let _ = last.await;
        }
    }
}

/// A message waiting for its batch.
#[derive(Clone, Debug)]
pub(crate) struct Item {
    pub(crate) delivery: Arc<Delivery>,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Option<Fingerprint>,
    /// Its ordering group: the messages of one group keep their order.
    pub(crate) group: u64,
    /// Retries so far (for the backoff).
    pub(crate) retries: u32,
    /// Not before this (a retry's backoff).
    pub(crate) due: Option<Instant>,
    /// Runs in a batch of its own (its batch failed as a whole for good).
    pub(crate) solo: bool,
    pub(crate) received: Instant,
}

/// What the loop hears when a batch (or a lone dead letter) is over.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) tp: TopicPartition,
    pub(crate) generation: u64,
    /// A batch (the partition may run its next one), or a message dead-lettered on its own.
    pub(crate) batch: bool,
    pub(crate) settled: Vec<(i64, Settled)>,
    /// Messages to run again (not settled; in offset order).
    pub(crate) again: Vec<Item>,
}

/// A partition's messages waiting for a batch, under one ownership.
#[derive(Debug)]
struct Queue {
    generation: u64,
    revoked: Arc<AtomicBool>,
    /// In offset order.
    queue: Vec<Item>,
    /// The generation of the batch running on this partition, if one is: a batch of an earlier
    /// ownership still holds the partition until it is over, whatever the generation is now.
    running: Option<u64>,
    /// When the oldest waiting message began to wait.
    since: Option<Instant>,
}

struct Loop<X> {
    inner: Arc<X>,
    source: Source,
    shared: Arc<Mutex<Shared>>,
    scope: Scope,
    parts: HashMap<TopicPartition, Queue>,
    /// Messages received and not settled: queued, in a running batch, or being dead-lettered.
    held: usize,
    /// Tasks running (batches and lone dead letters).
    running: usize,
    pressure: Backpressure,
    done_tx: mpsc::UnboundedSender<Done>,
    /// Offsets in the transaction: the positions stored outside a batch (updated once stored).
    stored: Arc<Mutex<HashMap<TopicPartition, i64>>>,
    /// The write of those positions under way, if one is.
    storing: Option<tokio::task::JoinHandle<()>>,
    /// Nothing held here escapes its partition's share.
    none: HashMap<(String, i32, u64), usize>,
}

/// When a partition's waiting messages should run, less the batch wait: now for those that can
/// run now (they wait another round), and for a retry, or a message of its group behind it, the
/// retry's due time. `None` for an empty queue.
fn waiting_since(queue: &[Item], now: Instant, wait: Duration) -> Option<Instant> {
    let mut ready_by_group: HashMap<u64, Instant> = HashMap::new();
    queue
        .iter()
        .map(|i| {
            let behind = ready_by_group.get(&i.group).copied().unwrap_or(now);
            let ready = i.due.unwrap_or(now).max(behind);
            ready_by_group.insert(i.group, ready);
            if ready <= now {
                now
            } else {
                ready.checked_sub(wait).unwrap_or(ready).max(now)
            }
        })
        .min()
}

/// The ordering group of messages without an ordering key under `PerKey`, and of every message
/// under `PerPartition`.
const PARTITION_GROUP: u64 = u64::MAX;

impl<X: Exec> Loop<X> {
    /// After each periodic commit, offsets in the transaction: the positions that moved without
    /// a batch are stored, unless a write of them is under way.
    fn store_moved(&mut self) {
        if self
            .storing
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
        {
            self.storing = self.store_positions();
        }
    }

    /// Offsets in the transaction: stores the positions that moved without a batch (dead letters
    /// acknowledged, a partition started from its stored position), forward only. A position is
    /// taken as stored once the write succeeded; a failed one is written again next time.
    fn store_positions(&self) -> Option<tokio::task::JoinHandle<()>> {
        let store = self.inner.positions()?.clone();
        let mut moved = Vec::new();
        {
            let shared = lock(&self.shared);
            let stored = self
                .stored
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (tp, part) in &shared.parts {
                if let Some(pos) = part.position()
                    && stored.get(tp).is_none_or(|&s| pos > s)
                {
                    moved.push((tp.clone(), pos));
                }
            }
        }
        if moved.is_empty() {
            return None;
        }
        let group = self.inner.common().config.group_id.clone();
        let stored = Arc::clone(&self.stored);
        Some(tokio::spawn(async move {
            let positions: Vec<(&str, i32, i64)> = moved
                .iter()
                .map(|((t, p), o)| (t.as_str(), *p, *o))
                .collect();
            match tx::offsets::store_offsets(&store, &group, &positions).await {
                Ok(()) => {
                    let mut stored = stored
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for (tp, pos) in moved {
                        let s = stored.entry(tp).or_insert(pos);
                        *s = (*s).max(pos);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "storing positions failed; the next commit tries again");
                }
            }
        }))
    }

    fn receive(&mut self, delivery: Delivery) {
        let c = &self.inner.common().counters;
        c.received.add(1);
        let tp = (delivery.topic.clone(), delivery.partition);
        let Some((generation, revoked)) = lock(&self.shared).received(&tp, delivery.offset) else {
            return;
        };
        self.held += 1;
        let delivery = Arc::new(delivery);
        let key = match extract_key(&self.inner.common().config.key, &self.scope, &delivery) {
            Ok(key) => key,
            Err(e) => {
                let reason = match &e {
                    KeyError::Missing(why) => {
                        c.missing_key.add(1);
                        format!("no idempotency key: {why}")
                    }
                    e => {
                        c.bad_key.add(1);
                        e.to_string()
                    }
                };
                warn!(topic = %tp.0, partition = tp.1, offset = delivery.offset, reason, "dead-lettering");
                self.running += 1;
                let (inner, tx) = (self.inner.clone(), self.done_tx.clone());
                tokio::spawn(async move {
                    let settled = inner
                        .common()
                        .dead_letter(&delivery, &reason, 0, None, &revoked)
                        .await;
                    let _ = tx.send(Done {
                        tp,
                        generation,
                        batch: false,
                        settled: vec![(delivery.offset, settled)],
                        again: Vec::new(),
                    });
                });
                return;
            }
        };
        let group = match self.inner.common().config.ordering {
            Ordering::PerKey => ordering_key(&self.inner.common().config.ordering_key, &delivery)
                .map_or(PARTITION_GROUP, |k| {
                    let mut h = DefaultHasher::new();
                    k.hash(&mut h);
                    h.finish()
                }),
            _ => PARTITION_GROUP,
        };
        let fingerprint = self
            .inner
            .common()
            .config
            .check_payload
            .then(|| Fingerprint::of(delivery.payload_bytes()));
        let item = Item {
            delivery,
            key,
            fingerprint,
            group,
            retries: 0,
            due: None,
            solo: false,
            received: Instant::now(),
        };
        let q = self.parts.entry(tp).or_insert_with(|| Queue {
            generation,
            revoked: revoked.clone(),
            queue: Vec::new(),
            running: None,
            since: None,
        });
        if q.generation != generation {
            // A new ownership: what was queued under the old one is redelivered to its owner.
            let old = std::mem::take(&mut q.queue).len();
            self.held -= old;
            c.abandoned.add(old as u64);
            *q = Queue {
                generation,
                revoked,
                queue: Vec::new(),
                running: q.running,
                since: None,
            };
        }
        // The batch is due one wait after its oldest runnable message arrived; a queue waiting
        // only on a retry's backoff gets a new runnable message now (the dispatch then works out
        // what really waits behind that retry).
        let now = Instant::now();
        q.since = Some(q.since.map_or(now, |s| s.min(now)));
        q.queue.push(item);
    }

    /// When the next batch is due to run, if one waits (none while the kill switch is open).
    fn next_batch_at(&self) -> Option<Instant> {
        if self.inner.common().breaker.is_open() {
            return None;
        }
        self.parts
            .values()
            .filter(|q| q.running.is_none() && !q.queue.is_empty())
            .filter_map(|q| q.since.map(|s| s + self.inner.common().batching.wait))
            .min()
    }

    /// Starts a batch on every partition whose batch is full or has waited long enough.
    fn dispatch_ready(&mut self) {
        let now = Instant::now();
        let (size, wait) = (
            self.inner.common().batching.size,
            self.inner.common().batching.wait,
        );
        // An open kill switch starts no batch until its pause is over.
        let stopping =
            *self.inner.common().stopping.borrow() || self.inner.common().breaker.is_open();
        let shared = self.shared.clone();
        let mut abandoned = 0;
        for (tp, q) in &mut self.parts {
            if q.revoked.load(AtomicOrdering::Acquire) && !q.queue.is_empty() {
                abandoned += std::mem::take(&mut q.queue).len();
                continue;
            }
            if stopping || q.running.is_some() || q.queue.is_empty() {
                continue;
            }
            let full = q.queue.len() >= size;
            if !full && q.since.is_some_and(|s| s + wait > now) {
                continue;
            }
            // In offset order: a message is taken if it is due and nothing of its group stays
            // behind before it.
            // A message whose batch failed as a whole for good runs in a batch of its own, so that
            // only it can be dead-lettered for that.
            // Where a batch runs its handlers at once, a group gives it one key (with its
            // repeats) at a time.
            let one_key = !self.inner.groups_in_batch();
            let mut blocked: HashSet<u64> = HashSet::new();
            let mut group_key: HashMap<u64, IdempotencyKey> = HashMap::new();
            let mut take: Vec<Item> = Vec::new();
            let mut keep = Vec::new();
            let mut closed = false;
            for item in std::mem::take(&mut q.queue) {
                let free = !closed
                    && take.len() < size
                    && !blocked.contains(&item.group)
                    && item.due.is_none_or(|d| d <= now)
                    && (!item.solo || take.is_empty())
                    && !(one_key && group_key.get(&item.group).is_some_and(|k| *k != item.key));
                if free {
                    closed = item.solo;
                    if one_key {
                        group_key
                            .entry(item.group)
                            .or_insert_with(|| item.key.clone());
                    }
                    take.push(item);
                } else {
                    blocked.insert(item.group);
                    keep.push(item);
                }
            }
            q.queue = keep;
            // What stays waits another round; a retry, and what waits behind it, until it is due.
            q.since = waiting_since(&q.queue, now, wait);
            if take.is_empty() {
                continue;
            }
            // Offsets in the transaction: the position if the whole batch settles.
            let end = if self.inner.positions().is_some() {
                let taken: HashSet<i64> = take.iter().map(|i| i.delivery.offset).collect();
                lock(&shared)
                    .parts
                    .get(tp)
                    .filter(|p| p.generation == q.generation)
                    .and_then(|p| {
                        p.pending
                            .iter()
                            .find(|o| !taken.contains(o))
                            .copied()
                            .or(p.next)
                    })
            } else {
                None
            };
            q.running = Some(q.generation);
            self.running += 1;
            let (inner, tx) = (self.inner.clone(), self.done_tx.clone());
            let (tp, generation, revoked) = (tp.clone(), q.generation, q.revoked.clone());
            tokio::spawn(async move {
                let done = inner.run_batch(tp, generation, take, end, &revoked).await;
                let _ = tx.send(done);
            });
        }
        if abandoned > 0 {
            self.held -= abandoned;
            self.inner.common().counters.abandoned.add(abandoned as u64);
        }
    }

    fn settle(&mut self, done: Done) {
        self.running -= 1;
        let c = &self.inner.common().counters;
        self.held -= done.settled.len();
        lock(&self.shared).settled(&done.tp, done.generation, done.settled, c);
        let Some(q) = self.parts.get_mut(&done.tp) else {
            self.held -= done.again.len();
            c.abandoned.add(done.again.len() as u64);
            return;
        };
        // The partition's batch is over, of whichever ownership it was.
        if done.batch && q.running == Some(done.generation) {
            q.running = None;
        }
        if q.generation != done.generation
            || q.revoked.load(AtomicOrdering::Acquire)
            || *self.inner.common().stopping.borrow()
        {
            self.held -= done.again.len();
            c.abandoned.add(done.again.len() as u64);
            return;
        }
        if !done.again.is_empty() {
            let now = Instant::now();
            q.queue.extend(done.again);
            q.queue.sort_by_key(|i| i.delivery.offset);
            q.since = waiting_since(&q.queue, now, self.inner.common().batching.wait);
        }
    }
}
