//! Group commit for concurrent callers: [`Batched`] turns the claims and completions that many
//! tasks make at once into [`Store::claim_batch`] and [`Store::complete_batch`] calls.
//!
//! No background task and no timer: the first caller to find a free flush slot leads, taking
//! every request queued so far (up to [`BatchConfig::max_batch`]) into one batch call; callers
//! that arrive while the slots are busy queue up and go in the next batch. An idle store adds no
//! delay (a lone call is a batch of one, sent at once); a busy one sends fewer, larger calls. This
//! is how Postgres's own group commit pays one WAL flush for many transactions.
//!
//! A claim that the store can answer from memory ([`Store::answer_cached`], an L1 hit) never
//! queues.
//!
//! By default a batch holds up to 512 requests and each kind (claims, completions) has two flush
//! slots (`BatchConfig::max_flushes`); callers queued meanwhile are woken when a flush ends. A
//! caller cancelled while it queues is withdrawn before the flush (its receiver is gone); one
//! cancelled while its claim is in a flush has the lease it was granted given back
//! (`Store::withdraw`) by the caller that led the flush.

use std::fmt;
use std::future::Future;
use std::mem;
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::time::Instant;

use bytes::Bytes;
use tokio::sync::{Notify, oneshot};
use tracing::Instrument;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::record::{AfterFailure, ClaimOutcome, ClaimRequest, Lease, Record, Timestamp};
use crate::store::Store;
use crate::tiered::{decision_span, record_decision};

/// How [`Batched`] groups calls.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct BatchConfig {
    /// The most requests in one batch call.
    pub max_batch: usize,
    /// How many batch calls of one kind (claims, completions) may be in flight at once. A batch
    /// starts when none is in flight, or when a full batch waits; otherwise requests queue for the
    /// next batch.
    pub max_flushes: usize,
}

impl Default for BatchConfig {
    /// Batches of up to 512, two in flight per kind.
    fn default() -> Self {
        Self {
            max_batch: 512,
            max_flushes: 2,
        }
    }
}

impl BatchConfig {
    /// Sets the largest batch (at least 1).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }

    /// Sets how many batch calls of one kind may be in flight (at least 1).
    pub fn with_max_flushes(mut self, n: usize) -> Self {
        self.max_flushes = n.max(1);
        self
    }
}

/// A [`Store`] whose concurrent claims and completions are sent as batches. Everything else
/// goes straight to the inner store.
pub struct Batched<S> {
    inner: S,
    claims: Lane<ClaimRequest, Result<ClaimOutcome, StoreError>>,
    completions: Lane<(Lease, Bytes), Result<(), StoreError>>,
}

impl<S: fmt::Debug> fmt::Debug for Batched<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batched")
            .field("inner", &self.inner)
            .field("config", &self.claims.config)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Batched<S> {
    /// Batches the calls made to `inner`.
    pub fn new(inner: S, config: BatchConfig) -> Self {
        Self {
            inner,
            claims: Lane::new(config),
            completions: Lane::new(config),
        }
    }

    /// The inner store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many batch calls were made, and how many requests they carried.
    pub fn batch_counts(&self) -> BatchCounts {
        let (claim_calls, claims) = self.claims.counts();
        let (completion_calls, completions) = self.completions.counts();
        BatchCounts {
            claim_calls,
            claims,
            completion_calls,
            completions,
        }
    }
}

/// What [`Batched`] sent ([`Batched::batch_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchCounts {
    /// Batch claim calls made.
    pub claim_calls: u64,
    /// Claims they carried.
    pub claims: u64,
    /// Batch completion calls made.
    pub completion_calls: u64,
    /// Completions they carried.
    pub completions: u64,
}

