//! (g): (e)'s stream with one message per event published through the outbox. Each batch queues
//! one message per key it executes; the relay publishes them to librdkafka's embedded mock
//! cluster; timed from the first batch to the broker's ack of the last message. Beside it, from
//! the same sitting: the relay alone, from an outbox prefilled with as many messages; and the
//! lag from a message's write (just before its commit) to its ack with the stream paced at half
//! of (g)'s rate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_core::IdempotencyKey;
use dedup_core::outbox::OutboxMessage;
use dedup_kafka::outbox::{OutboxRelay, RelayConfig, RelayStats, RelayStatsHandle};
use dedup_pg::PgStore;
use dedup_pg::outbox::{OutboxWriter, RelayStore};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use sqlx::PgPool;

use super::txmode::{Batches, run_batches};
use super::{Ctx, Outcome};
use crate::connect::CliError;

/// (g)'s own figures.
#[derive(Debug, Clone)]
pub(super) struct OutboxFigures {
    /// The relay alone: messages per second from a prefilled outbox, and how many.
    pub(super) relay_rate: f64,
    pub(super) prefilled: u64,
    /// The paced pass: the rate asked, and the write-to-ack lag's p50 and p99 over its messages.
    pub(super) paced_rate: f64,
    pub(super) lag_p50_ms: i64,
    pub(super) lag_p99_ms: i64,
}

/// A running relay: what stops it, its task, its counters.
type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), dedup_kafka::outbox::RelayError>>,
    RelayStatsHandle,
);

/// A relay of the bench's on `store`, publishing to `bootstrap`.
fn start_relay(store: &PgStore, bootstrap: &str, run: &str) -> Result<Running, CliError> {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", bootstrap);
    let relay = OutboxRelay::new(store, client, RelayConfig::default())
        .map_err(|e| CliError::Failed(format!("(g): the relay: {e}")))?
        .named(format!("bench-{run}"));
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    Ok((stop, task, stats))
}

