//! Lease mode by the batch (a `LeaseHandler` consumer with batching, built from an engine): each
//! partition's batches run by `Dedup::process_batch` over the full engine, with a per-message
//! handler, on both brokers.
//!
//! Duplicates and poison in batches with a transactional per-message handler; one ordering key
//! failing while the other keys settle past it, its later messages then in order and run once
//! each.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use dedup_core::{Completion, HandlerError, LeaseContext};
use dedup_kafka::{Batching, DLQ_REASON, Delivery, Ordering as KeyOrdering};
use sqlx::PgPool;

use super::settings::Settings;
use super::{
    Broker, Event, HandlerFuture, Running, Setup, assert_one_row_per_key, committed_to_the_end,
    event, eventually, ledger_handler, produce, read_dead_letters, setup, unique,
};
use crate::support::{RedisServer, effects_table};

/// Lease mode by the batch (default batching), built from an engine.
struct RunningLease;

impl RunningLease {
    async fn spawn<F, Fut, E>(config: Settings, setup: Setup, handler: F) -> Running
    where
        F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Completion, HandlerError<E>>> + Send,
        E: std::fmt::Display + Send + 'static,
    {
        Running::spawn_full(config, setup, Some(Batching::default()), handler).await
    }
}

on_brokers!(
    lease_a_stream_with_duplicates_and_poison_books_each_key_once_in_batches,
    lease_one_keys_failures_hold_back_only_that_keys_later_messages,
    lease_a_handler_that_panics_at_once_fails_only_its_message,
    lease_a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing,
);

/// The kill switch's outage scenario (`kill_switch.rs`) through the lease-mode batch runner.
async fn lease_a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let (topic, group, config) = super::kill_switch::stream(broker).await;
    let dedup = setup(&pool, &redis);
    let store = dedup.pg();
    let (broken, calls) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicU64::new(0)));
    let run = RunningLease::spawn(
        config,
        dedup,
        super::kill_switch::breakable(store, broken.clone(), calls.clone()),
    )
    .await;
    let stats = run.stats.clone();
    super::kill_switch::outage(broker, &pool, &topic, &group, &stats, &broken, &calls, true).await;
    run.stop().await;
}

/// 600 events over 3 partitions, a third of them repeats, poison every 50th key: each key's
/// effect once (its ledger row and completion in one transaction), in batches; poison
/// dead-lettered with its reason; offsets at the end.
async fn lease_a_stream_with_duplicates_and_poison_books_each_key_once_in_batches(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("lease-orders");
    broker.create_topic(&topic, 3).await;
    let events: Vec<Event> = (0..600u32)
        .map(|i| {
            let id = if i % 3 == 2 { i / 3 } else { i };
            let mut e = event(id, 3);
            if id % 50 == 7 {
                e.payload = format!(r#"{{"id":{id},"amount":-1}}"#);
            }
            e.partition = i32::try_from(i).unwrap() % 3;
            // The order is the message key (and the ordering key): one per event and its repeats.
            e.message_key = Some(format!("order-{id}"));
            e
        })
        .collect();
    let poison = |k: &str| {
        k.trim_start_matches("evt-")
            .parse::<u32>()
            .is_ok_and(|id| id % 50 == 7)
    };
    let keys: BTreeSet<String> = events.iter().filter_map(|e| e.key.clone()).collect();
    let good: BTreeSet<String> = keys.iter().filter(|k| !poison(k)).cloned().collect();
    let poisoned = events
        .iter()
        .filter(|e| e.key.as_deref().is_some_and(poison))
        .count() as u64;
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let dedup = setup(&pool, &redis);
    let store = dedup.pg();
    let run = RunningLease::spawn(
        broker
            .config(&group, &topic)
            .with_ordering(KeyOrdering::PerKey),
        dedup,
        ledger_handler(store, "lease"),
    )
    .await;
    let stats = run.stats.clone();
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == 600 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 3).await;
    let s = run.stop().await;
    assert_eq!(s.executed, good.len() as u64, "{s:?}");
    assert_eq!(s.dead_lettered, poisoned, "{s:?}");
    assert!(s.batches * 4 < s.executed, "not batched: {s:?}");
    assert_one_row_per_key(&pool, good).await;
    let letters = read_dead_letters(broker, &format!("{topic}.dlq"), poisoned as usize).await;
    assert!(
        letters.iter().all(|(_, h)| h
            .get(DLQ_REASON)
            .is_some_and(|r| r.contains("negative amount"))),
        "{letters:?}"
    );
}

