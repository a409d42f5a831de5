//! Transaction mode (a `TxHandler` consumer built from an engine): whole batches of a partition in
//! one Postgres transaction, on both brokers.
//!
//! The batch ledger handler is `tests/bin/batch_ledger.rs`, shared with `consume_and_die`, which
//! runs transaction mode when `DEDUP_TX_DELAY_MS` is set. Duplicates, poison and a payload mismatch in
//! batches; one ordering key failing across three batches while the other keys settle past it and
//! its later messages follow in order; a consumer process SIGKILLed while its batches sleep inside
//! their transactions, then a restart; with offsets in the transaction, a consumer process
//! SIGKILLed after every batch committed in Postgres and before any Kafka commit, whose successor
//! reads no message again (messages received and messages handed to the handler counted). A
//! second member joining while the first one's batches are held in their transactions (on
//! nisshi's eager protocol a partition is revoked and comes straight back mid-batch); caches
//! answering a second group's replay with no transaction; a consumer process SIGSTOPped with its
//! batches inside their transactions, whose sessions the server ends (`DEDUP_TX_IDLE_MS`),
//! another member then booking every key, and the stopped one resumed with SIGCONT: one row per
//! key.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use std::sync::Arc;

use dedup_core::Policy;
use dedup_kafka::{
    Batching, DLQ_REASON, MissingKey, Ordering, RunnerError, RunnerStats, StatsHandle,
};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::settings::Settings;
use super::{
    Broker, Event, assert_one_row_per_key, committed, committed_to_the_end, consumer_for,
    engine_for, event, eventually, ledger_count, produce, produced_ends, read_dead_letters, unique,
};
use crate::support::{RedisServer, effects_table};

#[path = "../../bin/batch_ledger.rs"]
pub(super) mod batch_ledger;
use batch_ledger::BatchLedger;

pub(super) struct RunningTx {
    stop: oneshot::Sender<()>,
    handle: JoinHandle<Result<RunnerStats, RunnerError>>,
    pub(super) stats: StatsHandle,
    /// The engine it was built from (its caches' counters).
    pub(super) engine: dedup::Engine,
}

impl RunningTx {
    pub(super) async fn spawn(config: Settings, pool: &PgPool, handler: BatchLedger) -> Self {
        Self::spawn_with(config, pool, handler, false).await
    }

    async fn spawn_with(
        config: Settings,
        pool: &PgPool,
        handler: BatchLedger,
        offsets_in_tx: bool,
    ) -> Self {
        Self::spawn_full(config, pool, handler, offsets_in_tx, None).await
    }

    /// A transaction-mode consumer built from an engine of its own (with `redis` as its fast
    /// path, if given) and stopped by `stop`.
    async fn spawn_full(
        config: Settings,
        pool: &PgPool,
        handler: BatchLedger,
        offsets_in_tx: bool,
        redis: Option<&RedisServer>,
    ) -> Self {
        let policy = Policy::default()
            .with_lease(Duration::from_secs(5))
            .with_max_attempts(10);
        let engine = engine_for(pool, &config, redis, policy).await;
        let mut consumer = consumer_for(&engine, &config).batching(Batching::default());
        if offsets_in_tx {
            consumer = consumer.offsets_in_transaction(Duration::from_secs(5));
        }
        let consumer = consumer.build(handler).unwrap();
        let stats = consumer.stats();
        let (stop, rx) = oneshot::channel::<()>();
        let stopping = engine.clone();
        tokio::spawn(async move {
            let _ = rx.await;
            stopping.shutdown().await;
        });
        let handle = tokio::spawn(consumer.run());
        Self {
            stop,
            handle,
            stats,
            engine,
        }
    }

    pub(super) async fn stop(self) -> RunnerStats {
        let _ = self.stop.send(());
        self.handle.await.unwrap().unwrap()
    }
}

fn ledger(worker: &str) -> BatchLedger {
    BatchLedger {
        worker: worker.to_owned(),
        ..BatchLedger::default()
    }
}

on_brokers!(
    tx_a_stream_with_duplicates_poison_and_a_mismatch_books_each_key_once_in_batches,
    tx_one_keys_failures_hold_back_only_that_keys_later_messages,
    tx_a_consumer_killed_mid_batch_leaves_one_row_per_key_and_offsets_at_the_end,
    tx_with_offsets_in_the_transaction_a_kill_before_the_kafka_commit_reads_nothing_again,
    tx_caches_are_filled_after_each_commit_and_answer_a_replay_without_a_transaction,
    tx_a_rebalance_while_batches_run_loses_stalls_and_doubles_nothing,
    tx_a_consumer_stopped_mid_batch_has_its_batch_rolled_back_by_the_server,
    tx_a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing,
);

