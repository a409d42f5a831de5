//! (ek) and (fk): Kafka consumers built the way a user builds them (`engine.consumer()`), on the
//! bench's stream, through librdkafka's embedded mock cluster: (ek) a `TxHandler` (transaction
//! mode by the batch, as (e) does it by hand), (fk) a `LeaseHandler` with batching (lease mode by
//! the batch, as (f)). Each runs on an engine of its own, with the engine's caches (L1, Redis)
//! and group commit, as a user's consumer does. Beside (e) and (f) they show what the consumers
//! themselves cost: fetching, lanes, batching, commits.
//!
//! The stream is produced first (not timed) into a topic of `--tx-workers` partitions, each
//! event's id as its `idempotency-key` header and its message key, so that a partition's batch
//! is as large as one of (e)'s and (f)'s workers' batches. The same in-flight bound
//! (`--concurrency`) as every contender. Timed from the first message handed to the handler to
//! the last one settled; the consumer's start (joining the group) is not timed. No latency per
//! event is taken (the events wait in the topic from before the clock starts).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dedup::kafka::{
    Acquired, Answer, Batching, Delivery, IdempotentConsumer, Ordering as KeyOrder, StatsHandle,
    TxHandler,
};
use dedup::{Completion, Engine, HandlerError, LeaseContext, MigrationMode};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sqlx::{PgConnection, PgPool};

use super::engine::tier_counts;
use super::{Ctx, EventKeys, Outcome, result_of};
use crate::connect::CliError;

/// Which mode.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Which {
    /// A `TxHandler`: (ek).
    Tx,
    /// A batched `LeaseHandler`: (fk).
    Lease,
}

