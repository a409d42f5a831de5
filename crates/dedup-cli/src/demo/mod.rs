//! `dedup demo`: a stream with duplicates through Kafka and dedup into a ledger.
//!
//! A deterministic stream (from `dedup-workload`), produced with a trace context per event, is
//! consumed into `dedup_demo_ledger` by a consumer built from a `dedup::Engine` (`consume.rs`);
//! then the report and the ledger check (`report.rs`).

mod consume;
mod report;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use dedup::kafka::{ConsumerBuilder, Ordering, RunnerStats, StatsHandle};
use dedup::{BuildError, Engine, Fingerprint, InstanceId, MigrationMode, Policy};
use indicatif::{ProgressBar, ProgressStyle};
use opentelemetry::propagation::Injector;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord, Producer};
use tracing::info_span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg, redact};
use crate::signals::Signals;
use dedup_workload::{Workload, ledger_payload};
use report::Report;

#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Events to produce.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Share of events that repeat an earlier event (0 to 0.9).
    #[arg(long, default_value_t = 0.3)]
    duplicates: f64,
    /// Hot keys: half of the duplicates repeat one of these, Zipf-skewed.
    #[arg(long, default_value_t = 100)]
    hot_keys: u64,
    /// Partitions of the demo topic.
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// How to consume: transaction mode by the batch (each partition's batch of up to 500
    /// events in one Postgres transaction), or one event at a time through the full engine.
    #[arg(long, value_enum, default_value_t = consume::Mode::Tx)]
    mode: consume::Mode,
    /// Messages held at once: with `--mode per-message`, those in flight (Postgres connections
    /// follow it, up to 64; on two cores with Postgres on loopback, 32 gave the best
    /// throughput); in transaction mode, messages received and not yet settled (default 4,096).
    #[arg(long)]
    in_flight: Option<usize>,
    /// Kafka bootstrap servers; without it, librdkafka's embedded mock cluster.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: Option<String>,
    /// Extra librdkafka properties for every client, as key=value (repeatable).
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    kafka_properties: Vec<String>,
    #[command(flatten)]
    pg: PgArgs,
    /// Redis (the fast path): redis://[user:password@]host:port[/db]
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: String,
    /// Give up if the stream is not settled within this many seconds.
    #[arg(long, default_value_t = 900)]
    timeout_secs: u64,
    /// No progress bar (for logs and CI).
    #[arg(long)]
    quiet: bool,
    /// A stable identity for this consumer (a pod or host name, `A-Za-z0-9._:-`, at most 100):
    /// the group member is static (`group.instance.id`), and with `--mode per-message` the engine
    /// owns its claims under it and, at start, adopts the leases an earlier run of the same
    /// identity left in flight (docs/RECOVERY.md).
    #[arg(long, env = "DEDUP_INSTANCE_ID")]
    instance_id: Option<String>,
}

/// One produced message.
struct Event {
    id: u64,
    payload: String,
}

/// The stream: `unique` first deliveries, with duplicates in between (half redeliveries of the
/// last 1,000 events, half Zipf-skewed picks among the `hot` oldest), every 997th event poison,
/// and one key reused with another payload.
fn stream(events: u64, duplicates: f64, hot: u64) -> (Vec<Event>, u64) {
    let generated = Workload::new(events)
        .with_duplicates(duplicates.clamp(0.0, 0.9))
        .with_hot_keys(hot)
        .with_recent(0.5, 1000)
        .ids();
    let mut out: Vec<Event> = generated
        .ids
        .into_iter()
        .map(|id| Event {
            id,
            payload: ledger_payload(id, 997),
        })
        .collect();
    // One producer bug: key 7 reused with another payload (dead-lettered as a mismatch).
    if let Some(e) = out.iter_mut().rev().find(|e| e.id == 7) {
        e.payload = r#"{"id":7,"account":1,"amount":999999}"#.to_owned();
    }
    (out, generated.unique)
}

struct HeaderInjector<'a>(&'a mut Vec<(String, String)>);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

/// The embedded Kafka mock cluster.
type Mock = MockCluster<'static, DefaultProducerContext>;

fn progress(quiet: bool, len: u64, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_owned());
    bar
}

