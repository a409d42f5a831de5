//! The Kafka runner against librdkafka's mock cluster and a nisshi broker process, with the full
//! engine (L1, a real Redis, Postgres) and a ledger written in transactional mode.
//!
//! Every scenario runs on both brokers (`kafka::mock::*`, `kafka::nisshi::*`).
//!
//! Duplicates; a consumer process (`tests/bin/consume_and_die.rs`) SIGKILLed after its handlers
//! and before any commit; two consumers with a rebalance mid-stream; poison; keyless messages
//! under both policies; per-key concurrency under a small in-flight bound; a stalled handler
//! (pause, and a rebalance served during it); a broker gone mid-stream and back (the mock's broker
//! down and up; nisshi's process stopped with SIGSTOP and continued); typed results replayed to
//! `on_result` and, after a deployment that changed the type, dead-lettered with the reason; and
//! `a_restarted_instance_adopts_what_it_left_in_flight`: a consumer process killed mid-effect
//! under a 10-minute lease, restarted with its identity, books the key under a new token within
//! seconds. The nisshi broker is a process of the test's own (`support::NisshiServer`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Completion, HandlerError, LeaseContext, Policy};
use dedup_kafka::{
    Backoff, DLQ_ATTEMPTS, DLQ_OFFSET, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC, Delivery, MissingKey,
    RunnerError, RunnerStats, StatsHandle,
};
use dedup_pg::PgStore;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use crate::support::{RedisServer, effect_in_tx, effect_rows, effects_table, url_of};
use settings::Settings;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name no other test uses.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A broker for one test: librdkafka's in-process mock cluster, or a nisshi process of its own.
///
/// A mock cluster is never destroyed: `rd_kafka_mock_cluster_destroy` once waited forever for its
/// thread at the end of a test that had passed (`kafka::tx::mock::tx_a_consumer_stopped_...`,
/// blocked in the drop, 2026-11-27), which holds the whole run. Its few idle threads end with
/// the test process.
enum Broker {
    Mock(std::mem::ManuallyDrop<MockCluster<'static, DefaultProducerContext>>),
    Nisshi(crate::support::NisshiServer),
    /// A nisshi process behind a TLS front, with the client properties to reach it.
    Secure(tls::SecureBroker),
}

impl Broker {
    fn mock() -> Self {
        Self::mock_of(1)
    }

    /// A mock cluster of `brokers` brokers.
    fn mock_of(brokers: i32) -> Self {
        Self::Mock(std::mem::ManuallyDrop::new(
            MockCluster::new(brokers).unwrap(),
        ))
    }

    fn nisshi() -> Self {
        Self::Nisshi(crate::support::NisshiServer::start())
    }

    fn bootstrap(&self) -> String {
        match self {
            Self::Mock(m) => m.bootstrap_servers(),
            Self::Nisshi(n) => n.bootstrap(),
            Self::Secure(s) => s.bootstrap(),
        }
    }

    /// Client properties every client of this broker needs.
    fn client(&self) -> Vec<(&'static str, String)> {
        let nisshi = [
            ("broker.address.family", "v4"),
            ("session.timeout.ms", "6000"),
            ("heartbeat.interval.ms", "500"),
        ];
        let owned = |props: &[(&'static str, &str)]| {
            props
                .iter()
                .map(|(k, v)| (*k, (*v).to_owned()))
                .collect::<Vec<_>>()
        };
        match self {
            // The KIP-848 protocol assigns in milliseconds; the classic one waits 3 s first.
            Self::Mock(_) => owned(&[("group.protocol", "consumer")]),
            Self::Nisshi(_) => owned(&nisshi),
            Self::Secure(s) => {
                let mut props = owned(&nisshi);
                props.extend(s.props.iter().cloned());
                props
            }
        }
    }

    /// Properties under which a killed member leaves the group within seconds. On the mock, the
    /// KIP-848 protocol's session timeout is the broker's (45 s); the classic one takes ours.
    fn fast_failover(&self) -> Vec<(&'static str, &'static str)> {
        match self {
            Self::Mock(_) => vec![
                ("group.protocol", "classic"),
                ("session.timeout.ms", "6000"),
                ("heartbeat.interval.ms", "500"),
            ],
            Self::Nisshi(_) | Self::Secure(_) => vec![],
        }
    }

    fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap());
        for (k, v) in self.client() {
            c.set(k, v);
        }
        c
    }

    async fn create_topic(&self, name: &str, partitions: i32) {
        match self {
            Self::Mock(m) => m.create_topic(name, partitions, 1).unwrap(),
            Self::Nisshi(_) | Self::Secure(_) => {
                let mut c = self.client_config();
                c.remove("session.timeout.ms");
                c.remove("heartbeat.interval.ms");
                let admin: AdminClient<DefaultClientContext> = c.create().unwrap();
                let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
                let r = admin
                    .create_topics(&[topic], &AdminOptions::new())
                    .await
                    .unwrap();
                for t in r {
                    t.unwrap();
                }
            }
        }
    }

    fn producer(&self) -> FutureProducer {
        let mut c = self.client_config();
        c.remove("group.protocol");
        c.remove("session.timeout.ms");
        c.remove("heartbeat.interval.ms");
        c.set("enable.idempotence", "true").set("acks", "all");
        c.create().unwrap()
    }

    fn config(&self, group: &str, topic: &str) -> Settings {
        let mut cfg = Settings::new(self.bootstrap(), group, [topic])
            .with_commit_interval(Duration::from_millis(200))
            .with_backoff(Backoff::new(
                Duration::from_millis(20),
                Duration::from_millis(200),
            ));
        for (k, v) in self.client() {
            cfg = cfg.with_client(k, v);
        }
        cfg
    }
}

/// One event of a test stream.
#[derive(Clone, Debug)]
struct Event {
    key: Option<String>,
    payload: String,
    partition: i32,
    /// The Kafka message key (what the producer partitions by: an account, an order).
    message_key: Option<String>,
}