/// The kill switch's outage scenario (`kill_switch.rs`) through the transaction-mode runner.
async fn tx_a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    effects_table(&pool).await;
    let (topic, group, config) = super::kill_switch::stream(broker).await;
    let broken = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicU64::new(0));
    let handler = BatchLedger {
        worker: "ks".to_owned(),
        broken: Some(broken.clone()),
        calls: calls.clone(),
        ..BatchLedger::default()
    };
    let run = RunningTx::spawn(config, &pool, handler).await;
    let stats = run.stats.clone();
    super::kill_switch::outage(
        broker, &pool, &topic, &group, &stats, &broken, &calls, false,
    )
    .await;
    run.stop().await;
}

/// 600 events over 3 partitions (a third of them repeats), poison every 50th key, one key reused
/// with another payload: each key's effect once, in batches; poison and the mismatch
/// dead-lettered with their reason; offsets committed to the end.
async fn tx_a_stream_with_duplicates_poison_and_a_mismatch_books_each_key_once_in_batches(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let topic = unique("tx-orders");
    broker.create_topic(&topic, 3).await;
    let mut events: Vec<Event> = (0..600u32)
        .map(|i| {
            let id = if i % 3 == 2 { i / 3 } else { i };
            let mut e = event(id, 3);
            if id % 50 == 7 {
                e.payload = format!(r#"{{"id":{id},"amount":-1}}"#);
            }
            e.partition = i32::try_from(i).unwrap() % 3;
            e
        })
        .collect();
    // A producer bug: the last event reuses key evt-1 with another payload.
    let mut reused = event(1, 3);
    reused.payload = r#"{"id":1,"amount":999}"#.to_owned();
    events.push(reused);
    let poison = |k: &str| {
        k.trim_start_matches("evt-")
            .parse::<u32>()
            .is_ok_and(|id| id % 50 == 7)
    };
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    let good: BTreeSet<String> = keys.iter().filter(|k| !poison(k)).cloned().collect();
    let poisoned_events = events
        .iter()
        .filter(|e| e.key.as_deref().is_some_and(poison))
        .count() as u64;
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let run = RunningTx::spawn(broker.config(&group, &topic), &pool, ledger("tx")).await;
    let stats = run.stats.clone();
    let total = events.len() as u64;
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == total }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 3).await;
    let s = run.stop().await;
    assert_eq!(s.executed, good.len() as u64);
    assert_eq!(
        s.dead_lettered,
        poisoned_events + 1,
        "poison and the mismatch"
    );
    assert!(
        s.batches * 4 < s.executed,
        "{} batches for {} executions: not batched",
        s.batches,
        s.executed
    );
    assert_one_row_per_key(&pool, good).await;
    let letters = read_dead_letters(
        broker,
        &format!("{topic}.dlq"),
        (poisoned_events + 1) as usize,
    )
    .await;
    let reasons: Vec<&str> = letters
        .iter()
        .map(|(_, h)| h.get(DLQ_REASON).map_or("", String::as_str))
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("different payload")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("negative amount")),
        "{reasons:?}"
    );
}

