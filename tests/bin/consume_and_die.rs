//! A consumer for the kill test: a consumer built from a `dedup::Engine` (Postgres, Redis), booking
//! each message into `effects` in one transaction with its completion, and never committing an
//! offset on its own (the test kills it with SIGKILL first).
//!
//! Usage: `dedup-consume-and-die <brokers> <group> <topic> <database-url> <redis-url> [k=v ...]`
//! (`k=v`: extra librdkafka properties).
//!
//! With `DEDUP_TX_DELAY_MS` set, it runs transaction mode instead (a `TxHandler`, batches of up
//! to 20), each batch sleeping that long inside its transaction after writing its
//! effects, so that the kill lands in the middle of a batch; with `DEDUP_TX_OFFSETS` set too,
//! each batch also stores its partition's position in its transaction; `DEDUP_TX_IDLE_MS` sets
//! how long a batch's session may sit idle in its transaction before the server ends it.
//!
//! In lease mode, `DEDUP_INSTANCE` gives the engine a stable instance identity (and the group
//! member a static `group.instance.id`, unless `DEDUP_STATIC=0`), `DEDUP_LEASE_MS` the lease,
//! `DEDUP_HANG_KEY` a key whose handler never returns (a process killed in the middle of an
//! effect), `DEDUP_HANDLER_MS` a wait inside every handler before its effect (a call to another
//! service), and `DEDUP_ORDERING=per-key` per-key ordering by the Kafka message key.
//!
//! `DEDUP_LEASE_BATCH` runs lease mode by the batch instead (batches of up to 20) with the same
//! handler.
//!
//! `DEDUP_PARK` turns parking on (key order, two runs in place, attempts up to 1,000), and
//! `DEDUP_FAIL_TABLE` fails a message retryably while its Kafka message key is in the table
//! `fail_accounts (account text)`.
//!
//! In transaction mode, `DEDUP_OUTBOX_TOPIC` makes each booked message publish one message to
//! that topic on the outbox, and `DEDUP_WORKER` names the ledger's worker column.
//!
//! `DEDUP_COMMIT_MS` sets the offset commit interval (an hour otherwise). With `DEDUP_REPORT`
//! set, it prints a line every 20 ms for the recovery measurement:
//! `tick <unix ms> <partitions assigned> <settled> <executed> <blocked>`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup::kafka::{Backoff, Batching, Delivery, Ordering, Parking, StatsHandle};
use dedup::{Completion, Engine, HandlerError, LeaseContext, PgStore, Policy};
use dedup_pg::TxBatchConfig;

#[path = "batch_ledger.rs"]
mod batch_ledger;

