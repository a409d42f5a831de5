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
//! This is the authority's half of the batch path, with no cache in it: the Kafka `TxRunner`
//! answers keys its caches hold settled before the transaction and backfills them after the
//! commit, through the tiered store's `BatchCache`.
//!
//! A client that stops mid-batch (SIGSTOP, a long GC pause) holds its keys only until
//! `idle_in_transaction_session_timeout` ([`TxBatchConfig::idle_timeout`]) ends its session: the
//! batch rolls back whole, and nothing it wrote survives.
//!
//! `PgStore::transact_batch` is the one entry point, given a `BatchRequest`: the claim requests,
//! and optionally ordering groups (`BatchRequest::ordered`), writes of the caller's own made in the
//! same transaction knowing what settles (`BatchRequest::with_writes`: the Kafka consumer's
//! position) and the timeouts;
//! built in steps that cannot fail, the lengths checked when it runs. Repeats of a key are
//! answered after the commit. The Kafka `TxRunner` and the demo use it. Here: the API and the
//! repeats; one transaction in `pass.rs`; fresh keys in `fresh.rs`; the handler call, the second
//! pass's parts under savepoints and a message's failure or give-back in `parts.rs`. A single
//! request held open for the caller's writes (`PgStore::begin_claim`, the HTTP layer's
//! transactional path) in `one.rs`.

mod fresh;
mod one;
mod parts;
mod pass;

pub use one::{ClaimedTx, TxClaim};

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    AfterHandlerError, ClaimRequest, FencingToken, Fingerprint, HandlerError, InputError, Lease,
    StoreError,
};
use sqlx::postgres::PgConnection;

use crate::PgStore;
use crate::outbox::OutboxBuffer;
use parts::handler_reason;
use pass::{Pass, Plan};

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
        /// The token it was completed under.
        token: FencingToken,
        /// The fingerprint the record holds (a cache copy must carry it).
        fingerprint: Option<Fingerprint>,
    },
    /// Another holder has the key (a live lease, or another transaction's uncommitted claim).
    /// Retry later.
    InFlight,
    /// Not run: an earlier message of its ordering group (see
    /// [`BatchRequest::ordered`]) did not settle in this batch, so this one waits for
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

/// What [`BatchWrites::write`] answers: how many statements it ran.
pub type BatchWritesFuture<'c> = Pin<Box<dyn Future<Output = Result<u64, StoreError>> + Send + 'c>>;

/// Writes of the caller's own in a batch's transaction ([`BatchRequest::with_writes`]), made
/// after its completions and before its COMMIT, knowing which of its requests settle if it
/// commits: they commit with the batch's effects or not at all. The Kafka consumer stores its
/// position so (the offset before which every message settled).
pub trait BatchWrites: std::fmt::Debug + Send + Sync {
    /// Makes the writes on `tx`, the batch's transaction. `settled[i]` says whether request `i`
    /// settles if the batch commits (it ran, or was answered from its record: nothing about it
    /// is left to do); a request that failed (to be retried or dead-lettered), answered InFlight
    /// or waited behind its group does not. Answers how many statements it ran (counted in
    /// [`PgStore::statements`]; a write that fails counts as one).
    ///
    /// # Errors
    /// A statement that failed: the batch fails with it (or, where it found the transaction
    /// aborted by a handler's statement, runs again in parts).
    fn write<'c>(&'c self, tx: &'c mut PgConnection, settled: &'c [bool]) -> BatchWritesFuture<'c>;
}

/// What one batch transaction is asked to run ([`PgStore::transact_batch`]): the claim requests,
/// and, where the batch needs them, the ordering group of each request, writes of the caller's
/// own in the same transaction, and the timeouts. Built in steps that cannot fail; the lengths
/// are checked when the batch runs.
///
/// ```
/// # use dedup_core::{ClaimRequest, IdempotencyKey, OwnerId, Scope};
/// # use dedup_pg::{BatchRequest, TxBatchConfig};
/// # let scope = Scope::new("orders").unwrap();
/// # let owner = OwnerId::new("worker-1");
/// let reqs = vec![
///     ClaimRequest::new(IdempotencyKey::new(scope.clone(), "a").unwrap(), owner.clone()),
///     ClaimRequest::new(IdempotencyKey::new(scope.clone(), "b").unwrap(), owner.clone()),
/// ];
/// let groups = [7, 7]; // one account: b runs only once a has settled
/// let batch = BatchRequest::new(&reqs).ordered(&groups).with_config(TxBatchConfig::default());
/// # let _ = batch;
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a batch request does nothing until it is given to `PgStore::transact_batch`"]
pub struct BatchRequest<'a> {
    reqs: &'a [ClaimRequest],
    groups: Option<&'a [u64]>,
    writes: Option<&'a dyn BatchWrites>,
    outbox: Option<&'a OutboxBuffer>,
    config: TxBatchConfig,
}