/// Under per-key order, one account's first message fails four times: the account's later
/// messages wait behind it and run after it in their original order, while every other
/// account's messages on the same partition settle before it recovers.
async fn lease_one_keys_failures_hold_back_only_that_keys_later_messages(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    sqlx::query("ALTER TABLE effects ADD COLUMN seq bigserial")
        .execute(&pool)
        .await
        .unwrap();
    let redis = RedisServer::start();
    let topic = unique("lease-accounts");
    broker.create_topic(&topic, 1).await;
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
    let failures = Arc::new(AtomicU32::new(4));
    let calls: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let (db, f, c) = (pool.clone(), failures.clone(), calls.clone());
    let handler = move |d: Arc<Delivery>, _lease: Option<LeaseContext>| -> HandlerFuture {
        let (db, f, c) = (db.clone(), f.clone(), c.clone());
        Box::pin(async move {
            let key = String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default())
                .into_owned();
            *c.lock().unwrap().entry(key.clone()).or_default() += 1;
            if key == "evt-0"
                && f.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                return Err(HandlerError::Retryable("not yet".to_owned()));
            }
            // An effect outside dedup's transaction (a call to a payment API, say).
            sqlx::query("INSERT INTO effects (key, token, worker) VALUES ($1, 0, 'lease')")
                .bind(&key)
                .execute(&db)
                .await
                .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            Ok(Completion::store(Bytes::from(format!("ran {key}"))))
        })
    };
    // Five attempts by default: four failures and a success fit.
    let run = RunningLease::spawn(
        broker
            .config(&group, &topic)
            .with_ordering(KeyOrdering::PerKey),
        setup(&pool, &redis),
        handler,
    )
    .await;
    let stats = run.stats.clone();
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed == 100 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "every failure was spent"
    );
    assert!(s.retries >= 4, "{s:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT key, seq FROM effects ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 100, "each key's effect once");
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
    let others_before = rows
        .iter()
        .filter(|(k, s)| !a.contains(&k.as_str()) && *s < seq["evt-0"])
        .count();
    assert_eq!(
        others_before, 90,
        "every other account settled before A recovered"
    );
    // The later messages of A never ran before its head had run.
    let calls = calls.lock().unwrap();
    assert!(expected[1..].iter().all(|k| calls[k] == 1), "{calls:?}");
}

/// A handler that panics at once (before its first await) on one message: that message alone is
/// retried and, past its attempts, dead-lettered with the panic's message; its neighbours in the
/// same batches run once each.
async fn lease_a_handler_that_panics_at_once_fails_only_its_message(broker: &Broker, pool: PgPool) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("lease-panic");
    broker.create_topic(&topic, 1).await;
    let events: Vec<Event> = (0..30u32)
        .map(|id| {
            let mut e = event(id, 1);
            e.message_key = Some(format!("order-{id}"));
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let dedup = setup(&pool, &redis);
    let store = dedup.pg();
    let booked = ledger_handler(store, "lease");
    let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| -> HandlerFuture {
        let key =
            String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default()).into_owned();
        assert!(key != "evt-7", "no future for evt-7");
        booked(d, lease)
    };
    let run = RunningLease::spawn(
        broker
            .config(&group, &topic)
            .with_ordering(KeyOrdering::PerKey),
        dedup,
        handler,
    )
    .await;
    let stats = run.stats.clone();
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 30 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (29, 1), "{s:?}");
    assert!(s.panics >= 1, "{s:?}");
    let good: BTreeSet<String> = (0..30u32)
        .filter(|&id| id != 7)
        .map(|id| format!("evt-{id}"))
        .collect();
    assert_one_row_per_key(&pool, good).await;
    let letters = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    assert!(
        letters[0]
            .1
            .get(DLQ_REASON)
            .is_some_and(|r| r.contains("no future for evt-7")),
        "{letters:?}"
    );
}
