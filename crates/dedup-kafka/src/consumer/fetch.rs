//! A fair share of the in-flight bound: each assigned partition's messages come through a queue
//! of its own (librdkafka's per-partition queue, `split_partition_queue`), read by a small task
//! that hands the loop one message at a time while its partition holds less than its share.
//!
//! Without it every message comes through the consumer's one queue in fetch order, and under a
//! deep backlog the first partition's fetched messages fill `max_in_flight` before the others'
//! arrive: the consumer runs one partition at a time, exactly after an outage, when throughput
//! matters. The share is work-conserving: the bound divided by the partitions that have work
//! (messages held, one waiting in their task, or work less than half a second ago), so a lone
//! busy partition may use all of it; the bound itself is never passed. A partition newly assigned
//! counts as having work until its queue first answers, with a message or with the end of the
//! partition (`enable.partition.eof`), up to [`FIRST_ANSWER`]: on a loaded machine a fetch may
//! take longer than half a second, and the partitions whose data came first must not take the
//! whole bound meanwhile.
//!
//! - **When.** Queues are split in the assign callback *before* librdkafka assigns the
//!   partitions: a queue split then is created to stay the application's, so no message of the
//!   partition reaches the consumer's queue (one split after the assignment would be undone by
//!   the fetch start, which forwards the partition back to the consumer's queue). The consumer's
//!   queue is still polled, for the callbacks (and a message it yields anyway, for a partition
//!   that could not be split, is handled as before).
//! - **Order.** One task per partition and ownership reads its queue in order and sends into one
//!   channel, so a partition's messages reach the loop in offset order. A task is stopped when its
//!   partition is revoked or assigned again; what it sent before is tagged with its split id and
//!   dropped by the loop if that is no longer the partition's current split (it would otherwise
//!   run ahead of the new ownership's first messages).
//! - **Pauses.** A paused partition fetches nothing into its queue; a message its task already
//!   read (librdkafka counts it consumed) waits in the task and is handed on when its share
//!   allows: nothing is lost or read twice.
//!
//! `Fetch` holds the queues and their tasks. [`FIRST_ANSWER`] is 10 s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use rdkafka::consumer::StreamConsumer;
use rdkafka::consumer::stream_consumer::StreamPartitionQueue;
use rdkafka::error::KafkaError;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{RunnerContext, Shared, TopicPartition, lock};
use crate::delivery::Delivery;
use crate::stats::Counters;

/// A message read from its partition's own queue, with the split that read it.
#[derive(Debug)]
pub(crate) struct Fetched {
    pub(crate) split: u64,
    pub(crate) delivery: Delivery,
}

/// One partition's split queue, as the loop steers it.
#[derive(Debug)]
struct Split {
    id: u64,
    task: tokio::task::AbortHandle,
    /// How many messages the task may have handed on in all (it waits before the next one).
    allowed: watch::Sender<u64>,
    /// How many of them the loop has taken.
    seen: u64,
    /// Since when the partition has had no work (from its assignment until its first message).
    idle_since: Option<Instant>,
    /// The task holds a message it may not hand on yet: the partition has work.
    holding: Arc<AtomicBool>,
    /// The partition's queue has answered (a message, or the end of the partition).
    answered: Arc<AtomicBool>,
    /// When the partition was assigned.
    assigned_at: Instant,
    /// What the partition holds against its share, as last counted.
    held: usize,
}

/// The most messages a partition's task may hand on ahead of the loop: a partition under its
/// share gets up to this many more at a time (fewer where its share is smaller).
const AHEAD: usize = 32;

/// How long a partition without work still counts as one with work (after its assignment, or
/// after its last message): about librdkafka's longest fetch wait, so that the partitions of an
/// assignment with a backlog all count before the first one's data fills the bound.
const IDLE: Duration = Duration::from_millis(500);

/// The longest a partition newly assigned counts as having work while its queue has not
/// answered yet (a leader that does not answer must not hold a share for ever).
const FIRST_ANSWER: Duration = Duration::from_secs(10);

/// The per-partition queues of a consumer.
#[derive(Debug)]
pub(crate) struct Fetch {
    consumer: OnceLock<Weak<StreamConsumer<RunnerContext>>>,
    splits: Mutex<HashMap<TopicPartition, Split>>,
    next_id: AtomicU64,
    tx: mpsc::UnboundedSender<Fetched>,
    counters: Arc<Counters>,
}

impl Fetch {
    /// A fetch side whose messages the loop reads from the answered receiver.
    pub(crate) fn new(counters: Arc<Counters>) -> (Arc<Self>, mpsc::UnboundedReceiver<Fetched>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let fetch = Arc::new(Self {
            consumer: OnceLock::new(),
            splits: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            tx,
            counters,
        });
        (fetch, rx)
    }

    /// The consumer whose partitions are split (set once it exists).
    pub(crate) fn set_consumer(&self, consumer: &Arc<StreamConsumer<RunnerContext>>) {
        let _ = self.consumer.set(Arc::downgrade(consumer));
    }

