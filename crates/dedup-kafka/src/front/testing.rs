//! A Kafka cluster inside the test process (librdkafka's mock cluster), to drive a consumer
//! built from an engine with messages of your own: [`MockKafka`].

use std::fmt;
use std::time::Duration;

use crate::{DEFAULT_KEY_HEADER, RunnerError, RunnerStats};
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};

use super::{ConsumerBuilder, Host, IdempotentConsumer};

/// A one-broker Kafka cluster in this process, for tests: topics, messages carrying an
/// idempotency key, and consumers already pointed at it. Not `Send` (librdkafka's mock is not):
/// keep it in the test's own task. With an engine built `in_memory()` (the `dedup` crate), a
/// lease-mode handler's test needs no server at all; with one on Postgres, it runs against the
/// real store.
///
/// ```ignore
/// // With the `dedup` crate (feature `kafka`), whose `kafka` module's docs run this.
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
pub struct MockKafka {
    producer: FutureProducer,
    /// Never destroyed (it lives until the process exits): a consumer may outlive this value
    /// (its tasks end with the runtime), and librdkafka 2.12's consumer, closing while its
    /// group's coordinator is gone, dereferences a null broker in its LeaveGroup error path
    /// (fixed upstream in 2.14.2, which no rdkafka release bundles yet): a SIGSEGV.
    cluster: std::mem::ManuallyDrop<MockCluster<'static, DefaultProducerContext>>,
}

impl fmt::Debug for MockKafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockKafka")
            .field("bootstrap", &self.cluster.bootstrap_servers())
            .finish_non_exhaustive()
    }
}

/// Why [`MockKafka::run_until_settled`] did not end with the messages settled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The consumer stopped with an error.
    #[error(transparent)]
    Consumer(#[from] RunnerError),
    /// Not every message settled in time.
    #[error("{settled} of {expected} messages settled within {within:?}")]
    Timeout {
        /// Messages settled (executed, replayed or dead-lettered).
        settled: u64,
        /// Messages waited for.
        expected: u64,
        /// The wait.
        within: Duration,
    },
}

impl MockKafka {
    /// A cluster of one broker.
    ///
    /// # Errors
    /// librdkafka could not start it.
    pub fn new() -> Result<Self, KafkaError> {
        let cluster = MockCluster::new(1)?;
        let producer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .create()?;
        Ok(Self {
            producer,
            cluster: std::mem::ManuallyDrop::new(cluster),
        })
    }

    /// `bootstrap.servers` for clients of your own.
    pub fn bootstrap(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Creates `topic` with `partitions` partitions.
    ///
    /// # Errors
    /// The cluster refused it.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), KafkaError> {
        self.cluster.create_topic(topic, partitions, 1)
    }

    /// Sends `payload` to `topic` with `key` in the `idempotency-key` header (what a consumer
    /// reads by default) and as the Kafka message key (so one key's messages share a partition).
    ///
    /// # Errors
    /// The cluster did not take it.
    pub async fn send(&self, topic: &str, key: &str, payload: &str) -> Result<(), KafkaError> {
        let headers = OwnedHeaders::new().insert(Header {
            key: DEFAULT_KEY_HEADER,
            value: Some(key.as_bytes()),
        });
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map(drop)
            .map_err(|(e, _)| e)
    }

    /// A consumer of `topic` on `engine`, pointed at this cluster: a group of its own, reading
    /// from the start, committing often. Set the rest as usual, then `build(handler)`.
    pub fn consumer<H: Host>(&self, engine: &H, topic: &str) -> ConsumerBuilder<H> {
        ConsumerBuilder::new(engine.clone())
            .brokers(self.bootstrap())
            .group_id(format!("{topic}-test"))
            .topics([topic])
            .commit_interval(Duration::from_millis(100))
            .set("auto.offset.reset", "earliest")
            // The mock assigns at once with the KIP-848 protocol.
            .set("group.protocol", "consumer")
    }

    /// Runs `consumer` until `messages` have settled (executed, replayed or dead-lettered), then
    /// stops it (its engine goes on) and answers its counters. Gives up after a minute.
    ///
    /// # Errors
    /// The consumer failed, or the messages did not settle in time.
    pub async fn run_until_settled(
        &self,
        consumer: IdempotentConsumer,
        messages: u64,
    ) -> Result<RunnerStats, RunError> {
        const WITHIN: Duration = Duration::from_secs(60);
        let stats = consumer.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(consumer.run_until(stopped));
        let settled = |s: &RunnerStats| s.executed + s.replayed + s.dead_lettered;
        let deadline = tokio::time::Instant::now() + WITHIN;
        while settled(&stats.snapshot()) < messages && tokio::time::Instant::now() < deadline {
            if run.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        let ended = match run.await {
            Ok(ended) => ended?,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        if settled(&ended) < messages {
            return Err(RunError::Timeout {
                settled: settled(&ended),
                expected: messages,
                within: WITHIN,
            });
        }
        Ok(ended)
    }
}