/// Runs a consumer of `which` mode over the bench's stream.
pub(super) async fn through_kafka(
    ctx: &Ctx,
    pool: &PgPool,
    redis_url: &str,
    which: Which,
) -> Result<Outcome, CliError> {
    let (name, label, tag) = match which {
        Which::Tx => (
            "(ek)",
            "dedup: transaction-mode consumer (mock Kafka)",
            "ek",
        ),
        Which::Lease => (
            "(fk)",
            "dedup: batched lease-mode consumer (mock Kafka)",
            "fk",
        ),
    };
    let partitions = i32::try_from(ctx.tx_workers.max(1)).unwrap_or(i32::MAX);
    let size = (ctx.concurrency / ctx.tx_workers.max(1)).max(1);
    ctx.note(&format!(
        "{name} {label}: producing {} events to {partitions} partitions",
        ctx.stream.len()
    ));
    let mock = MockCluster::new(1)
        .map_err(|e| CliError::Failed(format!("embedded Kafka mock cluster: {e}")))?;
    let topic = format!("bench-{tag}-{}", ctx.run_id);
    mock.create_topic(&topic, partitions, 1)
        .map_err(|e| CliError::Failed(format!("creating {topic}: {e}")))?;
    let bootstrap = mock.bootstrap_servers();
    produce(&bootstrap, &topic, partitions, &ctx.stream, ctx.keys).await?;

    ctx.note(&format!(
        "{name} consuming: {partitions} partitions, batches of up to {size}, {} in flight",
        ctx.concurrency
    ));
    let engine = Engine::builder()
        .postgres(pool.clone())
        .redis_url(redis_url)
        .scope(ctx.scope(tag))
        .migrations(MigrationMode::Verify)
        .build()
        .await
        .map_err(|e| CliError::Failed(format!("{name}: the engine: {e}")))?;
    let pg = engine
        .postgres()
        .map_err(|e| CliError::Failed(format!("{name}: {e}")))?
        .clone();
    let consumer = engine
        .consumer()
        .brokers(bootstrap)
        .group_id(format!("bench-{tag}-{}", ctx.run_id))
        .topics([&topic])
        .ordering(KeyOrder::PerKey)
        .max_in_flight(ctx.concurrency)
        .batching(Batching::new(size, Duration::from_millis(5)))
        // The mock cluster assigns at once with the KIP-848 protocol.
        .set("group.protocol", "consumer");
    let first = Arc::new(OnceLock::new());
    let effects = Arc::new(AtomicU64::new(0));
    let built = |c: Result<IdempotentConsumer, dedup::kafka::ConfigError>| {
        c.map_err(|e| CliError::Failed(format!("{name}: {e}")))
    };
    let consumer = match which {
        Which::Tx => built(consumer.build(Counted {
            first: Arc::clone(&first),
        }))?,
        Which::Lease => {
            let (first, effects) = (Arc::clone(&first), Arc::clone(&effects));
            built(
                consumer.build(move |d: Arc<Delivery>, _lease: LeaseContext| {
                    let (first, effects) = (Arc::clone(&first), Arc::clone(&effects));
                    async move {
                        let _ = first.set(Instant::now());
                        effects.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, HandlerError<std::io::Error>>(Completion::store(Bytes::from(
                            result_for(&d),
                        )))
                    }
                }),
            )?
        }
    };
    let stats: StatsHandle = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(stopped));
    // Until every event settled (or the runner ended, which it only does on an error).
    let events = ctx.stream.len() as u64;
    let mut last_change = (Instant::now(), 0);
    let ended = loop {
        let s = stats.snapshot();
        let settled = s.executed + s.replayed + s.dead_lettered;
        if settled >= events || task.is_finished() {
            break Instant::now();
        }
        if settled != last_change.1 {
            last_change = (Instant::now(), settled);
        } else if last_change.0.elapsed() > Duration::from_secs(120) {
            let _ = stop.send(());
            // The consumer closes before the mock cluster goes (librdkafka 2.12 dereferences a
            // null broker when a consumer leaves a group whose coordinator is gone).
            let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
            engine.shutdown().await;
            return Err(CliError::Failed(format!(
                "{name}: no progress for 120 s at {settled} of {events} events settled"
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let _ = stop.send(());
    let s = task
        .await
        .map_err(|e| CliError::Failed(format!("{name}: the consumer's task: {e}")))?
        .map_err(|e| CliError::Failed(format!("{name}: {e}")))?;
    engine.shutdown().await;
    let started = first.get().copied().unwrap_or(ended);
    let effects = match which {
        // Counted once committed: the consumer's executed messages.
        Which::Tx => s.executed,
        Which::Lease => effects.load(Ordering::Relaxed),
    };
    Ok(Outcome {
        name,
        label,
        durable: true,
        elapsed: ended.saturating_duration_since(started),
        latencies: super::Latencies::default(),
        effects,
        errors: s.dead_lettered + s.consumer_errors + s.store_errors,
        pg_trips: Some(pg.statements()),
        server_statements: None,
        cpu: None,
        wal: None,
        row_bytes: None,
        http: None,
        outbox: None,
        tiers: tier_counts(&engine.tier_stats()),
        batches: None,
    })
}

/// The result stored for an event: its id's, as the other contenders store.
fn result_for(d: &Delivery) -> String {
    let id = std::str::from_utf8(d.payload_bytes())
        .ok()
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    result_of(id)
}

/// (ek)'s handler: nothing to write beside the completions (as (e)); the first call starts the
/// clock.
#[derive(Debug)]
struct Counted {
    first: Arc<OnceLock<Instant>>,
}

impl TxHandler for Counted {
    type Error = std::io::Error;
    type Output = Bytes;

    async fn handle(
        &self,
        _tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<std::io::Error>> {
        let _ = self.first.set(Instant::now());
        Ok(Bytes::from(result_for(message.delivery())))
    }

    async fn handle_batch(
        &self,
        _tx: &mut PgConnection,
        batch: &[Acquired],
    ) -> Result<Vec<Answer<Self>>, HandlerError<std::io::Error>> {
        let _ = self.first.set(Instant::now());
        Ok(batch
            .iter()
            .map(|a| Ok(Bytes::from(result_for(a.delivery()))))
            .collect())
    }
}

/// The most bytes of record batches the embedded mock cluster keeps per partition
/// (librdkafka's `rdkafka_mock.c`: older batches are dropped beyond it).
const MOCK_PARTITION_BYTES: &str = "5 MiB";

/// Produces the stream: each event's id as its payload, its `idempotency-key` header and its
/// message key (the partitioner spreads the keys over the partitions). Compressed (gzip), since
/// the mock cluster keeps only [`MOCK_PARTITION_BYTES`] per partition and drops the oldest
/// batches beyond it: 100,000 events of UUID-shaped keys take about 11 MB uncompressed. Fails,
/// naming the way out, when a partition's first offset is not 0 after all (the stream would be
/// short, and the runner would wait for events that are gone).
async fn produce(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    stream: &[u64],
    keys: EventKeys,
) -> Result<(), CliError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("compression.type", "gzip")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .map_err(|e| CliError::Failed(format!("Kafka producer: {e}")))?;
    let mut pending = Vec::with_capacity(4096);
    for id in stream {
        let key = keys.of(*id);
        let payload = id.to_string();
        let record = FutureRecord::<str, str>::to(topic)
            .key(&key)
            .payload(&payload)
            .headers(OwnedHeaders::new().insert(Header {
                key: "idempotency-key",
                value: Some(key.as_bytes()),
            }));
        let ack = producer
            .send_result(record)
            .map_err(|(e, _)| CliError::Failed(format!("producing: {e}")))?;
        pending.push(ack);
        if pending.len() >= 4096 {
            for ack in pending.drain(..) {
                await_ack(ack).await?;
            }
        }
    }
    for ack in pending {
        await_ack(ack).await?;
    }
    for partition in 0..partitions {
        let (low, high) = producer
            .client()
            .fetch_watermarks(topic, partition, Duration::from_secs(10))
            .map_err(|e| CliError::Failed(format!("reading {topic}'s offsets: {e}")))?;
        if low != 0 {
            return Err(CliError::Failed(format!(
                "the embedded Kafka mock cluster keeps {MOCK_PARTITION_BYTES} per partition and \
                 dropped the first {low} of partition {partition}'s {high} events: run fewer \
                 --events, more --tx-workers, or --keys sequential (shorter keys)"
            )));
        }
    }
    Ok(())
}

async fn await_ack(ack: rdkafka::producer::DeliveryFuture) -> Result<(), CliError> {
    match ack.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(CliError::Failed(format!("producing: {e}"))),
        Err(_) => Err(CliError::Failed("producing: the producer went away".into())),
    }
}
