//! One batch of one partition: its transaction, what each message's answer means for it, and its
//! dead letters.
//!
//! The caches answer what they hold settled, one `transact_batch` call (ordered) runs the rest,
//! each answer is filed, and the dead letters are written. Executed and replayed messages settle;
//! InFlight and retryably failed ones go back to the queue with backoff, deferred ones without,
//! and the next batch takes a message only if nothing of its group waits before it. FAILED keys,
//! payload mismatches and bad or missing keys are dead-lettered (acknowledged before their
//! offsets move), without waiting for an earlier unsettled message of their group: they have no
//! effect, and the stored and committed positions still wait for them. A batch whose transaction
//! fails for good as a whole sends its messages round again one per batch, so that only a message
//! at fault is dead-lettered. Each batch is a `dedup.kafka.batch` span (partition, size,
//! executed, again).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use dedup_core::{
    AfterHandlerError, BatchCache, Cached, ClaimOutcome, ClaimRequest, HandlerError,
    IdempotencyKey, Lease, OwnerId, OwnerIds, Policy, State, StoreError,
};
use dedup_pg::outbox::OutboxBuffer;
use dedup_pg::{BatchAnswer, BatchBody, BatchRequest, ItemResult, PgStore};

use super::offsets::TxOffsets;
use futures_util::FutureExt;
use futures_util::future::join_all;
use sqlx::PgConnection;
use tracing::{Instrument, debug, info_span, warn};

use super::super::exec::{Common, Exec};
use super::super::{Done, Item};
use super::{Acquired, BatchHandler};
use crate::consumer::Settled;
use crate::consumer::TopicPartition;
use crate::delivery::Delivery;
use crate::handler::{panic_message, retry_withdrawn};
use crate::kill_switch::Breaker;

pub(crate) struct Inner<H> {
    pub(crate) common: Common,
    pub(crate) store: PgStore,
    pub(crate) policy: Policy,
    pub(crate) handler: Arc<H>,
    /// The owner ids its claims are made under.
    pub(crate) owners: Arc<OwnerIds>,
    /// Whether each batch stores its partition's position in its transaction.
    pub(crate) offsets_in_tx: bool,
    /// Caches in front of the transaction, if any.
    pub(crate) caches: Option<Arc<dyn BatchCache>>,
}

/// Why a message goes to the dead-letter topic, and after how many attempts.
struct Letter {
    item: Item,
    reason: String,
    attempts: u32,
}

impl<H: BatchHandler> Exec for Inner<H> {
    fn common(&self) -> &Common {
        &self.common
    }

    fn positions(&self) -> Option<&PgStore> {
        self.offsets_in_tx.then_some(&self.store)
    }

    fn groups_in_batch(&self) -> bool {
        true
    }

    /// Runs one batch and says what became of each message. Never panics out: a panic anywhere
    /// in the batch (the handler's are caught inside the transaction) leaves every message to
    /// run again.
    async fn run_batch(
        &self,
        tp: TopicPartition,
        generation: u64,
        items: Vec<Item>,
        end: Option<i64>,
        revoked: &AtomicBool,
    ) -> Done {
        let span = info_span!(
            "dedup.kafka.batch",
            "messaging.system" = "kafka",
            "messaging.destination.name" = %tp.0,
            "messaging.kafka.partition" = tp.1,
            size = items.len(),
            executed = tracing::field::Empty,
            again = tracing::field::Empty,
        );
        // Kept for a panic outside the handler (its own are caught inside the transaction).
        let backup = items.clone();
        let body = AssertUnwindSafe(self.run(&tp, items, end, revoked).instrument(span.clone()));
        let (settled, again) = match body.catch_unwind().await {
            Ok(out) => out,
            Err(panic) => {
                let message = panic_message(&*panic).to_owned();
                self.common.after_panic(backup, &message, revoked).await
            }
        };
        span.record(
            "executed",
            settled
                .iter()
                .filter(|(_, s)| *s == Settled::Executed)
                .count(),
        );
        span.record("again", again.len());
        Done {
            tp,
            generation,
            batch: true,
            settled,
            again,
        }
    }
}

/// What a batch's messages have come to so far: settled, to run again, or to dead-letter.
#[derive(Default)]
struct Sorted {
    settled: Vec<(i64, Settled)>,
    again: Vec<Item>,
    letters: Vec<Letter>,
}