fn millis(name: &str) -> Result<Option<Duration>, Box<dyn std::error::Error>> {
    Ok(match std::env::var(name) {
        Ok(ms) => Some(Duration::from_millis(ms.parse()?)),
        Err(_) => None,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, brokers, group, topic, db, redis, extra @ ..] = args.as_slice() else {
        return Err("usage: dedup-consume-and-die <brokers> <group> <topic> <database-url> <redis-url> [k=v ...]".into());
    };
    let park = std::env::var_os("DEDUP_PARK").is_some();
    let mut policy = Policy::default();
    if let Some(lease) = millis("DEDUP_LEASE_MS")? {
        policy = policy.with_lease(lease);
    }
    if park {
        policy = policy.with_max_attempts(1000);
    }
    let mut engine = Engine::builder()
        .postgres_url(db.as_str())
        .redis_url(redis.as_str())
        // The group's name as the scope: every instance of one test shares it.
        .scope(group.as_str())
        .policy(policy);
    if let Ok(id) = std::env::var("DEDUP_INSTANCE") {
        engine = engine.instance(id);
    }
    let engine = engine.build().await?;
    let mut consumer = engine
        .consumer()
        .brokers(brokers.as_str())
        .group_id(group.as_str())
        .topics([topic.as_str()])
        .commit_interval(millis("DEDUP_COMMIT_MS")?.unwrap_or(Duration::from_secs(3600)))
        .static_membership(std::env::var("DEDUP_STATIC").as_deref() != Ok("0"));
    if park || std::env::var("DEDUP_ORDERING").as_deref() == Ok("per-key") {
        consumer = consumer.ordering(Ordering::PerKey);
    }
    for kv in extra {
        let (k, v) = kv.split_once('=').ok_or("extra properties are k=v")?;
        consumer = consumer.set(k, v);
    }
    let report = std::env::var_os("DEDUP_REPORT").is_some();
    let consumer = if let Some(delay) = millis("DEDUP_TX_DELAY_MS")? {
        let handler = batch_ledger::BatchLedger {
            worker: std::env::var("DEDUP_WORKER").unwrap_or_else(|_| "killed".to_owned()),
            delay,
            publish_to: std::env::var("DEDUP_OUTBOX_TOPIC").ok(),
            ..Default::default()
        };
        let mut batching = Batching::new(20, Duration::from_millis(5));
        if let Some(idle) = millis("DEDUP_TX_IDLE_MS")? {
            batching = batching.with_transaction(TxBatchConfig::default().with_idle_timeout(idle));
        }
        consumer = consumer.batching(batching);
        if std::env::var_os("DEDUP_TX_OFFSETS").is_some() {
            consumer = consumer.offsets_in_transaction(Duration::from_secs(5));
        }
        consumer.build(handler)?
    } else {
        let handler = Booking {
            pg: engine.postgres()?.clone(),
            hang: std::env::var("DEDUP_HANG_KEY").ok(),
            pause: millis("DEDUP_HANDLER_MS")?.unwrap_or_default(),
            fail_table: std::env::var_os("DEDUP_FAIL_TABLE").is_some(),
        };
        if std::env::var_os("DEDUP_LEASE_BATCH").is_some() {
            consumer = consumer.batching(Batching::new(20, Duration::from_millis(5)));
        }
        if park {
            consumer = consumer.parking(
                Parking::default()
                    .with_in_place_attempts(2)
                    .with_backoff(Backoff::new(
                        Duration::from_millis(50),
                        Duration::from_millis(500),
                    ))
                    .with_poll(Duration::from_millis(50)),
            );
        }
        consumer.build(handler)?
    };
    if report {
        tokio::spawn(ticks(consumer.stats()));
    }
    consumer.run().await?;
    Ok(())
}

/// Lease mode, the effect in Postgres: the `effects` row and the completion in one transaction
/// (`PgStore::transact`), so that a kill anywhere leaves one row or none.
#[derive(Debug)]
struct Booking {
    pg: PgStore,
    hang: Option<String>,
    pause: Duration,
    fail_table: bool,
}

impl dedup::kafka::LeaseHandler for Booking {
    type Error = String;
    type Output = Completion;

    async fn handle(
        &self,
        d: Arc<Delivery>,
        lease: LeaseContext,
    ) -> Result<Completion, HandlerError<String>> {
        if self.fail_table {
            let failing: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM fail_accounts WHERE account = $1)",
            )
            .bind(String::from_utf8_lossy(d.key.as_deref().unwrap_or_default()).into_owned())
            .fetch_one(self.pg.pool())
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            if failing {
                return Err(HandlerError::Retryable(
                    "the account's service is down".into(),
                ));
            }
        }
        let key =
            String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default()).into_owned();
        if self.hang.as_deref() == Some(key.as_str()) {
            std::future::pending::<()>().await;
        }
        if !self.pause.is_zero() {
            tokio::time::sleep(self.pause).await;
        }
        let token = i64::try_from(lease.lease().token.get()).unwrap_or(i64::MAX);
        self.pg
            .transact(&lease, move |tx| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects VALUES ($1, $2, 'killed')")
                        .bind(&key)
                        .bind(token)
                        .execute(tx)
                        .await
                        .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                    Ok(Bytes::from(format!("booked {key}")))
                })
            })
            .await
    }
}

/// Prints the runner's progress every 20 ms (see the module docs).
async fn ticks(stats: StatsHandle) {
    let mut every = tokio::time::interval(Duration::from_millis(20));
    loop {
        every.tick().await;
        let s = stats.snapshot();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        #[allow(clippy::print_stdout)] // the measurement reads these lines
        {
            println!(
                "tick {now} {} {} {} {}",
                s.assigned,
                s.executed + s.replayed + s.dead_lettered,
                s.executed,
                s.blocked
            );
        }
    }
}
