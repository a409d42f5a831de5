//! Transaction mode by the batch: a whole batch of messages in one Postgres transaction.
//!
//! ```text
//! BEGIN
//!   try-lock every key (pg_try_advisory_xact_lock): a key another transaction holds answers
//!   InFlight at once, so no batch ever waits on another's uncommitted writes
//!   read which locked keys have no row at all (fresh), with a fencing token for each
//!   claim the others in one statement                 (replays, takeovers, retries)
//!   the handler: every acquired message at once, on this transaction
//!   write the fresh successes COMPLETED in one statement; complete the others in one
//! COMMIT                                              (one WAL flush for the batch)
//! ```
//!
//! A fresh key is written once, at the end, instead of a claim and then a completion: the
//! advisory lock is what keeps other batches off it meanwhile, and if a writer that takes no
//! advisory lock (a lease-mode claim) wrote it in between, the final insert says so and the batch
//! rolls back whole, retryably (see `fresh.rs`).
//!
//! On the happy path there is no savepoint. When the handler fails as a whole, or reports
//! messages as failed, the transaction is rolled back and the batch runs again with a savepoint
//! per part: the successes together, each failed message alone, and a part that fails as a whole
//! split in halves until the message at fault stands alone. A poisoned message is then released or
//! FAILED on its own and its neighbours commit.
//!
//! Keys are try-locked with transaction-scoped advisory locks on a hash of scope and key, so a
//! batch never waits on another batch (a hash collision only makes a key answer InFlight once
//! more). A key that a transaction of another kind holds uncommitted (a `claim_in`) can make a
//! batch statement wait, up to [`TxBatchConfig::lock_timeout`]; past it the batch fails as a
//! whole and is retried.
//! Each lock is a slot of Postgres's shared lock table, which holds `max_locks_per_transaction`
//! × `max_connections` entries (6,400 with the defaults): size it for the batches that run at
//! once. A full table is SQLSTATE 53200, a passing error: the batch is retried.
//!
//! Caches are not involved yet: this is the authority's half of the batch path (the runner and
//! the tiered store build on it).
//!
//! A client that stops mid-batch (SIGSTOP, a long GC pause) holds its keys only until
//! `idle_in_transaction_session_timeout` ([`TxBatchConfig::idle_timeout`]) ends its session: the
//! batch rolls back whole, and nothing it wrote survives.

mod fresh;
mod parts;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    AfterHandlerError, ClaimOutcome, ClaimRequest, FencingToken, HandlerError, InputError, Lease,
    State, Store, StoreError,
};
use sqlx::postgres::PgConnection;
use tracing::debug;

use crate::PgStore;
use crate::claim::{claim_counted, claim_many};
use crate::classify::classify;
use crate::complete::complete_many;
use crate::offsets::{TxOffsets, store_offsets_on};
use crate::sql::TRY_LOCK_SQL;
use fresh::{insert_claimed, insert_completed, read_fresh};
use parts::{call, handler_reason, record_failure, withdraw};

/// How a batch transaction is run.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct TxBatchConfig {
    /// How long the batch's session may sit idle inside its transaction (its client stopped)
    /// before Postgres ends it and rolls the batch back: the bound on how long a stopped consumer
    /// holds its keys. Default 10 s.
    pub idle_timeout: Duration,
    /// How long one of the batch's statements may wait on a lock: a key that a transaction of
    /// another kind holds uncommitted (a `claim_in`, or a lease-mode claim mid-statement).
    /// Another batch's keys never make it wait (they are try-locked and answer InFlight); past
    /// this bound the batch fails as a whole, retryably (SQLSTATE 55P03). Default 5 s.
    pub lock_timeout: Duration,
}

impl Default for TxBatchConfig {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(10),
            lock_timeout: Duration::from_secs(5),
        }
    }
}

impl TxBatchConfig {
    /// Sets the idle-in-transaction bound (at least 1 ms).
    pub fn with_idle_timeout(mut self, t: Duration) -> Self {
        self.idle_timeout = t.max(Duration::from_millis(1));
        self
    }