fn event(id: u32, partitions: i32) -> Event {
    Event {
        key: Some(format!("evt-{id}")),
        payload: format!(r#"{{"id":{id},"amount":{}}}"#, id % 100 + 1),
        partition: i32::try_from(id).unwrap() % partitions,
        message_key: None,
    }
}

async fn produce(broker: &Broker, topic: &str, events: &[Event]) {
    let producer = broker.producer();
    let mut acks = Vec::new();
    for e in events {
        let mut headers = OwnedHeaders::new();
        if let Some(k) = &e.key {
            headers = headers.insert(Header {
                key: "idempotency-key",
                value: Some(k.as_bytes()),
            });
        }
        let mut record = FutureRecord::<str, str>::to(topic)
            .payload(&e.payload)
            .partition(e.partition)
            .headers(headers);
        if let Some(k) = &e.message_key {
            record = record.key(k);
        }
        acks.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
    }
    for a in acks {
        let d = a.await.unwrap().map_err(|(e, _)| e).unwrap();
        let mut ends = PRODUCED.lock().unwrap();
        let end = ends.entry((topic.to_owned(), d.partition)).or_default();
        *end = (*end).max(d.offset + 1);
    }
}

/// The ledger handler: an amount below zero is poison; otherwise one row in `effects` and the
/// fenced completion, in one transaction.
type HandlerFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Completion, HandlerError<String>>> + Send>,
>;

fn ledger_handler(
    store: PgStore,
    worker: &'static str,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    move |d, lease| {
        let store = store.clone();
        Box::pin(async move {
            let json: serde_json::Value = serde_json::from_slice(d.payload_bytes())
                .map_err(|e| HandlerError::Permanent(format!("payload: {e}")))?;
            if json["amount"].as_i64().unwrap_or(0) < 0 {
                return Err(HandlerError::Permanent("negative amount".to_owned()));
            }
            let key = d
                .header("idempotency-key")
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_else(|| format!("offset-{}", d.offset));
            match lease {
                Some(ctx) => effect_in_tx(
                    &store,
                    &ctx,
                    key.clone(),
                    worker.to_owned(),
                    Bytes::from(format!("booked {key}")),
                )
                .await
                .map_err(|e| match e {
                    HandlerError::Retryable(e) => HandlerError::Retryable(e.to_string()),
                    HandlerError::Permanent(e) => HandlerError::Permanent(e.to_string()),
                    HandlerError::Store(e) => HandlerError::Store(e),
                    _ => HandlerError::Permanent("unexpected".to_owned()),
                }),
                None => {
                    sqlx::query("INSERT INTO effects VALUES ($1, 0, $2)")
                        .bind(&key)
                        .bind(worker)
                        .execute(store.pool())
                        .await
                        .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                    Ok(Completion::store(Bytes::new()))
                }
            }
        })
    }
}

/// A per-message lease-mode consumer built from an engine of its own, running until `stop`.
struct Running {
    stop: oneshot::Sender<()>,
    handle: JoinHandle<Result<RunnerStats, RunnerError>>,
    stats: StatsHandle,
}

impl Running {
    async fn spawn(config: Settings, setup: Setup, worker: &'static str) -> Self {
        let store = setup.pg();
        Self::spawn_with(config, setup, ledger_handler(store, worker)).await
    }

    async fn spawn_with<F, Fut, E>(config: Settings, setup: Setup, handler: F) -> Self
    where
        F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send,
        E: std::fmt::Display + Send + 'static,
    {
        Self::spawn_full(config, setup, None, handler).await
    }

    /// With `batching`: lease mode by the batch.
    async fn spawn_full<F, Fut, E>(
        config: Settings,
        setup: Setup,
        batching: Option<dedup_kafka::Batching>,
        handler: F,
    ) -> Self
    where
        F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send,
        E: std::fmt::Display + Send + 'static,
    {
        Self::spawn_built(config, setup, handler, |consumer| match batching {
            Some(batching) => consumer.batching(batching),
            None => consumer,
        })
        .await
    }

    /// With the consumer's builder set further by `more` (parking, say).
    async fn spawn_built<F, Fut, E>(
        config: Settings,
        setup: Setup,
        handler: F,
        more: impl FnOnce(dedup::kafka::ConsumerBuilder) -> dedup::kafka::ConsumerBuilder,
    ) -> Self
    where
        F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send,
        E: std::fmt::Display + Send + 'static,
    {
        Self::spawn_handler(config, setup, Shim(handler), more).await
    }

    /// Any lease handler (a typed one, say).
    async fn spawn_handler(
        config: Settings,
        setup: Setup,
        handler: impl dedup::kafka::LeaseHandler<Output: Into<Completion>>,
        more: impl FnOnce(dedup::kafka::ConsumerBuilder) -> dedup::kafka::ConsumerBuilder,
    ) -> Self {
        let engine = setup.build(&config).await;
        let consumer = more(consumer_for(&engine, &config)).build(handler).unwrap();
        let stats = consumer.stats();
        let (stop, rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = rx.await;
            engine.shutdown().await;
        });
        let handle = tokio::spawn(consumer.run());
        Self {
            stop,
            handle,
            stats,
        }
    }

    async fn stop(self) -> RunnerStats {
        let _ = self.stop.send(());
        self.handle.await.unwrap().unwrap()
    }
}

/// The tests' handlers, `Fn(message, Option<lease>)` (no lease: a keyless message under
/// `ProcessWithoutDedup`), as a `LeaseHandler`.
struct Shim<F>(F);

impl<F, Fut, E> dedup::kafka::LeaseHandler for Shim<F>
where
    F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send,
    E: std::fmt::Display + Send + 'static,
{
    type Error = E;
    type Output = Completion;
    const RUNS_KEYLESS: bool = true;

    fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> impl std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send {
        (self.0)(message, Some(lease))
    }

    fn handle_keyless(
        &self,
        message: Arc<Delivery>,
    ) -> impl std::future::Future<Output = Result<(), HandlerError<E>>> + Send {
        let run = (self.0)(message, None);
        async move { run.await.map(drop) }
    }
}

/// What a test's consumer runs on: Postgres, a Redis of the test's own, the policy and the
/// in-flight wait; its engine is built with the consumer (`Setup::build`), in the consumer's
/// dedup scope.
#[derive(Clone, Debug)]
struct Setup {
    pool: PgPool,
    redis: String,
    policy: Policy,
    in_flight_wait: Duration,
    /// An engine built `in_memory()` (no Postgres behind the consumer: no dead-letter table).
    in_memory: bool,
}

/// The engine the tests run on: a 5 s lease, a 1 s in-flight wait.
fn setup(pool: &PgPool, redis: &RedisServer) -> Setup {
    Setup {
        pool: pool.clone(),
        redis: redis.url(),
        policy: Policy::default().with_lease(Duration::from_secs(5)),
        in_flight_wait: Duration::from_secs(1),
        in_memory: false,
    }
}

impl Setup {
    /// The same, with `policy`.
    fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The same, in memory: the consumer has no Postgres of its own (a handler may still write
    /// to the test's database).
    fn in_memory(mut self) -> Self {
        self.in_memory = true;
        self
    }
}

impl Setup {
    /// A Postgres store on the test's database (for handlers' own transactions).
    fn pg(&self) -> PgStore {
        PgStore::new(self.pool.clone())
    }

