//! Transaction mode by the batch: [`TxRunner`] takes what it has received for a partition, up to
//! a size or a short wait, and runs it in one Postgres transaction
//! ([`PgStore::transact_batch`] with [`BatchRequest::ordered`](dedup_pg::BatchRequest::ordered)): every claim in one statement, the handler's writes for
//! the whole batch, every completion in one statement, one COMMIT.
//!
//! ```text
//! receive ──► per-partition queue ──(500 messages, or 5 ms)──► one transaction per batch
//!                 ▲                                              │ executed / replayed: settled
//!                 └── InFlight, deferred, released: again ◄──────┤ FAILED, mismatch: dead letter
//!                     (backoff, in offset order per group)       ▼
//!                                               offsets committed up to the first unsettled
//! ```
//!
//! `run.rs` is one batch (its transaction, what each answer means, its dead letters);
//! `offsets/` is offsets in the transaction: the position each batch stores with its effects,
//! those stored on their own, and the read at assignment.
//!
//! The ordering groups are the partition (`Ordering::PerPartition`) or the ordering key
//! (`PerKey`). The user's `BatchHandler` gets the acquired messages (`Acquired`: delivery and
//! lease) and the transaction. With `with_offsets_in_transaction`, each batch stores its
//! partition's position in its transaction (the batch's end: the first pending offset outside the
//! batch, or the next to read), each commit tick stores positions that moved without a batch, and
//! on assignment the rebalance callback (`pre_rebalance`) sets each partition's start from the
//! stored positions. A partition started from a stored position commits it to Kafka too.

pub(super) mod offsets;
mod run;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::outbox::OutboxMessage;
use dedup_core::{BatchCache, InputError, Lease, OwnerIds, Policy, Scope};
use dedup_pg::outbox::OutboxBuffer;
use dedup_pg::{BatchBody, PgStore};
use sqlx::PgConnection;

use super::exec::Common;
use super::{Batching, run_loop};
use crate::config::{ConfigError, RunnerConfig};
use crate::consumer::{StartOffsets, refused_or};
use crate::delivery::Delivery;
use crate::start::{RunnerError, Started, start};
use crate::stats::{Counters, RunnerStats, StatsHandle};

/// A message of the batch whose key this transaction holds: the handler writes its effect.
#[derive(Clone, Debug)]
pub struct Acquired {
    delivery: Arc<Delivery>,
    lease: Lease,
    outbox: Arc<OutboxBuffer>,
}

impl Acquired {
    /// The message.
    pub fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    /// The claim it runs under (its key, fencing token and attempt).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The fencing token as Postgres's `bigint`, to store beside the effect.
    pub fn token(&self) -> i64 {
        i64::try_from(self.lease.token.get()).unwrap_or(i64::MAX)
    }

    /// Queues `message` on the outbox (docs/OUTBOX.md): it is written in this message's
    /// transaction, with its effect and completion, and published by the relay once that
    /// commits; never if it rolls back. A part of the batch run again after a failure starts
    /// this message's queue afresh, so only its attempt that commits publishes.
    ///
    /// The relay sends it with a derived idempotency key (`idempotency-key`: a function of this
    /// message's key, the topic and its ordinal among this message's publishes to that topic, so
    /// a downstream dedup consumer drops the relay's duplicates), the cause (`dedup-cause-scope`,
    /// `dedup-cause-key`) and the trace context (`traceparent`, unless the message sets its own).
    ///
    /// # Errors
    /// A message the relay could never publish: an invalid topic name, or one over
    /// [`OutboxMessage::MAX_BYTES`].
    pub fn publish(&self, message: OutboxMessage) -> Result<(), InputError> {
        let has_trace = message
            .headers()
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("traceparent"));
        let message = if has_trace {
            message
        } else {
            crate::trace::context_headers(&self.delivery)
                .into_iter()
                .fold(message, |m, (n, v)| m.with_header(n, v))
        };
        let fallback = self
            .delivery
            .timestamp_ms
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or_else(now_ms);
        let event_ms = dedup_core::outbox::event_ms(&self.lease.key, fallback);
        self.outbox.publish(&self.lease, event_ms, message)
    }
}

/// Now, in milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What [`TxRunner`] calls for each batch: the business writes of every acquired message, on the
/// batch's transaction, in as few statements as it likes, and one answer per message, in order.
///
/// It may be called again on parts of the batch after a failure (under savepoints), and only ever
/// sees its own writes of the current attempt. An error for the whole call fails every message
/// in it (the batch then runs again in parts, so the message at fault ends alone). A message
/// answered `Err(HandlerError::Retryable)` is released and retried with backoff; `Permanent`
/// fails its key and dead-letters it. `Withdraw` counts as `Retryable` here (a message is retried
/// until it settles, so a withdrawal would retry it without end). A per-message handler is a loop
/// over `batch` inside `handle`.
pub(crate) trait BatchHandler: Send + Sync + 'static {
    /// The handler's own error.
    type Error: fmt::Display + Send + 'static;

    /// Writes the batch's effects.
    fn handle<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [Acquired],
    ) -> BatchBody<'c, Self::Error>;
}