impl<H: BatchHandler> Inner<H> {
    /// The batch's stages: the caches answer what they hold settled, one transaction runs the
    /// rest, each answer is filed, and the dead letters are written.
    async fn run(
        &self,
        tp: &TopicPartition,
        items: Vec<Item>,
        end: Option<i64>,
        revoked: &AtomicBool,
    ) -> (Vec<(i64, Settled)>, Vec<Item>) {
        let mut out = Sorted {
            settled: Vec::with_capacity(items.len()),
            ..Sorted::default()
        };
        let reqs: Vec<ClaimRequest> = items
            .iter()
            .map(|i| {
                ClaimRequest::new(i.key.clone(), self.owner())
                    .with_fingerprint(i.fingerprint)
                    .with_policy(self.policy)
            })
            .collect();
        let (items, reqs, end) = self.answer_cached(items, reqs, end, &mut out).await;
        if !items.is_empty() {
            match self.transact(tp, &items, &reqs, end).await {
                Ok(answers) => {
                    self.common.counters.batches.add(1);
                    self.file(items, answers, &mut out).await;
                }
                Err(e) => self.refused(items, &e, &mut out),
            }
        }
        // Dead letters, each acknowledged before its offset may move on.
        let written = join_all(out.letters.iter().map(|l| {
            self.common.dead_letter(
                &l.item.delivery,
                &l.reason,
                l.attempts,
                Some(&l.item.key),
                revoked,
            )
        }))
        .await;
        for (l, s) in out.letters.iter().zip(written) {
            out.settled.push((l.item.delivery.offset, s));
        }
        for (offset, s) in &out.settled {
            if matches!(s, Settled::Executed | Settled::Replayed) {
                debug!(offset, settled = ?s, "settled");
            }
        }
        (out.settled, out.again)
    }

    /// Keys the caches hold settled are answered at once (a replay, a dead letter); the rest,
    /// with their requests, go on to the transaction. A message answered here moves the stored
    /// position no further than itself unless it settled.
    async fn answer_cached(
        &self,
        items: Vec<Item>,
        reqs: Vec<ClaimRequest>,
        mut end: Option<i64>,
        out: &mut Sorted,
    ) -> (Vec<Item>, Vec<ClaimRequest>, Option<i64>) {
        let Some(caches) = &self.caches else {
            return (items, reqs, end);
        };
        let cached = caches.settled_many(&reqs).await;
        let mut rest = Vec::with_capacity(items.len());
        let mut rest_reqs = Vec::with_capacity(items.len());
        for ((item, req), answer) in items.into_iter().zip(reqs).zip(cached) {
            match answer {
                Some(ClaimOutcome::Completed { .. }) => {
                    out.settled.push(self.common.done(&item, Settled::Replayed));
                }
                Some(ClaimOutcome::Failed { reason, attempts }) => {
                    end = end.map(|e| e.min(item.delivery.offset));
                    out.letters.push(Letter {
                        item,
                        reason,
                        attempts,
                    });
                }
                Some(ClaimOutcome::PayloadMismatch) => {
                    end = end.map(|e| e.min(item.delivery.offset));
                    out.letters.push(mismatch(item));
                }
                _ => {
                    rest.push(item);
                    rest_reqs.push(req);
                }
            }
        }
        (rest, rest_reqs, end)
    }

    /// The batch's one transaction: ordered by the messages' groups, and storing the partition's
    /// position with the effects where offsets live in the transaction (`end`).
    async fn transact(
        &self,
        tp: &TopicPartition,
        items: &[Item],
        reqs: &[ClaimRequest],
        end: Option<i64>,
    ) -> Result<Vec<BatchAnswer<H::Error>>, StoreError> {
        let position = end.map(|end| {
            TxOffsets::new(
                self.common.config.group_id.clone(),
                tp.0.clone(),
                tp.1,
                items.iter().map(|i| i.delivery.offset).collect(),
                end,
            )
        });
        let groups: Vec<u64> = items.iter().map(|i| i.group).collect();
        let mut deliveries: HashMap<IdempotencyKey, Arc<Delivery>> = HashMap::new();
        for i in items {
            deliveries
                .entry(i.key.clone())
                .or_insert_with(|| i.delivery.clone());
        }
        let outbox = Arc::new(OutboxBuffer::new());
        let body = body(
            self.handler.clone(),
            deliveries,
            self.common.breaker.clone(),
            outbox.clone(),
        );
        let mut batch = BatchRequest::new(reqs)
            .ordered(&groups)
            .with_outbox(&outbox)
            .with_config(self.common.batching.transaction);
        if let Some(position) = &position {
            batch = batch.with_writes(position);
        }
        self.store.transact_batch(batch, body).await
    }

