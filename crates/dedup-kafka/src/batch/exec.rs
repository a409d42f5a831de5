//! What the batch loop needs from a way of running batches: the parts every runner of batches
//! shares (`Common`), and `Exec`, the batch itself (transaction mode, or lease mode).
//!
//! `Common` holds the settings, counters, dead letters and kill switch; `Exec::run_batch` runs
//! one partition's batch. After a panic outside the handlers (ours, or a user's code such as
//! `check_result`), the batch's messages go round again one per batch; a message that panics
//! alone is dead-lettered with the panic's message.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};

use dedup_pg::PgStore;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::warn;

use super::{Batching, Done, Item};
use crate::config::RunnerConfig;
use crate::consumer::{Settled, TopicPartition};
use crate::dead_letter::DeadLetters;
use crate::delivery::Delivery;
use crate::stats::Counters;

/// What every runner of batches holds.
pub(crate) struct Common {
    pub(crate) config: RunnerConfig,
    pub(crate) batching: Batching,
    pub(crate) dead_letters: DeadLetters,
    pub(crate) counters: Arc<Counters>,
    pub(crate) stopping: watch::Receiver<bool>,
    /// The kill switch: judges handler answers; while open, no batch starts.
    pub(crate) breaker: Arc<crate::kill_switch::Breaker>,
}

impl Common {
    /// What every runner of batches holds, from its start-up (`crate::start::start`).
    pub(crate) fn new(
        config: RunnerConfig,
        batching: Batching,
        dead_letters: DeadLetters,
        counters: Arc<Counters>,
        stopping: watch::Receiver<bool>,
        breaker: Arc<crate::kill_switch::Breaker>,
    ) -> Self {
        Self {
            config,
            batching,
            dead_letters,
            counters,
            stopping,
            breaker,
        }
    }

    /// A message settled: its latency counted.
    pub(crate) fn done(&self, item: &Item, s: Settled) -> (i64, Settled) {
        let us = u64::try_from(item.received.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.counters.latency.record(us);
        (item.delivery.offset, s)
    }

    /// A message to run again after its backoff.
    pub(crate) fn retry_later(&self, mut item: Item) -> Item {
        self.counters.retries.add(1);
        item.retries = item.retries.saturating_add(1);
        item.due = Some(Instant::now() + self.config.backoff.delay(item.retries));
        item
    }

    /// After a panic in a batch (ours, or a user's code outside the handler, which dedup
    /// catches): a batch of several runs again one message per batch, so that the message at
    /// fault is found; a message that panics alone is dead-lettered with the panic's message, as
    /// the per-message runner does. A lease a panic left held expires; if the panic came after a
    /// handler's effect and before its completion, that effect runs again after the lease.
    pub(crate) async fn after_panic(
        &self,
        items: Vec<Item>,
        message: &str,
        revoked: &AtomicBool,
    ) -> (Vec<(i64, Settled)>, Vec<Item>) {
        self.counters.panics.add(1);
        if let [item] = items.as_slice()
            && item.solo
        {
            warn!(
                offset = item.delivery.offset,
                message, "a message panicked alone: dead-lettering it"
            );
            let reason = format!("the runner panicked: {message}");
            let s = self
                .dead_letter(&item.delivery, &reason, 0, Some(&item.key), revoked)
                .await;
            return (vec![(item.delivery.offset, s)], Vec::new());
        }
        warn!(
            messages = items.len(),
            message, "a batch panicked; its messages run again alone"
        );
        let again = items
            .into_iter()
            .map(|mut i| {
                i.solo = true;
                self.retry_later(i)
            })
            .collect();
        (Vec::new(), again)
    }

    /// Gives a message up to the dead-letter topic (or, refused there for good, to Postgres)
    /// and waits until it is there; gives up (the message is then redelivered) if the partition
    /// is revoked or the runner stops.
    pub(crate) async fn dead_letter(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&dedup_core::IdempotencyKey>,
        revoked: &AtomicBool,
    ) -> Settled {
        let abandoned = || revoked.load(AtomicOrdering::Acquire) || *self.stopping.borrow();
        self.dead_letters
            .settle(d, reason, attempts, key, &abandoned)
            .await
    }
}

/// A way of running one partition's batch.
pub(crate) trait Exec: Send + Sync + 'static {
    fn common(&self) -> &Common;

    /// Offsets in the transaction: where positions are stored, if they are.
    fn positions(&self) -> Option<&PgStore> {
        None
    }

    /// Whether one batch may hold several distinct keys of one ordering group: transaction mode
    /// keeps their order inside its transaction; lease mode runs a batch's handlers at once, so a
    /// group gives a batch one key (and its repeats) at a time.
    fn groups_in_batch(&self) -> bool;

    /// Runs the batch and says what became of each message; never panics out.
    fn run_batch(
        &self,
        tp: TopicPartition,
        generation: u64,
        items: Vec<Item>,
        end: Option<i64>,
        revoked: &AtomicBool,
    ) -> impl Future<Output = Done> + Send;
}