impl<S: Store> Store for Batched<S> {
    /// Answers from memory when the inner store can; otherwise queues for the next batch. Each
    /// claim is a `dedup.decision` span in its caller's trace, with `tier` = `l1` (answered from
    /// memory) or `batched` (the batch's own `dedup.claim_batch` span says which tiers it asked).
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let span = decision_span(&req.key);
        let started = Instant::now();
        let (res, tier) = match self.inner.answer_cached(req) {
            Some(answer) => (Ok(answer), "l1"),
            None => {
                let (res, orphans) = self
                    .claims
                    .call(req.clone(), |reqs| async move {
                        self.inner.claim_batch(&reqs).await
                    })
                    .instrument(span.clone())
                    .await;
                // Leases granted to callers that were cancelled while their batch was in flight:
                // nobody holds them, so give them back (without spending an attempt) rather than
                // leave the keys blocked for a lease.
                let orphans: Vec<Lease> = orphans
                    .into_iter()
                    .filter_map(|o| match o {
                        Ok(ClaimOutcome::Acquired(lease)) => Some(lease),
                        _ => None,
                    })
                    .collect();
                let withdrawn = futures_util::future::join_all(
                    orphans.iter().map(|lease| self.inner.withdraw(lease)),
                )
                .await;
                for (lease, r) in orphans.iter().zip(withdrawn) {
                    if let Err(e) = r {
                        tracing::warn!(key = %lease.key, error = %e, "could not withdraw a cancelled caller's lease; it will expire");
                    }
                }
                (res.unwrap_or_else(|| Err(abandoned(&req.key))), "batched")
            }
        };
        if let Ok(outcome) = &res {
            record_decision(&span, tier, outcome, started);
        }
        res
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        // A completion whose caller went away still landed or not: either is a settled state.
        let (res, _) = self
            .completions
            .call(
                (lease.clone(), Bytes::copy_from_slice(result)),
                |items| async move { self.inner.complete_batch(&items).await },
            )
            .await;
        res.unwrap_or_else(|| Err(abandoned(&lease.key)))
    }

    fn withdraw(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.withdraw(lease)
    }

    fn fail_retryable(
        &self,
        lease: &Lease,
        error: &str,
    ) -> impl Future<Output = Result<AfterFailure, StoreError>> + Send {
        self.inner.fail_retryable(lease, error)
    }

    fn fail_permanent(
        &self,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.fail_permanent(lease, reason)
    }

    fn extend(&self, lease: &Lease) -> impl Future<Output = Result<Timestamp, StoreError>> + Send {
        self.inner.extend(lease)
    }

    fn get(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.inner.get(key)
    }

    fn purge(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send {
        self.inner.purge(limit)
    }

    fn adopt(
        &self,
        instance: &crate::InstanceId,
        mine: &str,
    ) -> impl Future<Output = Result<crate::Adoption, StoreError>> + Send {
        self.inner.adopt(instance, mine)
    }

    fn committed(&self, lease: &Lease, result: &[u8]) -> impl Future<Output = ()> + Send {
        self.inner.committed(lease, result)
    }

    fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        self.inner.answer_cached(req)
    }

    fn claim_batch(
        &self,
        reqs: &[ClaimRequest],
    ) -> impl Future<Output = Vec<Result<ClaimOutcome, StoreError>>> + Send {
        self.inner.claim_batch(reqs)
    }

    fn complete_batch(
        &self,
        items: &[(Lease, Bytes)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        self.inner.complete_batch(items)
    }

    fn extend_batch(
        &self,
        leases: &[Lease],
    ) -> impl Future<Output = Vec<Result<Timestamp, StoreError>>> + Send {
        self.inner.extend_batch(leases)
    }
}

/// The leader carrying a request was dropped mid-batch: the batch may or may not have applied.
fn abandoned(key: &IdempotencyKey) -> StoreError {
    StoreError::outcome_unknown(Abandoned(key.clone()))
}

#[derive(Debug)]
struct Abandoned(IdempotencyKey);

impl fmt::Display for Abandoned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the batch carrying {} was abandoned in flight (its caller was cancelled)",
            self.0
        )
    }
}

impl std::error::Error for Abandoned {}

struct Queue<Q, R> {
    waiting: Vec<(Q, oneshot::Sender<R>)>,
    flushing: usize,
    calls: u64,
    items: u64,
}