/// Waits until the relay has published `n` messages (120 s without progress is an error).
async fn until_published(stats: &RelayStatsHandle, n: u64) -> Result<RelayStats, CliError> {
    let mut last = (Instant::now(), 0);
    loop {
        let s = stats.snapshot();
        if s.published >= n {
            return Ok(s);
        }
        if s.published != last.1 {
            last = (Instant::now(), s.published);
        } else if last.0.elapsed() > Duration::from_secs(120) {
            return Err(CliError::Failed(format!(
                "(g): the relay published nothing for 120 s at {} of {n}",
                s.published
            )));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn stop_relay(
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), dedup_kafka::outbox::RelayError>>,
) {
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
}

/// One pass of the stream in batches that publish, with a relay running; `pace` in events/s.
async fn pass(
    ctx: &Ctx,
    pool: &PgPool,
    bootstrap: &str,
    topic: &Arc<String>,
    tag: &'static str,
    pace: Option<f64>,
) -> Result<(Outcome, RelayStats), CliError> {
    let store = PgStore::new(pool.clone());
    let (stop, task, stats) = start_relay(&store, bootstrap, &ctx.run_id)?;
    let ran = run_batches(
        ctx,
        pool,
        Batches {
            name: "(g)",
            label: "dedup: transaction mode + outbox to Kafka",
            tag,
            ledger: false,
            outbox: Some(Arc::clone(topic)),
            pace,
            store: Some(store),
        },
    )
    .await;
    let waited = Instant::now();
    let published = match &ran {
        Ok(o) => until_published(&stats, o.effects).await,
        Err(_) => Ok(stats.snapshot()),
    };
    stop_relay(stop, task).await;
    let mut outcome = ran?;
    let published = published?;
    outcome.elapsed += waited.elapsed();
    Ok((outcome, published))
}

/// (g): the stream through batches that publish and the relay, timed until the last ack.
pub(super) async fn outbox(ctx: &Ctx, pool: &PgPool) -> Result<Outcome, CliError> {
    let relays = RelayStore::new(PgStore::new(pool.clone()));
    let status = relays
        .status()
        .await
        .map_err(|e| CliError::Failed(format!("(g): the outbox's status: {e}")))?;
    if status.unpublished > 0 {
        return Err(CliError::Failed(format!(
            "(g) needs an outbox with nothing waiting: {} messages are unpublished (`dedup outbox \
             status`); publish them first (`dedup outbox relay`)",
            status.unpublished
        )));
    }
    if let Some(leader) = status.leader.filter(|l| !l.starts_with("bench-")) {
        return Err(CliError::Failed(format!(
            "(g) needs the outbox's lease, which the relay {leader} holds: stop it first"
        )));
    }
    let (_mock, bootstrap, topic) = mock_topic(ctx)?;
    ctx.note("(g) dedup: transaction mode, one message per event through the outbox");
    let (outcome, _) = pass(ctx, pool, &bootstrap, &topic, "g", None).await?;
    Ok(outcome)
}

/// A mock cluster with (g)'s topic: the cluster (kept while it is used), its bootstrap servers
/// and the topic.
fn mock_topic(
    ctx: &Ctx,
) -> Result<
    (
        MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        String,
        Arc<String>,
    ),
    CliError,
> {
    let mock = MockCluster::new(1)
        .map_err(|e| CliError::Failed(format!("embedded Kafka mock cluster: {e}")))?;
    let partitions = i32::try_from(ctx.tx_workers.max(1)).unwrap_or(i32::MAX);
    let topic = Arc::new(format!("bench-g-{}", ctx.run_id));
    mock.create_topic(&topic, partitions, 1)
        .map_err(|e| CliError::Failed(format!("creating {topic}: {e}")))?;
    let bootstrap = mock.bootstrap_servers();
    Ok((mock, bootstrap, topic))
}

/// (g)'s figures beside its measured pass, outside its counters: the stream paced at half of
/// `outcome`'s rate (in a key space of its own), and the relay alone from a prefilled outbox.
pub(super) async fn beside(
    ctx: &Ctx,
    pool: &PgPool,
    outcome: &mut Outcome,
) -> Result<(), CliError> {
    let (_mock, bootstrap, topic) = mock_topic(ctx)?;
    let paced_rate = outcome.rate(ctx.stream.len() as u64) / 2.0;
    ctx.note(&format!("(g) paced at {paced_rate:.0} events/s"));
    let (_, paced) = pass(ctx, pool, &bootstrap, &topic, "g2", Some(paced_rate)).await?;
    // The relay alone: as many messages as (g) published, written first, then published.
    let n = outcome.effects;
    ctx.note(&format!("(g) the relay alone: {n} messages prefilled"));
    let store = PgStore::new(pool.clone());
    let scope = dedup_core::Scope::new(ctx.scope("g3"))
        .map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let failed = |e: &dyn std::fmt::Display| CliError::Failed(format!("(g): prefill: {e}"));
    let mut left = n;
    let mut i = 0u64;
    while left > 0 {
        let chunk = left.min(1000);
        let mut tx = pool.begin().await.map_err(|e| failed(&e))?;
        for _ in 0..chunk {
            let cause =
                IdempotencyKey::new(scope.clone(), format!("p{i}")).map_err(|e| failed(&e))?;
            let mut w = OutboxWriter::new(cause, super::unix_ms_now());
            let m = OutboxMessage::new(topic.as_str(), format!("p{i}")).with_key(format!("p{i}"));
            w.publish(m).map_err(|e| failed(&e))?;
            w.write(&mut tx).await.map_err(|e| failed(&e))?;
            i += 1;
        }
        tx.commit().await.map_err(|e| failed(&e))?;
        left -= chunk;
    }
    let started = Instant::now();
    let (stop, task, stats) = start_relay(&store, &bootstrap, &ctx.run_id)?;
    let alone = until_published(&stats, n).await;
    let elapsed = started.elapsed();
    stop_relay(stop, task).await;
    alone?;
    #[allow(clippy::cast_precision_loss)]
    let relay_rate = n as f64 / elapsed.as_secs_f64().max(1e-9);
    outcome.outbox = Some(OutboxFigures {
        relay_rate,
        prefilled: n,
        paced_rate,
        lag_p50_ms: paced.lag_p50_ms,
        lag_p99_ms: paced.lag_p99_ms,
    });
    Ok(())
}
