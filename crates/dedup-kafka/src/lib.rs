//! The Kafka consumers behind `dedup::Engine::consumer` (the `dedup` crate, feature `kafka`):
//! each message's effect runs once, duplicates get the stored result, and no offset is committed
//! ahead of durable state. Build consumers there (`engine.consumer()...build(handler)`; the
//! crate's `examples/kafka_ledger.rs` and `examples/kafka_calls.rs` are whole ones). This crate is
//! their machinery and the pieces the facade re-exports (key sources, ordering, backoff, the kill
//! switch, parking, dead-letter headers, stats); its runner types are the facade's
//! implementation, hidden from these docs.
//!
//! # Concepts
//! - A consumer takes topics in a consumer group and passes each message through
//!   [`dedup_core::Dedup::process`] (lease mode) or one Postgres transaction per batch
//!   (transaction mode) to the handler. The idempotency key comes from a header (default
//!   `idempotency-key`), a JSON pointer, a digest of chosen JSON fields, a random event id
//!   keyed with the event's own time, time-ordered, or the first of a list of these that finds
//!   one, whose sources must make one event the same key ([`KeySource`]), under the engine's
//!   scope (never the group's).
//! - **Offsets.** Automatic commit and automatic offset storing are off. A partition's offset is
//!   committed up to the first message not yet settled (completed, replayed, or dead-lettered),
//!   every commit interval, on revocation and on shutdown, and only for
//!   partitions this member owns at that moment.
//! - **Order.** One message at a time per partition, partitions concurrently; or, with
//!   [`Ordering::PerKey`], different *ordering keys* of one partition concurrently, each ordering
//!   key's messages in offset order. The ordering key is the Kafka message key by default (an
//!   order, an account: [`OrderingKey`]), never the idempotency key, which is unique per event;
//!   messages without one run in partition order. The consumer's `max_in_flight` bounds the
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
//!   few failures in a row, in transaction mode further failures are withdrawn (the effect rolled
//!   back: the key given back, no attempt spent, the message retried later); in lease mode, whose
//!   effect is outside, a failure keeps its record and its attempt, and a final one (permanent,
//!   or on the last attempt) is held, its lease kept, until the switch closes. Past a failure
//!   rate the runner stops taking messages and starts no handler for a pause (its partitions
//!   paused, the consumer still polling), then probes: the first success closes it. Counted in
//!   [`RunnerStats::kill_switch_trips`], [`RunnerStats::kill_switch_withdrawn`] and
//!   [`RunnerStats::kill_switch_held`].
//! - **Rebalances.** On revocation the runner takes no new work for those partitions, lets running
//!   messages finish on their own (their dedup state is fenced and durable; the new owner replays
//!   or waits for them), drops queued ones, and commits what is settled. Every assignment resumes
//!   or re-pauses its partitions explicitly.
//! - **Configuration** is checked when the consumer is built: a setting that would fail at run
//!   time is refused there, by name.
//! - **Shutdown.** `run` takes a future (SIGINT/SIGTERM in the binary): it stops taking messages,
//!   waits up to the drain timeout for running ones, commits and leaves the group.
//! - **Batching.** Every message in flight makes its claim (and its completion) at once, and the
//!   engine's group commit sends those calls to Postgres as one statement per batch of whatever
//!   is in flight, while duplicates found in L1 are answered without queueing. With the
//!   consumer's `batching`, messages are taken in batches per partition instead (transaction
//!   mode always is): one claim, one transaction or one completion per batch.
//! - **Typed results.** Every settled keyed message's result, fresh or replayed, is shown to the
//!   handler before the message settles; an error dead-letters the message with the reason (the
//!   facade's `dedup::kafka::Typed` decodes results there).
//! - **Traces.** Each message is a `dedup.kafka.message` span with OpenTelemetry's messaging
//!   attributes; with the `otel` feature its parent is read from the W3C `traceparent` header.
//! - **Features.** `pg`: transaction mode, lease mode by the batch, dead letters kept in a
//!   table, and parking. `tls`: TLS and SASL (PLAIN, SCRAM), with librdkafka linked against the system's
//!   OpenSSL (Debian's `libssl-dev`, which `scripts/services.sh` installs). `zstd`:
//!   zstd-compressed topics (a bundled zstd).
//!
//! # Example
//! Where a message's idempotency key comes from, tried on a message built by hand (as a
//! handler's unit test can build one):
//! ```
//! use dedup_core::Scope;
//! use dedup_kafka::{Delivery, EventTime, KeySource, extract_key};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let scope = Scope::new("payments")?;
//! let message = Delivery::new("payments", 0, 42)
//!     .with_payload(r#"{"account": 7, "request": "r-19", "amount": 1250}"#);
//! // A producer that sends no key: the fields that make two messages the same event.
//! let fields = KeySource::Fields(vec!["/account".into(), "/request".into()]);
//! let key = extract_key(&fields, &scope, &message)?;
//! let again = extract_key(&fields, &scope, &message.clone().with_header("x", "y"))?;
//! assert_eq!(key, again);
//! // The default: the `idempotency-key` header, which this message lacks.
//! assert!(extract_key(&KeySource::default(), &scope, &message).is_err());
//! // A random event id and the time the producer gave the event: a time-ordered key.
//! let event = Delivery::new("payments", 0, 43)
//!     .with_payload(r#"{"id": "9b2e6f1c-58d4-4c1a-a3f0-2d7e8b9c0a15", "at_ms": 1795000000123}"#);
//! let timed = KeySource::timed(
//!     KeySource::JsonPointer("/id".into()),
//!     EventTime::JsonPointer("/at_ms".into()),
//! );
//! let key = extract_key(&timed, &scope, &event)?;
//! assert_eq!(key.uuid7_millis(), Some(1_795_000_000_123));
//! // The same time as RFC 3339 text (CloudEvents' `time`) is the same key.
//! let rfc3339 = Delivery::new("payments", 0, 44).with_payload(
//!     r#"{"id": "9b2e6f1c-58d4-4c1a-a3f0-2d7e8b9c0a15", "at_ms": "2026-11-18T11:06:40.123Z"}"#,
//! );
//! assert_eq!(extract_key(&timed, &scope, &rfc3339)?, key);
//! // The `event-id` header, else the payload's `/id`: one key for a copy with the header and a
//! // copy without it.
//! let header_else_id = KeySource::first_of([
//!     KeySource::Header("event-id".into()),
//!     KeySource::JsonPointer("/id".into()),
//! ]);
//! let with_header = Delivery::new("payments", 1, 7).with_header("event-id", "e-1");
//! let without = Delivery::new("payments", 0, 45).with_payload(r#"{"id": "e-1", "amount": 9}"#);
//! assert_eq!(
//!     extract_key(&header_else_id, &scope, &with_header)?,
//!     extract_key(&header_else_id, &scope, &without)?,
//! );
//! # Ok(()) }
//! ```
mod batch;
mod config;
mod consumer;
mod dead_letter;
mod delivery;
mod front;
mod handler;
mod kill_switch;
pub mod outbox;
mod runner;
mod start;
mod stats;
mod trace;
pub use batch::{Acquired, Batching, MAX_ASSIGNMENT_WAIT, MAX_BATCH};
pub use config::{
    Backoff, ConfigError, DEFAULT_KEY_HEADER, EventTime, KeySource, KillSwitch,
    MAX_SETTING_DURATION, MissingKey, Ordering, OrderingKey,
};
pub use dead_letter::{
    DLQ_ATTEMPTS, DLQ_HEADERS, DLQ_KEY, DLQ_OFFSET, DLQ_PARTITION, DLQ_REASON, DLQ_SCOPE,
    DLQ_TOPIC, KeptDeadLetters, RefusedDeadLetter,
};
pub use delivery::{Delivery, KeyError, event_time_ms, extract_key, ordering_key};
pub use front::{
    Answer, ConsumerBuilder, Host, IdempotentConsumer, Ignore, LeaseHandler, Liveness, Member,
    OnResult, Started, TxHandler, Typed, testing,
};
pub use runner::{AfterGiveUp, ParkedFilter, ParkedKey, ParkedKeySummary, ParkedQueue, Parking};
pub use start::RunnerError;
pub use stats::{RunnerStats, StatsHandle};

// The runners, their handler traits and their configuration: what the consumer builder
// (`front`) builds. Not an API of their own.
pub(crate) use batch::{BatchHandler, LeaseRunner, TxRunner};
pub(crate) use config::RunnerConfig;
pub(crate) use handler::Handler;
pub(crate) use runner::Runner;