fn client_config(bootstrap: &str, extra: &[(String, String)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    for (k, v) in extra {
        c.set(k, v);
    }
    c
}

pub(crate) async fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    let instance = check(&args)?;
    let extra = kafka_properties(&args.kafka_properties)?;
    let started_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let run_id = format!("demo-{started_at}");
    let mut signals = Signals::install()?;

    // Postgres and Redis first: a bad URL should fail before anything is produced.
    let in_flight = args.in_flight.unwrap_or(match args.mode {
        consume::Mode::Tx => 4096,
        consume::Mode::PerMessage => 32,
    });
    let pool = prepare_pg(&args, in_flight).await?;
    let engine = build_engine(&args, pool.clone(), &run_id, instance.as_ref()).await?;

    // Kafka: the given cluster, or the embedded mock (kept in this function: it is not Send).
    let (mock, bootstrap, kafka_name) = kafka_target(args.brokers.as_deref())?;
    let topic = run_id.clone();
    let producer = open_topic(
        mock.as_ref(),
        &bootstrap,
        &extra,
        &topic,
        args.partitions,
        &kafka_name,
    )
    .await?;

    // Produce.
    let (events, unique) = stream(args.events, args.duplicates, args.hot_keys);
    let poison_keys = (0..unique).filter(|id| id % 997 == 996).count() as u64;
    println!(
        "dedup demo: {} events ({} unique keys, {:.0}% duplicates) to {topic} on {kafka_name}",
        args.events,
        unique,
        args.duplicates * 100.0
    );
    let produce_secs = produce(&producer, &events, &topic, &args).await?;

    // Consume.
    let consumer = consumer(
        &engine,
        &bootstrap,
        &run_id,
        &topic,
        in_flight,
        &extra,
        mock.is_some(),
    );
    let started = consume::start(args.mode, consumer, &engine, run_id.clone())?;
    let (stats, task) = (started.stats.clone(), started.task);
    let (interrupted, consume_secs) = wait_settled(&stats, &task, &args, &mut signals).await;
    // Drain, commit, release the identity.
    engine.shutdown().await;
    let s: RunnerStats = task
        .await
        .map_err(|e| CliError::Failed(format!("runner: {e}")))??;
    // Every client of the embedded cluster before the cluster: librdkafka 2.12 crashes closing
    // a client whose cluster is gone.
    drop(producer);
    drop(mock);

    // Check the ledger.
    let (rows, keys) = ledger_counts(&pool, &run_id).await?;
    let report = Report {
        args: &args,
        instance: instance.as_ref(),
        topic: &topic,
        in_flight,
        unique,
        poison_keys,
        produce_secs,
        consume_secs,
        rows,
        keys,
        engine: consume::lines(args.mode, &engine, &s),
        stats: s,
    };
    report.print();
    report.verdict(interrupted)
}

/// Checks the arguments; returns the instance identity, if one is given.
fn check(args: &DemoArgs) -> Result<Option<InstanceId>, CliError> {
    if args.events == 0 {
        return Err(CliError::Config("--events must be at least 1".into()));
    }
    if !(0.0..=0.9).contains(&args.duplicates) {
        return Err(CliError::Config(
            "--duplicates must be between 0 and 0.9".into(),
        ));
    }
    if args.partitions < 1 {
        return Err(CliError::Config("--partitions must be at least 1".into()));
    }
    args.instance_id
        .as_deref()
        .map(InstanceId::new)
        .transpose()
        .map_err(|e| CliError::Config(format!("--instance-id: {e}")))
}

/// The extra Kafka properties, each `key=value` split in two.
fn kafka_properties(props: &[String]) -> Result<Vec<(String, String)>, CliError> {
    let mut extra = Vec::new();
    for p in props {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| CliError::Config(format!("--kafka-property {p:?} is not key=value")))?;
        extra.push((k.to_owned(), v.to_owned()));
    }
    Ok(extra)
}

/// Connects to Postgres, applies the migrations, and creates the demo's ledger table.
async fn prepare_pg(args: &DemoArgs, in_flight: usize) -> Result<sqlx::PgPool, CliError> {
    let conns = match args.mode {
        // One transaction per partition at a time, and a few for the rest.
        consume::Mode::Tx => u32::try_from(args.partitions.clamp(1, 60) + 4).unwrap_or(64),
        consume::Mode::PerMessage => u32::try_from(in_flight.clamp(8, 64)).unwrap_or(64),
    };
    let pool = connect_pg(&args.pg.database_url, conns).await?;
    dedup_pg::migrate(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("migrations: {e}")))?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dedup_demo_ledger (
            id bigserial PRIMARY KEY, run text NOT NULL, key text NOT NULL,
            account bigint NOT NULL, amount bigint NOT NULL, token bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .map_err(|e| CliError::Failed(format!("creating the ledger: {e}")))?;
    Ok(pool)
}