/// Under per-key order, one account's first message fails in three batches: the account's later
/// messages wait behind it and run after it in their original order, while every other
/// account's messages on the same partition settle before it recovers.
async fn tx_one_keys_failures_hold_back_only_that_keys_later_messages(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    sqlx::query("ALTER TABLE effects ADD COLUMN seq bigserial")
        .execute(&pool)
        .await
        .unwrap();
    let topic = unique("tx-accounts");
    broker.create_topic(&topic, 1).await;
    // Account A: events 0, 10, 20, ... 90; every other event its own account.
    let events: Vec<Event> = (0..100u32)
        .map(|id| {
            let mut e = event(id, 1);
            e.message_key = Some(if id % 10 == 0 {
                "acct-A".to_owned()
            } else {
                format!("acct-{id}")
            });
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let handler = ledger("tx");
    // Six failed handler calls: each batch that holds evt-0 calls the handler on it twice (the
    // whole batch, then evt-0 alone), so it takes three batches to recover.
    handler
        .failing
        .lock()
        .unwrap()
        .insert("evt-0".to_owned(), 6);
    let failing = handler.failing.clone();
    let config = broker
        .config(&group, &topic)
        .with_ordering(Ordering::PerKey);
    let run = RunningTx::spawn(config, &pool, handler).await;
    let stats = run.stats.clone();
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed == 100 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!(
        failing.lock().unwrap()["evt-0"],
        0,
        "every failure was spent"
    );
    assert!(s.retries >= 3, "{s:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effects ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 100);
    let seq: HashMap<&str, i64> = rows.iter().map(|(k, s)| (k.as_str(), *s)).collect();
    let a: Vec<&str> = rows
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| {
            k.trim_start_matches("evt-")
                .parse::<u32>()
                .is_ok_and(|id| id % 10 == 0)
        })
        .collect();
    let expected: Vec<String> = (0..10).map(|i| format!("evt-{}", i * 10)).collect();
    assert_eq!(a, expected, "account A in its original order");
    // The other accounts did not wait for A's failing head.
    let others_before = rows
        .iter()
        .filter(|(k, s)| !a.contains(&k.as_str()) && *s < seq["evt-0"])
        .count();
    assert_eq!(
        others_before, 90,
        "every other account settled before A recovered"
    );
}

/// A transaction-mode consumer process is killed with SIGKILL while its batches sleep inside
/// their transactions (20 messages each, effects written, not committed): nothing of an
/// uncommitted batch survives, and a restarted runner settles the rest: one row per key, offsets
/// at the end.
async fn tx_a_consumer_killed_mid_batch_leaves_one_row_per_key_and_offsets_at_the_end(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = crate::support::RedisServer::start();
    let topic = unique("tx-killed");
    broker.create_topic(&topic, 4).await;
    let events: Vec<Event> = (0..400u32).map(|i| event(i, 4)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"))
        .args(super::consumer_args(broker, &group, &topic, &pool, &redis))
        .env("DEDUP_TX_DELAY_MS", "300")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually(60, "the first batches committed", || {
        let pool = pool.clone();
        async move { ledger_count(&pool).await >= 20 }
    })
    .await;
    child.kill().await.unwrap();
    assert!(!child.wait().await.unwrap().success());
    let at_kill = ledger_count(&pool).await;
    assert!(at_kill < 400, "killed after the end: {at_kill}");
    // Batch transactions commit whole: the rows are whole batches of one partition.
    assert_eq!(committed(broker, &group, &topic, 4).await, vec![-1; 4]);

    let mut config = broker.config(&group, &topic);
    for (k, v) in broker.fast_failover() {
        config = config.with_client(k, v);
    }
    let second = RunningTx::spawn(config, &pool, ledger("second")).await;
    let stats = second.stats.clone();
    eventually(90, "all 400 settled again", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 400 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 4).await;
    let s = second.stop().await;
    // What the killed process committed: at least what was there at the kill; a COMMIT it sent
    // just before dying may be applied by the server after that count was read.
    let killed_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE worker <> 'second'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(killed_rows >= at_kill, "{killed_rows} < {at_kill}");
    let killed_rows = u64::try_from(killed_rows).unwrap();
    assert_eq!(
        s.executed,
        400 - killed_rows,
        "only what had not committed ran"
    );
    assert_eq!(s.replayed, killed_rows);
    assert_one_row_per_key(&pool, events.iter().filter_map(|e| e.key.clone())).await;
    assert_eq!(
        committed(broker, &group, &topic, 4).await,
        produced_ends(&topic, 4)
    );
}

/// Settings transaction mode cannot honour are refused by name, before anything connects to
/// Kafka.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn tx_runner_settings_that_cannot_work_are_refused_by_name(pool: PgPool) {
    let config = Settings::new("127.0.0.1:1", "g", ["t"]);
    let engine = engine_for(&pool, &config, None, Policy::default()).await;
    let refused = |config: Settings, batching: Batching| match consumer_for(&engine, &config)
        .batching(batching)
        .build(ledger("x"))
    {
        Err(e) => e.setting,
        Ok(_) => panic!("accepted"),
    };
    assert_eq!(
        refused(
            config
                .clone()
                .with_missing_key(MissingKey::ProcessWithoutDedup),
            Batching::default()
        ),
        "missing_key"
    );
    assert_eq!(
        refused(config.clone(), Batching::new(0, Duration::from_millis(5))),
        "batching.size"
    );
    assert_eq!(
        refused(config.clone(), Batching::new(10, Duration::from_secs(60))),
        "batching.wait"
    );
    for wait in [Duration::ZERO, Duration::from_secs(3600)] {
        match consumer_for(&engine, &config)
            .offsets_in_transaction(wait)
            .build(ledger("x"))
        {
            Err(e) => {
                assert_eq!(e.setting, "offsets_in_transaction");
            }
            other => panic!("{wait:?} accepted: {:?}", other.map(|_| ())),
        }
    }
    assert!(matches!(
        consumer_for(&engine, &config)
            .policy(Policy::default().with_max_attempts(0))
            .build(ledger("x")),
        Err(dedup::kafka::ConfigError {
            setting: "policy",
            ..
        })
    ));
}

/// Offsets in the transaction. A consumer process commits every batch (effects and positions)
/// in Postgres and is killed with SIGKILL before it ever commits an offset to Kafka. Restarted,
/// the runner starts each partition from its stored position: no message is read again, so no
/// handler runs again and no claim is made (counted: messages received, messages handed to the
/// handler); Kafka's committed offsets then catch up with the stored ones, for tooling.
async fn tx_with_offsets_in_the_transaction_a_kill_before_the_kafka_commit_reads_nothing_again(
    broker: &Broker,
    pool: PgPool,
) {
    let t0 = std::time::Instant::now();
    effects_table(&pool).await;
    let redis = crate::support::RedisServer::start();
    let topic = unique("tx-offsets");
    broker.create_topic(&topic, 4).await;
    // A third of the events repeat an earlier key. Each partition ends on a fresh key: a batch
    // answered wholly from the caches runs no transaction, and its position is stored at the
    // next periodic commit (an hour away here), so a partition ending on such a batch would
    // keep its stored position short of the end.
    let events: Vec<Event> = (0..300u32)
        .map(|i| {
            let mut e = event(if i % 3 == 2 { i / 3 } else { i }, 4);
            e.partition = i32::try_from(i).unwrap() % 4;
            e
        })
        .chain((1000..1004u32).map(|i| event(i, 4)))
        .collect();
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    produce(broker, &topic, &events).await;
    let ends = produced_ends(&topic, 4);
    let group = unique("g");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"))
        .args(super::consumer_args(broker, &group, &topic, &pool, &redis))
        .env("DEDUP_TX_DELAY_MS", "0")
        .env("DEDUP_TX_OFFSETS", "1")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stored = |pool: PgPool, group: String, topic: String| async move {
        let rows: Vec<(i32, i64)> = sqlx::query_as(
            "SELECT partition, next_offset FROM dedup_offsets WHERE consumer_group = $1 AND topic = $2 ORDER BY partition",
        )
        .bind(&group)
        .bind(&topic)
        .fetch_all(&pool)
        .await
        .unwrap();
        (0..4)
            .map(|p| rows.iter().find(|r| r.0 == p).map_or(-1, |r| r.1))
            .collect::<Vec<i64>>()
    };
    eventually(
        120,
        "every batch and position committed in Postgres",
        || {
            let (pool, group, topic, ends) =
                (pool.clone(), group.clone(), topic.clone(), ends.clone());
            async move { stored(pool, group, topic).await == ends }
        },
    )
    .await;
    eprintln!(
        "{:?}: the child committed everything in Postgres",
        t0.elapsed()
    );
    child.kill().await.unwrap();
    assert!(!child.wait().await.unwrap().success());
    assert_eq!(
        committed(broker, &group, &topic, 4).await,
        vec![-1; 4],
        "the killed consumer never committed to Kafka"
    );
    assert_one_row_per_key(&pool, keys.iter().cloned()).await;

    let mut config = broker.config(&group, &topic);
    for (k, v) in broker.fast_failover() {
        config = config.with_client(k, v);
    }
    let handler = ledger("second");
    let calls = handler.calls.clone();
    let second = RunningTx::spawn_with(config, &pool, handler, true).await;
    let stats = second.stats.clone();
    eprintln!("{:?}: the second runner spawned", t0.elapsed());
    eventually(120, "the restarted runner assigned", || {
        let s = stats.snapshot();
        async move { s.assigned > 0 }
    })
    .await;
    eprintln!("{:?}: the second runner assigned", t0.elapsed());
    super::committed_to_the_end_within(broker, &group, &topic, 4, 120).await;
    eprintln!("{:?}: Kafka's offsets caught up", t0.elapsed());
    let s = second.stop().await;
    assert_eq!(s.received, 0, "nothing was read again: {s:?}");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no handler ran again"
    );
    assert_eq!(s.executed + s.replayed, 0);
    assert_one_row_per_key(&pool, keys).await;
}

/// Caches in front of the transactions: a first consumer group books a stream (its commits copy
/// every completed key to Redis); a second group in the same dedup scope, with an empty L1, reads
/// the stream again and every message is answered from the caches: no transaction runs, and
/// Postgres is asked nothing. After a Redis flush, Postgres's replays refill the caches.
async fn tx_caches_are_filled_after_each_commit_and_answer_a_replay_without_a_transaction(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("tx-cached");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..200u32)
        .map(|i| {
            let mut e = event(if i % 2 == 1 { i / 2 } else { i }, 2);
            e.partition = i32::try_from(i).unwrap() % 2;
            e
        })
        .collect();
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    produce(broker, &topic, &events).await;
    let scope = unique("scope");
    let config = broker
        .config(&unique("g"), &topic)
        .with_scope(scope.clone());
    let run = RunningTx::spawn_full(config, &pool, ledger("first"), false, Some(&redis)).await;
    let (stats, first) = (run.stats.clone(), run.engine.clone());
    eventually(60, "the first group settled the stream", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 200 }
    })
    .await;
    let s = run.stop().await;
    // The engine copies each commit's completions to Redis in the background, after the commit.
    backfilled(&first, keys.len()).await;
    assert_eq!(s.executed, keys.len() as u64);
    assert_one_row_per_key(&pool, keys.iter().cloned()).await;

    let config = broker
        .config(&unique("g"), &topic)
        .with_scope(scope.clone());
    let run = RunningTx::spawn_full(config, &pool, ledger("second"), false, Some(&redis)).await;
    let (stats, second) = (run.stats.clone(), run.engine.clone());
    eventually(60, "the second group settled the stream", || {
        let s = stats.snapshot();
        async move { s.replayed == 200 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.batches), (0, 0), "no transaction ran: {s:?}");
    let tiers = second.tier_stats();
    assert_eq!(tiers.authority_claims, 0, "{tiers:?}");
    assert!(tiers.l2_hits >= keys.len() as u64, "{tiers:?}");

    // Redis flushed: a third group's replays come from Postgres, which refills Redis after its
    // transactions, so that a fourth group is answered by the caches again.
    let mut conn = redis.client().await;
    let _: () = dedup_redis::redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .unwrap();
    for (n, from_postgres) in [(3, true), (4, false)] {
        let config = broker
            .config(&unique("g"), &topic)
            .with_scope(scope.clone());
        let run = RunningTx::spawn_full(config, &pool, ledger("again"), false, Some(&redis)).await;
        let (stats, caches) = (run.stats.clone(), run.engine.clone());
        eventually(60, "the group settled the stream", || {
            let s = stats.snapshot();
            async move { s.replayed == 200 }
        })
        .await;
        let s = run.stop().await;
        assert_eq!(s.executed, 0, "group {n}: {s:?}");
        if from_postgres {
            backfilled(&caches, keys.len()).await;
        }
        let tiers = caches.tier_stats();
        if from_postgres {
            assert!(
                tiers.authority_claims >= keys.len() as u64,
                "group {n}: {tiers:?}"
            );
            assert!(tiers.backfills >= keys.len() as u64, "group {n}: {tiers:?}");
        } else {
            assert_eq!(tiers.authority_claims, 0, "group {n}: {tiers:?}");
        }
    }
    assert_one_row_per_key(&pool, keys).await;
}

