//! An idempotent Kafka consumer on rdkafka: each message's effect runs once, duplicates get the
//! stored result, and no offset is committed ahead of durable state.
//!
//! # Concepts
//! - A [`Runner`] consumes topics in a consumer group and passes each message through
//!   [`dedup_core::Dedup::process`] to a [`Handler`]. The idempotency key comes from a header
//!   (default `idempotency-key`), a JSON pointer, or a digest of chosen JSON fields
//!   ([`KeySource`]); the scope defaults to the group.
//! - **Offsets.** Automatic commit and automatic offset storing are off. A partition's offset is
//!   committed up to the first message not yet settled (completed, replayed, or dead-lettered),
//!   every [`RunnerConfig::commit_interval`], on revocation and on shutdown, and only for
//!   partitions this member owns at that moment.
//! - **Order.** One message at a time per partition, partitions concurrently; or, with
//!   [`Ordering::PerKey`], different *ordering keys* of one partition concurrently, each ordering
//!   key's messages in offset order. The ordering key is the Kafka message key by default (an
//!   order, an account: [`OrderingKey`]), never the idempotency key, which is unique per event;
//!   messages without one run in partition order. [`RunnerConfig::max_in_flight`] bounds the
//!   messages held, shared fairly between the partitions that have work: each partition's
//!   messages come through a queue of its own, taken while the partition holds less than its
//!   share (the bound over the partitions with work, or with work in the last half second; a lone
//!   busy partition may use all of it), so
//!   under a deep backlog every partition runs from the start instead of the first one's fetched
//!   messages filling the bound. A partition that holds more than a share that shrank (others
//!   found work) is given nothing until it is under it, so each message it settles lets another
//!   partition in. At the bound nothing is taken until one settles (without pausing, so nothing
//!   is refetched); if none settles for a second the runner pauses its partitions and keeps
//!   polling, so rebalances are served during a stall.
//! - **Failures.** Retryable errors are retried with [`Backoff`] up to the policy's attempt limit;
//!   a handler that panics counts as a retryable failure (caught, counted in
//!   [`RunnerStats::panics`], dead-lettered as "handler panicked: ..." past the attempts);
//!   poison messages, permanent errors, exhausted attempts, payload mismatches and unusable keys
//!   go to the dead-letter topic with headers [`DLQ_REASON`], [`DLQ_ATTEMPTS`], [`DLQ_TOPIC`],
//!   [`DLQ_PARTITION`], [`DLQ_OFFSET`], and then the offset moves on. A store that is down is
//!   retried without limit: a message is never dropped for want of a database.
//! - **The kill switch** ([`KillSwitch`], off unless set): a handler that fails everything (a
//!   dropped table, a revoked credential, a bad deploy) does not dead-letter the stream. After a
//!   few failures in a row further failures are withdrawn (the key given back, no attempt spent,
//!   the message retried later); past a failure rate the runner stops taking messages and starts
//!   no handler for a pause (its partitions paused, the consumer still polling), then probes: the
//!   first success closes it. Counted in [`RunnerStats::kill_switch_trips`] and
//!   [`RunnerStats::kill_switch_withdrawn`].
//! - **Rebalances.** On revocation the runner takes no new work for those partitions, lets running
//!   messages finish on their own (their dedup state is fenced and durable; the new owner replays
//!   or waits for them), drops queued ones, and commits what is settled. Every assignment resumes
//!   or re-pauses its partitions explicitly.
//! - **Configuration** is checked by [`Runner::new`] ([`RunnerConfig::validate`]): a setting that
//!   would fail at run time is a [`ConfigError`] that names it.
//! - **Shutdown.** `run` takes a future (SIGINT/SIGTERM in the binary): it stops taking messages,
//!   waits up to [`RunnerConfig::drain_timeout`] for running ones, commits and leaves the group.
//! - **Batching.** Every message in flight makes its claim (and its completion) at once; put the
//!   store behind [`dedup_core::Batched`] and those calls reach Postgres as one statement per
//!   batch of whatever is in flight (everything the consumer has fetched, up to
//!   `max_in_flight`), while duplicates found in L1 are answered without queueing. The demo and
//!   the Kafka tests run this way.
//! - **Typed results.** [`Handler::check_result`] sees every settled keyed message's result,
//!   fresh or replayed, before it settles; an error dead-letters the message with the reason
//!   (the facade's `dedup::kafka::Typed` decodes results there).
//! - **Traces.** Each message is a `dedup.kafka.message` span with OpenTelemetry's messaging
//!   attributes; with the `otel` feature its parent is read from the W3C `traceparent` header.
//! - **Features.** `pg`: the runners of batches (`TxRunner`, transaction mode by the batch on
//!   `PgStore`; `LeaseRunner`, lease mode by the batch for effects outside the database) and
//!   parking. `tls`: TLS and SASL (PLAIN, SCRAM), with librdkafka linked against the system's
//!   OpenSSL (Debian's `libssl-dev`, which `scripts/services.sh` installs). `zstd`:
//!   zstd-compressed topics (a bundled zstd).
//!
//! # Example
//! ```no_run
//! use std::sync::Arc;
//! use dedup_core::{Completion, Dedup, HandlerError, MemoryStore};
//! use dedup_kafka::{Delivery, Runner, RunnerConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let dedup = Arc::new(Dedup::new(MemoryStore::new()));
//! let config = RunnerConfig::new("127.0.0.1:9092", "payments", ["payments"]);
//! let runner = Runner::new(config, dedup, |d: Arc<Delivery>, _lease| async move {
//!     // The effect, once per key. Its result is replayed to duplicates.
//!     Ok::<_, HandlerError<String>>(Completion::store(d.payload.clone().unwrap_or_default()))
//! })?;
//! let stats = runner.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```

#[cfg(feature = "pg")]
mod batch;
mod config;
mod consumer;
mod dead_letter;
mod delivery;
mod handler;
mod kill_switch;
mod runner;
mod start;
mod stats;
mod trace;

#[cfg(feature = "pg")]
pub use batch::{
    Acquired, BatchHandler, Batching, LeaseRunner, MAX_ASSIGNMENT_WAIT, MAX_BATCH, TxRunner,
};
pub use config::{
    Backoff, ConfigError, DEFAULT_KEY_HEADER, KeySource, KillSwitch, MAX_SETTING_DURATION,
    MissingKey, Ordering, OrderingKey, RunnerConfig,
};
pub use dead_letter::{
    DLQ_ATTEMPTS, DLQ_KEY, DLQ_OFFSET, DLQ_PARTITION, DLQ_REASON, DLQ_SCOPE, DLQ_TOPIC,
};
pub use delivery::{Delivery, KeyError, extract_key, ordering_key};
pub use handler::Handler;
pub use runner::{AfterGiveUp, Parking, Runner};
pub use start::RunnerError;
pub use stats::{RunnerStats, StatsHandle};
