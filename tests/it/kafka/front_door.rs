//! The front door: an engine built once, consumers built from it by their handler's trait, and
//! the examples that show it, run against the real servers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedup::kafka::{Batching, MissingKey, Ordering as KeyOrdering, Parking, TxHandler};
use dedup::{BuildError, Engine, HandlerError, LeaseContext};
use sqlx::PgPool;
use tokio::sync::oneshot;

use super::{Broker, Event, committed_to_the_end, eventually, produce, unique};
use crate::support::{RedisServer, url_of};

#[allow(dead_code, unreachable_pub, clippy::print_stderr)]
#[path = "../../../crates/dedup/examples/kafka_ledger.rs"]
mod kafka_ledger;

#[allow(dead_code, unreachable_pub, clippy::print_stderr)]
#[path = "../../../crates/dedup/examples/kafka_calls.rs"]
mod kafka_calls;

#[allow(dead_code, unreachable_pub, clippy::print_stderr)]
#[path = "../../../crates/dedup/examples/outbox.rs"]
mod outbox_example;

on_brokers!(
    the_kafka_ledger_example_books_each_payment_once_and_commits_to_the_end,
    the_kafka_calls_example_charges_each_payment_once_at_the_provider,
    the_outbox_example_charges_each_order_once_and_publishes_each_charge,
    the_engine_answers_ready_while_its_consumers_run_and_names_what_is_wrong,
    a_lease_handler_runs_each_key_once_per_message_and_by_the_batch,
    a_handler_past_the_drain_timeout_keeps_the_identity_from_a_successor,
    a_consumer_stopped_by_its_own_signal_commits_and_leaves_the_others_running,
    a_consumer_whose_run_is_dropped_or_whose_stop_panics_loses_and_doubles_nothing,
);

/// 300 payments over 200 keys on 3 partitions: every third a redelivery of an earlier one.
fn payments() -> (Vec<Event>, BTreeSet<String>) {
    let events: Vec<Event> = (0..300u32)
        .map(|i| {
            let id = if i % 3 == 2 { i / 3 } else { i };
            Event {
                key: Some(format!("pay-{id}")),
                payload: format!(r#"{{"account":{},"amount":{}}}"#, id % 7, id + 1),
                partition: i32::try_from(i % 3).unwrap(),
                message_key: None,
            }
        })
        .collect();
    let keys = events.iter().filter_map(|e| e.key.clone()).collect();
    (events, keys)
}

async fn the_kafka_ledger_example_books_each_payment_once_and_commits_to_the_end(
    broker: &Broker,
    pool: PgPool,
) {
    let topic = unique("payments");
    broker.create_topic(&topic, 3).await;
    let (events, keys) = payments();
    produce(broker, &topic, &events).await;
    let settings = kafka_ledger::Settings {
        database_url: url_of(&pool),
        brokers: broker.bootstrap(),
        topic: topic.clone(),
        instance: Some(unique("ledger")),
        client: broker
            .client()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        kafka_ledger::consume(&settings, async {
            let _ = stopped.await;
        })
        .await
        .map_err(|e| e.to_string())
    });
    let expected = i64::try_from(keys.len()).unwrap();
    eventually(60, "every payment booked", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
                .fetch_one(&pool)
                .await
                .is_ok_and(|n| n >= expected)
        }
    })
    .await;
    // Booked is not settled: the duplicates still have to be answered before the stop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.send(()).unwrap();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.executed, keys.len() as u64);
    assert_eq!(stats.executed + stats.replayed, 300);
    assert_eq!(stats.dead_lettered, 0);
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM ledger GROUP BY key ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(rows.iter().all(|(_, n)| *n == 1), "a payment booked twice");
    let booked: BTreeSet<String> = rows.into_iter().map(|(k, _)| k).collect();
    assert_eq!(booked, keys);
    committed_to_the_end(broker, &format!("{topic}-ledger"), &topic, 3).await;
}