    /// Sets the lock-wait bound (at least 1 ms).
    pub fn with_lock_timeout(mut self, t: Duration) -> Self {
        self.lock_timeout = t.max(Duration::from_millis(1));
        self
    }
}

/// What a batch handler answers for each message it was given: its result, or why it failed.
pub type ItemResult<E> = Result<Bytes, HandlerError<E>>;

/// The body of a batch handler: the business writes of every message in `leases`, on the batch's
/// transaction, in as few statements as it likes; one answer per lease, in order. An error for
/// the whole call fails every message in it (the batch is then retried in parts).
pub type BatchBody<'c, E> =
    Pin<Box<dyn Future<Output = Result<Vec<ItemResult<E>>, HandlerError<E>>> + Send + 'c>>;

/// What became of one message of a batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum BatchAnswer<E> {
    /// The handler ran and its writes committed with the completion.
    Executed {
        /// The handler's result.
        result: Bytes,
        /// The token it ran under.
        token: FencingToken,
        /// Which attempt it was.
        attempts: u32,
    },
    /// The key was done before (or earlier in this batch): the stored result.
    Replayed {
        /// The stored result.
        result: Bytes,
    },
    /// Another holder has the key (a live lease, or another transaction's uncommitted claim).
    /// Retry later.
    InFlight,
    /// Not run: an earlier message of its ordering group (see
    /// [`PgStore::transact_batch_ordered`]) did not settle in this batch, so this one waits for
    /// it. Nothing was spent; run it again after that message.
    Deferred,
    /// The key is poison: dead-letter the message.
    Failed {
        /// Why.
        reason: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The key was used before with a different payload.
    PayloadMismatch,
    /// The handler failed on this message; `after` says where that left the key.
    Handler {
        /// The handler's error.
        error: HandlerError<E>,
        /// Where the key stands.
        after: AfterHandlerError,
    },
}

impl<E> BatchAnswer<E> {
    /// Whether delivering the message again later can lead to a result.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InFlight | Self::Deferred => true,
            Self::Executed { .. } | Self::Replayed { .. } => false,
            Self::Failed { .. } | Self::PayloadMismatch => false,
            Self::Handler { after, .. } => !matches!(after, AfterHandlerError::Failed { .. }),
        }
    }
}

/// A part of the acquired messages, run under one savepoint in the second pass.
type Part = Vec<usize>;