/// Waits until `engine` has copied at least `n` completions to Redis (its backfills run in the
/// background, after each commit).
async fn backfilled(engine: &dedup::Engine, n: usize) {
    eventually(30, "the completions copied to Redis", || {
        let done = engine.tier_stats().backfills >= n as u64;
        async move { done }
    })
    .await;
}

/// A second member joins while the first one's batches are held inside their transactions: the
/// first is revoked (on an eager protocol, all of its partitions, some of which come straight
/// back) while those batches run. Once they finish, every partition goes on, under whichever
/// member owns it: every key booked once, offsets at the end, nothing stalled.
async fn tx_a_rebalance_while_batches_run_loses_stalls_and_doubles_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let topic = unique("tx-rebalance");
    broker.create_topic(&topic, 4).await;
    let events: Vec<Event> = (0..1200u32)
        .map(|i| {
            let mut e = event(if i % 3 == 2 { i / 2 } else { i }, 4);
            e.partition = i32::try_from(i).unwrap() % 4;
            e
        })
        .collect();
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    let group = unique("g");
    let (open, gate) = tokio::sync::watch::channel(false);
    let mut held = ledger("a");
    held.gate = Some(gate);
    let calls = held.calls.clone();
    let a = RunningTx::spawn(broker.config(&group, &topic), &pool, held).await;
    produce(broker, &topic, &events[..600]).await;
    eventually(
        60,
        "the first member's batches held in their transactions",
        || {
            let n = calls.load(std::sync::atomic::Ordering::Relaxed);
            async move { n > 0 }
        },
    )
    .await;
    let b = RunningTx::spawn(broker.config(&group, &topic), &pool, ledger("b")).await;
    let (a_stats, b_stats) = (a.stats.clone(), b.stats.clone());
    eventually(90, "the second member assigned, the first revoked", || {
        let (sa, sb) = (a_stats.snapshot(), b_stats.snapshot());
        async move { sb.assigned > 0 && sa.revoked > 0 }
    })
    .await;
    open.send(true).unwrap();
    produce(broker, &topic, &events[600..]).await;
    committed_to_the_end(broker, &group, &topic, 4).await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_one_row_per_key(&pool, keys.iter().cloned()).await;
    assert_eq!(
        sa.executed + sb.executed,
        keys.len() as u64,
        "{sa:?} {sb:?}"
    );
    assert_eq!(sa.dead_lettered + sb.dead_lettered, 0);
}

