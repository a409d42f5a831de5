//! dedup makes message consumers and HTTP handlers idempotent: each event's effect runs exactly
//! once, under a fenced lease or inside the transaction that records it, and every duplicate
//! gets the stored result.
//!
//! One [`Engine`] is built per process ([`Engine::builder`]): Postgres (the authority), optional
//! Redis in front of it, the default policy, the dedup scope and the instance identity. Kafka
//! consumers ([`Engine::consumer`], feature `kafka`) and the HTTP Idempotency-Key layer
//! ([`Engine::http_layer`], feature `http`) are built from it, and [`Engine::shutdown`] stops
//! them all.
//!
//! ```no_run
//! # #[cfg(feature = "kafka")]
//! # mod example {
//! use dedup::kafka::{Acquired, TxHandler};
//! use dedup::sqlx::PgConnection;
//! use dedup::{Bytes, Engine, HandlerError};
//!
//! /// The effect is a row in the same Postgres: transaction mode.
//! struct Ledger;
//!
//! impl TxHandler for Ledger {
//!     type Error = dedup::sqlx::Error;
//!     type Output = Bytes;
//!
//!     async fn handle(
//!         &self,
//!         tx: &mut PgConnection,
//!         message: &Acquired,
//!     ) -> Result<Bytes, HandlerError<Self::Error>> {
//!         dedup::sqlx::query("INSERT INTO ledger (event, body) VALUES ($1, $2)")
//!             .bind(message.lease().key.key_bytes())
//!             .bind(message.delivery().payload_bytes())
//!             .execute(tx)
//!             .await
//!             .map_err(HandlerError::Retryable)?;
//!         Ok(Bytes::from_static(b"booked"))
//!     }
//! }
//!
//! async fn run() -> Result<(), Box<dyn std::error::Error>> {
//!     let engine = Engine::builder()
//!         .postgres_url("postgres://dedup@db/payments")
//!         .scope("payments")
//!         .instance("payments-0")
//!         .build()
//!         .await?;
//!     let consumer = engine
//!         .consumer()
//!         .brokers("kafka:9092")
//!         .group_id("payments")
//!         .topics(["payments"])
//!         .build(Ledger)?;
//!     let running = tokio::spawn(consumer.run());
//!     tokio::signal::ctrl_c().await?;
//!     engine.shutdown().await; // drain, commit, release the identity
//!     running.await??;
//!     Ok(())
//! }
//! # }
//! ```
//!
//! # Features
//! `pg` (default: the engine), `redis` (Redis as the fast path), `kafka` (consumers), `http`
//! (the tower layer), `json` (a JSON codec for typed results), `tls` (TLS to each server that is
//! on), `zstd` (zstd-compressed topics), `otel` (a message's span joined to its producer's trace).
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "kafka")]
mod consumer;
#[cfg(feature = "pg")]
mod engine;
#[cfg(feature = "pg")]
mod health;
#[cfg(feature = "http")]
mod layer;
#[cfg(feature = "pg")]
mod running;

/// Kafka consumers built from an [`Engine`]: the handler traits, the builder and its settings,
/// and a test kit. A lease-mode handler tested on an in-memory engine and a Kafka cluster inside
/// the test process, with no server at all:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use dedup::kafka::{Delivery, testing::MockKafka};
/// use dedup::{Bytes, Engine, HandlerError, LeaseContext};
///
/// let engine = Engine::builder().in_memory().scope("test").build().await?;
/// let kafka = MockKafka::new()?;
/// kafka.create_topic("orders", 2)?;
/// kafka.send("orders", "order-1", r#"{"cents":1250}"#).await?;
/// kafka.send("orders", "order-1", r#"{"cents":1250}"#).await?; // a duplicate
/// let consumer = kafka
///     .consumer(&engine, "orders")
///     .build(|_m: Arc<Delivery>, _lease: LeaseContext| async {
///         Ok::<_, HandlerError<String>>(Bytes::new())
///     })?;
/// let stats = kafka.run_until_settled(consumer, 2).await?;
/// assert_eq!((stats.executed, stats.replayed), (1, 1));
/// # Ok(()) }
/// ```
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka {
    pub use crate::consumer::ConsumerBuilder;
    pub use dedup_kafka::{
        Acquired, AfterGiveUp, Answer, Backoff, Batching, ConfigError, DEFAULT_KEY_HEADER,
        Delivery, EventTime, IdempotentConsumer, Ignore, KeySource, KillSwitch, LeaseHandler,
        MissingKey, OnResult, Ordering, OrderingKey, Parking, RunnerError, RunnerStats,
        StatsHandle, TxHandler, Typed, event_time_ms, testing,
    };
}

/// The outbox (docs/OUTBOX.md): what a handler publishes is written in the transaction of its
/// effect and published by the relay once that commits, with a derived idempotency key the next
/// consumer dedups on.
pub mod outbox {
    pub use dedup_core::outbox::{
        OUTBOX_CAUSE_KEY, OUTBOX_CAUSE_SCOPE, OUTBOX_HEADERS, OUTBOX_KEY, OutboxMessage,
        derived_key, event_ms,
    };
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub use dedup_kafka::outbox::{
        OutboxRelay, RelayConfig, RelayError, RelayStats, RelayStatsHandle,
    };
    #[cfg(feature = "pg")]
    #[cfg_attr(docsrs, doc(cfg(feature = "pg")))]
    pub use dedup_pg::outbox::{OutboxStatus, OutboxWriter, RelayStore};
}

pub use bytes::Bytes;
/// Typed results: the codecs and their errors ([`ResultCodec`](typed::ResultCodec) stores a value with one).
pub use dedup_core::typed;
pub use dedup_core::{
    BatchConfig, BatchCounts, Completion, Dedup, Fingerprint, HandlerError, IdempotencyKey,
    InputError, InstanceId, L1Policy, Lease, LeaseContext, Policy, ProcessError, Processed, Scope,
    StoreError, TierStats, TieredConfig,
};
#[cfg(feature = "pg")]
#[cfg_attr(docsrs, doc(cfg(feature = "pg")))]
pub use {
    dedup_pg::{
        ConnectError, KeyTimeLayout, MigrationMode, PgStore, RangePolicy, RangeReport, Retention,
        RetentionConfig, RetentionRound, RetentionStats, SchemaError, maintain_ranges,
        partition_by_key_time,
    },
    engine::{BuildError, Engine, EngineBuilder, EngineStore, NoPostgres, ShutdownReport},
    health::{ConsumerHealth, EngineStats, Health},
    running::{Shutdown, Stopped},
    sqlx,
};

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use dedup_redis::redis;

/// The HTTP Idempotency-Key layer built from an [`Engine`] ([`Engine::http_layer`]).
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http {
    pub use crate::layer::{CommitError, EngineLayer, RequestTx};
    pub use dedup_http::{
        Committed, DoNotStore, Extractor, IdempotencyConfig, IdempotencyContext, IdempotencyLayer,
        InFlight, LayerBody, StoreResponses,
    };
}

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use rdkafka;

/// The README's examples are compiled as doctests (the servers they need are not there: `no_run`),
/// so they cannot rot.
#[cfg(all(doctest, feature = "kafka", feature = "http"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