impl PgStore {
    /// Runs a batch in one transaction: claims (fresh keys need none), the handler's
    /// writes for every acquired message, and the completions commit together, with one WAL
    /// flush. One answer per request, in order; a key that appears twice is answered after the
    /// commit as the duplicate of its first appearance. The messages are independent: one that
    /// fails holds back no other (see
    /// [`transact_batch_ordered`](Self::transact_batch_ordered) for messages that keep an order).
    ///
    /// `handler` may be called more than once (the retry in parts after a failure), each time on
    /// a subset of the acquired messages, and only ever sees writes of the current attempt. An
    /// error for the whole batch (the connection, BEGIN, the claim statement, the COMMIT) is
    /// returned as it is: nothing committed, except where it [is an unknown
    /// outcome](StoreError::is_outcome_unknown) that could not be read back.
    pub async fn transact_batch<E, H>(
        &self,
        reqs: &[ClaimRequest],
        config: TxBatchConfig,
        handler: H,
    ) -> Result<Vec<BatchAnswer<E>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        self.transact_many(reqs, None, None, config, handler).await
    }

    /// [`transact_batch`](Self::transact_batch) for messages that keep an order within their
    /// *ordering group* (`groups[i]` for `reqs[i]`: an account, an order, a partition). A
    /// message runs only if every earlier message of its group in the batch settled: once one
    /// answers InFlight or its handler fails, the group's later messages are not run and answer
    /// [`BatchAnswer::Deferred`] (their claims given back, no attempt spent), so a retry can
    /// never let a later message overtake an earlier one. A key answered from the store
    /// (replayed, FAILED, a payload mismatch) holds nothing back. On the happy path this costs
    /// nothing: the whole batch, groups and all, still runs in one handler call, in request
    /// order. After a failure the parts run in request order.
    ///
    /// # Errors
    /// As `transact_batch`; `groups` must have one entry per request
    /// ([`InputError::Setting`] otherwise).
    pub async fn transact_batch_ordered<E, H>(
        &self,
        reqs: &[ClaimRequest],
        groups: &[u64],
        config: TxBatchConfig,
        handler: H,
    ) -> Result<Vec<BatchAnswer<E>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        if groups.len() != reqs.len() {
            return Err(StoreError::Input(InputError::Setting {
                setting: "groups",
                problem: "needs one ordering group per request",
            }));
        }
        self.transact_many(reqs, Some(groups), None, config, handler)
            .await
    }

    /// [`transact_batch_ordered`](Self::transact_batch_ordered) that also stores the consumer's
    /// position in the batch's transaction (`dedup_offsets`): the batch's effects and the
    /// position commit together, so a consumer restarted from the stored position never hands
    /// a committed batch to its handler again. The position stored is `offsets.end`, or the
    /// offset of the batch's first message that did not settle (InFlight, deferred, failed or
    /// to be dead-lettered: a dead letter moves the position only once it is acknowledged, with
    /// [`store_offsets`](Self::store_offsets)), whichever is lower; it only ever moves forward.
    ///
    /// # Errors
    /// As `transact_batch_ordered`; `offsets.offsets` must have one entry per request
    /// ([`InputError::Setting`] otherwise).
    pub async fn transact_batch_with_offsets<E, H>(
        &self,
        reqs: &[ClaimRequest],
        groups: &[u64],
        offsets: &TxOffsets,
        config: TxBatchConfig,
        handler: H,
    ) -> Result<Vec<BatchAnswer<E>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        if groups.len() != reqs.len() {
            return Err(StoreError::Input(InputError::Setting {
                setting: "groups",
                problem: "needs one ordering group per request",
            }));
        }
        if offsets.offsets.len() != reqs.len() {
            return Err(StoreError::Input(InputError::Setting {
                setting: "offsets",
                problem: "needs one offset per request",
            }));
        }
        self.transact_many(reqs, Some(groups), Some(offsets), config, handler)
            .await
    }

    async fn transact_many<E, H>(
        &self,
        reqs: &[ClaimRequest],
        groups: Option<&[u64]>,
        offsets: Option<&TxOffsets>,
        config: TxBatchConfig,
        mut handler: H,
    ) -> Result<Vec<BatchAnswer<E>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        for req in reqs {
            req.policy.validate()?;
        }
        // First appearances go to the store; repeats are answered after the commit.
        let mut first: HashMap<&dedup_core::IdempotencyKey, usize> = HashMap::new();
        let mut distinct = Vec::with_capacity(reqs.len());
        for (i, req) in reqs.iter().enumerate() {
            if let std::collections::hash_map::Entry::Vacant(e) = first.entry(&req.key) {
                e.insert(i);
                distinct.push(i);
            }
        }
        let mut failed_before: Vec<usize> = Vec::new();
        let mut answers = None;
        // The happy path runs once; a failure in it runs the batch again, in parts.
        for pass in 0..2 {
            let parts = (pass == 1).then(|| failed_before.clone());
            match self
                .run_once(
                    reqs,
                    groups,
                    offsets,
                    &distinct,
                    config,
                    &mut handler,
                    parts,
                )
                .await?
            {
                Pass::Done(a) => {
                    answers = Some(a);
                    break;
                }
                Pass::Retry(failed) => failed_before = failed,
            }
        }
        let mut answers = answers.ok_or_else(|| {
            StoreError::unavailable(BatchRetried("the batch failed in parts and as a whole"))
        })?;
        // Repeats: the duplicate of their first appearance, now that it has committed.
        let mut out: Vec<Option<BatchAnswer<E>>> = (0..reqs.len()).map(|_| None).collect();
        for (n, &i) in distinct.iter().enumerate() {
            out[i] = answers[n].take();
        }
        for (i, req) in reqs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let f = first[&req.key];
            let repeat = match &out[f] {
                _ if req.fingerprint.is_some()
                    && reqs[f].fingerprint.is_some()
                    && req.fingerprint != reqs[f].fingerprint =>
                {
                    BatchAnswer::PayloadMismatch
                }
                Some(BatchAnswer::Executed { result, .. } | BatchAnswer::Replayed { result }) => {
                    BatchAnswer::Replayed {
                        result: result.clone(),
                    }
                }
                Some(BatchAnswer::Failed { reason, attempts }) => BatchAnswer::Failed {
                    reason: reason.clone(),
                    attempts: *attempts,
                },
                Some(BatchAnswer::Handler {
                    after: AfterHandlerError::Failed { attempts },
                    error,
                }) => BatchAnswer::Failed {
                    reason: handler_reason(error),
                    attempts: *attempts,
                },
                Some(BatchAnswer::PayloadMismatch) => BatchAnswer::PayloadMismatch,
                Some(BatchAnswer::Deferred) => BatchAnswer::Deferred,
                _ => BatchAnswer::InFlight,
            };
            out[i] = Some(repeat);
        }
        Ok(out
            .into_iter()
            .map(|a| a.unwrap_or(BatchAnswer::InFlight))
            .collect())
    }

    /// One transaction over the distinct requests. `alone`: `None` on the happy path (no
    /// savepoint); in the second pass, the messages that failed in the first, each to be run
    /// alone. `groups`: the ordering group of each request, if the batch keeps an order.
    #[allow(clippy::too_many_lines)]
    async fn run_once<E, H>(
        &self,
        reqs: &[ClaimRequest],
        groups: Option<&[u64]>,
        offsets: Option<&TxOffsets>,
        distinct: &[usize],
        config: TxBatchConfig,
        handler: &mut H,
        alone: Option<Vec<usize>>,
    ) -> Result<Pass<E>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        let mut conn = self.conn().await?;
        let out = async {
            let mut tx = sqlx::Connection::begin(&mut **conn)
                .await
                .map_err(|e| classify(e, false))?;
            self.count(1);
            // Ordering groups with a message that did not settle: their later messages wait.
            let mut held = Held::new(groups);
            // Lock what can be locked at once; the rest is InFlight.
            let scopes: Vec<&str> = distinct.iter().map(|&i| reqs[i].key.scope().as_str()).collect();
            let keys: Vec<&[u8]> = distinct.iter().map(|&i| reqs[i].key.key_bytes()).collect();
            let idle = format!("{}ms", config.idle_timeout.as_millis().max(1));
            let wait = format!("{}ms", config.lock_timeout.as_millis().max(1));
            let got: Vec<bool> = sqlx::query_scalar(TRY_LOCK_SQL)
                .bind(&scopes)
                .bind(&keys)
                .bind(&idle)
                .bind(&wait)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| classify(e, false))?;
            self.count(1);
            let mut answers: Vec<Option<BatchAnswer<E>>> = distinct.iter().map(|_| None).collect();
            let mut locked = Vec::with_capacity(distinct.len());
            for (n, ok) in got.into_iter().enumerate() {
                let i = distinct[n];
                if held.waits(i) {
                    answers[n] = Some(BatchAnswer::Deferred);
                } else if ok {
                    locked.push(i);
                } else {
                    held.hold(i);
                    answers[n] = Some(BatchAnswer::InFlight);
                }
            }
            let index: HashMap<usize, usize> =
                distinct.iter().enumerate().map(|(n, &i)| (i, n)).collect();
            // Fresh keys (no row at all) are granted without a claim statement; the others are
            // claimed in one statement, and what it leaves out one by one.
            let mut outcomes: HashMap<usize, ClaimOutcome> = HashMap::new();
            let mut unwritten: HashSet<usize> = HashSet::new();
            let mut existing = Vec::new();
            if !locked.is_empty() {
                self.count(1);
                for (&i, lease) in locked.iter().zip(read_fresh(&mut tx, reqs, &locked).await?) {
                    match lease {
                        Some(lease) => {
                            unwritten.insert(i);
                            outcomes.insert(i, ClaimOutcome::Acquired(lease));
                        }
                        None => existing.push(i),
                    }
                }
            }
            if !existing.is_empty() {
                self.count(1);
                for (i, answer, _) in claim_many(&mut tx, reqs, &existing).await? {
                    outcomes.insert(i, answer?);
                }
                // Left out: a lost race, or a key out of attempts (the single claim marks it).
                let left: Vec<usize> = existing
                    .iter()
                    .copied()
                    .filter(|i| !outcomes.contains_key(i))
                    .collect();
                for i in left {
                    let (answer, statements) = claim_counted(&mut tx, &reqs[i]).await;
                    self.count(statements);
                    outcomes.insert(i, answer?);
                }
            }
            // In request order, so that a group's InFlight holds back only its later messages.
            let mut leases: Vec<(usize, Lease)> = Vec::new();
            for &i in &locked {
                let n = index[&i];
                let Some(outcome) = outcomes.remove(&i) else {
                    answers[n] = Some(BatchAnswer::InFlight);
                    continue;
                };
                answers[n] = Some(match outcome {
                    ClaimOutcome::Acquired(lease) if held.waits(i) => {
                        // A fresh key has nothing written to give back.
                        if !unwritten.contains(&i) {
                            withdraw(&mut tx, &lease).await?;
                            self.count(1);
                        }
                        BatchAnswer::Deferred
                    }
                    ClaimOutcome::Acquired(lease) => {
                        leases.push((n, lease));
                        continue;
                    }
                    ClaimOutcome::Completed { result, .. } => BatchAnswer::Replayed { result },
                    ClaimOutcome::Failed { reason, attempts } => {
                        BatchAnswer::Failed { reason, attempts }
                    }
                    ClaimOutcome::PayloadMismatch => BatchAnswer::PayloadMismatch,
                    _ => {
                        held.hold(i);
                        BatchAnswer::InFlight
                    }
                });
            }
            let (positions, leases): (Vec<usize>, Vec<Lease>) = leases.into_iter().unzip();
            let req_of = |k: usize| reqs_index(&positions, distinct, k);
            // The handler: the whole batch at once, or in parts under savepoints.
            let results: Vec<Option<ItemResult<E>>> = match &alone {
                _ if leases.is_empty() => Vec::new(),
                None => {
                    let whole = call(handler, &mut tx, &leases).await;
                    match whole {
                        Ok(results) if results.iter().all(Result::is_ok) => {
                            results.into_iter().map(Some).collect()
                        }
                        Ok(results) => {
                            let failed = results
                                .iter()
                                .enumerate()
                                .filter(|(_, r)| r.is_err())
                                .map(|(k, _)| req_of(k))
                                .collect();
                            debug!("batch handler reported failures; running again in parts");
                            // Before the second pass takes its locks: let go of this one's.
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(failed));
                        }
                        Err(e) => {
                            debug!(error = %handler_reason(&e), "batch handler failed; running again in parts");
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(Vec::new()));
                        }
                    }
                }
                Some(alone) => {
                    // Parts in request order: each message that failed before on its own, the
                    // runs between them together.
                    let mut parts: VecDeque<Part> =
                        segments((0..leases.len()).collect(), |k| alone.contains(&req_of(k)));
                    let mut results: Vec<Option<ItemResult<E>>> =
                        (0..leases.len()).map(|_| None).collect();
                    while let Some(part) = parts.pop_front() {
                        // A message whose group had a failure before it waits (left as None).
                        let part: Part = part.into_iter().filter(|&k| !held.waits(req_of(k))).collect();
                        if part.is_empty() {
                            continue;
                        }
                        let sub: Vec<Lease> = part.iter().map(|&k| leases[k].clone()).collect();
                        sqlx::query("SAVEPOINT dedup_part")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| classify(e, false))?;
                        self.count(1);
                        let out = call(handler, &mut tx, &sub).await;
                        let all_ok = matches!(&out, Ok(r) if r.iter().all(Result::is_ok));
                        if all_ok {
                            sqlx::query("RELEASE SAVEPOINT dedup_part")
                                .execute(&mut *tx)
                                .await
                                .map_err(|e| classify(e, false))?;
                            self.count(1);
                            if let Ok(r) = out {
                                for (&k, r) in part.iter().zip(r) {
                                    results[k] = Some(r);
                                }
                            }
                            continue;
                        }
                        // Undone, and released too, so that failed parts do not nest.
                        sqlx::query("ROLLBACK TO SAVEPOINT dedup_part")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| classify(e, false))?;
                        sqlx::query("RELEASE SAVEPOINT dedup_part")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| classify(e, false))?;
                        self.count(2);
                        match out {
                            // The message at fault, alone: its group's later messages wait.
                            Ok(mut r) if part.len() == 1 => {
                                held.hold(req_of(part[0]));
                                results[part[0]] = r.pop();
                            }
                            Err(e) if part.len() == 1 => {
                                held.hold(req_of(part[0]));
                                results[part[0]] = Some(Err(e));
                            }
                            // The handler said which failed: those alone, the runs between
                            // together, still in request order.
                            Ok(r) => {
                                let bad: HashSet<usize> = part
                                    .iter()
                                    .zip(&r)
                                    .filter(|(_, r)| r.is_err())
                                    .map(|(&k, _)| k)
                                    .collect();
                                for p in segments(part, |k| bad.contains(&k)).into_iter().rev() {
                                    parts.push_front(p);
                                }
                            }
                            // Failed as a whole: halves, until the message at fault is alone.
                            Err(_) => {
                                let mid = part.len() / 2;
                                parts.push_front(part[mid..].to_vec());
                                parts.push_front(part[..mid].to_vec());
                            }
                        }
                    }
                    results
                }
            };
            // Record: fresh successes written COMPLETED in one statement, the other successes
            // completed in one; each failure on its own (a fresh key's claim written first); a
            // message that waited on its group given back.
            let fresh_failed: Vec<&Lease> = results
                .iter()
                .enumerate()
                .filter(|(k, r)| matches!(r, Some(Err(_))) && unwritten.contains(&req_of(*k)))
                .map(|(k, _)| &leases[k])
                .collect();
            if !fresh_failed.is_empty() {
                self.count(1);
                insert_claimed(&mut tx, &fresh_failed).await?;
            }
            let mut done = Vec::new();
            let mut done_at = Vec::new();
            let mut written = Vec::new();
            let mut written_at = Vec::new();
            for (k, r) in results.into_iter().enumerate() {
                let n = positions[k];
                let lease = &leases[k];
                let fresh = unwritten.contains(&req_of(k));
                match r {
                    Some(Ok(result)) if fresh => {
                        written.push((lease.clone(), result));
                        written_at.push(k);
                    }
                    Some(Ok(result)) => {
                        done.push((lease.clone(), result));
                        done_at.push(k);
                    }
                    Some(Err(error)) => {
                        answers[n] = Some(record_failure(&mut tx, lease, error).await?);
                        self.count(1);
                    }
                    None => {
                        if !fresh {
                            withdraw(&mut tx, lease).await?;
                            self.count(1);
                        }
                        answers[n] = Some(BatchAnswer::Deferred);
                    }
                }
            }
            if !written.is_empty() {
                self.count(1);
                insert_completed(&mut tx, &written).await?;
                for (k, (lease, result)) in written_at.iter().zip(&written) {
                    answers[positions[*k]] = Some(BatchAnswer::Executed {
                        result: result.clone(),
                        token: lease.token,
                        attempts: lease.attempts,
                    });
                }
            }
            if !done.is_empty() {
                let (completed, failed, statements) = complete_many(&mut tx, &done).await;
                self.count(statements);
                if let Some(e) = failed {
                    return Err(e);
                }
                for ((k, r), (lease, result)) in done_at.iter().zip(completed).zip(&done) {
                    // Our own uncommitted claims: only an oversized result can refuse here,
                    // and that fails the whole batch before anything is recorded wrongly.
                    r?;
                    answers[positions[*k]] = Some(BatchAnswer::Executed {
                        result: result.clone(),
                        token: lease.token,
                        attempts: lease.attempts,
                    });
                }
            }
            // The consumer's position, with the effects.
            if let Some(offsets) = offsets {
                let first: HashMap<&dedup_core::IdempotencyKey, usize> = distinct
                    .iter()
                    .enumerate()
                    .map(|(n, &i)| (&reqs[i].key, n))
                    .collect();
                let position = offsets.position(|i| settles(reqs, distinct, &first, &answers, i));
                self.count(1);
                store_offsets_on(
                    &mut tx,
                    &offsets.consumer_group,
                    &[(&offsets.topic, offsets.partition, position)],
                )
                .await?;
            }
            // A commit whose reply is lost is read back through one completed lease (a
            // transaction commits whole); whatever did not commit is a passing failure of the
            // whole batch, which a retry settles (every claim is read again).
            self.count(1);
            if let Err(e) = tx.commit().await {
                let err = classify(e, true);
                let landed = match (err.is_outcome_unknown(), done.first().or(written.first())) {
                    (true, Some((lease, _))) => matches!(
                        self.get(&lease.key).await,
                        Ok(Some(r)) if r.token == lease.token && r.state == State::Completed
                    ),
                    _ => false,
                };
                if !landed {
                    return Err(if err.is_outcome_unknown() && !(done.is_empty() && written.is_empty()) {
                        StoreError::unavailable(BatchRetried("the batch's commit did not land"))
                    } else {
                        err
                    });
                }
            }
            Ok(Pass::Done(answers))
        }
        .await;
        if let Err(e) = &out {
            conn.saw(e);
            // A transaction dropped on an error only queues its ROLLBACK: send it now, so that
            // its advisory locks are gone before the caller retries the batch.
            if !crate::classify::must_discard(e) {
                let _ = sqlx::Connection::ping(&mut **conn).await;
            }
        }
        out
    }
}