    /// Files each message by its answer; then the caches learn what the commit settled (what it
    /// completed, and what Postgres replayed because the caches had lost it: a flush, a
    /// restart, an eviction). Only after the commit: nothing is COMPLETED in a cache before.
    async fn file(&self, items: Vec<Item>, answers: Vec<BatchAnswer<H::Error>>, out: &mut Sorted) {
        let mut copies = Vec::new();
        for (item, answer) in items.into_iter().zip(answers) {
            let copy = match &answer {
                BatchAnswer::Executed {
                    result,
                    token,
                    attempts,
                } => Some((result, *token, item.fingerprint, *attempts)),
                BatchAnswer::Replayed {
                    result,
                    token,
                    fingerprint,
                } => Some((result, *token, *fingerprint, 1)),
                _ => None,
            };
            if self.caches.is_some()
                && let Some((result, token, fingerprint, attempts)) = copy
            {
                let mut copy = Cached::new(State::Completed, token);
                copy.fingerprint = fingerprint;
                copy.attempts = attempts;
                copy.result = Some(result.clone());
                copies.push((item.key.clone(), copy, self.policy.retention));
            }
            self.sort(item, answer, out);
        }
        if let Some(caches) = &self.caches
            && !copies.is_empty()
        {
            caches.committed_many(copies).await;
        }
    }

    /// The transaction failed as a whole: retried if that can help; refused for good, its
    /// messages run again one per batch, so that one at fault is found and dead-lettered alone;
    /// a message alone is dead-lettered.
    fn refused(&self, items: Vec<Item>, e: &StoreError, out: &mut Sorted) {
        if e.is_retryable() {
            self.common.counters.store_errors.add(1);
            warn!(error = %e, messages = items.len(), "batch transaction failed; retrying");
            for item in items {
                out.again.push(self.common.retry_later(item));
            }
        } else if items.len() > 1 {
            self.common.counters.store_errors.add(1);
            warn!(error = %e, messages = items.len(), "batch transaction refused; running its messages alone");
            for mut item in items {
                item.solo = true;
                out.again.push(self.common.retry_later(item));
            }
        } else {
            warn!(error = %e, "transaction refused for a message alone; dead-lettering it");
            let reason = format!("the batch transaction failed: {e}");
            for item in items {
                out.letters.push(Letter {
                    item,
                    reason: reason.clone(),
                    attempts: 0,
                });
            }
        }
    }

    /// Files one message by its answer.
    fn sort(&self, item: Item, answer: BatchAnswer<H::Error>, out: &mut Sorted) {
        let Sorted {
            settled,
            again,
            letters,
        } = out;
        let offset = item.delivery.offset;
        match answer {
            BatchAnswer::Executed { .. } => {
                settled.push(self.common.done(&item, Settled::Executed))
            }
            BatchAnswer::Replayed { .. } => {
                settled.push(self.common.done(&item, Settled::Replayed))
            }
            // Waits for an earlier message of its group: no backoff of its own.
            BatchAnswer::Deferred => again.push(item),
            BatchAnswer::Failed { reason, attempts } => letters.push(Letter {
                item,
                reason,
                attempts,
            }),
            BatchAnswer::PayloadMismatch => letters.push(mismatch(item)),
            BatchAnswer::Handler {
                error,
                after: AfterHandlerError::Failed { attempts },
            } => letters.push(Letter {
                item,
                reason: format!("the handler failed: {}", error),
                attempts,
            }),
            BatchAnswer::Handler { error, .. } => {
                debug!(offset, error = %error, "retrying");
                again.push(self.common.retry_later(item));
            }
            // InFlight (another holder), or an answer this runner does not know: again later.
            _ => again.push(self.common.retry_later(item)),
        }
    }

    fn owner(&self) -> OwnerId {
        self.owners.next()
    }
}

/// The dead letter of a key reused with another payload.
fn mismatch(item: Item) -> Letter {
    Letter {
        reason: format!(
            "the idempotency key {} was used before with a different payload",
            item.key
        ),
        item,
        attempts: 0,
    }
}

/// The transaction's handler: the acquired leases matched to their messages, then the user's
/// batch handler.
fn body<H: BatchHandler>(
    handler: Arc<H>,
    deliveries: HashMap<IdempotencyKey, Arc<Delivery>>,
    breaker: Arc<Breaker>,
    outbox: Arc<OutboxBuffer>,
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, H::Error> + Send {
    move |tx, leases| {
        let batch: Option<Vec<Acquired>> = leases
            .iter()
            .map(|l| {
                deliveries.get(&l.key).map(|d| Acquired {
                    delivery: d.clone(),
                    lease: l.clone(),
                    outbox: outbox.clone(),
                })
            })
            .collect();
        let (handler, breaker) = (handler.clone(), breaker.clone());
        Box::pin(async move {
            let Some(batch) = batch else {
                return Err(HandlerError::Store(StoreError::backend(Unmatched)));
            };
            // The kill switch judges each message's answer (a failure of the whole call counts
            // once); while it is wary a failure is withdrawn: released, no attempt spent.
            let out = breaker.judge(handler.handle(tx, &batch).await.map_err(retry_withdrawn))?;
            Ok(out
                .into_iter()
                .map(|r| breaker.judge(r.map_err(retry_withdrawn)))
                .collect::<Vec<ItemResult<H::Error>>>())
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("a claim of the batch matched no message")]
struct Unmatched;
