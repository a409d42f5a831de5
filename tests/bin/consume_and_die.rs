//! A consumer for the kill test: runs the Kafka runner over the full engine, booking each message
//! into `effects` in transactional mode, and never commits an offset on its own (the test kills it
//! with SIGKILL first).
//!
//! Usage: `dedup-consume-and-die <brokers> <group> <topic> <database-url> <redis-url> [k=v ...]`
//! (`k=v`: extra librdkafka properties).
//!
//! With `DEDUP_TX_DELAY_MS` set, it runs the transaction-mode runner instead (`TxRunner`,
//! batches of up to 20), each batch sleeping that long inside its transaction after writing its
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
//! `DEDUP_LEASE_BATCH` runs lease mode by the batch instead (`LeaseRunner`, batches of up to 20)
//! with the same handler.
//!
//! `DEDUP_PARK` turns parking on (key order, two runs in place, attempts up to 1,000), and
//! `DEDUP_FAIL_TABLE` fails a message retryably while its Kafka message key is in the table
//! `fail_accounts (account text)`.
//!
//! `DEDUP_COMMIT_MS` sets the offset commit interval (an hour otherwise). With `DEDUP_REPORT`
//! set, it prints a line every 20 ms for the recovery measurement:
//! `tick <unix ms> <partitions assigned> <settled> <executed> <blocked>`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    Dedup, HandlerError, InstanceId, LeaseContext, Policy, TieredConfig, TieredStore,
};
use dedup_kafka::{
    Backoff, Batching, Delivery, LeaseRunner, Ordering, Parking, Runner, RunnerConfig, StatsHandle,
    TxRunner,
};
use dedup_pg::{PgStore, TxBatchConfig};
use dedup_redis::RedisFastPath;

#[path = "batch_ledger.rs"]
mod batch_ledger;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, brokers, group, topic, db, redis, extra @ ..] = args.as_slice() else {
        return Err("usage: dedup-consume-and-die <brokers> <group> <topic> <database-url> <redis-url> [k=v ...]".into());
    };
    let pg = PgStore::new(sqlx::PgPool::connect(db).await?);
    let store = TieredStore::new(
        pg.clone(),
        RedisFastPath::connect(redis).await?,
        TieredConfig::default(),
    );
    let mut dedup = Dedup::new(store);
    let commit = match std::env::var("DEDUP_COMMIT_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::from_secs(3600),
    };
    let mut config = RunnerConfig::new(brokers.as_str(), group.as_str(), [topic.as_str()])
        .with_commit_interval(commit);
    if let Ok(id) = std::env::var("DEDUP_INSTANCE") {
        let id = InstanceId::new(id)?;
        if std::env::var("DEDUP_STATIC").as_deref() != Ok("0") {
            config = config.with_instance_id(&id);
        }
        dedup = dedup.with_instance(id);
    }
    if std::env::var("DEDUP_ORDERING").as_deref() == Ok("per-key") {
        config = config.with_ordering(Ordering::PerKey);
    }
    let pause = match std::env::var("DEDUP_HANDLER_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::ZERO,
    };
    let report = std::env::var_os("DEDUP_REPORT").is_some();
    let park = std::env::var_os("DEDUP_PARK").is_some();
    let mut policy = Policy::default();
    if let Ok(ms) = std::env::var("DEDUP_LEASE_MS") {
        policy = policy.with_lease(Duration::from_millis(ms.parse()?));
    }
    if park {
        policy = policy.with_max_attempts(1000);
        config = config.with_ordering(Ordering::PerKey);
    }
    dedup = dedup.with_policy(policy)?;
    let fail_table = std::env::var_os("DEDUP_FAIL_TABLE").is_some();
    let dedup = Arc::new(dedup);
    let hang = std::env::var("DEDUP_HANG_KEY").ok();
    for kv in extra {
        let (k, v) = kv.split_once('=').ok_or("extra properties are k=v")?;
        config = config.with_client(k, v);
    }
    if let Ok(ms) = std::env::var("DEDUP_TX_DELAY_MS") {
        let handler = batch_ledger::BatchLedger {
            worker: "killed".to_owned(),
            delay: Duration::from_millis(ms.parse()?),
            ..Default::default()
        };
        let mut batching = Batching::new(20, Duration::from_millis(5));
        if let Ok(ms) = std::env::var("DEDUP_TX_IDLE_MS") {
            batching = batching.with_transaction(
                TxBatchConfig::default().with_idle_timeout(Duration::from_millis(ms.parse()?)),
            );
        }
        let mut runner = TxRunner::new(config, batching, pg, handler)?;
        if std::env::var_os("DEDUP_TX_OFFSETS").is_some() {
            runner = runner.with_offsets_in_transaction(Duration::from_secs(5))?;
        }
        if report {
            tokio::spawn(ticks(runner.stats()));
        }
        runner.run(std::future::pending()).await?;
        return Ok(());
    }
    let parked_store = pg.clone();
    let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| {
        let pg = pg.clone();
        let hang = hang.clone();
        async move {
            if fail_table {
                let failing: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM fail_accounts WHERE account = $1)",
                )
                .bind(String::from_utf8_lossy(d.key.as_deref().unwrap_or_default()).into_owned())
                .fetch_one(pg.pool())
                .await
                .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                if failing {
                    return Err(HandlerError::Retryable(
                        "the account's service is down".into(),
                    ));
                }
            }
            let lease = lease.ok_or(HandlerError::Permanent("no key".to_owned()))?;
            let key = String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default())
                .into_owned();
            if hang.as_deref() == Some(key.as_str()) {
                std::future::pending::<()>().await;
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let token = i64::try_from(lease.lease().token.get()).unwrap_or(i64::MAX);
            pg.transact(&lease, move |tx| {
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
    };
    if std::env::var_os("DEDUP_LEASE_BATCH").is_some() {
        let runner = LeaseRunner::new(
            config,
            Batching::new(20, Duration::from_millis(5)),
            dedup,
            handler,
        )?;
        if report {
            tokio::spawn(ticks(runner.stats()));
        }
        runner.run(std::future::pending()).await?;
        return Ok(());
    }
    let mut runner = Runner::new(config, dedup, handler)?;
    if park {
        runner = runner.with_parking(
            parked_store,
            Parking::default()
                .with_in_place_attempts(2)
                .with_backoff(Backoff::new(
                    Duration::from_millis(50),
                    Duration::from_millis(500),
                ))
                .with_poll(Duration::from_millis(50)),
        )?;
    }
    if report {
        tokio::spawn(ticks(runner.stats()));
    }
    runner.run(std::future::pending()).await?;
    Ok(())
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