/// An idempotent consumer in transaction mode by the batch (per partition, up to a size or a
/// short wait, one batch at a time; ordering groups kept as `BatchRequest::ordered` keeps them): the
/// effects of a whole batch, its claims and its completions commit in one Postgres transaction.
/// Offsets are committed only up to the first message not settled (completed, replayed, or
/// acknowledged by the dead-letter topic).
#[derive(Debug)]
pub(crate) struct TxRunner<H> {
    config: RunnerConfig,
    batching: Batching,
    scope: Scope,
    store: PgStore,
    policy: Policy,
    handler: Arc<H>,
    counters: Arc<Counters>,
    owners: Arc<OwnerIds>,
    /// Offsets in the transaction: on, with the bound on reading them at assignment.
    offsets: Option<Duration>,
    caches: Option<Arc<dyn BatchCache>>,
}

/// The longest a rebalance callback may wait for stored positions (it holds the poll).
pub const MAX_ASSIGNMENT_WAIT: Duration = Duration::from_secs(60);

impl<H: BatchHandler> TxRunner<H> {
    /// A runner writing through `store` and calling `handler` per batch. Every setting is
    /// checked here, so a configuration that could fail at run time is refused now, named.
    ///
    /// # Errors
    /// A setting that cannot work: the runner's ([`RunnerConfig::validate`]), the batching's, and
    /// [`MissingKey::ProcessWithoutDedup`], which transaction mode cannot honour (every message
    /// runs under a claim).
    pub(crate) fn new(
        config: RunnerConfig,
        batching: Batching,
        store: PgStore,
        handler: H,
    ) -> Result<Self, RunnerError> {
        let scope = batching.check(&config, "transaction mode")?;
        Ok(Self {
            config,
            batching,
            scope,
            store,
            policy: Policy::default(),
            handler: Arc::new(handler),
            counters: Arc::new(Counters::default()),
            owners: Arc::new(OwnerIds::for_process()),
            offsets: None,
            caches: None,
        })
    }

    /// Puts caches in front of the transactions (a [`TieredStore`](dedup_core::TieredStore)
    /// over the same Postgres, for example, with Redis as its fast path): keys they hold settled
    /// (completed, failed, used with another payload) are answered without a transaction, in one
    /// L1 pass and one fast-path call per batch; after each commit the keys it completed are
    /// copied to them, in one call. Nothing is copied before the commit.
    pub(crate) fn with_caches(mut self, caches: Arc<dyn BatchCache>) -> Self {
        self.caches = Some(caches);
        self
    }

    /// Offsets in the transaction: each batch stores its partition's position (`dedup_offsets`)
    /// in its own transaction, so the effects and the consumer's position commit together; on
    /// assignment each partition starts from its stored position, read with a bounded `wait`
    /// (the rebalance callback holds the poll meanwhile), and from Kafka's committed offset when
    /// there is none or it is not read in time (safe: claims deduplicate what is read again).
    /// A dead-lettered message's offset is stored once its dead letter is acknowledged. Kafka
    /// offset commits go on as before, for tooling and lag monitoring.
    ///
    /// # Errors
    /// `wait` is zero or longer than [`MAX_ASSIGNMENT_WAIT`].
    pub(crate) fn with_offsets_in_transaction(
        mut self,
        wait: Duration,
    ) -> Result<Self, RunnerError> {
        if wait.is_zero() || wait > MAX_ASSIGNMENT_WAIT {
            return Err(ConfigError {
                setting: "offsets_in_transaction",
                problem: format!(
                    "the wait {wait:?} is not between 1 ns and {MAX_ASSIGNMENT_WAIT:?}"
                ),
            }
            .into());
        }
        self.offsets = Some(wait);
        Ok(self)
    }

    /// Sets the claim policy (lease, attempts, retention).
    ///
    /// # Errors
    /// A policy that cannot work.
    pub(crate) fn with_policy(mut self, policy: Policy) -> Result<Self, RunnerError> {
        policy.validate().map_err(|e| ConfigError {
            setting: "policy",
            problem: e.to_string(),
        })?;
        self.policy = policy;
        Ok(self)
    }

    /// Claims under owner ids `<prefix>#<n>` (an engine's instance and incarnation) instead of
    /// this process's id and start time.
    #[must_use]
    pub(crate) fn with_owner_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.owners = Arc::new(OwnerIds::with_prefix(prefix));
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
        let start_offsets: Option<Arc<dyn StartOffsets>> = match self.offsets {
            Some(wait) => Some(Arc::new(
                offsets::OffsetReader::start(
                    self.store.pool().connect_options(),
                    self.config.group_id.clone(),
                    wait,
                )
                .map_err(|e| ConfigError {
                    setting: "offsets_in_transaction",
                    problem: format!("starting the offset reader thread: {e}"),
                })?,
            )),
            None => None,
        };
        let Started {
            shared,
            source,
            dead_letters,
            shutdown,
            refused,
            stop_tx,
            stopping,
            breaker,
        } = start(
            &self.config,
            &self.counters,
            start_offsets,
            Some(Arc::new(self.store.clone())),
            shutdown,
        )?;
        let inner = Arc::new(run::Inner {
            common: Common::new(
                self.config,
                self.batching,
                dead_letters,
                self.counters.clone(),
                stopping,
                breaker,
            ),
            store: self.store,
            policy: self.policy,
            handler: self.handler,
            owners: self.owners,
            offsets_in_tx: self.offsets.is_some(),
            caches: self.caches,
        });
        let stats = run_loop(inner, source, shared, self.scope, stop_tx, shutdown).await;
        refused_or(refused, stats)
    }
}