/// A payment provider: counts the charges of each idempotency key, and answers with them.
async fn provider() -> (String, Arc<Mutex<BTreeMap<String, u32>>>) {
    use axum::routing::post;
    let charges: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let seen = charges.clone();
    let app = axum::Router::new().route(
        "/charges",
        post(move |headers: axum::http::HeaderMap, body: Bytes| {
            let seen = seen.clone();
            async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                assert!(
                    headers["fencing-token"]
                        .to_str()
                        .unwrap()
                        .parse::<u64>()
                        .is_ok()
                );
                *seen.lock().unwrap().entry(key.clone()).or_default() += 1;
                format!("charged {key}: {}", String::from_utf8_lossy(&body))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), charges)
}

async fn the_kafka_calls_example_charges_each_payment_once_at_the_provider(
    broker: &Broker,
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let (url, charges) = provider().await;
    let topic = unique("charges");
    broker.create_topic(&topic, 3).await;
    let (events, keys) = payments();
    produce(broker, &topic, &events).await;
    let settings = kafka_calls::Settings {
        database_url: url_of(&pool),
        redis_url: Some(redis.url()),
        brokers: broker.bootstrap(),
        topic: topic.clone(),
        provider: url,
        client: broker
            .client()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        kafka_calls::consume(&settings, async {
            let _ = stopped.await;
        })
        .await
        .map_err(|e| e.to_string())
    });
    eventually(60, "every payment charged and settled", || {
        let n = charges.lock().unwrap().len();
        let pool = pool.clone();
        async move {
            // Charged, and recorded: the record is what answers the duplicates.
            n == keys_len()
                && sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM dedup_records WHERE state = 'completed'",
                )
                .fetch_one(&pool)
                .await
                .is_ok_and(|done| done == i64::try_from(keys_len()).unwrap())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.send(()).unwrap();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.executed, keys.len() as u64);
    assert_eq!(stats.executed + stats.replayed, 300);
    let charges = charges.lock().unwrap().clone();
    assert!(charges.values().all(|n| *n == 1), "a payment charged twice");
    assert_eq!(charges.into_keys().collect::<BTreeSet<_>>(), keys);
    committed_to_the_end(broker, &format!("{topic}-charges"), &topic, 3).await;
}

/// Health and stats through a consumer's life: not yet running (absent), running and ready with
/// its partitions, a handler that fails everything (the kill switch opens: not ready, named),
/// then shutting down (not ready, stopping).
async fn the_engine_answers_ready_while_its_consumers_run_and_names_what_is_wrong(
    broker: &Broker,
    pool: PgPool,
) {
    use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
    let topic = unique("health");
    broker.create_topic(&topic, 3).await;
    let (events, _) = payments();
    produce(broker, &topic, &events[..30]).await;
    let engine = Engine::builder()
        .postgres(pool.clone())
        .scope(unique("health"))
        .build()
        .await
        .unwrap();
    let broken = Arc::new(AtomicBool::new(false));
    let handler = {
        let broken = broken.clone();
        move |_: Arc<dedup::kafka::Delivery>, _: LeaseContext| {
            let broken = broken.load(AtomicOrdering::Acquire);
            async move {
                if broken {
                    Err(HandlerError::Retryable("the table is gone".to_owned()))
                } else {
                    Ok(Bytes::from_static(b"done"))
                }
            }
        }
    };
    let group = unique("g");
    let mut consumer = engine
        .consumer()
        .brokers(broker.bootstrap())
        .group_id(&group)
        .topics([&topic])
        .commit_interval(Duration::from_millis(200))
        .kill_switch(super::kill_switch::switch())
        .set("auto.offset.reset", "earliest");
    for (k, v) in broker.client() {
        consumer = consumer.set(k, v);
    }
    let consumer = consumer.build(handler).unwrap();
    let stall = Duration::from_secs(10);
    assert!(
        engine.health(stall).ready,
        "nothing runs yet: nothing is wrong"
    );
    assert!(engine.health(stall).consumers.is_empty());
    let run = tokio::spawn(consumer.run());
    eventually(60, "ready with its 3 partitions and 30 settled", || {
        let h = engine.health(stall);
        let settled = engine
            .stats()
            .consumers
            .first()
            .is_some_and(|(_, s)| s.executed + s.replayed == 30);
        async move {
            h.ready && settled && h.consumers.len() == 1 && h.consumers[0].partitions == 3
        }
    })
    .await;
    let h = engine.health(stall);
    assert_eq!(h.status(), 200);
    assert_eq!(h.consumers[0].group, group);
    assert!(
        h.consumers[0]
            .last_turn_ago_ms
            .is_some_and(|ms| ms < 10_000)
    );
    assert!(h.to_json().contains(r#""ready":true"#), "{}", h.to_json());

    broken.store(true, AtomicOrdering::Release);
    produce(broker, &topic, &events[30..90]).await;
    eventually(60, "the kill switch open, named", || {
        let h = engine.health(stall);
        async move {
            !h.ready
                && h.consumers[0].kill_switch_open
                && h.consumers[0]
                    .problems
                    .iter()
                    .any(|p| p == "kill switch open")
        }
    })
    .await;
    assert_eq!(engine.health(stall).status(), 503);

    broken.store(false, AtomicOrdering::Release);
    engine.shutdown().await;
    run.await.unwrap().unwrap();
    let h = engine.health(stall);
    assert!(h.stopping && !h.ready);
    assert!(!h.consumers[0].running);
    assert!(h.to_string().starts_with("not ready (stopping)"), "{h}");
}

/// How many distinct keys [`payments`] has.
fn keys_len() -> usize {
    payments().1.len()
}

async fn a_lease_handler_runs_each_key_once_per_message_and_by_the_batch(
    broker: &Broker,
    pool: PgPool,
) {
    for batched in [false, true] {
        let topic = unique("calls");
        broker.create_topic(&topic, 3).await;
        let (events, keys) = payments();
        produce(broker, &topic, &events).await;
        let engine = Engine::builder()
            .postgres(pool.clone())
            .scope(unique("calls"))
            .build()
            .await
            .unwrap();
        let effects: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
        let handler = {
            let effects = effects.clone();
            move |message: Arc<dedup::kafka::Delivery>, lease: LeaseContext| {
                let effects = effects.clone();
                async move {
                    assert!(!lease.is_lost());
                    let key = String::from_utf8_lossy(lease.lease().key.key_bytes()).into_owned();
                    *effects.lock().unwrap().entry(key).or_default() += 1;
                    Ok::<_, HandlerError<String>>(Bytes::copy_from_slice(message.payload_bytes()))
                }
            }
        };
        let mut consumer = engine
            .consumer()
            .brokers(broker.bootstrap())
            .group_id(unique("g"))
            .topics([&topic])
            .ordering(KeyOrdering::PerKey)
            .commit_interval(Duration::from_millis(200))
            .set("auto.offset.reset", "earliest");
        for (k, v) in broker.client() {
            consumer = consumer.set(k, v);
        }
        if batched {
            consumer = consumer.batching(Batching::default());
        }
        let consumer = consumer.build(handler).unwrap();
        let stats = consumer.stats();
        let run = tokio::spawn(consumer.run());
        eventually(60, "all 300 settled", || {
            let s = stats.snapshot();
            async move { s.executed + s.replayed == 300 }
        })
        .await;
        engine.shutdown().await;
        let s = run.await.unwrap().unwrap();
        assert_eq!(s.executed, keys.len() as u64, "batched: {batched}");
        let effects = effects.lock().unwrap();
        assert!(effects.values().all(|n| *n == 1), "an effect ran twice");
        assert_eq!(effects.keys().cloned().collect::<BTreeSet<_>>(), keys);
    }
}

/// A lease-mode handler still in its effect when the drain times out: shutdown does not abort it
/// and does not let go of the identity while it runs, so a successor with the same identity
/// (built as soon as it can be) never adopts its lease and runs the redelivered message's effect
/// a second time.
async fn a_handler_past_the_drain_timeout_keeps_the_identity_from_a_successor(
    broker: &Broker,
    pool: PgPool,
) {
    let topic = unique("slow");
    broker.create_topic(&topic, 1).await;
    let event = Event {
        key: Some("pay-1".into()),
        payload: r#"{"amount":1}"#.into(),
        partition: 0,
        message_key: None,
    };
    produce(broker, &topic, std::slice::from_ref(&event)).await;
    let (id, group, scope) = (unique("pod"), unique("g"), unique("slow"));
    let effects: Arc<Mutex<Vec<String>>> = Arc::default();
    let build = || {
        Engine::builder()
            .postgres(pool.clone())
            .scope(scope.clone())
            .instance(id.clone())
            .build()
    };
    let consumer_of = |engine: &Engine| {
        let effects = effects.clone();
        let handler = move |_: Arc<dedup::kafka::Delivery>, lease: LeaseContext| {
            let effects = effects.clone();
            async move {
                let key = String::from_utf8_lossy(lease.lease().key.key_bytes()).into_owned();
                effects.lock().unwrap().push(key);
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, HandlerError<String>>(Bytes::from_static(b"done"))
            }
        };
        let mut consumer = engine
            .consumer()
            .brokers(broker.bootstrap())
            .group_id(group.clone())
            .topics([&topic])
            .drain_timeout(Duration::from_millis(200))
            .commit_interval(Duration::from_millis(100))
            .set("auto.offset.reset", "earliest");
        for (k, v) in broker.client() {
            consumer = consumer.set(k, v);
        }
        consumer.build(handler).unwrap()
    };
    let first = build().await.unwrap();
    let run = tokio::spawn(consumer_of(&first).run());
    eventually(60, "the first handler started", || {
        let n = effects.lock().unwrap().len();
        async move { n == 1 }
    })
    .await;
    let report = first.shutdown().await;
    run.await.unwrap().unwrap();
    // The successor, as soon as the identity is free: it consumes the message again (its offset
    // was never committed) and finds it done (or waits for the lease), never adopting it.
    let second = loop {
        match build().await {
            Ok(engine) => break engine,
            Err(BuildError::Setting {
                setting: "instance",
                ..
            }) => {}
            Err(e) => panic!("{e}"),
        }
    };
    let consumer = consumer_of(&second);
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run());
    eventually(60, "the message settled again", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed == 1 }
    })
    .await;
    second.shutdown().await;
    run.await.unwrap().unwrap();
    assert_eq!(
        *effects.lock().unwrap(),
        vec!["pay-1".to_owned()],
        "the effect ran again"
    );
    // Shutdown said so: one handler left running, the identity kept for it.
    assert_eq!(report.left_running, 1, "{report:?}");
    assert!(!report.identity_released, "{report:?}");
}