/// One kind of call, grouped.
struct Lane<Q, R> {
    config: BatchConfig,
    queue: Mutex<Queue<Q, R>>,
    /// Woken whenever a flush ends, so that a queued caller can lead the next one.
    flushed: Notify,
}

impl<Q: Send, R: Send> Lane<Q, R> {
    fn new(config: BatchConfig) -> Self {
        Self {
            config,
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                flushing: 0,
                calls: 0,
                items: 0,
            }),
            flushed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue<Q, R>> {
        // Held only to move items in and out, never across an await: always consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn counts(&self) -> (u64, u64) {
        let q = self.lock();
        (q.calls, q.items)
    }

    /// Takes the next batch if a flush slot is free. Requests whose callers went away while they
    /// queued (their receivers are dropped) are withdrawn here, before anything is sent.
    fn lead(&self) -> Option<Vec<(Q, oneshot::Sender<R>)>> {
        let mut q = self.lock();
        q.waiting.retain(|(_, tx)| !tx.is_closed());
        if !Self::may_lead(&q, &self.config) {
            return None;
        }
        q.flushing += 1;
        let n = q.waiting.len().min(self.config.max_batch);
        let rest = q.waiting.split_off(n);
        let batch = mem::replace(&mut q.waiting, rest);
        q.calls += 1;
        q.items += batch.len() as u64;
        Some(batch)
    }

    /// Queues `item` and waits for its answer, leading batches when a slot is free. The answer is
    /// `None` when the batch carrying it was abandoned (its leader was cancelled). Beside it come
    /// the answers this caller's flushes could not deliver, because their callers were cancelled
    /// while the batch was in flight: the caller undoes what they granted.
    async fn call<F, Fut>(&self, item: Q, run: F) -> (Option<R>, Vec<R>)
    where
        F: Fn(Vec<Q>) -> Fut,
        Fut: Future<Output = Vec<R>>,
    {
        let (tx, mut rx) = oneshot::channel();
        self.lock().waiting.push((item, tx));
        let mut orphans = Vec::new();
        loop {
            if let Some(batch) = self.lead() {
                let _slot = Slot(self);
                let (items, senders): (Vec<Q>, Vec<oneshot::Sender<R>>) = batch.into_iter().unzip();
                // Boxed: only a leader runs the batch call, once per batch, and its future (the
                // whole tiered claim down to the SQL) is tens of kilobytes. Inline, every queued
                // caller's future would carry that much, allocated and moved per message.
                let answers = Box::pin(run(items)).await;
                for (sender, answer) in senders.into_iter().zip(answers) {
                    if let Err(answer) = sender.send(answer) {
                        orphans.push(answer);
                    }
                }
            }
            match rx.try_recv() {
                Ok(answer) => return (Some(answer), orphans),
                Err(oneshot::error::TryRecvError::Closed) => return (None, orphans),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            let flushed = self.flushed.notified();
            tokio::pin!(flushed);
            flushed.as_mut().enable();
            // A flush that ended between the checks above and `enable` is seen here.
            if self.can_lead() {
                continue;
            }
            tokio::select! {
                answer = &mut rx => return (answer.ok(), orphans),
                () = flushed => {}
            }
        }
    }

    fn can_lead(&self) -> bool {
        Self::may_lead(&self.lock(), &self.config)
    }

    /// A batch starts when nothing is in flight, or when a full batch is waiting and a slot is
    /// free: a second slot carries overflow, not stragglers (a batch of one in a slot would cost a
    /// whole statement and hold the slot that the next full batch needs).
    fn may_lead(q: &Queue<Q, R>, config: &BatchConfig) -> bool {
        !q.waiting.is_empty()
            && q.flushing < config.max_flushes
            && (q.flushing == 0 || q.waiting.len() >= config.max_batch)
    }
}

/// A flush slot, given back (and the queued callers woken) when the flush ends or is dropped.
struct Slot<'a, Q, R>(&'a Lane<Q, R>);

impl<Q, R> Drop for Slot<'_, Q, R> {
    fn drop(&mut self) {
        {
            let mut q = self.0.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.flushing -= 1;
        }
        self.0.flushed.notify_waiters();
    }
}
