//! The test kit a user drives their handlers with: an in-process cluster ([`MockKafka`]), an
//! engine on Postgres or in memory, and typed results over either kind of handler.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dedup::kafka::testing::MockKafka;
use dedup::kafka::{
    Acquired, Batching, Delivery, LeaseHandler, Ordering as KeyOrdering, Parking, TxHandler, Typed,
};
use dedup::typed::ResultCodec;
use dedup::{Engine, HandlerError, IdempotencyKey, LeaseContext};
use sqlx::PgPool;

use super::front_door::{Nothing, lease_nothing, setting_of};
use super::unique;

/// The test kit as a user drives it: an in-process cluster, messages with their keys, a handler,
/// and the consumer's counters once every message settled; on a Postgres engine and on an
/// in-memory one alike.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_test_kit_drives_a_handler_through_an_in_process_cluster(pool: PgPool) {
    let engine = Engine::builder()
        .postgres(pool)
        .scope(unique("kit"))
        .build()
        .await
        .unwrap();
    drive_the_kit(&engine).await;
}

#[tokio::test]
async fn the_test_kit_runs_on_an_in_memory_engine_without_postgres() {
    let engine = Engine::builder()
        .in_memory()
        .scope("kit")
        .build()
        .await
        .unwrap();
    assert!(engine.is_in_memory());
    drive_the_kit(&engine).await;
    // The records are the engine's own: a second look at a key finds it done.
    let key = dedup::IdempotencyKey::new(engine.scope().clone(), "o-1").unwrap();
    let done = engine
        .dedup()
        .process(&key, None, |_| async {
            Ok::<_, HandlerError<String>>(dedup::Completion::store("again"))
        })
        .await
        .unwrap();
    assert!(!done.executed());
    assert_eq!(done.result().as_ref(), b"charged");
}

/// What an in-memory engine cannot do is refused by name, never half done.
#[tokio::test]
async fn an_in_memory_engine_refuses_what_needs_postgres_by_name() {
    let engine = Engine::builder()
        .in_memory()
        .scope("memory")
        .build()
        .await
        .unwrap();
    assert!(engine.pool().is_err());
    assert!(engine.postgres().is_err());
    let base = || {
        engine
            .consumer()
            .brokers("127.0.0.1:1")
            .group_id("g")
            .topics(["t"])
    };
    assert_eq!(setting_of(base().build(Nothing)), "in_memory");
    assert_eq!(
        setting_of(
            base()
                .ordering(KeyOrdering::PerKey)
                .parking(Parking::default())
                .build(lease_nothing)
        ),
        "parking"
    );
    assert!(base().build(lease_nothing).is_ok());
    assert!(
        base()
            .batching(Batching::default())
            .build(lease_nothing)
            .is_ok()
    );
    let redis = Engine::builder()
        .in_memory()
        .redis_url("redis://127.0.0.1:1")
        .scope("memory")
        .build()
        .await;
    assert_eq!(setting_of(redis), "in_memory");
    let retention = Engine::builder()
        .in_memory()
        .retention(dedup::RetentionConfig::default())
        .scope("memory")
        .build()
        .await;
    assert_eq!(setting_of(retention), "retention");
}

async fn drive_the_kit(engine: &Engine) {
    let kafka = MockKafka::new().unwrap();
    kafka.create_topic("orders", 2).unwrap();
    for (key, cents) in [
        ("o-1", 100),
        ("o-2", 250),
        ("o-1", 100),
        ("o-3", -1),
        ("o-2", 250),
    ] {
        kafka
            .send("orders", key, &format!(r#"{{"cents":{cents}}}"#))
            .await
            .unwrap();
    }
    let effects: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let handler = {
        let effects = effects.clone();
        move |m: Arc<dedup::kafka::Delivery>, lease: LeaseContext| {
            let effects = effects.clone();
            async move {
                let body: serde_json::Value = serde_json::from_slice(m.payload_bytes()).unwrap();
                if body["cents"].as_i64().unwrap_or(0) < 0 {
                    return Err(HandlerError::Permanent("negative amount".to_owned()));
                }
                let key = String::from_utf8_lossy(lease.lease().key.key_bytes()).into_owned();
                *effects.lock().unwrap().entry(key).or_default() += 1;
                Ok(Bytes::from_static(b"charged"))
            }
        }
    };
    let consumer = kafka.consumer(engine, "orders").build(handler).unwrap();
    let stats = kafka.run_until_settled(consumer, 5).await.unwrap();
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (2, 2, 1)
    );
    let effects = effects.lock().unwrap().clone();
    assert_eq!(
        effects.into_iter().collect::<Vec<_>>(),
        vec![("o-1".to_owned(), 1), ("o-2".to_owned(), 1)]
    );
}

/// A result type of the user's own.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    order: String,
    cents: i64,
}

fn receipt(message: &Delivery, key: &IdempotencyKey) -> Receipt {
    let body: serde_json::Value = serde_json::from_slice(message.payload_bytes()).unwrap();
    Receipt {
        order: String::from_utf8_lossy(key.key_bytes()).into_owned(),
        cents: body["cents"].as_i64().unwrap(),
    }
}

/// A transaction-mode handler returning a value: a row per order, and the receipt.
struct Receipts;