    /// The engine, in `config`'s dedup scope (its group id where it names none).
    async fn build(&self, config: &Settings) -> dedup::Engine {
        let engine = if self.in_memory {
            dedup::Engine::builder().in_memory()
        } else {
            dedup::Engine::builder()
                .postgres(self.pool.clone())
                .redis_url(&self.redis)
        };
        engine
            .tiers(crate::support::test_config())
            .scope(config.scope())
            .policy(self.policy)
            .in_flight_wait(self.in_flight_wait)
            .build()
            .await
            .unwrap()
    }
}

async fn ledger_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The arguments of a `dedup-consume-and-die` process: the broker, the group and topic, the
/// servers, and the broker's client properties with fast failover.
fn consumer_args(
    broker: &Broker,
    group: &str,
    topic: &str,
    pool: &PgPool,
    redis: &RedisServer,
) -> Vec<String> {
    consumer_args_for(broker, group, topic, &url_of(pool), redis)
}

/// [`consumer_args`] with the database's URL (a Postgres of the test's own).
fn consumer_args_for(
    broker: &Broker,
    group: &str,
    topic: &str,
    database_url: &str,
    redis: &RedisServer,
) -> Vec<String> {
    let mut args = vec![
        broker.bootstrap(),
        group.to_owned(),
        topic.to_owned(),
        database_url.to_owned(),
        redis.url(),
    ];
    args.extend(
        broker
            .client()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .chain(
                broker
                    .fast_failover()
                    .iter()
                    .map(|(k, v)| format!("{k}={v}")),
            ),
    );
    args
}

/// An engine on `pool` (with `redis` as its fast path, if given) in `config`'s dedup scope (its
/// group id where it names none, as the tests' streams expect), under `policy`.
async fn engine_for(
    pool: &PgPool,
    config: &Settings,
    redis: Option<&RedisServer>,
    policy: Policy,
) -> dedup::Engine {
    let mut engine = dedup::Engine::builder()
        .postgres(pool.clone())
        .scope(config.scope())
        .policy(policy);
    if let Some(redis) = redis {
        engine = engine.redis_url(redis.url());
    }
    engine.build().await.unwrap()
}

/// The consumer builder of `engine` set as `config` says, setting by setting.
fn consumer_for(engine: &dedup::Engine, config: &Settings) -> dedup::kafka::ConsumerBuilder {
    let mut c = engine
        .consumer()
        .brokers(&config.brokers)
        .group_id(&config.group_id)
        .topics(config.topics.clone());
    if let Some(t) = &config.dead_letter_topic {
        c = c.dead_letter_topic(t);
    }
    if let Some(k) = &config.key {
        c = c.key(k.clone());
    }
    if let Some(m) = config.missing_key {
        c = c.missing_key(m);
    }
    if let Some(on) = config.payload_check {
        c = c.payload_check(on);
    }
    if let Some(n) = config.max_in_flight {
        c = c.max_in_flight(n);
    }
    if let Some(n) = config.max_blocked {
        c = c.max_blocked(n);
    }
    if let Some(o) = config.ordering {
        c = c.ordering(o);
    }
    if let Some(k) = &config.ordering_key {
        c = c.ordering_key(k.clone());
    }
    if let Some(b) = config.backoff {
        c = c.backoff(b);
    }
    if let Some(i) = config.commit_interval {
        c = c.commit_interval(i);
    }
    if let Some(t) = config.drain_timeout {
        c = c.drain_timeout(t);
    }
    if let Some(switch) = config.kill_switch {
        c = c.kill_switch(switch);
    }
    for (k, v) in &config.client {
        c = c.set(k, v);
    }
    c
}

/// Waits until `done` holds, or fails the test after `secs`.
async fn eventually<F, Fut>(secs: u64, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(50)).await;
    }
}

/// Every key in the ledger exactly once, and nothing else.
async fn assert_one_row_per_key(pool: &PgPool, keys: impl IntoIterator<Item = String>) {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (k, _, _) in effect_rows(pool).await {
        *counts.entry(k).or_default() += 1;
    }
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        doubled.is_empty(),
        "keys with more than one effect: {doubled:?}"
    );
    let expected: std::collections::BTreeSet<String> = keys.into_iter().collect();
    let got: std::collections::BTreeSet<String> = counts.into_keys().collect();
    assert_eq!(got, expected, "ledger keys differ from the stream's");
}

/// The group's committed offset per partition (-1 where none). Blocking calls go to the blocking
/// pool: the test's runtime has one thread, and the runner lives on it.
async fn committed(broker: &Broker, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let mut c = broker.client_config();
    c.set("group.id", group);
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = c.create().unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let got = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        (0..partitions)
            .map(
                |p| match got.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => -1,
                },
            )
            .collect()
    })
    .await
    .unwrap()
}

/// Waits until the group has committed every partition of `topic` to its end.
async fn committed_to_the_end(broker: &Broker, group: &str, topic: &str, partitions: i32) {
    committed_to_the_end_within(broker, group, topic, partitions, 60).await;
}

/// [`committed_to_the_end`] with a bound of `secs` (for scenarios that wait on rebalances).
async fn committed_to_the_end_within(
    broker: &Broker,
    group: &str,
    topic: &str,
    partitions: i32,
    secs: u64,
) {
    let ends = produced_ends(topic, partitions);
    eventually(secs, "offsets committed to the end", || {
        let ends = ends.clone();
        async move { committed(broker, group, topic, partitions).await == ends }
    })
    .await;
}

/// The end offset of each partition (its last message's offset + 1), from the producer's
/// acknowledgements: nisshi 0.6.0 answers a ListOffsets request for the latest offset with 1
/// whatever the partition holds, so watermarks cannot be asked of the broker.
fn produced_ends(topic: &str, partitions: i32) -> Vec<i64> {
    let ends = PRODUCED.lock().unwrap();
    (0..partitions)
        .map(|p| ends.get(&(topic.to_owned(), p)).copied().unwrap_or(0))
        .collect()
}

static PRODUCED: std::sync::Mutex<BTreeMap<(String, i32), i64>> =
    std::sync::Mutex::new(BTreeMap::new());

/// A message read back whole: its Kafka key, payload, and headers in order.
#[derive(Debug)]
pub(super) struct Letter {
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

/// Reads `n` messages of `topic` from its start, whole.
async fn read_letters(broker: &Broker, topic: &str, n: usize) -> Vec<Letter> {
    let mut c = broker.client_config();
    c.set("group.id", unique("dlq-reader"))
        .set("auto.offset.reset", "earliest");
    let consumer: StreamConsumer = c.create().unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} of {n} dead letters arrived", out.len()))
            .unwrap();
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        out.push(Letter {
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
        });
    }
    out
}