/// Whether request `i` settles with this pass's answers (`answers[n]` for `distinct[n]`):
/// executed or replayed, or a repeat of a key that does (with a compatible payload). A failure
/// or mismatch is not settled here: its dead letter is not written yet.
fn settles<E>(
    reqs: &[ClaimRequest],
    distinct: &[usize],
    first: &HashMap<&dedup_core::IdempotencyKey, usize>,
    answers: &[Option<BatchAnswer<E>>],
    i: usize,
) -> bool {
    let Some(&n) = first.get(&reqs[i].key) else {
        return false;
    };
    let first = &reqs[distinct[n]];
    let compatible = reqs[i].fingerprint.is_none()
        || first.fingerprint.is_none()
        || reqs[i].fingerprint == first.fingerprint;
    compatible
        && matches!(
            answers[n],
            Some(BatchAnswer::Executed { .. } | BatchAnswer::Replayed { .. })
        )
}

/// The ordering groups of a batch in which a message did not settle: the group's later messages
/// wait. Without groups, nothing waits.
struct Held<'g> {
    groups: Option<&'g [u64]>,
    held: HashSet<u64>,
}

impl<'g> Held<'g> {
    fn new(groups: Option<&'g [u64]>) -> Self {
        Self {
            groups,
            held: HashSet::new(),
        }
    }