/// `run_until`: one consumer of an engine stops on its own signal (settled, committed, out of
/// its group) while the engine and its other consumer go on, until the engine's shutdown.
async fn a_consumer_stopped_by_its_own_signal_commits_and_leaves_the_others_running(
    broker: &Broker,
    pool: PgPool,
) {
    let (first, second) = (unique("own-stop"), unique("goes-on"));
    for topic in [&first, &second] {
        broker.create_topic(topic, 3).await;
    }
    let (events, keys) = payments();
    produce(broker, &first, &events).await;
    let engine = Engine::builder()
        .postgres(pool.clone())
        .scope(unique("own-stop"))
        .build()
        .await
        .unwrap();
    let effects: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let consumer_of = |topic: &str, group: &str| {
        let effects = effects.clone();
        let handler = move |message: Arc<dedup::kafka::Delivery>, lease: LeaseContext| {
            let effects = effects.clone();
            async move {
                let key = String::from_utf8_lossy(lease.lease().key.key_bytes()).into_owned();
                *effects.lock().unwrap().entry(key).or_default() += 1;
                Ok::<_, HandlerError<String>>(Bytes::copy_from_slice(message.payload_bytes()))
            }
        };
        let mut consumer = engine
            .consumer()
            .brokers(broker.bootstrap())
            .group_id(group)
            .topics([topic])
            .commit_interval(Duration::from_millis(200))
            .set("auto.offset.reset", "earliest");
        for (k, v) in broker.client() {
            consumer = consumer.set(k, v);
        }
        consumer.build(handler).unwrap()
    };
    let (group_1, group_2) = (unique("g"), unique("g"));
    let one = consumer_of(&first, &group_1);
    let two = consumer_of(&second, &group_2);
    let (stats_1, stats_2) = (one.stats(), two.stats());
    let (stop, stopped) = oneshot::channel::<()>();
    let run_1 = tokio::spawn(one.run_until(stopped));
    let run_2 = tokio::spawn(two.run());
    eventually(60, "the first topic settled", || {
        let s = stats_1.snapshot();
        async move { s.executed + s.replayed == 300 }
    })
    .await;
    stop.send(()).unwrap();
    let s = tokio::time::timeout(Duration::from_secs(60), run_1)
        .await
        .expect("the first consumer stopped on its own signal")
        .unwrap()
        .unwrap();
    assert_eq!(s.executed, keys.len() as u64);
    committed_to_the_end(broker, &group_1, &first, 3).await;
    // The engine and the other consumer go on: the second topic is consumed after the stop,
    // and the engine is ready (the consumer stopped on purpose is not counted against it).
    let h = engine.health(Duration::from_secs(60));
    assert!(!h.stopping && h.ready, "{h}");
    assert_eq!(h.consumers.len(), 1, "{h}");
    produce(broker, &second, &events).await;
    eventually(
        60,
        "the second topic settled after the first stopped",
        || {
            let s = stats_2.snapshot();
            async move { s.executed + s.replayed == 300 }
        },
    )
    .await;
    assert!(!run_2.is_finished());
    engine.shutdown().await;
    let s = run_2.await.unwrap().unwrap();
    assert_eq!(s.executed + s.replayed, 300);
    // One scope: the second topic's keys were done by the first, so all 300 are replays.
    assert_eq!(s.executed, 0);
    assert!(
        effects.lock().unwrap().values().all(|n| *n == 1),
        "an effect ran twice"
    );
}