/// A consumer process is stopped with SIGSTOP while its batches sit inside their transactions
/// (effects written, not committed). The server ends those sessions after the batch's idle bound
/// (2 s here), rolling each batch back whole; another member takes the partitions over and books
/// every key. The stopped process then resumes (SIGCONT): its late commits find their sessions
/// gone, and no effect runs twice.
async fn tx_a_consumer_stopped_mid_batch_has_its_batch_rolled_back_by_the_server(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("tx-stopped");
    broker.create_topic(&topic, 4).await;
    let events: Vec<Event> = (0..400u32).map(|i| event(i, 4)).collect();
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"))
        .args(super::consumer_args(broker, &group, &topic, &pool, &redis))
        .env("DEDUP_TX_DELAY_MS", "1500")
        .env("DEDUP_TX_IDLE_MS", "2000")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let idle_in_tx = |pool: PgPool, db: String| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state = 'idle in transaction'",
        )
        .bind(db)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    eventually(60, "a batch of the consumer inside its transaction", || {
        let (pool, db) = (pool.clone(), db.clone());
        async move { idle_in_tx(pool, db).await > 0 }
    })
    .await;
    let pid = child.id().unwrap().to_string();
    let signal = |s: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([s, &pid])
                .status()
                .unwrap()
                .success()
        );
    };
    signal("-STOP");
    let at_stop = ledger_count(&pool).await;
    // The server ends the stopped client's sessions: nothing of those batches stays.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while idle_in_tx(pool.clone(), db.clone()).await > 0 {
        if tokio::time::Instant::now() > deadline {
            // Which sessions outlived their bound, and in what statement.
            let left: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT application_name, xact_start::text, query FROM pg_stat_activity \
                 WHERE datname = $1 AND state = 'idle in transaction'",
            )
            .bind(&db)
            .fetch_all(&pool)
            .await
            .unwrap();
            panic!(
                "the stopped batches' sessions were not ended by the server within 30 s: {left:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        ledger_count(&pool).await,
        at_stop,
        "an uncommitted batch left nothing"
    );
    let mut config = broker.config(&group, &topic);
    for (k, v) in broker.fast_failover() {
        config = config.with_client(k, v);
    }
    let other = RunningTx::spawn(config, &pool, ledger("other")).await;
    // Waits on the stopped member's session timeout and a rebalance: generous bounds, for a
    // loaded machine.
    eventually(180, "every key booked by the other member", || {
        let pool = pool.clone();
        let n = keys.len();
        async move { ledger_count(&pool).await >= i64::try_from(n).unwrap() }
    })
    .await;
    // The stopped consumer goes on: its transactions are gone, and it may try them again.
    signal("-CONT");
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    child.kill().await.unwrap();
    let _ = child.wait().await;
    // Its leaving (the kill) may cost another session timeout and rebalance.
    super::committed_to_the_end_within(broker, &group, &topic, 4, 180).await;
    let s = other.stop().await;
    assert_one_row_per_key(&pool, keys).await;
    assert_eq!(s.dead_lettered, 0);
}
