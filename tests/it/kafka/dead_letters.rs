//! Dead letters the dead-letter topic refuses for good: a message near `message.max.bytes`
//! whose dead letter (its headers added) is larger than the producer and the topic accept.
//! Without a Postgres table the partition stalls, loudly (a counter and an error naming what to
//! do); with one the dead letter is kept whole in `dedup_dead_letters` and the stream goes on.

use dedup_kafka::Runner;
use dedup_pg::PgStore;
use sqlx::PgPool;
use tokio::sync::oneshot;

use super::{
    Broker, Event, Running, assert_one_row_per_key, committed, committed_to_the_end, engine, event,
    eventually, ledger_handler, produce, unique,
};
use crate::support::{RedisServer, effects_table};

/// Under the producer's `message.max.bytes` (1,000,000) with the message's own header, over it
/// with the headers a dead letter adds.
const PAYLOAD: usize = 999_800;

on_brokers!(a_dead_letter_refused_for_good_stalls_without_a_table_and_is_kept_with_one);

async fn a_dead_letter_refused_for_good_stalls_without_a_table_and_is_kept_with_one(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("big");
    broker.create_topic(&topic, 1).await;
    let mut events: Vec<Event> = (0..6).map(|i| event(i, 1)).collect();
    // Not JSON: a permanent failure. Its own size fits under the producer's 1,000,000 bytes;
    // with the dead letter's headers it does not.
    events[2].payload = "x".repeat(PAYLOAD);
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));

    // No table: the partition waits on the dead letter, counted and logged.
    let run = Running::spawn(config.clone(), engine(&pool, &redis).await, "a");
    let stats = run.stats.clone();
    eventually(60, "the refused dead letter stalls, counted", || {
        let s = stats.snapshot();
        async move { s.dead_letter_stalls >= 2 }
    })
    .await;
    run.stop().await;
    assert!(
        committed(broker, &group, &topic, 1).await[0] <= 2,
        "the offset never passed a message that is nowhere"
    );

    // With a table: kept whole, and the stream goes on to the end.
    let store = PgStore::new(pool.clone());
    let dedup = engine(&pool, &redis).await;
    let authority = dedup.store().inner().authority().clone();
    let runner = Runner::new(config, dedup, ledger_handler(authority, "b"))
        .unwrap()
        .with_dead_letter_table(store.clone());
    let stats = runner.stats();
    let (stop, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(runner.run(async {
        let _ = rx.await;
    }));
    committed_to_the_end(broker, &group, &topic, 1).await;
    let _ = stop.send(());
    let s = handle.await.unwrap().unwrap();
    assert_eq!(s.dead_letters_kept, 1);
    assert_eq!(stats.snapshot().dead_letters_kept, 1);
    let kept = store.refused_dead_letters(&group).await.unwrap();
    assert_eq!(kept.len(), 1);
    let d = &kept[0];
    assert_eq!(
        (d.topic.as_str(), d.partition, d.offset),
        (topic.as_str(), 0, 2)
    );
    assert_eq!(
        d.payload.as_ref().map(Vec::len),
        Some(PAYLOAD),
        "kept whole"
    );
    assert!(
        d.headers
            .iter()
            .any(|(k, v)| k == b"idempotency-key" && v.as_deref() == Some(b"evt-2".as_slice())),
        "{:?}",
        d.headers.iter().map(|h| &h.0).collect::<Vec<_>>()
    );
    assert!(
        d.refusal.to_lowercase().contains("too large"),
        "{}",
        d.refusal
    );
    let good = events
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2)
        .filter_map(|(_, e)| e.key.clone());
    assert_one_row_per_key(&pool, good).await;
    assert!(
        store
            .remove_refused_dead_letter(&group, &topic, 0, 2)
            .await
            .unwrap()
    );
    assert!(store.refused_dead_letters(&group).await.unwrap().is_empty());
}