/// A transaction-mode handler that books each payment in `cut_short`, slowly enough that a
/// consumer cut short has batches in flight.
struct SlowBooking;

impl TxHandler for SlowBooking {
    type Error = String;
    type Output = Bytes;

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        message: &dedup::kafka::Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        sqlx::query("INSERT INTO cut_short (payment) VALUES ($1)")
            .bind(String::from_utf8_lossy(message.lease().key.key_bytes()).into_owned())
            .execute(&mut *tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(Bytes::new())
    }
}

/// `run_until`, ended without its drain: a stop future that panics (the panic comes out of
/// `run_until`), then a `run_until` future dropped mid-stream (its task aborted), each while
/// payments are still to book. Neither drains nor commits its offsets (a batch already running
/// may still finish on its own: its effects and completions commit together, so the successor
/// replays it), and the engine's health says each is not running (it did not stop on its own
/// signal). A successor in the same group finishes the stream from the committed offsets:
/// every payment booked once, none lost.
async fn a_consumer_whose_run_is_dropped_or_whose_stop_panics_loses_and_doubles_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    sqlx::query("CREATE TABLE cut_short (payment text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let topic = unique("cut-short");
    broker.create_topic(&topic, 3).await;
    let (events, keys) = payments();
    produce(broker, &topic, &events).await;
    let engine = Engine::builder()
        .postgres(pool.clone())
        .scope(unique("cut-short"))
        .build()
        .await
        .unwrap();
    let group = unique("g");
    let consumer = || {
        let mut consumer = engine
            .consumer()
            .brokers(broker.bootstrap())
            .group_id(&group)
            .topics([&topic])
            .commit_interval(Duration::from_millis(200))
            .batching(Batching::new(10, Duration::from_millis(5)))
            // The next member is not held up by the one cut short.
            .static_membership(false)
            .set("auto.offset.reset", "earliest");
        for (k, v) in broker.client() {
            consumer = consumer.set(k, v);
        }
        for (k, v) in broker.fast_failover() {
            consumer = consumer.set(k, v);
        }
        consumer.build(SlowBooking).unwrap()
    };
    let booked = |pool: PgPool| async move {
        let n: i64 = sqlx::query_scalar("SELECT count(DISTINCT payment) FROM cut_short")
            .fetch_one(&pool)
            .await
            .unwrap();
        usize::try_from(n).unwrap()
    };
    let not_running = |engine: &Engine| {
        let h = engine.health(Duration::from_secs(60));
        assert!(!h.ready, "{h}");
        assert!(h.consumers.iter().all(|c| !c.running), "{h}");
    };

    // A stop future that panics once a third of the payments are booked.
    let (panic_now, panicking) = oneshot::channel::<()>();
    let first = tokio::spawn(consumer().run_until(async move {
        let _ = panicking.await;
        panic!("the stop signal's own bug");
    }));
    eventually(60, "a third of the payments booked", || {
        let pool = pool.clone();
        let want = keys.len() / 3;
        async move { booked(pool).await >= want }
    })
    .await;
    assert!(
        booked(pool.clone()).await < keys.len(),
        "cut short mid-stream"
    );
    panic_now.send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(60), first)
        .await
        .expect("the panic ended the consumer");
    assert!(ended.is_err_and(|e| e.is_panic()));
    not_running(&engine);

    // A `run_until` future dropped while a third of the payments are still to book.
    let second = tokio::spawn(consumer().run_until(std::future::pending::<()>()));
    eventually(90, "two thirds of the payments booked", || {
        let pool = pool.clone();
        let want = keys.len() * 2 / 3;
        async move { booked(pool).await >= want }
    })
    .await;
    assert!(
        booked(pool.clone()).await < keys.len(),
        "cut short mid-stream"
    );
    second.abort();
    assert!(second.await.is_err_and(|e| e.is_cancelled()));
    not_running(&engine);

    // A successor finishes the stream.
    let (stop, stopped) = oneshot::channel::<()>();
    let third = tokio::spawn(consumer().run_until(stopped));
    eventually(90, "every payment booked", || {
        let pool = pool.clone();
        let want = keys.len();
        async move { booked(pool).await == want }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 3).await;
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), third)
        .await
        .expect("the successor stopped on its own signal")
        .unwrap()
        .unwrap();
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT payment, count(*) FROM cut_short GROUP BY payment")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r.0.clone())
            .collect::<BTreeSet<String>>(),
        keys,
        "every payment booked"
    );
    assert!(
        rows.iter().all(|r| r.1 == 1),
        "a payment booked twice: {rows:?}"
    );
    engine.shutdown().await;
}

