//! Lease mode by the batch: [`Dedup::process_batch`]. A batch of messages whose effects are
//! outside the store (an email, a payment API) is claimed in one call, its handlers run
//! concurrently, one heartbeat extends every live lease in one call, and its completions are
//! recorded in one call.
//!
//! The heartbeat is shared with the instance's other running batches (`heartbeat.rs`). A passing
//! failure of the batch completion is retried per key while the lease holds; each failure is
//! recorded alone, as `process` records it. A key held elsewhere answers InFlight at once, and
//! repeats of a key are answered after their first. A handler that panics is caught, also before
//! its first await.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::join_all;
use tokio::time::{Instant, sleep};
use tracing::{Instrument, debug, info_span};

use super::heartbeat::Beat;
use super::{
    Completion, Dedup, Granted, HandlerError, LeaseContext, ProcessError, Processed, panic_message,
};
use crate::error::StoreError;
use crate::key::{Fingerprint, IdempotencyKey};
use crate::machine;
use crate::record::{ClaimOutcome, ClaimRequest, Lease};
use crate::store::Store;

/// One message of a batch for [`Dedup::process_batch`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BatchItem {
    /// Its idempotency key.
    pub key: IdempotencyKey,
    /// Its payload's fingerprint (`None`: no payload check).
    pub fingerprint: Option<Fingerprint>,
}

impl BatchItem {
    /// A message of `key` with `fingerprint`.
    pub fn new(key: IdempotencyKey, fingerprint: Option<Fingerprint>) -> Self {
        Self { key, fingerprint }
    }
}

/// One acquired message of the batch, while its handler runs and its end is recorded.
struct Running {
    item: usize,
    lease: Lease,
    lost: Arc<AtomicBool>,
    granted: Arc<Granted>,
    /// Its end is recorded: the heartbeat leaves it.
    done: Arc<AtomicBool>,
}

/// What `process_batch` answers for one message.
type Answer<E> = Result<Processed, ProcessError<E>>;

/// Answers the repeats of a key in the batch (the indexes left unanswered) as the duplicate of
/// its first appearance, now that it has settled.
fn answer_repeats<E>(
    items: &[BatchItem],
    first: &HashMap<&IdempotencyKey, usize>,
    out: &mut [Option<Answer<E>>],
) {
    let in_flight = |item: &BatchItem| ProcessError::InFlight {
        key: item.key.clone(),
        owner: None,
        lease_until: None,
    };
    for (i, item) in items.iter().enumerate() {
        if out[i].is_some() {
            continue;
        }
        let f = first[&item.key];
        let answer = match &out[f] {
            // Its first was refused as a reuse of the key: this one may be the true
            // redelivery, which a claim of its own answers.
            Some(Err(ProcessError::PayloadMismatch { .. })) => Err(in_flight(item)),
            _ if machine::mismatch(items[f].fingerprint, item.fingerprint) => {
                Err(ProcessError::PayloadMismatch {
                    key: item.key.clone(),
                })
            }
            Some(Ok(Processed::Executed { result, .. } | Processed::Replayed { result })) => {
                Ok(Processed::Replayed {
                    result: result.clone(),
                })
            }
            Some(Err(ProcessError::Failed {
                reason, attempts, ..
            })) => Err(ProcessError::Failed {
                key: item.key.clone(),
                reason: reason.clone(),
                attempts: *attempts,
            }),
            // Its first is not settled (it failed retryably, is held elsewhere, ...): this one
            // is retried with it.
            _ => Err(in_flight(item)),
        };
        out[i] = Some(answer);
    }
}