/// A dead-lettered message: its payload and its headers, as text.
type Dead = (Option<String>, HashMap<String, String>);

async fn read_dead_letters(broker: &Broker, topic: &str, n: usize) -> Vec<Dead> {
    read_letters(broker, topic, n)
        .await
        .into_iter()
        .map(|l| {
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            let headers = l
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), text(v.as_deref().unwrap_or_default())))
                .collect();
            (l.payload.as_deref().map(text), headers)
        })
        .collect()
}

macro_rules! on_brokers {
    ($($name:ident),* $(,)?) => {
        mod mock {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $name(pool: sqlx::PgPool) {
                    let broker = super::Broker::mock();
                    super::$name(&broker, pool).await;
                }
            )*
        }
        mod nisshi {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $name(pool: sqlx::PgPool) {
                    let broker = super::Broker::nisshi();
                    super::$name(&broker, pool).await;
                }
            )*
        }
    };
}

on_brokers!(
    a_stream_with_duplicates_books_each_key_once_and_commits_to_the_end,
    killed_after_the_handler_and_before_the_commit_replays_on_restart,
    a_restarted_instance_adopts_what_it_left_in_flight,
    two_consumers_with_a_rebalance_mid_stream_lose_and_double_nothing,
    poison_goes_to_the_dead_letter_topic_and_the_stream_goes_on,
    keyless_messages_are_dead_lettered_by_default,
    keyless_messages_run_without_dedup_when_asked,
    per_key_concurrency_with_a_small_in_flight_bound_keeps_the_ledger_exact,
    the_broker_down_mid_stream_and_back_loses_and_doubles_nothing,
    a_stalled_handler_pauses_the_partitions_and_a_rebalance_is_still_served,
    retryable_failures_are_retried_then_dead_lettered_past_the_attempt_limit,
    a_panicking_handler_on_one_partition_is_dead_lettered_and_the_stream_goes_on,
    a_panicking_handler_on_several_partitions_is_dead_lettered_and_the_stream_goes_on,
    per_key_order_follows_the_ordering_key_not_the_idempotency_key,
    typed_results_are_replayed_and_a_changed_type_is_dead_lettered,
);

async fn a_stream_with_duplicates_books_each_key_once_and_commits_to_the_end(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("orders");
    broker.create_topic(&topic, 3).await;
    // 300 events over 200 keys: every third event is a redelivery of an earlier one.
    let events: Vec<Event> = (0..300u32)
        .map(|i| {
            let id = if i % 3 == 2 { i / 3 } else { i };
            let mut e = event(id, 3);
            e.partition = i32::try_from(i).unwrap() % 3;
            e
        })
        .collect();
    let keys: std::collections::BTreeSet<String> =
        events.iter().filter_map(|e| e.key.clone()).collect();
    produce(broker, &topic, &events).await;
    let dedup = setup(&pool, &redis);
    let group = unique("g");
    let run = Running::spawn(broker.config(&group, &topic), dedup, "a").await;
    let stats = run.stats.clone();
    eventually(60, "all 300 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 300 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!(s.executed, keys.len() as u64);
    assert_eq!(s.replayed, 300 - keys.len() as u64);
    assert_eq!(s.dead_lettered, 0);
    assert_one_row_per_key(&pool, keys).await;
    assert_eq!(
        committed(broker, &group, &topic, 3).await,
        produced_ends(&topic, 3)
    );
}

async fn killed_after_the_handler_and_before_the_commit_replays_on_restart(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("payments");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..40).map(|i| event(i, 2)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");

    // The first consumer is a process of its own: it runs every handler (each effect commits
    // with its completion) and is killed with SIGKILL before any offset is committed (its commit
    // interval is an hour; a kill runs no revocation and no shutdown).
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"))
        .args(consumer_args(broker, &group, &topic, &pool, &redis))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually(60, "40 effects", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await == 40 }
    })
    .await;
    child.kill().await.unwrap();
    assert!(!child.wait().await.unwrap().success());
    assert_eq!(committed(broker, &group, &topic, 2).await, vec![-1, -1]);

    // On restart (a new process would have an empty L1: a new engine), every message comes again
    // and is replayed from dedup.
    let mut config = broker.config(&group, &topic);
    for (k, v) in broker.fast_failover() {
        config = config.with_client(k, v);
    }
    let second = Running::spawn(config, setup(&pool, &redis), "second").await;
    let stats = second.stats.clone();
    eventually(60, "40 replays", || {
        let s = stats.snapshot();
        async move { s.replayed == 40 }
    })
    .await;
    let s = second.stop().await;
    assert_eq!(s.executed, 0, "nothing runs twice");
    assert_one_row_per_key(&pool, events.iter().filter_map(|e| e.key.clone())).await;
    assert!(
        effect_rows(&pool)
            .await
            .iter()
            .all(|(_, _, w)| w == "killed")
    );
    assert_eq!(committed(broker, &group, &topic, 2).await, vec![20, 20]);
}

/// A consumer with a stable identity is killed while one handler is in the middle of its effect
/// (holding a 10-minute lease). Restarted with the same identity, it adopts that lease at start
/// and runs the key under a new token as soon as the message comes again: long before the lease
/// would have ended. Nothing runs twice.
async fn a_restarted_instance_adopts_what_it_left_in_flight(broker: &Broker, pool: PgPool) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("adopt");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..20).map(|i| event(i, 2)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let instance = unique("node");
    let spawn = |hang: Option<&str>| {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"));
        c.args(consumer_args(broker, &group, &topic, &pool, &redis))
            .env("DEDUP_INSTANCE", &instance)
            .env("DEDUP_LEASE_MS", "600000")
            .kill_on_drop(true);
        if let Some(k) = hang {
            c.env("DEDUP_HANG_KEY", k);
        }
        c.spawn().unwrap()
    };
    let mut first = spawn(Some("evt-3"));
    // Partition 0 (even ids) all booked; partition 1 stops behind evt-3 (evt-1 booked before it).
    eventually(60, "11 effects, evt-3 hanging", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await == 11 }
    })
    .await;
    let k = crate::support::key_in(&group, "evt-3");
    let held = dedup_core::Store::get(&PgStore::new(pool.clone()), &k)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(held.state, dedup_core::State::InProgress);
    first.kill().await.unwrap();
    first.wait().await.unwrap();

    let started = Instant::now();
    let mut second = spawn(None);
    eventually(60, "evt-3 booked by the restarted instance", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await == 20 }
    })
    .await;
    let took = started.elapsed();
    second.kill().await.unwrap();
    let rec = dedup_core::Store::get(&PgStore::new(pool.clone()), &k)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.state, dedup_core::State::Completed);
    assert!(rec.token > held.token);
    assert_eq!(rec.attempts, 2);
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert_one_row_per_key(&pool, events.iter().filter_map(|e| e.key.clone())).await;
}