/// The setting a builder refused: the engine's (`BuildError`) or a consumer's (`ConfigError`).
pub(super) fn setting_of<T: std::fmt::Debug>(r: Result<T, impl Into<BuildError>>) -> &'static str {
    match r.map_err(Into::into) {
        Err(BuildError::Setting { setting, .. }) => setting,
        other => panic!("expected a refused setting, got {other:?}"),
    }
}

#[tokio::test]
async fn the_engine_builder_names_the_setting_at_fault() {
    assert_eq!(setting_of(Engine::builder().build().await), "scope");
    assert_eq!(
        setting_of(Engine::builder().scope("").build().await),
        "scope"
    );
    assert_eq!(
        setting_of(Engine::builder().scope("s").instance("").build().await),
        "instance"
    );
    // A scope of 125 bytes is a scope, but its HTTP layers' `<scope>/http` would not be.
    assert_eq!(
        setting_of(
            Engine::builder()
                .in_memory()
                .scope("s".repeat(125))
                .build()
                .await
        ),
        "scope"
    );
    assert!(
        Engine::builder()
            .in_memory()
            .scope("s".repeat(123))
            .build()
            .await
            .is_ok()
    );
    assert_eq!(
        setting_of(
            Engine::builder()
                .scope("s")
                .in_flight_wait(Duration::from_secs(8 * 24 * 3600))
                .build()
                .await
        ),
        "in_flight_wait"
    );
    assert_eq!(
        setting_of(Engine::builder().scope("s").build().await),
        "postgres"
    );
    let policy = dedup::Policy::default().with_max_attempts(0);
    assert_eq!(
        setting_of(Engine::builder().scope("s").policy(policy).build().await),
        "policy"
    );
}