impl<S: Store> Dedup<S> {
    /// Runs each message's effect once, a whole batch at a time, for effects outside the store:
    /// the keys are claimed in one call ([`Store::claim_batch`]: L1, one fast-path call and one
    /// authority statement with a tiered store), every acquired message's handler runs
    /// concurrently (`handler(index, lease)`), one heartbeat extends every live lease in one
    /// call ([`Store::extend_batch`]), and the successes are completed in one call
    /// ([`Store::complete_batch`]). One answer per item, in order, each what
    /// [`process`](Self::process) would have answered, with two differences: a key another
    /// holder runs answers [`ProcessError::InFlight`] at once (no waiting: retry it later), and
    /// a key that appears twice is answered after its first appearance settled, as its
    /// duplicate.
    ///
    /// Everything `process` guarantees holds per message: a handler that panics fails its own
    /// message (retryably), a completion that meets a passing error is retried while its lease
    /// can be held, an unknown outcome is read back, a lease taken over is reported lost.
    pub async fn process_batch<F, Fut, E>(
        &self,
        items: &[BatchItem],
        handler: F,
    ) -> Vec<Result<Processed, ProcessError<E>>>
    where
        F: Fn(usize, LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        let span = info_span!(
            "dedup.process_batch",
            size = items.len(),
            acquired = tracing::field::Empty,
            executed = tracing::field::Empty,
        );
        async move {
            let mut out: Vec<Option<Answer<E>>> = items.iter().map(|_| None).collect();
            // First appearances are claimed; repeats are answered after them.
            let mut first: HashMap<&IdempotencyKey, usize> = HashMap::new();
            let mut distinct = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                first.entry(&item.key).or_insert_with(|| {
                    distinct.push(i);
                    i
                });
            }
            let (mut running, sent) = self.claim_items(items, &distinct, &mut out).await;
            // Resolving lost replies one by one may have taken a while: the leases granted so
            // far are extended before any handler starts, and one lost meanwhile is not run.
            if !running.is_empty() && sent.elapsed() > self.policy.lease / 3 {
                running = self.extend_before_start(running, &mut out).await;
            }
            tracing::Span::current().record("acquired", running.len());
            if !running.is_empty() {
                let answers = self.run_beating(&running, &handler).await;
                for (r, answer) in running.iter().zip(answers) {
                    out[r.item] = Some(answer);
                }
            }
            let executed = out
                .iter()
                .filter(|a| matches!(a, Some(Ok(Processed::Executed { .. }))))
                .count();
            tracing::Span::current().record("executed", executed);
            answer_repeats(items, &first, &mut out);
            out.into_iter()
                .zip(items)
                .map(|(a, item)| {
                    // Every index was answered above; a hole would be a bug, reported, not a panic.
                    a.unwrap_or_else(|| {
                        Err(ProcessError::Store(StoreError::Corrupt {
                            key: item.key.clone(),
                            detail: "the batch left this message unanswered".into(),
                        }))
                    })
                })
                .collect()
        }
        .instrument(span)
        .await
    }

    /// Claims the first appearances (`distinct`) in one call, and answers each that was not
    /// acquired; the acquired ones come back to run. A lost reply is read back, as a single
    /// claim would be; our own owner id found in flight (a batch whose reply was lost, claimed
    /// again one by one) is our lease, adopted rather than waited out. Answers when the claims
    /// left too.
    async fn claim_items<E>(
        &self,
        items: &[BatchItem],
        distinct: &[usize],
        out: &mut [Option<Answer<E>>],
    ) -> (Vec<Running>, Instant) {
        let reqs: Vec<ClaimRequest> = distinct
            .iter()
            .map(|&i| {
                ClaimRequest::new(items[i].key.clone(), self.next_owner())
                    .with_fingerprint(items[i].fingerprint)
                    .with_policy(self.policy)
            })
            .collect();
        // The leases cannot have started before the claims left.
        let sent = Instant::now();
        let claims = self.store.claim_batch(&reqs).await;
        let mut running = Vec::new();
        for ((&i, req), claim) in distinct.iter().zip(&reqs).zip(claims) {
            let claim = match claim {
                Err(e) if e.is_outcome_unknown() => self.claim_resolved_as(req, true).await,
                Ok(ClaimOutcome::InFlight { owner: Some(o), .. }) if o == req.owner => {
                    self.claim_resolved_as(req, true).await
                }
                other => other,
            };
            out[i] = Some(match claim {
                Ok(ClaimOutcome::Acquired(lease)) => {
                    running.push(Running {
                        item: i,
                        granted: Arc::new(Granted::new(sent + lease.policy.lease)),
                        lease,
                        lost: Arc::new(AtomicBool::new(false)),
                        done: Arc::new(AtomicBool::new(false)),
                    });
                    continue;
                }
                Ok(ClaimOutcome::Completed { result, .. }) => Ok(Processed::Replayed { result }),
                Ok(ClaimOutcome::Failed { reason, attempts }) => Err(ProcessError::Failed {
                    key: req.key.clone(),
                    reason,
                    attempts,
                }),
                Ok(ClaimOutcome::PayloadMismatch) => Err(ProcessError::PayloadMismatch {
                    key: req.key.clone(),
                }),
                Ok(ClaimOutcome::InFlight { owner, lease_until }) => Err(ProcessError::InFlight {
                    key: req.key.clone(),
                    owner,
                    lease_until,
                }),
                Err(e) => Err(ProcessError::Store(e)),
            });
        }
        (running, sent)
    }

    /// Extends the leases granted so far in one call, before any handler starts: one lost
    /// meanwhile is answered and not run; one not extended now is left to the heartbeat.
    async fn extend_before_start<E>(
        &self,
        running: Vec<Running>,
        out: &mut [Option<Answer<E>>],
    ) -> Vec<Running> {
        let leases: Vec<Lease> = running.iter().map(|r| r.lease.clone()).collect();
        let at = Instant::now();
        let answers = self.store.extend_batch(&leases).await;
        let mut kept = Vec::with_capacity(running.len());
        for (r, answer) in running.into_iter().zip(answers) {
            match answer {
                Err(e) if e.is_lease_lost() => {
                    out[r.item] = Some(Err(ProcessError::LeaseLost {
                        key: r.lease.key.clone(),
                        token: r.lease.token,
                    }));
                }
                Ok(_) => {
                    r.granted.extended(at + r.lease.policy.lease);
                    kept.push(r);
                }
                Err(_) => kept.push(r),
            }
        }
        kept
    }

    /// Runs the acquired messages ([`run_many`](Self::run_many)) under the instance's one
    /// heartbeat: their leases join the registry of every running batch's until this batch is
    /// over (or dropped).
    async fn run_beating<F, Fut, E>(&self, running: &[Running], handler: &F) -> Vec<Answer<E>>
    where
        F: Fn(usize, LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        let _registered = self.beats.register(
            running
                .iter()
                .map(|r| Beat {
                    lease: r.lease.clone(),
                    lost: Arc::clone(&r.lost),
                    granted: Arc::clone(&r.granted),
                    done: Arc::clone(&r.done),
                })
                .collect(),
        );
        let beat = self.heartbeat_many();
        tokio::pin!(beat);
        let work = self.run_many(running, handler);
        tokio::pin!(work);
        tokio::select! {
            biased;
            answers = &mut work => answers,
            never = &mut beat => match never {},
        }
    }

    /// Runs every acquired message's handler concurrently, then records the ends: the
    /// completions in one call, each failure on its own.
    async fn run_many<F, Fut, E>(
        &self,
        running: &[Running],
        handler: &F,
    ) -> Vec<Result<Processed, ProcessError<E>>>
    where
        F: Fn(usize, LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        let outcomes = join_all(running.iter().map(|r| {
            let ctx = LeaseContext {
                lease: r.lease.clone(),
                lost: Arc::clone(&r.lost),
            };
            let item = r.item;
            // A panicking handler fails its own message, not the batch: the call itself is
            // inside the catch too (a handler may panic before its first await).
            AssertUnwindSafe(async move { handler(item, ctx).await }).catch_unwind()
        }))
        .await;
        let mut answers: Vec<Option<Result<Processed, ProcessError<E>>>> =
            running.iter().map(|_| None).collect();
        let mut to_complete: Vec<(usize, Bytes)> = Vec::new();
        for (k, (r, outcome)) in running.iter().zip(outcomes).enumerate() {
            let lease = &r.lease;
            let answer = match outcome {
                Ok(Ok(Completion::Store(result))) => {
                    to_complete.push((k, result));
                    continue;
                }
                Ok(Ok(Completion::Committed(result))) => {
                    self.store.committed(lease, &result).await;
                    Ok(executed(lease, result))
                }
                Ok(Err(e)) => self.recorded_failure(lease, e).await,
                Err(panic) => Err(self.panicked(lease, panic_message(&*panic)).await),
            };
            r.done.store(true, Ordering::Release);
            answers[k] = Some(answer);
        }
        if !to_complete.is_empty() {
            let batch: Vec<(Lease, Bytes)> = to_complete
                .iter()
                .map(|(k, result)| (running[*k].lease.clone(), result.clone()))
                .collect();
            let done = self.store.complete_batch(&batch).await;
            for ((k, result), done) in to_complete.into_iter().zip(done) {
                let r = &running[k];
                let done = match done {
                    // A passing error: retried on its own while the lease can be held.
                    Err(e) if e.is_retryable() => {
                        debug!(key = %r.lease.key, error = %e, "batch completion failed; completing alone");
                        self.complete_resolved(&r.lease, &result, &r.lost, &r.granted)
                            .await
                    }
                    other => other,
                };
                let answer = match done {
                    Ok(()) => Ok(executed(&r.lease, result)),
                    Err(StoreError::Input(e)) => {
                        // The effect ran but its result cannot be stored: FAILED keeps it at one.
                        let reason = format!("the effect ran but its result was refused: {e}");
                        let _ = self.store.fail_permanent(&r.lease, &reason).await;
                        Err(ProcessError::Store(StoreError::Input(e)))
                    }
                    Err(e) => Err(self.lease_error(&r.lease, e)),
                };
                r.done.store(true, Ordering::Release);
                answers[k] = Some(answer);
            }
        }
        answers
            .into_iter()
            .zip(running)
            .map(|(a, r)| {
                a.unwrap_or_else(|| {
                    Err(ProcessError::Store(StoreError::Corrupt {
                        key: r.lease.key.clone(),
                        detail: "the batch left this message unanswered".into(),
                    }))
                })
            })
            .collect()
    }

    /// This batch's heartbeat timer, every third of the lease; never returns. Its turn extends
    /// every live lease of the instance's batches in one call, unless another batch's turn just
    /// did; a failed call is tried again sooner, every twelfth of the lease.
    async fn heartbeat_many(&self) -> std::convert::Infallible {
        let every = (self.policy.lease / 3).max(Duration::from_millis(1));
        let mut wait = every;
        loop {
            sleep(wait).await;
            wait = if self.beats.beat(&self.store, every).await {
                (every / 4).max(Duration::from_millis(1))
            } else {
                every
            };
        }
    }
}

fn executed(lease: &Lease, result: Bytes) -> Processed {
    Processed::Executed {
        result,
        token: lease.token,
        attempts: lease.attempts,
    }
}
