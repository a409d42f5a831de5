//! A key source that is a list: the `idempotency-key` header, else the payload's `/id`. Two
//! copies of one event, one with the header and one without it, get one key and run once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedup::kafka::{DEFAULT_KEY_HEADER, EventTime, KeySource};
use dedup::{Engine, HandlerError, LeaseContext};
use dedup_kafka::DLQ_REASON;
use sqlx::PgPool;

use super::front_door::{lease_nothing, setting_of};
use super::{Broker, Event, eventually, produce, read_dead_letters, unique};

on_brokers!(a_copy_without_the_header_gets_the_key_of_the_copy_with_it_and_runs_once);

/// The header, else the JSON field: the same bytes for the same event.
fn header_else_id() -> KeySource {
    KeySource::first_of([
        KeySource::Header(DEFAULT_KEY_HEADER.into()),
        KeySource::JsonPointer("/id".into()),
    ])
}

async fn a_copy_without_the_header_gets_the_key_of_the_copy_with_it_and_runs_once(
    broker: &Broker,
    pool: PgPool,
) {
    let topic = unique("fallback");
    broker.create_topic(&topic, 2).await;
    // Each event twice, on two partitions (so the copies may meet in flight): once with the
    // header, once with the JSON field only.
    let mut events: Vec<Event> = Vec::new();
    for i in 0..20_i32 {
        let id = format!("evt-{i}");
        let payload = format!(r#"{{"id":"{id}","cents":{}}}"#, i + 1);
        events.push(Event {
            key: Some(id),
            payload: payload.clone(),
            partition: i % 2,
            message_key: None,
        });
        events.push(Event {
            key: None,
            payload,
            partition: (i + 1) % 2,
            message_key: None,
        });
    }
    // Neither the header nor the field: no key, dead-lettered naming both.
    events.push(Event {
        key: None,
        payload: r#"{"cents":5}"#.into(),
        partition: 0,
        message_key: None,
    });
    // A header that is there but no key (too long): dead-lettered, never keyed by its field.
    events.push(Event {
        key: Some("k".repeat(dedup_core::MAX_KEY_LEN + 1)),
        payload: r#"{"id":"evt-bad","cents":6}"#.into(),
        partition: 1,
        message_key: None,
    });
    produce(broker, &topic, &events).await;
    let engine = Engine::builder()
        .postgres(pool)
        .scope(unique("fallback"))
        .build()
        .await
        .unwrap();
    let effects: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let handler = {
        let effects = effects.clone();
        move |_: Arc<dedup::kafka::Delivery>, lease: LeaseContext| {
            let effects = effects.clone();
            async move {
                let key = String::from_utf8_lossy(lease.lease().key.key_bytes()).into_owned();
                *effects.lock().unwrap().entry(key).or_default() += 1;
                Ok::<_, HandlerError<String>>(Bytes::from_static(b"done"))
            }
        }
    };
    let mut consumer = engine
        .consumer()
        .brokers(broker.bootstrap())
        .group_id(unique("g"))
        .topics([&topic])
        .key(header_else_id())
        .commit_interval(Duration::from_millis(200))
        .set("auto.offset.reset", "earliest");
    for (k, v) in broker.client() {
        consumer = consumer.set(k, v);
    }
    let consumer = consumer.build(handler).unwrap();
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run());
    eventually(60, "all 42 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == 42 }
    })
    .await;
    engine.shutdown().await;
    let s = run.await.unwrap().unwrap();
    let effects = effects.lock().unwrap().clone();
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "events run twice: {twice:?}");
    let want: BTreeSet<String> = (0..20).map(|i| format!("evt-{i}")).collect();
    assert_eq!(effects.keys().cloned().collect::<BTreeSet<_>>(), want);
    assert_eq!(
        (s.executed, s.replayed, s.dead_lettered, s.missing_key),
        (20, 20, 2, 1)
    );
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 2).await;
    let reasons: Vec<&str> = dead.iter().map(|(_, h)| h[DLQ_REASON].as_str()).collect();
    assert!(
        reasons.iter().any(|r| r.contains("no idempotency key")
            && r.contains(DEFAULT_KEY_HEADER)
            && r.contains("/id")),
        "the keyless message's reason names both sources: {reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("invalid idempotency key")),
        "the bad header is the reason: {reasons:?}"
    );
}

/// Lists that cannot give one event one key are refused when the consumer is built, as `key`.
#[tokio::test]
async fn a_list_of_key_sources_that_cannot_agree_is_refused_by_the_builder() {
    let engine = Engine::builder()
        .in_memory()
        .scope("fallback")
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
    let timed = KeySource::timed(
        KeySource::Header("event-id".into()),
        EventTime::Header("event-ms".into()),
    );
    for refused in [
        KeySource::first_of([]),
        KeySource::first_of([timed.clone(), KeySource::JsonPointer("/id".into())]),
        KeySource::first_of([
            KeySource::Header("event-id".into()),
            KeySource::Fields(vec!["/id".into()]),
        ]),
        KeySource::first_of([header_else_id(), KeySource::Header("other".into())]),
    ] {
        assert_eq!(
            setting_of(base().key(refused.clone()).build(lease_nothing)),
            "key",
            "{refused:?}"
        );
    }
    assert!(base().key(header_else_id()).build(lease_nothing).is_ok());
}