    fn splits(&self) -> std::sync::MutexGuard<'_, HashMap<TopicPartition, Split>> {
        self.splits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// In the assign callback, before the assignment: a queue and a task per partition. Outside
    /// a runtime, or without the consumer, nothing is split (messages come the usual way).
    pub(crate) fn assigning(&self, tps: &[TopicPartition]) {
        let Some(consumer) = self.consumer.get().and_then(Weak::upgrade) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut splits = self.splits();
        for tp in tps {
            if let Some(old) = splits.remove(tp) {
                old.task.abort();
            }
            let Some(queue) = consumer.split_partition_queue(&tp.0, tp.1) else {
                warn!(topic = %tp.0, partition = tp.1, "the partition's queue could not be split: its messages come through the consumer's");
                continue;
            };
            let id = self.next_id.fetch_add(1, AtomicOrdering::Relaxed);
            let (allowed, gate) = watch::channel(1);
            let holding = Arc::new(AtomicBool::new(false));
            let answered = Arc::new(AtomicBool::new(false));
            let task = runtime
                .spawn(forward(
                    queue,
                    id,
                    gate,
                    holding.clone(),
                    answered.clone(),
                    self.tx.clone(),
                    self.counters.clone(),
                ))
                .abort_handle();
            splits.insert(
                tp.clone(),
                Split {
                    id,
                    task,
                    allowed,
                    seen: 0,
                    idle_since: Some(Instant::now()),
                    holding,
                    answered,
                    assigned_at: Instant::now(),
                    held: 0,
                },
            );
        }
        debug!(partitions = tps.len(), "partition queues split");
    }

    /// In the revoke callback: the partitions' tasks stop (what they sent is dropped).
    pub(crate) fn revoked(&self, tps: &[TopicPartition]) {
        let mut splits = self.splits();
        for tp in tps {
            if let Some(old) = splits.remove(tp) {
                old.task.abort();
            }
        }
    }

    /// Whether `tp` has a queue of its own now.
    pub(crate) fn is_split(&self, tp: &TopicPartition) -> bool {
        self.splits().contains_key(tp)
    }

    /// Whether `fetched` comes from its partition's current split (then it counts as taken).
    pub(crate) fn take(&self, fetched: &Fetched) -> bool {
        let tp = (fetched.delivery.topic.clone(), fetched.delivery.partition);
        match self.splits().get_mut(&tp) {
            Some(s) if s.id == fetched.split => {
                s.seen += 1;
                true
            }
            _ => false,
        }
    }

    /// Lets each partition's task run ahead of the loop by what its partition may still take:
    /// its share of `max_in_flight` less what it holds (received, not settled), at most
    /// [`AHEAD`]. The share is the bound over the partitions that count as having work: those
    /// holding messages, or whose task holds one, and those that had work (or were assigned) less
    /// than [`IDLE`] ago, so that the first partition whose data arrives after an assignment does
    /// not take the whole bound before the others' arrives, and a lone busy partition still gets
    /// all of it once the others have been idle a while. The loop never holds more than the bound:
    /// a partition over a share that shrank is given nothing until it is under it again, so every
    /// message it settles lets a partition under its share in.
    pub(crate) fn share(
        &self,
        shared: &Mutex<Shared>,
        max_in_flight: usize,
        blocked: &HashMap<(String, i32, u64), usize>,
    ) {
        let mut splits = self.splits();
        if splits.is_empty() {
            return;
        }
        // What counts against the bound: received and not settled, less what waits blocked.
        // Read in place, under both locks (always taken in this order), once per partition and
        // with no allocation unless messages wait blocked: this runs on every turn of the loop.
        let shared = lock(shared);
        let held = |tp: &TopicPartition| {
            shared.parts.get(tp).map_or(0, |p| {
                let out = if blocked.is_empty() {
                    0
                } else {
                    blocked
                        .get(&(tp.0.clone(), tp.1, p.generation))
                        .copied()
                        .unwrap_or(0)
                };
                p.pending.len().saturating_sub(out)
            })
        };
        let now = Instant::now();
        let mut busy = 0;
        for (tp, s) in splits.iter_mut() {
            s.held = held(tp);
            if s.held > 0 || s.holding.load(AtomicOrdering::Relaxed) {
                s.idle_since = None;
            } else if s.idle_since.is_none() {
                s.idle_since = Some(now);
            }
            let unanswered = !s.answered.load(AtomicOrdering::Relaxed)
                && now.duration_since(s.assigned_at) < FIRST_ANSWER;
            if unanswered || s.idle_since.is_none_or(|t| now.duration_since(t) < IDLE) {
                busy += 1;
            }
        }
        let share = max_in_flight.div_ceil(busy.max(1)).max(1);
        for s in splits.values() {
            let room = share.saturating_sub(s.held).min(AHEAD);
            let allowed = s.seen + room as u64;
            // Never lowered: what was allowed may be on its way already.
            s.allowed.send_if_modified(|a| {
                let raise = allowed > *a;
                if raise {
                    *a = allowed;
                }
                raise
            });
        }
    }

    /// At shutdown: every task stops (each holds the consumer).
    pub(crate) fn stop(&self) {
        for (_, s) in self.splits().drain() {
            s.task.abort();
        }
    }
}

/// A partition's task: reads its queue in order and hands each message on once the loop allows
/// it.
async fn forward(
    queue: StreamPartitionQueue<RunnerContext>,
    split: u64,
    mut gate: watch::Receiver<u64>,
    holding: Arc<AtomicBool>,
    answered: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Fetched>,
    counters: Arc<Counters>,
) {
    let mut sent: u64 = 0;
    loop {
        let got = queue.recv().await;
        answered.store(true, AtomicOrdering::Relaxed);
        let delivery = match got {
            Ok(m) => Delivery::from_message(&m),
            // The end of the partition, for now: nothing to hand on.
            Err(KafkaError::PartitionEOF(_)) => continue,
            Err(e) => {
                counters.consumer_errors.add(1);
                warn!(error = %e, "partition queue error");
                continue;
            }
        };
        holding.store(true, AtomicOrdering::Relaxed);
        if gate.wait_for(|allowed| *allowed > sent).await.is_err() {
            return;
        }
        holding.store(false, AtomicOrdering::Relaxed);
        sent += 1;
        if tx.send(Fetched { split, delivery }).is_err() {
            return;
        }
    }
}