async fn two_consumers_with_a_rebalance_mid_stream_lose_and_double_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("stock");
    broker.create_topic(&topic, 4).await;
    // 1,200 events over 800 keys, redeliveries spread over every partition.
    let events: Vec<Event> = (0..1200u32)
        .map(|i| {
            let mut e = event(if i % 3 == 2 { i / 2 } else { i }, 4);
            e.partition = i32::try_from(i).unwrap() % 4;
            e
        })
        .collect();
    let keys: std::collections::BTreeSet<String> =
        events.iter().filter_map(|e| e.key.clone()).collect();
    let group = unique("g");
    // Each consumer is its own instance: its own L1, the shared Redis and Postgres. The first
    // one's handlers hold at a gate after 50 calls, so that it still has messages in flight when
    // the second member joins, however fast the machine: the scenario makes its own
    // precondition instead of racing the clock.
    let a_dedup = setup(&pool, &redis);
    let (gate, calls) = Gate::new();
    let a_handler = gate.after(50, ledger_handler(a_dedup.pg(), "a"));
    let a = Running::spawn_with(broker.config(&group, &topic), a_dedup, a_handler).await;
    produce(broker, &topic, &events[..600]).await;
    eventually(
        60,
        "the first consumer under way and held at the gate",
        || {
            let n = calls.load(Ordering::Relaxed);
            async move { n > 50 }
        },
    )
    .await;
    // The second member joins mid-stream: partitions move while messages are in flight.
    let b = Running::spawn(broker.config(&group, &topic), setup(&pool, &redis), "b").await;
    let (a_stats, b_stats) = (a.stats.clone(), b.stats.clone());
    eventually(90, "the second member assigned, the first revoked", || {
        let (sa, sb) = (a_stats.snapshot(), b_stats.snapshot());
        async move { sb.assigned > 0 && sa.revoked > 0 }
    })
    .await;
    gate.open();
    produce(broker, &topic, &events[600..]).await;
    eventually(90, "every key booked", || {
        let pool = pool.clone();
        let n = keys.len();
        async move { ledger_count(&pool).await >= i64::try_from(n).unwrap() }
    })
    .await;
    // Wait until both have settled what they hold and committed.
    committed_to_the_end(broker, &group, &topic, 4).await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert!(
        sb.assigned > 0,
        "the second consumer got partitions: {sb:?}"
    );
    assert!(sa.revoked > 0, "the first consumer gave some up: {sa:?}");
    assert_one_row_per_key(&pool, keys.clone()).await;
    assert_eq!(sa.executed + sb.executed, keys.len() as u64);
    assert_eq!(sa.dead_lettered + sb.dead_lettered, 0);
}

async fn poison_goes_to_the_dead_letter_topic_and_the_stream_goes_on(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("ledger");
    broker.create_topic(&topic, 1).await;
    let mut events: Vec<Event> = (0..30).map(|i| event(i, 1)).collect();
    events[10].payload = r#"{"id":10,"amount":-5}"#.to_owned();
    events[20].payload = "not json at all".to_owned();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "30 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 30 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (28, 2));
    let mut dead = read_dead_letters(broker, &format!("{topic}.dlq"), 2).await;
    dead.sort_by_key(|(_, h)| h[DLQ_OFFSET].parse::<i64>().unwrap());
    let (payload, h) = &dead[0];
    assert_eq!(payload.as_deref(), Some(r#"{"id":10,"amount":-5}"#));
    assert!(h[DLQ_REASON].contains("negative amount"), "{h:?}");
    assert_eq!(h[DLQ_ATTEMPTS], "1");
    assert_eq!(h[DLQ_TOPIC], topic);
    assert_eq!(h[DLQ_PARTITION], "0");
    assert_eq!(h[DLQ_OFFSET], "10");
    assert_eq!(h["idempotency-key"], "evt-10", "original headers are kept");
    assert!(dead[1].1[DLQ_REASON].contains("payload"), "{:?}", dead[1].1);
    assert_eq!(dead[1].1[DLQ_OFFSET], "20");
    // The stream went on: every other key booked, the offset past the poison.
    let good = events
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 10 && *i != 20)
        .filter_map(|(_, e)| e.key.clone());
    assert_one_row_per_key(&pool, good).await;
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![30]);
}

async fn keyless_messages_are_dead_lettered_by_default(broker: &Broker, pool: PgPool) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("keyless");
    broker.create_topic(&topic, 1).await;
    let mut events: Vec<Event> = (0..10).map(|i| event(i, 1)).collect();
    events[3].key = None;
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let run = Running::spawn(broker.config(&group, &topic), setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "10 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 10 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered, s.missing_key), (9, 1, 1));
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    assert!(
        dead[0].1[DLQ_REASON].contains("no idempotency key"),
        "{:?}",
        dead[0].1
    );
    assert_eq!(dead[0].1[DLQ_OFFSET], "3");
    assert_eq!(ledger_count(&pool).await, 9);
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![10]);
}

async fn keyless_messages_run_without_dedup_when_asked(broker: &Broker, pool: PgPool) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("keyless-ok");
    broker.create_topic(&topic, 1).await;
    let mut events: Vec<Event> = (0..10).map(|i| event(i, 1)).collect();
    events[4].key = None;
    events[7].key = None;
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_missing_key(MissingKey::ProcessWithoutDedup);
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "10 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.processed_without_dedup == 10 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!(
        (s.executed, s.processed_without_dedup, s.dead_lettered),
        (8, 2, 0)
    );
    assert_eq!(s.missing_key, 2);
    let rows = effect_rows(&pool).await;
    assert!(
        rows.iter().any(|(k, t, _)| k == "offset-4" && *t == 0),
        "{rows:?}"
    );
    assert!(
        rows.iter().any(|(k, t, _)| k == "offset-7" && *t == 0),
        "{rows:?}"
    );
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![10]);
}