    /// Request `i` did not settle: its group's later messages wait.
    fn hold(&mut self, i: usize) {
        if let Some(g) = self.groups {
            self.held.insert(g[i]);
        }
    }

    /// Whether request `i` waits for an earlier message of its group.
    fn waits(&self, i: usize) -> bool {
        self.groups.is_some_and(|g| self.held.contains(&g[i]))
    }
}

/// `items` in order, cut so that each one `alone` says is a part by itself and the runs between
/// them are parts.
fn segments(items: Part, alone: impl Fn(usize) -> bool) -> VecDeque<Part> {
    let mut parts = VecDeque::new();
    let mut run = Vec::new();
    for k in items {
        if alone(k) {
            if !run.is_empty() {
                parts.push_back(std::mem::take(&mut run));
            }
            parts.push_back(vec![k]);
        } else {
            run.push(k);
        }
    }
    if !run.is_empty() {
        parts.push_back(run);
    }
    parts
}

/// The outcome of one transaction over the batch.
enum Pass<E> {
    Done(Vec<Option<BatchAnswer<E>>>),
    /// Rolled back after a handler failure; these requests (indices into `reqs`) failed alone.
    Retry(Vec<usize>),
}

fn reqs_index(positions: &[usize], distinct: &[usize], k: usize) -> usize {
    distinct[positions[k]]
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BatchRetried(pub(crate) &'static str);
