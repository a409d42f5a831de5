//! Lease mode by the batch for Kafka: [`LeaseRunner`], for handlers whose effects are outside the
//! database. The same per-partition batches as [`TxRunner`](super::TxRunner), each run with
//! [`Dedup::process_batch`]: one claim call, the handlers at once under one heartbeat, one
//! completion call.
//!
//! The handler is the per-message `Handler`, so `check_result` and typed results work as under
//! `Runner` (a panicking `check_result` is caught per message). Since a batch's handlers run at
//! once, an ordering group gives a batch one key (with its repeats) at a time, where transaction
//! mode takes the group's messages in order into one transaction: so `LeaseRunner` wants
//! `Ordering::PerKey`.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use dedup_core::{BatchItem, Dedup, ProcessError, Processed, Store};
use futures_util::FutureExt;
use futures_util::future::join_all;
use tracing::{Instrument, info_span, warn};

use super::exec::{Common, Exec};
use super::{Batching, Done, Item, run_loop};
use crate::config::RunnerConfig;
use crate::consumer::Settled;
use crate::consumer::{TopicPartition, refused_or};
use crate::handler::{Handler, attempts_of, last_attempt, no_withdraw, panic_message};
use crate::start::{RunnerError, Started, scope_of, start};
use crate::stats::{Counters, RunnerStats, StatsHandle};

/// An idempotent consumer in lease mode by the batch: each partition's messages are taken in
/// batches (as [`TxRunner`](super::TxRunner) takes them), and a batch is run by
/// [`Dedup::process_batch`]: its keys claimed in one call, its acquired messages' handlers run at
/// once under one heartbeat for all their leases, its completions recorded in one call. For
/// effects outside the database (an email, a payment API); [`Handler`] is the per-message
/// handler the [`Runner`](crate::Runner) takes.
///
/// Since a batch's handlers run at once, one ordering group (the partition under
/// [`Ordering::PerPartition`](crate::Ordering::PerPartition), the ordering key under `PerKey`)
/// gives a batch one key at a time; distinct groups fill it. So use
/// [`Ordering::PerKey`](crate::Ordering::PerKey): under the default `PerPartition` a batch holds
/// one key (with its repeats) and this runner is no faster than the per-message `Runner`.
/// Offsets are committed only up to the first message not settled.
#[derive(Debug)]
pub(crate) struct LeaseRunner<S, H> {
    config: RunnerConfig,
    batching: Batching,
    dedup: Arc<Dedup<S>>,
    handler: H,
    counters: Arc<Counters>,
    refused: Option<Arc<dyn crate::dead_letter::RefusedTable>>,
}

impl<S, H> LeaseRunner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// A runner over `dedup` calling `handler` for each acquired message.
    ///
    /// # Errors
    /// A setting that cannot work, named: the runner's, the batching's, and
    /// [`MissingKey::ProcessWithoutDedup`] (every message of a batch runs under a claim).
    pub(crate) fn new(
        config: RunnerConfig,
        batching: Batching,
        dedup: Arc<Dedup<S>>,
        handler: H,
    ) -> Result<Self, RunnerError> {
        batching.check(&config, "lease mode by the batch")?;
        Ok(Self {
            config,
            batching,
            dedup,
            handler,
            counters: Arc::new(Counters::default()),
            refused: None,
        })
    }

    /// Keeps the dead letters that the dead-letter topic refuses for good (larger than it
    /// accepts, invalid) in `store`'s `dedup_dead_letters` table (`dedup dead-letters`), instead
    /// of stalling their partition.
    #[must_use]
    pub(crate) fn with_dead_letter_table(mut self, store: dedup_pg::PgStore) -> Self {
        self.refused = Some(Arc::new(store));
        self
    }

    /// A handle to the runner's counters, readable while it runs.
    pub(crate) fn stats(&self) -> StatsHandle {
        StatsHandle(self.counters.clone())
    }

    /// Consumes until `shutdown` completes, then lets running batches finish (up to the drain
    /// timeout), commits and leaves the group.
    ///
    /// # Errors
    /// The Kafka client could not start or subscribe.
    pub(crate) async fn run(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RunnerStats, RunnerError> {
        let scope = scope_of(&self.config)?;
        crate::start::adopt_at_start(&self.dedup).await;
        let Started {
            shared,
            source,
            dead_letters,
            shutdown,
            refused,
            stop_tx,
            stopping,
            breaker,
        } = start(&self.config, &self.counters, None, self.refused, shutdown)?;
        let inner = Arc::new(Inner {
            common: Common::new(
                self.config,
                self.batching,
                dead_letters,
                self.counters.clone(),
                stopping,
                breaker,
            ),
            dedup: self.dedup,
            handler: self.handler,
        });
        let stats = run_loop(inner, source, shared, scope, stop_tx, shutdown).await;
        refused_or(refused, stats)
    }
}

