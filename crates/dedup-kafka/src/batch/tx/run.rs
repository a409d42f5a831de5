//! One batch of one partition: its transaction, what each message's answer means for it, and its
//! dead letters.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use dedup_core::{
    AfterHandlerError, BatchCache, Cached, ClaimOutcome, ClaimRequest, HandlerError,
    IdempotencyKey, Lease, OwnerId, OwnerIds, Policy, State, StoreError,
};
use dedup_pg::{BatchAnswer, BatchBody, ItemResult, PgStore, TxOffsets};
use futures_util::FutureExt;
use futures_util::future::join_all;
use sqlx::PgConnection;
use tracing::{Instrument, debug, info_span, warn};

use super::super::exec::{Common, Exec, Settled};
use super::super::{Done, Item};
use super::{Acquired, BatchHandler};
use crate::consumer::TopicPartition;
use crate::delivery::Delivery;
use crate::handler::{DisplayHandlerError, panic_message, retry_withdrawn};
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

impl<H: BatchHandler> Inner<H> {
    async fn run(
        &self,
        tp: &TopicPartition,
        items: Vec<Item>,
        end: Option<i64>,
        revoked: &AtomicBool,
    ) -> (Vec<(i64, Settled)>, Vec<Item>) {
        let mut settled = Vec::with_capacity(items.len());
        let mut again = Vec::new();
        let mut letters = Vec::new();
        let mut reqs: Vec<ClaimRequest> = items
            .iter()
            .map(|i| {
                ClaimRequest::new(i.key.clone(), self.owner())
                    .with_fingerprint(i.fingerprint)
                    .with_policy(self.policy)
            })
            .collect();
        // Keys the caches hold settled are answered at once; the rest go to the transaction.
        let (items, end) = match &self.caches {
            Some(caches) => {
                let cached = caches.settled_many(&reqs).await;
                let mut rest = Vec::with_capacity(items.len());
                let mut rest_reqs = Vec::with_capacity(items.len());
                let mut end = end;
                for ((item, req), answer) in items.into_iter().zip(reqs).zip(cached) {
                    match answer {
                        Some(ClaimOutcome::Completed { .. }) => {
                            settled.push(self.common.done(&item, Settled::Replayed));
                        }
                        Some(ClaimOutcome::Failed { reason, attempts }) => {
                            end = end.map(|e| e.min(item.delivery.offset));
                            letters.push(Letter {
                                item,
                                reason,
                                attempts,
                            });
                        }
                        Some(ClaimOutcome::PayloadMismatch) => {
                            end = end.map(|e| e.min(item.delivery.offset));
                            letters.push(mismatch(item));
                        }
                        _ => {
                            rest.push(item);
                            rest_reqs.push(req);
                        }
                    }
                }
                reqs = rest_reqs;
                (rest, end)
            }
            None => (items, end),
        };
        let position = end.map(|end| {
            TxOffsets::new(
                self.common.config.group_id.clone(),
                tp.0.clone(),
                tp.1,
                items.iter().map(|i| i.delivery.offset).collect(),
                end,
            )
        });
        let position = position.as_ref();
        let groups: Vec<u64> = items.iter().map(|i| i.group).collect();
        let mut deliveries: HashMap<IdempotencyKey, Arc<Delivery>> = HashMap::new();
        for i in &items {
            deliveries
                .entry(i.key.clone())
                .or_insert_with(|| i.delivery.clone());
        }
        let body = body(
            self.handler.clone(),
            deliveries,
            self.common.breaker.clone(),
        );
        let answers = match position {
            _ if items.is_empty() => Ok(Vec::new()),
            Some(position) => {
                self.store
                    .transact_batch_with_offsets(
                        &reqs,
                        &groups,
                        position,
                        self.common.batching.transaction,
                        body,
                    )
                    .await
            }
            None => {
                self.store
                    .transact_batch_ordered(&reqs, &groups, self.common.batching.transaction, body)
                    .await
            }
        };
        match answers {
            Ok(answers) => {
                if !items.is_empty() {
                    self.common.counters.batches.add(1);
                }
                let mut copies = Vec::new();
                for (item, answer) in items.into_iter().zip(answers) {
                    // What the commit completed, and what Postgres replayed (the caches had
                    // lost it: a flush, a restart, an eviction), go to the caches.
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
                    if let Some((result, token, fingerprint, attempts)) = copy {
                        let mut copy = Cached::new(State::Completed, token);
                        copy.fingerprint = fingerprint;
                        copy.attempts = attempts;
                        copy.result = Some(result.clone());
                        copies.push((item.key.clone(), copy, self.policy.retention));
                    }
                    self.sort(item, answer, &mut settled, &mut again, &mut letters);
                }
                // After the commit: the caches learn what it settled.
                if let Some(caches) = &self.caches
                    && !copies.is_empty()
                {
                    caches.committed_many(copies).await;
                }
            }
            Err(e) if e.is_retryable() => {
                self.common.counters.store_errors.add(1);
                warn!(error = %e, messages = items.len(), "batch transaction failed; retrying");
                for item in items {
                    again.push(self.common.retry_later(item));
                }
            }
            // Failed for good as a whole: the messages run again one per batch, so that one at
            // fault is found and dead-lettered alone; a message alone is dead-lettered.
            Err(e) if items.len() > 1 => {
                self.common.counters.store_errors.add(1);
                warn!(error = %e, messages = items.len(), "batch transaction refused; running its messages alone");
                for mut item in items {
                    item.solo = true;
                    again.push(self.common.retry_later(item));
                }
            }
            Err(e) => {
                warn!(error = %e, "transaction refused for a message alone; dead-lettering it");
                let reason = format!("the batch transaction failed: {e}");
                for item in items {
                    letters.push(Letter {
                        item,
                        reason: reason.clone(),
                        attempts: 0,
                    });
                }
            }
        }
        // Dead letters, each acknowledged before its offset may move on.
        let written = join_all(letters.iter().map(|l| {
            self.common.dead_letter(
                &l.item.delivery,
                &l.reason,
                l.attempts,
                Some(&l.item.key),
                revoked,
            )
        }))
        .await;
        for (l, s) in letters.iter().zip(written) {
            settled.push((l.item.delivery.offset, s));
        }
        for (offset, s) in &settled {
            if matches!(s, Settled::Executed | Settled::Replayed) {
                debug!(offset, settled = ?s, "settled");
            }
        }
        (settled, again)
    }

    /// Files one message by its answer.
    fn sort(
        &self,
        item: Item,
        answer: BatchAnswer<H::Error>,
        settled: &mut Vec<(i64, Settled)>,
        again: &mut Vec<Item>,
        letters: &mut Vec<Letter>,
    ) {
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
                reason: format!("the handler failed: {}", DisplayHandlerError(&error)),
                attempts,
            }),
            BatchAnswer::Handler { error, .. } => {
                debug!(offset, error = %DisplayHandlerError(&error), "retrying");
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
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, H::Error> + Send {
    move |tx, leases| {
        let batch: Option<Vec<Acquired>> = leases
            .iter()
            .map(|l| {
                deliveries.get(&l.key).map(|d| Acquired {
                    delivery: d.clone(),
                    lease: l.clone(),
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