impl TxHandler for Receipts {
    type Error = String;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        message: &Acquired,
    ) -> Result<Receipt, HandlerError<String>> {
        let receipt = receipt(message.delivery(), &message.lease().key);
        sqlx::query("INSERT INTO kit_orders (order_id, cents) VALUES ($1, $2)")
            .bind(&receipt.order)
            .bind(receipt.cents)
            .execute(tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        Ok(receipt)
    }
}

/// A lease-mode handler (a type, not a closure) returning a value, which looks at every result
/// itself too (its `check_result`, kept by `Typed`).
struct Charges(Arc<Mutex<BTreeMap<String, u32>>>, Arc<AtomicU32>);

impl LeaseHandler for Charges {
    type Error = String;
    type Output = Receipt;

    async fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> Result<Receipt, HandlerError<String>> {
        let receipt = receipt(&message, &lease.lease().key);
        *self
            .0
            .lock()
            .unwrap()
            .entry(receipt.order.clone())
            .or_default() += 1;
        Ok(receipt)
    }

    fn check_result(
        &self,
        _: &Delivery,
        _: &dedup::Processed,
    ) -> Result<(), dedup::typed::CodecError> {
        self.1.fetch_add(1, AtomicOrdering::SeqCst);
        Ok(())
    }
}

/// Three orders, one twice, on one partition.
async fn orders(kafka: &MockKafka) {
    kafka.create_topic("orders", 1).unwrap();
    for (key, cents) in [("o-1", 100), ("o-2", 250), ("o-1", 100), ("o-3", 75)] {
        kafka
            .send("orders", key, &format!(r#"{{"cents":{cents}}}"#))
            .await
            .unwrap();
    }
}

/// What the engine holds for `order` under `codec`: the stored value, replayed (the closure
/// must not run).
async fn stored(
    engine: &Engine,
    codec: &ResultCodec<Receipt, dedup::typed::Bincode>,
    order: &str,
) -> Receipt {
    let key = IdempotencyKey::new(engine.scope().clone(), order).unwrap();
    let done = engine
        .dedup()
        .process_typed(codec, &key, None, |_| async {
            Err::<Receipt, _>(HandlerError::Permanent("ran again".to_owned()))
        })
        .await
        .unwrap();
    assert!(!done.executed(), "{order} ran again");
    done.value().clone()
}

/// `Typed` over a `TxHandler`: each order's row and its encoded receipt commit together, once;
/// the stored result is the typed value, read back through the codec.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn typed_wraps_a_transaction_handler_and_stores_its_value(pool: PgPool) {
    sqlx::query("CREATE TABLE kit_orders (order_id text, cents bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let engine = Engine::builder()
        .postgres(pool.clone())
        .scope(unique("typed-tx"))
        .build()
        .await
        .unwrap();
    let codec = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
    let kafka = MockKafka::new().unwrap();
    orders(&kafka).await;
    let consumer = kafka
        .consumer(&engine, "orders")
        .batching(Batching::default())
        .build(Typed::new(codec.clone(), Receipts))
        .unwrap();
    let stats = kafka.run_until_settled(consumer, 4).await.unwrap();
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (3, 1, 0)
    );
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, cents FROM kit_orders ORDER BY order_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![("o-1".into(), 100), ("o-2".into(), 250), ("o-3".into(), 75)]
    );
    for (order, cents) in rows {
        let want = Receipt {
            order: order.clone(),
            cents,
        };
        assert_eq!(stored(&engine, &codec, &order).await, want);
    }
}

/// `Typed` over a lease handler of the user's own type, on an in-memory engine: each order
/// charged once, `on_result` sees every delivery's value, and the stored value decodes.
#[tokio::test]
async fn typed_wraps_a_lease_handler_type_on_an_in_memory_engine() {
    let engine = Engine::builder()
        .in_memory()
        .scope("typed-lease")
        .build()
        .await
        .unwrap();
    let codec = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
    let charged: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let checked = Arc::new(AtomicU32::new(0));
    let seen: Arc<Mutex<Vec<(i64, Receipt, bool)>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        Typed::new(codec.clone(), Charges(charged.clone(), checked.clone())).on_result(
            move |m: &Delivery, r: &dedup::typed::TypedProcessed<Receipt>| {
                seen.lock()
                    .unwrap()
                    .push((m.offset, r.value().clone(), r.executed()));
            },
        )
    };
    let kafka = MockKafka::new().unwrap();
    orders(&kafka).await;
    let consumer = kafka
        .consumer(&engine, "orders")
        .ordering(KeyOrdering::PerKey)
        .build(handler)
        .unwrap();
    let stats = kafka.run_until_settled(consumer, 4).await.unwrap();
    assert_eq!((stats.executed, stats.replayed), (3, 1));
    assert!(charged.lock().unwrap().values().all(|n| *n == 1));
    assert_eq!(
        checked.load(AtomicOrdering::SeqCst),
        4,
        "the handler's own check, every result"
    );
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by_key(|(offset, _, _)| *offset);
    let orders: Vec<(&str, bool)> = seen
        .iter()
        .map(|(_, r, executed)| (r.order.as_str(), *executed))
        .collect();
    assert_eq!(
        orders,
        vec![("o-1", true), ("o-2", true), ("o-1", false), ("o-3", true)]
    );
    assert_eq!(
        stored(&engine, &codec, "o-2").await,
        Receipt {
            order: "o-2".into(),
            cents: 250
        }
    );
}