impl<'a> BatchRequest<'a> {
    /// A batch of independent messages, one per request: one that fails holds back no other.
    pub fn new(reqs: &'a [ClaimRequest]) -> Self {
        Self {
            reqs,
            groups: None,
            writes: None,
            outbox: None,
            config: TxBatchConfig::default(),
        }
    }

    /// Messages that keep an order within their *ordering group* (`groups[i]` for `reqs[i]`: an
    /// account, an order, a partition). A message runs only if every earlier message of its
    /// group in the batch settled: once one answers InFlight or its handler fails, the group's
    /// later messages are not run and answer [`BatchAnswer::Deferred`] (their claims given back,
    /// no attempt spent), so a retry can never let a later message overtake an earlier one. A
    /// key answered from the store (replayed, FAILED, a payload mismatch) holds nothing back. On
    /// the happy path this costs nothing: the whole batch, groups and all, still runs in one
    /// handler call, in request order. After a failure the parts run in request order.
    ///
    /// `groups` must have one entry per request ([`InputError::Setting`] when the batch runs).
    pub fn ordered(mut self, groups: &'a [u64]) -> Self {
        self.groups = Some(groups);
        self
    }

    /// Also makes `writes` in the batch's transaction, after its completions and before its
    /// COMMIT, told which requests settle if it commits: they commit with the batch's effects
    /// or not at all (the Kafka consumer stores its position so, and a consumer restarted from
    /// the stored position never hands a committed batch to its handler again). A pass that
    /// rolls back takes them with it; the pass that commits makes them again.
    pub fn with_writes(mut self, writes: &'a dyn BatchWrites) -> Self {
        self.writes = Some(writes);
        self
    }

    /// Also writes what the handler queued on `outbox` (under each message's lease) for the
    /// messages that run and settle in the pass that commits, in one statement after their
    /// completions: published once the batch commits, never if it rolls back. Each handler call
    /// starts its messages' queues afresh, so a part run again publishes only what its last run
    /// queued.
    pub fn with_outbox(mut self, outbox: &'a OutboxBuffer) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// The transaction's timeouts (default [`TxBatchConfig::default`]).
    pub fn with_config(mut self, config: TxBatchConfig) -> Self {
        self.config = config;
        self
    }

    /// The lists given beside the requests, checked to have one entry per request.
    fn check(&self) -> Result<(), StoreError> {
        let n = self.reqs.len();
        if self.groups.is_some_and(|g| g.len() != n) {
            return Err(StoreError::Input(InputError::Setting {
                setting: "groups",
                problem: "needs one ordering group per request",
            }));
        }
        Ok(())
    }
}

impl PgStore {
    /// Runs a batch in one transaction: claims (fresh keys need none), the handler's
    /// writes for every acquired message, and the completions commit together, with one WAL
    /// flush. One answer per request, in order; a key that appears twice is answered after the
    /// commit as the duplicate of its first appearance. [`BatchRequest`] says whether the
    /// messages are independent or keep an order, and what else commits with them.
    ///
    /// `handler` may be called more than once (the retry in parts after a failure), each time on
    /// a subset of the acquired messages, and only ever sees writes of the current attempt. An
    /// error for the whole batch (the connection, BEGIN, the claim statement, the COMMIT) is
    /// returned as it is: nothing committed, except where it [is an unknown
    /// outcome](StoreError::is_outcome_unknown) that could not be read back.
    ///
    /// # Errors
    /// As above, and [`InputError::Setting`] for a list given beside the requests that does not
    /// have one entry per request, or an invalid policy.
    pub async fn transact_batch<E, H>(
        &self,
        batch: BatchRequest<'_>,
        mut handler: H,
    ) -> Result<Vec<BatchAnswer<E>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        batch.check()?;
        let BatchRequest {
            reqs,
            groups,
            writes,
            outbox,
            config,
        } = batch;
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
                    &Plan {
                        reqs,
                        groups,
                        writes,
                        outbox,
                        distinct: &distinct,
                        config,
                    },
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
                // Its first was refused as a reuse of the key: this one may be the true
                // redelivery, which a claim of its own answers.
                Some(BatchAnswer::PayloadMismatch) => BatchAnswer::InFlight,
                _ if req.fingerprint.is_some()
                    && reqs[f].fingerprint.is_some()
                    && req.fingerprint != reqs[f].fingerprint =>
                {
                    BatchAnswer::PayloadMismatch
                }
                Some(BatchAnswer::Executed { result, token, .. }) => BatchAnswer::Replayed {
                    result: result.clone(),
                    token: *token,
                    fingerprint: reqs[f].fingerprint,
                },
                Some(BatchAnswer::Replayed {
                    result,
                    token,
                    fingerprint,
                }) => BatchAnswer::Replayed {
                    result: result.clone(),
                    token: *token,
                    fingerprint: *fingerprint,
                },
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
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BatchRetried(pub(crate) &'static str);