async fn per_key_concurrency_with_a_small_in_flight_bound_keeps_the_ledger_exact(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("perkey");
    broker.create_topic(&topic, 2).await;
    // Hot keys: 600 events over 60 keys, so one key's copies queue behind each other.
    let events: Vec<Event> = (0..600u32)
        .map(|i| {
            let mut e = event(i % 60, 2);
            e.partition = i32::try_from(i).unwrap() % 2;
            // One order per key: the ordering key is the message key.
            e.message_key = e.key.clone();
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_ordering(dedup_kafka::Ordering::PerKey)
        .with_max_in_flight(16);
    // Each execution takes a few milliseconds, so both partitions' shares of the bound fill
    // while their backlogs last (with instant handlers a loaded machine may drain one
    // partition's share as fast as it fills, and the bound is never reached).
    let setup = setup(&pool, &redis);
    let inner = ledger_handler(setup.pg(), "a");
    let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| -> HandlerFuture {
        let effect = inner(d, lease);
        Box::pin(async move {
            sleep(Duration::from_millis(5)).await;
            effect.await
        })
    };
    let run = Running::spawn_with(config, setup, handler).await;
    let stats = run.stats.clone();
    eventually(60, "600 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 600 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!(s.executed, 60);
    assert!(s.saturated > 0, "the in-flight bound was reached: {s:?}");
    assert!(s.max_held <= 16, "never more than the bound held: {s:?}");
    assert_one_row_per_key(&pool, (0..60).map(|i| format!("evt-{i}"))).await;
    assert_eq!(committed(broker, &group, &topic, 2).await, vec![300, 300]);
}

async fn the_broker_down_mid_stream_and_back_loses_and_doubles_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("restart");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..400).map(|i| event(i, 2)).collect();
    produce(broker, &topic, &events[..200]).await;
    let group = unique("g");
    let run = Running::spawn(broker.config(&group, &topic), setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "the first half booked", || {
        let s = stats.snapshot();
        async move { s.executed >= 200 }
    })
    .await;
    match broker {
        Broker::Mock(m) => {
            m.broker_down(1).unwrap();
            sleep(Duration::from_secs(2)).await;
            m.broker_up(1).unwrap();
        }
        Broker::Nisshi(n) => n.stop_for(Duration::from_secs(5)).await,
        Broker::Secure(s) => s.nisshi.stop_for(Duration::from_secs(5)).await,
    }
    produce(broker, &topic, &events[200..]).await;
    eventually(120, "every key booked after the restart", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await >= 400 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 2).await;
    let s = run.stop().await;
    assert_eq!(s.dead_lettered, 0);
    assert_one_row_per_key(&pool, events.iter().filter_map(|e| e.key.clone())).await;
}

async fn a_stalled_handler_pauses_the_partitions_and_a_rebalance_is_still_served(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("stall");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..20).map(|i| event(i, 2)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    // The first member's handlers hold at a gate: with two messages in flight and none settling,
    // it stalls past the limit and pauses, for as long as the test needs, on any machine.
    let (gate, _) = Gate::new();
    let slow = gate.after(0, ledger_handler(PgStore::new(pool.clone()), "slow"));
    let config = broker.config(&group, &topic).with_max_in_flight(2);
    let a = Running::spawn_with(config, setup(&pool, &redis), slow).await;
    let a_stats = a.stats.clone();
    eventually(60, "a pause for the stall", || {
        let s = a_stats.snapshot();
        async move { s.pauses > 0 }
    })
    .await;
    // A second member joins while the first is stalled: the first still serves the rebalance
    // (it polls while paused) and gives partitions up.
    let b = Running::spawn(broker.config(&group, &topic), setup(&pool, &redis), "b").await;
    let b_stats = b.stats.clone();
    eventually(90, "the rebalance served during the stall", || {
        let (sa, sb) = (a_stats.snapshot(), b_stats.snapshot());
        async move { sa.revoked > 0 && sb.assigned > 0 }
    })
    .await;
    gate.open();
    eventually(90, "every key booked", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await >= 20 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 2).await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert!(
        sa.revoked > 0,
        "the stalled member served the rebalance: {sa:?}"
    );
    assert!(sb.executed > 0, "the new member took work: {sb:?}");
    assert_one_row_per_key(&pool, events.iter().filter_map(|e| e.key.clone())).await;
}

#[test]
fn keys_come_from_a_header_a_json_pointer_or_a_digest_of_fields() {
    use dedup_kafka::{KeyError, KeySource, extract_key};
    let scope = dedup_core::Scope::new("orders-group").unwrap();
    let d = Delivery::new("t", 0, 7)
        .with_header("idempotency-key", "evt-1")
        .with_payload(r#"{"order":{"id":42,"ref":"A-9"},"account":7,"request":"r1","nested":{}}"#);
    let header = extract_key(&KeySource::default(), &scope, &d).unwrap();
    assert_eq!(header.key_bytes(), b"evt-1");
    assert_eq!(header.scope().as_str(), "orders-group");
    let number = extract_key(&KeySource::JsonPointer("/order/id".into()), &scope, &d).unwrap();
    assert_eq!(number.key_bytes(), b"42");
    let text = extract_key(&KeySource::JsonPointer("/order/ref".into()), &scope, &d).unwrap();
    assert_eq!(text.key_bytes(), b"A-9");
    let fields = KeySource::Fields(vec!["/account".into(), "/request".into()]);
    let a = extract_key(&fields, &scope, &d).unwrap();
    assert_eq!(a.key_bytes().len(), 64, "a hex SHA-256 digest");
    // The same fields in another message give the same key; other values another.
    let same = Delivery::new("t", 1, 9).with_payload(r#"{"request":"r1","account":7,"x":1}"#);
    assert_eq!(extract_key(&fields, &scope, &same).unwrap(), a);
    let other = Delivery::new("t", 1, 9).with_payload(r#"{"request":"r2","account":7}"#);
    assert_ne!(extract_key(&fields, &scope, &other).unwrap(), a);

    let err = |source: KeySource, d: &Delivery| extract_key(&source, &scope, d).unwrap_err();
    assert!(matches!(
        err(KeySource::Header("other".into()), &d),
        KeyError::Missing(_)
    ));
    assert!(matches!(
        err(KeySource::JsonPointer("/nope".into()), &d),
        KeyError::Missing(_)
    ));
    assert!(matches!(
        err(KeySource::JsonPointer("/nested".into()), &d),
        KeyError::NotScalar { .. }
    ));
    let not_json = Delivery::new("t", 0, 1).with_payload(&b"\xff\xfe not json"[..]);
    assert!(matches!(
        err(KeySource::JsonPointer("/id".into()), &not_json),
        KeyError::NotJson(_)
    ));
    let empty_header = Delivery::new("t", 0, 1).with_header("idempotency-key", "");
    assert!(matches!(
        err(KeySource::default(), &empty_header),
        KeyError::Invalid(_)
    ));
    let long = Delivery::new("t", 0, 1).with_header("idempotency-key", "k".repeat(600));
    assert!(matches!(
        err(KeySource::default(), &long),
        KeyError::Invalid(_)
    ));
    // Binary header values are keys too (keys are bytes).
    let binary = Delivery::new("t", 0, 1).with_header("idempotency-key", &b"\x00\xff"[..]);
    assert_eq!(
        extract_key(&KeySource::default(), &scope, &binary)
            .unwrap()
            .key_bytes(),
        b"\x00\xff"
    );
}

async fn retryable_failures_are_retried_then_dead_lettered_past_the_attempt_limit(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("flaky");
    broker.create_topic(&topic, 1).await;
    let events: Vec<Event> = (0..6).map(|i| event(i, 1)).collect();
    produce(broker, &topic, &events).await;
    let dedup = setup(&pool, &redis);
    let inner = ledger_handler(dedup.pg(), "a");
    let calls = Arc::new(std::sync::Mutex::new(HashMap::<i64, u32>::new()));
    let seen = calls.clone();
    // Offset 2 fails twice and then succeeds; offset 4 always fails (retryably).
    let flaky = move |d: Arc<Delivery>, lease: Option<LeaseContext>| {
        let n = {
            let mut c = seen.lock().unwrap();
            let n = c.entry(d.offset).or_default();
            *n += 1;
            *n
        };
        let fut = inner(d.clone(), lease);
        async move {
            if (d.offset == 2 && n <= 2) || d.offset == 4 {
                return Err(HandlerError::Retryable(format!("flaky {n}")));
            }
            fut.await
        }
    };
    let group = unique("g");
    let run = Running::spawn_with(broker.config(&group, &topic), dedup, flaky).await;
    let stats = run.stats.clone();
    eventually(60, "6 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 6 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (5, 1), "{s:?}");
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls[&2], 3, "failed twice, then succeeded");
    assert_eq!(calls[&4], 5, "the policy's 5 attempts");
    assert!(s.retries >= 6, "{s:?}");
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    assert_eq!(dead[0].1[DLQ_OFFSET], "4");
    assert_eq!(dead[0].1[DLQ_ATTEMPTS], "5");
    assert!(dead[0].1[DLQ_REASON].contains("flaky 5"), "{:?}", dead[0].1);
    assert_eq!(ledger_count(&pool).await, 5);
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![6]);
}

/// Holds a handler's calls after the first `n` until it is opened: a test's way to keep messages
/// in flight until something it waits for has happened, instead of sleeping.
#[derive(Clone)]
struct Gate(tokio::sync::watch::Sender<bool>, Arc<AtomicU32>);

impl Gate {
    /// A closed gate, and the count of calls that reached it.
    fn new() -> (Self, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        (
            Self(tokio::sync::watch::channel(false).0, calls.clone()),
            calls,
        )
    }

    fn open(&self) {
        self.0.send_replace(true);
    }

    /// `inner`, with every call after the first `n` waiting for the gate to open.
    fn after(
        &self,
        n: u32,
        inner: impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static,
    ) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
        let gate = self.clone();
        move |d, lease| {
            let mut open = gate.0.subscribe();
            let call = gate.1.fetch_add(1, Ordering::Relaxed) + 1;
            let fut = inner(d, lease);
            Box::pin(async move {
                if call > n {
                    let _ = open.wait_for(|o| *o).await;
                }
                fut.await
            })
        }
    }
}

/// 300 events; the handler panics on every call for one of them. The panic is caught and counted
/// as a retryable failure; after the policy's 5 attempts the message is dead-lettered with the
/// panic's message, and every other message, before and after it, is booked.
async fn panicking_handler_case(broker: &Broker, pool: PgPool, partitions: i32) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("panics");
    broker.create_topic(&topic, partitions).await;
    let events: Vec<Event> = (0..300).map(|i| event(i, partitions)).collect();
    produce(broker, &topic, &events).await;
    let dedup = setup(&pool, &redis);
    let inner = ledger_handler(dedup.pg(), "a");
    let panics = Arc::new(AtomicU32::new(0));
    let seen = panics.clone();
    let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| {
        let poisoned = d.header("idempotency-key") == Some(b"evt-150".as_slice());
        let fut = inner(d, lease);
        let seen = seen.clone();
        async move {
            if poisoned {
                seen.fetch_add(1, Ordering::Relaxed);
                panic!("boom on evt-150");
            }
            fut.await
        }
    };
    let group = unique("g");
    let config = broker.config(&group, &topic).with_max_in_flight(4);
    let run = Running::spawn_with(config, dedup, handler).await;
    let stats = run.stats.clone();
    eventually(90, "300 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 300 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, partitions).await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (299, 1), "{s:?}");
    assert_eq!(s.panics, 5, "each attempt panicked and was counted: {s:?}");
    assert_eq!(panics.load(Ordering::Relaxed), 5);
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    let h = &dead[0].1;
    assert!(
        h[DLQ_REASON].starts_with("handler panicked: boom on evt-150"),
        "{h:?}"
    );
    assert_eq!(h[DLQ_ATTEMPTS], "5");
    assert_eq!(h["idempotency-key"], "evt-150");
    assert_one_row_per_key(
        &pool,
        (0..300).filter(|i| *i != 150).map(|i| format!("evt-{i}")),
    )
    .await;
}

async fn a_panicking_handler_on_one_partition_is_dead_lettered_and_the_stream_goes_on(
    broker: &Broker,
    pool: PgPool,
) {
    panicking_handler_case(broker, pool, 1).await;
}

async fn a_panicking_handler_on_several_partitions_is_dead_lettered_and_the_stream_goes_on(
    broker: &Broker,
    pool: PgPool,
) {
    panicking_handler_case(broker, pool, 3).await;
}

/// Four accounts' events, interleaved on two partitions, each with its own event id (idempotency
/// key) and the account as the Kafka message key. With `Ordering::PerKey` each account's events
/// run one at a time in offset order, and different accounts run at the same time.
async fn per_key_order_follows_the_ordering_key_not_the_idempotency_key(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("accounts");
    broker.create_topic(&topic, 2).await;
    let accounts = ["acct-a", "acct-b", "acct-c", "acct-d"];
    let events: Vec<Event> = (0..200u32)
        .map(|i| {
            let mut e = event(i, 2);
            let account = accounts[i as usize % 4];
            // acct-a and acct-c on partition 0, acct-b and acct-d on partition 1.
            e.partition = i32::try_from(i % 2).unwrap();
            e.message_key = Some(account.to_owned());
            e.payload = format!(r#"{{"id":{i},"amount":1,"account":"{account}"}}"#);
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let dedup = setup(&pool, &redis);
    let inner = ledger_handler(dedup.pg(), "a");
    // Per account: the offsets whose handler started, in order, and whether one is running.
    type Log = std::sync::Mutex<HashMap<String, (Vec<i64>, bool)>>;
    let log: Arc<Log> = Arc::default();
    // The first call of each partition's first account waits until a second account of the same
    // partition has started: if one account held up the other, this would never happen.
    let (all_started, _) = tokio::sync::watch::channel(false);
    let all_started = Arc::new(all_started);
    let overlapped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = log.clone();
    let started = all_started.clone();
    let overlap = overlapped.clone();
    let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| {
        let account = String::from_utf8(d.key.clone().unwrap().to_vec()).unwrap();
        let accounts_started = {
            let mut log = seen.lock().unwrap();
            let entry = log.entry(account.clone()).or_default();
            if entry.1 {
                overlap.store(true, Ordering::Relaxed);
            }
            entry.0.push(d.offset);
            entry.1 = true;
            log.len()
        };
        if accounts_started >= 4 {
            started.send_replace(true);
        }
        let first_of_a = account == "acct-a" && d.offset == 0;
        let mut wait = started.subscribe();
        let fut = inner(d, lease);
        let seen = seen.clone();
        Box::pin(async move {
            if first_of_a {
                let _ = wait.wait_for(|s| *s).await;
            }
            let out = fut.await;
            seen.lock().unwrap().get_mut(&account).unwrap().1 = false;
            out
        }) as HandlerFuture
    };
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_ordering(dedup_kafka::Ordering::PerKey)
        .with_max_in_flight(64);
    let run = Running::spawn_with(config, dedup, handler).await;
    let stats = run.stats.clone();
    eventually(60, "200 settled", || {
        let s = stats.snapshot();
        async move { s.executed == 200 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (200, 0), "{s:?}");
    assert!(
        *all_started.borrow(),
        "all four accounts started while acct-a's first was held"
    );
    assert!(
        !overlapped.load(Ordering::Relaxed),
        "two events of one account ran at once"
    );
    let log = log.lock().unwrap().clone();
    for (i, account) in accounts.iter().enumerate() {
        let (offsets, _) = &log[*account];
        // Account i's events are ids i, i+4, ...: on partition i % 2, at offsets i/2, i/2+2, ...
        let expected: Vec<i64> = (0..50)
            .map(|n| i64::try_from(i / 2 + 2 * n).unwrap())
            .collect();
        assert_eq!(offsets, &expected, "{account} ran out of offset order");
    }
    assert_one_row_per_key(&pool, (0..200).map(|i| format!("evt-{i}"))).await;
}

#[derive(serde::Serialize, serde::Deserialize, Clone, PartialEq, Debug)]
struct Booked {
    key: String,
    amount: i64,
}

#[derive(serde::Serialize, serde::Deserialize, Clone, PartialEq, Debug)]
struct BookedV2 {
    key: String,
    amount: i64,
    currency: String,
}

type Seen<T> = Arc<std::sync::Mutex<Vec<(i64, T, bool)>>>;

fn booked(d: &Delivery) -> Booked {
    let json: serde_json::Value = serde_json::from_slice(d.payload_bytes()).unwrap();
    Booked {
        key: String::from_utf8_lossy(d.header("idempotency-key").unwrap()).into_owned(),
        amount: json["amount"].as_i64().unwrap(),
    }
}

/// Typed results under the runner: every delivery, fresh or duplicate, hands the same value to
/// `on_result`; after a deployment that changed the result type, duplicates of keys stored by
/// the old one are dead-lettered with the reason, and the new handler never runs for them.
async fn typed_results_are_replayed_and_a_changed_type_is_dead_lettered(
    broker: &Broker,
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let topic = unique("typed");
    broker.create_topic(&topic, 1).await;
    // 10 keys, each delivered twice.
    let events: Vec<Event> = (0..20).map(|i| event(i % 10, 1)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));

    let runs = Arc::new(AtomicU32::new(0));
    let seen: Seen<Booked> = Arc::default();
    let handler = {
        let (runs, seen) = (runs.clone(), seen.clone());
        dedup::kafka::Typed::new(
            dedup_core::ResultCodec::<Booked, _>::bincode("booked/v1").unwrap(),
            move |d: Arc<Delivery>, _lease| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>(booked(&d))
                }
            },
        )
        .on_result(
            move |d: &Delivery, r: &dedup_core::TypedProcessed<Booked>| {
                seen.lock()
                    .unwrap()
                    .push((d.offset, r.value().clone(), r.executed()));
            },
        )
    };
    let run = Running::spawn_handler(config.clone(), setup(&pool, &redis), handler, |c| c).await;
    let stats = run.stats.clone();
    eventually(60, "20 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 20 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.replayed, s.dead_lettered), (10, 10, 0));
    assert_eq!(runs.load(Ordering::SeqCst), 10);
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by_key(|(offset, _, _)| *offset);
    assert_eq!(seen.len(), 20);
    for (offset, value, executed) in &seen {
        let id = u32::try_from(*offset % 10).unwrap();
        assert_eq!(value.key, format!("evt-{id}"), "offset {offset}");
        assert_eq!(value.amount, i64::from(id % 100 + 1));
        assert_eq!(*executed, *offset < 10, "offset {offset}");
    }

    // The next deployment stores BookedV2 under a new tag; the same 10 keys arrive again.
    produce(broker, &topic, &events[..10]).await;
    let runs_v2 = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs_v2.clone();
        dedup::kafka::Typed::new(
            dedup_core::ResultCodec::<BookedV2, _>::bincode("booked/v2").unwrap(),
            move |d: Arc<Delivery>, _lease| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let b = booked(&d);
                    Ok::<_, HandlerError<String>>(BookedV2 {
                        key: b.key,
                        amount: b.amount,
                        currency: "EUR".into(),
                    })
                }
            },
        )
    };
    let run = Running::spawn_handler(config, setup(&pool, &redis), handler, |c| c).await;
    let stats = run.stats.clone();
    eventually(60, "10 dead-lettered", || {
        let s = stats.snapshot();
        async move { s.dead_lettered == 10 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.replayed, s.dead_lettered), (0, 0, 10));
    assert_eq!(runs_v2.load(Ordering::SeqCst), 0, "no handler ran again");
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 10).await;
    for (_, h) in &dead {
        let reason = &h[DLQ_REASON];
        assert!(
            reason.contains("cannot be used") && reason.contains("\"booked/v1\""),
            "{reason}"
        );
    }
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![30]);
}

mod blocked;
mod chain;
mod dead_letters;
mod front_door;
mod key_fallback;
mod kill_switch;
mod lease;
mod outbox;
mod parked;
mod pauses;
mod recovery;
mod redrive;
mod settings;
mod share;
mod test_kit;
mod tls;
mod tx;