/// The Kafka to use: the embedded mock (without brokers), the bootstrap servers, and its name.
fn kafka_target(brokers: Option<&str>) -> Result<(Option<Mock>, String, String), CliError> {
    let mock = match brokers {
        Some(_) => None,
        None => Some(
            MockCluster::new(3)
                .map_err(|e| CliError::Failed(format!("embedded Kafka mock cluster: {e}")))?,
        ),
    };
    let bootstrap = match (brokers, &mock) {
        (Some(b), _) => b.to_owned(),
        (None, Some(m)) => m.bootstrap_servers(),
        (None, None) => unreachable!("one of the two is set"),
    };
    let kafka_name = if mock.is_some() {
        "embedded mock cluster (librdkafka)".to_owned()
    } else {
        redact(&bootstrap)
    };
    Ok((mock, bootstrap, kafka_name))
}

/// Creates the demo topic and a producer for it, and checks that Kafka answers.
async fn open_topic(
    mock: Option<&Mock>,
    bootstrap: &str,
    extra: &[(String, String)],
    topic: &str,
    partitions: i32,
    kafka_name: &str,
) -> Result<FutureProducer, CliError> {
    if let Some(m) = mock {
        m.create_topic(topic, partitions, 1)
            .map_err(|e| CliError::Failed(format!("creating {topic}: {e}")))?;
    }
    let producer: FutureProducer = client_config(bootstrap, extra)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .map_err(|e| CliError::Config(format!("Kafka producer ({kafka_name}): {e}")))?;
    producer
        .client()
        .fetch_metadata(None, Duration::from_secs(10))
        .map_err(|e| {
            CliError::Unreachable(format!(
                "cannot reach Kafka at {kafka_name} (KAFKA_BROKERS): {e}. Is it running?"
            ))
        })?;
    if mock.is_none() {
        create_topic(bootstrap, extra, topic, partitions).await?;
    }
    Ok(producer)
}

/// Produces the stream to `topic`, with a progress bar; returns the seconds it took.
async fn produce(
    producer: &FutureProducer,
    events: &[Event],
    topic: &str,
    args: &DemoArgs,
) -> Result<f64, CliError> {
    let bar = progress(args.quiet, args.events, "producing");
    let produce_started = Instant::now();
    let mut pending = Vec::with_capacity(1024);
    for e in events {
        let key = format!("order-{}", e.id);
        let partition = partition_of(&key, args.partitions);
        // A producer span per event, its W3C context carried in the headers (exported only
        // with OTEL_EXPORTER_OTLP_ENDPOINT set).
        let span = info_span!("dedup.demo.produce", "messaging.system" = "kafka", "messaging.destination.name" = %topic, key = %key);
        // The order is also the message key: what the runner's per-key lanes keep in order.
        let record = FutureRecord::<str, str>::to(topic)
            .partition(partition)
            .key(&key)
            .payload(&e.payload)
            .headers(headers(&key, &span));
        let ack = producer
            .send_result(record)
            .map_err(|(e, _)| CliError::Failed(format!("producing: {e}")))?;
        pending.push(ack);
        if pending.len() >= 1024 {
            await_acks(&mut pending, &bar).await?;
        }
    }
    await_acks(&mut pending, &bar).await?;
    bar.finish_and_clear();
    Ok(produce_started.elapsed().as_secs_f64())
}

/// The partition of `key`: the first four bytes of its fingerprint, modulo `partitions`.
fn partition_of(key: &str, partitions: i32) -> i32 {
    i32::from_be_bytes(
        Fingerprint::of(key.as_bytes()).as_bytes()[..4]
            .try_into()
            .unwrap_or([0; 4]),
    )
    .rem_euclid(partitions)
}

/// A message's headers: its idempotency key, and the W3C trace context of `span`.
fn headers(key: &str, span: &tracing::Span) -> OwnedHeaders {
    let mut trace = Vec::new();
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(&mut trace));
    });
    let mut headers = OwnedHeaders::new().insert(Header {
        key: "idempotency-key",
        value: Some(key.as_bytes()),
    });
    for (k, v) in &trace {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    headers
}