struct Inner<S, H> {
    common: Common,
    dedup: Arc<Dedup<S>>,
    handler: H,
}

impl<S, H> Exec for Inner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    fn common(&self) -> &Common {
        &self.common
    }

    fn groups_in_batch(&self) -> bool {
        false
    }

    async fn run_batch(
        &self,
        tp: TopicPartition,
        generation: u64,
        items: Vec<Item>,
        _end: Option<i64>,
        revoked: &AtomicBool,
    ) -> Done {
        let span = info_span!(
            "dedup.kafka.batch",
            "messaging.system" = "kafka",
            "messaging.destination.name" = %tp.0,
            "messaging.kafka.partition" = tp.1,
            size = items.len(),
            mode = "lease",
        );
        // Kept for a panic outside the handlers (theirs are caught by `process_batch`).
        let backup = items.clone();
        let body = AssertUnwindSafe(self.run(items, revoked).instrument(span));
        let (settled, again) = match body.catch_unwind().await {
            Ok(out) => out,
            Err(panic) => {
                let message = panic_message(&*panic).to_owned();
                self.common.after_panic(backup, &message, revoked).await
            }
        };
        Done {
            tp,
            generation,
            batch: true,
            settled,
            again,
        }
    }
}

impl<S, H> Inner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    async fn run(
        &self,
        items: Vec<Item>,
        revoked: &AtomicBool,
    ) -> (Vec<(i64, Settled)>, Vec<Item>) {
        let batch: Vec<BatchItem> = items
            .iter()
            .map(|i| BatchItem::new(i.key.clone(), i.fingerprint))
            .collect();
        let handler = &self.handler;
        let answers = self
            .dedup
            .process_batch(&batch, |k, lease| {
                let last = last_attempt(&lease);
                let delivery = items[k].delivery.clone();
                async move {
                    let r = no_withdraw(handler.handle(delivery, Some(lease)).await);
                    // Lease mode withdraws nothing; a final failure while the switch is wary
                    // holds its batch until the switch closes.
                    self.common
                        .breaker
                        .judge_lease(
                            r,
                            last,
                            &self.common.stopping,
                            || revoked.load(std::sync::atomic::Ordering::Acquire),
                            || {},
                            || {},
                        )
                        .await
                }
            })
            .await;
        self.common.counters.batches.add(1);
        let mut settled = Vec::with_capacity(items.len());
        let mut again = Vec::new();
        let mut letters = Vec::new();
        for (item, answer) in items.into_iter().zip(answers) {
            let err = match answer {
                Ok(processed) => match std::panic::catch_unwind(AssertUnwindSafe(|| {
                    self.handler.check_result(&item.delivery, &processed)
                })) {
                    Ok(Ok(())) => {
                        let s = match processed {
                            Processed::Executed { .. } => Settled::Executed,
                            _ => Settled::Replayed,
                        };
                        settled.push(self.common.done(&item, s));
                        continue;
                    }
                    Ok(Err(source)) => ProcessError::Undecodable {
                        key: item.key.clone(),
                        source,
                    },
                    Err(panic) => {
                        // The user's result check panicked on this message: it alone goes.
                        self.common.counters.panics.add(1);
                        let reason =
                            format!("the result check panicked: {}", panic_message(&*panic));
                        warn!(key = %item.key, reason, "dead-lettering");
                        letters.push((item, reason, 0));
                        continue;
                    }
                },
                Err(e) => e,
            };
            if matches!(err, ProcessError::Panicked { .. }) {
                self.common.counters.panics.add(1);
                self.common.breaker.failure();
            }
            if err.is_retryable() {
                if matches!(err, ProcessError::Store(_)) {
                    self.common.counters.store_errors.add(1);
                    warn!(key = %item.key, error = %err, "store unavailable; retrying");
                }
                again.push(self.common.retry_later(item));
            } else {
                let attempts = attempts_of(&err, item.retries + 1);
                warn!(key = %item.key, error = %err, attempts, "dead-lettering");
                letters.push((item, err.to_string(), attempts));
            }
        }
        // Dead letters, each acknowledged before its offset may move on.
        let written = join_all(letters.iter().map(|(item, reason, attempts)| {
            self.common
                .dead_letter(&item.delivery, reason, *attempts, Some(&item.key), revoked)
        }))
        .await;
        for ((item, _, _), s) in letters.iter().zip(written) {
            settled.push((item.delivery.offset, s));
        }
        (settled, again)
    }
}