/// A transaction-mode handler that books nothing (the refusals never run it).
pub(super) struct Nothing;

impl TxHandler for Nothing {
    type Error = String;
    type Output = Bytes;

    async fn handle(
        &self,
        _: &mut sqlx::PgConnection,
        _: &dedup::kafka::Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        Ok(Bytes::new())
    }
}

pub(super) async fn lease_nothing(
    _: Arc<dedup::kafka::Delivery>,
    _: LeaseContext,
) -> Result<Bytes, HandlerError<String>> {
    Ok(Bytes::new())
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_consumer_builder_refuses_what_its_mode_cannot_honour_by_name(pool: PgPool) {
    let engine = Engine::builder()
        .postgres(pool)
        .scope("refusals")
        .build()
        .await
        .unwrap();
    let base = || {
        engine
            .consumer()
            .brokers("127.0.0.1:1")
            .group_id("g")
            .topics(["t"])
    };
    let parking = || Parking::default();
    assert_eq!(setting_of(engine.consumer().build(Nothing)), "brokers");
    assert_eq!(
        setting_of(base().topics(Vec::<String>::new()).build(Nothing)),
        "topics"
    );
    assert_eq!(
        setting_of(base().parking(parking()).build(Nothing)),
        "parking"
    );
    assert_eq!(
        setting_of(
            base()
                .ordering(KeyOrdering::PerKey)
                .batching(Batching::default())
                .parking(parking())
                .build(lease_nothing)
        ),
        "parking"
    );
    // Parking under per-partition order cannot keep a key's order apart from its partition's.
    assert_eq!(
        setting_of(base().parking(parking()).build(lease_nothing)),
        "parking"
    );
    assert_eq!(
        setting_of(
            base()
                .offsets_in_transaction(Duration::from_secs(1))
                .build(lease_nothing)
        ),
        "offsets_in_transaction"
    );
    assert_eq!(
        setting_of(
            base()
                .missing_key(MissingKey::ProcessWithoutDedup)
                .build(lease_nothing)
        ),
        "missing_key"
    );
    assert_eq!(
        setting_of(base().max_in_flight(0).build(Nothing)),
        "max_in_flight"
    );
    assert_eq!(
        setting_of(
            base()
                .policy(dedup::Policy::default().with_max_attempts(0))
                .build(Nothing)
        ),
        "policy"
    );
    // What is left builds, in every mode.
    let builds = |r: Result<dedup::kafka::IdempotentConsumer, dedup::kafka::ConfigError>| {
        if let Err(e) = r {
            panic!("refused: {e}");
        }
    };
    builds(base().build(Nothing));
    builds(base().build(lease_nothing));
    builds(base().batching(Batching::default()).build(lease_nothing));
    builds(
        base()
            .ordering(KeyOrdering::PerKey)
            .parking(parking())
            .build(lease_nothing),
    );
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn an_instance_identity_is_held_by_one_engine_and_released_at_shutdown(pool: PgPool) {
    let id = unique("pod");
    let build = || {
        Engine::builder()
            .postgres(pool.clone())
            .scope("identity")
            .instance(id.clone())
            .build()
    };
    let first = build().await.unwrap();
    assert_eq!(setting_of(build().await), "instance");
    first.shutdown().await;
    let second = build().await.unwrap();
    assert_eq!(second.instance().unwrap().as_str(), id);
    second.shutdown().await;
}

/// The outbox example (README, docs/OUTBOX.md): 300 orders over 233 keys; one charge row per
/// order, and one `charged` message per order published by the engine's relay, with the derived
/// key and the cause.
async fn the_outbox_example_charges_each_order_once_and_publishes_each_charge(
    broker: &Broker,
    pool: PgPool,
) {
    let topic = unique("orders");
    broker.create_topic(&topic, 3).await;
    broker.create_topic(&format!("{topic}.charged"), 3).await;
    let events: Vec<Event> = (0..300u32)
        .map(|i| {
            let id = if i % 3 == 2 { i / 3 } else { i };
            Event {
                key: Some(format!("ord-{id}")),
                payload: format!(r#"{{"order":"o-{id}","cents":{}}}"#, id + 1),
                partition: i32::try_from(i % 3).unwrap(),
                message_key: None,
            }
        })
        .collect();
    let n = events
        .iter()
        .filter_map(|e| e.key.clone())
        .collect::<BTreeSet<_>>()
        .len();
    produce(broker, &topic, &events).await;
    let settings = outbox_example::Settings {
        database_url: url_of(&pool),
        brokers: broker.bootstrap(),
        topic: topic.clone(),
        client: broker
            .client()
            .into_iter()
            .filter(|(k, _)| !matches!(*k, "session.timeout.ms" | "heartbeat.interval.ms"))
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        outbox_example::run(&settings, async {
            let _ = stopped.await;
        })
        .await
        .map_err(|e| e.to_string())
    });
    let charged = super::read_letters(broker, &format!("{topic}.charged"), n).await;
    stop.send(()).unwrap();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(stats.executed, n as u64);
    let rows: i64 = sqlx::query_scalar("SELECT count(DISTINCT order_id) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    let n64 = i64::try_from(n).unwrap();
    assert_eq!((rows, all), (n64, n64), "one charge per order");
    let mut orders = BTreeSet::new();
    for l in &charged {
        let v: serde_json::Value = serde_json::from_slice(l.payload.as_deref().unwrap()).unwrap();
        let order = v["order"].as_str().unwrap().to_owned();
        assert_eq!(l.key.as_deref(), Some(order.as_bytes()));
        assert!(l.headers.iter().any(|(n, _)| n == "idempotency-key"));
        orders.insert(order);
    }
    assert_eq!(orders.len(), n, "one charged message per order");
}