/// The engine: the demo's Postgres, Redis under the run's own key prefix, the run as the dedup
/// scope, a 10 s lease, the instance identity if one was given (its earlier runs' leases adopted).
async fn build_engine(
    args: &DemoArgs,
    pool: sqlx::PgPool,
    run_id: &str,
    instance: Option<&InstanceId>,
) -> Result<Engine, CliError> {
    let mut engine = Engine::builder()
        .postgres(pool)
        .redis_url(&args.redis_url)
        .redis_prefix(run_id)
        .scope(run_id)
        .policy(Policy::default().with_lease(Duration::from_secs(10)))
        .in_flight_wait(Duration::from_millis(200))
        // `prepare_pg` applied them.
        .migrations(MigrationMode::Verify);
    if let Some(id) = instance {
        engine = engine.instance(id.as_str());
    }
    engine.build().await.map_err(|e| match e {
        BuildError::Setting {
            setting: "redis_url",
            problem,
            ..
        } => CliError::Config(format!("REDIS_URL: {problem}")),
        BuildError::Store {
            what: "connecting to Redis",
            source,
            ..
        } => CliError::Unreachable(format!(
            "cannot connect to Redis at {} (REDIS_URL): {source}. Is it running? \
             `source scripts/services.sh && ensure_redis` starts one",
            redact(&args.redis_url)
        )),
        other => CliError::Config(other.to_string()),
    })
}

/// The consumer: the demo topic, keys kept in order, and the extra properties; with an instance
/// identity, a static group member.
fn consumer(
    engine: &Engine,
    bootstrap: &str,
    run_id: &str,
    topic: &str,
    in_flight: usize,
    extra: &[(String, String)],
    mock: bool,
) -> ConsumerBuilder {
    let mut consumer = engine
        .consumer()
        .brokers(bootstrap)
        .group_id(run_id)
        .topics([topic])
        .ordering(Ordering::PerKey)
        .max_in_flight(in_flight.max(1));
    for (k, v) in extra {
        consumer = consumer.set(k, v);
    }
    if mock {
        // The embedded cluster assigns at once with the KIP-848 protocol.
        consumer = consumer.set("group.protocol", "consumer");
    }
    consumer
}

/// Waits for the events to settle; returns whether a signal cut it short, and the seconds.
async fn wait_settled(
    stats: &StatsHandle,
    task: &tokio::task::JoinHandle<Result<RunnerStats, CliError>>,
    args: &DemoArgs,
    signals: &mut Signals,
) -> (bool, f64) {
    let consume_started = Instant::now();
    let bar = progress(args.quiet, args.events, "consuming");
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut interrupted = false;
    loop {
        let s = stats.snapshot();
        let settled = s.executed + s.replayed + s.dead_lettered + s.processed_without_dedup;
        bar.set_position(settled);
        if settled >= args.events {
            break;
        }
        if Instant::now() > deadline || task.is_finished() {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            () = signals.recv() => { interrupted = true; break; }
        }
    }
    let consume_secs = consume_started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    (interrupted, consume_secs)
}

/// The ledger's rows for this run, and the distinct keys among them.
async fn ledger_counts(pool: &sqlx::PgPool, run_id: &str) -> Result<(i64, i64), CliError> {
    sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM dedup_demo_ledger WHERE run = $1")
        .bind(run_id)
        .fetch_one(pool)
        .await
        .map_err(|e| CliError::Failed(format!("reading the ledger: {e}")))
}

async fn await_acks(
    pending: &mut Vec<rdkafka::producer::DeliveryFuture>,
    bar: &ProgressBar,
) -> Result<(), CliError> {
    for ack in pending.drain(..) {
        match ack.await {
            Ok(Ok(_)) => bar.inc(1),
            Ok(Err((e, _))) => return Err(CliError::Failed(format!("producing: {e}"))),
            Err(_) => return Err(CliError::Failed("producing: the producer went away".into())),
        }
    }
    Ok(())
}

async fn create_topic(
    bootstrap: &str,
    extra: &[(String, String)],
    topic: &str,
    partitions: i32,
) -> Result<(), CliError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = client_config(bootstrap, extra)
        .create()
        .map_err(|e| CliError::Config(format!("Kafka admin client: {e}")))?;
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let results = admin
        .create_topics(&[new], &AdminOptions::new())
        .await
        .map_err(|e| CliError::Failed(format!("creating {topic}: {e}")))?;
    for r in results {
        match r {
            Ok(_) | Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => return Err(CliError::Failed(format!("creating {t}: {e}"))),
        }
    }
    Ok(())
}
