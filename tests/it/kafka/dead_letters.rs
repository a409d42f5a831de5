//! Dead letters the dead-letter topic refuses for good: a message near `message.max.bytes`
//! whose dead letter (its headers added) is larger than the producer and the topic accept.
//! Without a Postgres table the partition stalls, loudly (a counter and an error naming what to
//! do); with one the dead letter is kept whole in `dedup_dead_letters` and the stream goes on,
//! also where an older letter is kept at its coordinates (a topic made again). And what a dead
//! letter carries: the user's headers, whatever their names, and dedup's own written fresh.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Completion, HandlerError, LeaseContext};
use dedup_kafka::{Delivery, KeptDeadLetters};
use dedup_pg::PgStore;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use super::{
    Broker, DLQ_ATTEMPTS, DLQ_OFFSET, DLQ_REASON, Event, Running, assert_one_row_per_key,
    committed, committed_to_the_end, event, eventually, produce, read_dead_letters, read_letters,
    setup, unique,
};
use crate::support::{RedisServer, effects_table};

/// Under the producer's `message.max.bytes` (1,000,000) with the message's own header, over it
/// with the headers a dead letter adds.
const PAYLOAD: usize = 999_800;

on_brokers!(
    a_dead_letter_refused_for_good_stalls_without_a_table_and_is_kept_with_one,
    a_dead_letter_refused_for_good_is_kept_beside_an_old_one_at_its_coordinates,
    a_dead_letter_keeps_the_users_dedup_named_headers_and_writes_dedups_own_fresh,
);

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

    // No table (an engine in memory has no Postgres to keep one in): the partition waits on the
    // dead letter, counted and logged. The handler books its row outside any dedup transaction
    // (its keys are the in-memory engine's).
    let booked = {
        let pool = pool.clone();
        move |d: Arc<Delivery>, _lease: Option<LeaseContext>| {
            let pool = pool.clone();
            async move {
                serde_json::from_slice::<serde_json::Value>(d.payload_bytes())
                    .map_err(|e| HandlerError::Permanent(format!("payload: {e}")))?;
                let key = String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default())
                    .into_owned();
                sqlx::query("INSERT INTO effects VALUES ($1, 0, 'a')")
                    .bind(&key)
                    .execute(&pool)
                    .await
                    .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                Ok::<_, HandlerError<String>>(Completion::store(Bytes::new()))
            }
        }
    };
    let run = Running::spawn_with(config.clone(), setup(&pool, &redis).in_memory(), booked).await;
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

    // Built from an engine: kept whole in its table, and the stream goes on to the end.
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let run = Running::spawn(config, setup(&pool, &redis), "b").await;
    let stats = run.stats.clone();
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!(s.dead_letters_kept, 1);
    assert_eq!(stats.snapshot().dead_letters_kept, 1);
    let kept = store.list(&group).await.unwrap();
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
    assert!(store.remove(&group, &topic, 0, 2, &d.digest).await.unwrap());
    assert!(store.list(&group).await.unwrap().is_empty());
}

/// Issue #57, item 3: the group's table holds a letter at (group, topic, 0, 0), kept before the
/// topic was deleted and made again (here written as a binary of generation 11 wrote it, without
/// a digest). The new topic's offset 0 is an oversize poison message whose dead letter the
/// topic refuses: it is kept beside the old one, naming its idempotency key, and the stream goes
/// on; neither letter is lost.
async fn a_dead_letter_refused_for_good_is_kept_beside_an_old_one_at_its_coordinates(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("again");
    let group = unique("g");
    sqlx::query(
        "INSERT INTO dedup_dead_letters (consumer_group, topic, partition, \"offset\", \
         message_key, payload, header_names, header_values, timestamp_ms, reason, attempts, \
         dead_letter_topic, refusal, stored_at) VALUES ($1, $2, 0, 0, NULL, \
         'the old topic''s letter', '{}', '{}', 1700000000000, 'poison', 1, $3, \
         'Message production error: MessageSizeTooLarge', now() - interval '1 day')",
    )
    .bind(&group)
    .bind(&topic)
    .bind(format!("{topic}.dlq"))
    .execute(&pool)
    .await
    .unwrap();
    broker.create_topic(&topic, 1).await;
    let mut events: Vec<Event> = (0..4).map(|i| event(i, 1)).collect();
    events[0].payload = "x".repeat(PAYLOAD);
    produce(broker, &topic, &events).await;
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!(s.dead_letters_kept, 1, "{s:?}");

    let at_zero: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_dead_letters WHERE consumer_group = $1 AND topic = $2 \
         AND partition = 0 AND \"offset\" = 0",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        at_zero, 2,
        "the new topic's dead letter at offset 0 is kept beside the old one, not lost"
    );
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let kept = store.list(&group).await.unwrap();
    let mut sizes: Vec<usize> = kept
        .iter()
        .map(|d| d.payload.as_ref().map_or(0, Vec::len))
        .collect();
    sizes.sort_unstable();
    assert_eq!(
        sizes,
        ["the old topic's letter".len(), PAYLOAD],
        "both kept whole"
    );
    let (scope, key): (Option<String>, Option<Vec<u8>>) = sqlx::query_as(
        "SELECT scope, dedup_key FROM dedup_dead_letters WHERE consumer_group = $1 \
         AND length(payload) = $2",
    )
    .bind(&group)
    .bind(i32::try_from(PAYLOAD).unwrap())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (scope.as_deref(), key.as_deref()),
        (Some(group.as_str()), Some(&b"evt-0"[..])),
        "the row names its idempotency key"
    );
    let good = events.iter().skip(1).filter_map(|e| e.key.clone());
    assert_one_row_per_key(&pool, good).await;
}

/// Issue #57, item 8: a message with a header of the user's named `dedup-event-ms` (its event
/// time, say, which a key source may read) and old copies of dedup's own headers in another case
/// (a dead letter re-driven to its topic) is dead-lettered. The letter keeps the user's header
/// as it was, and carries dedup's own once each, fresh.
async fn a_dead_letter_keeps_the_users_dedup_named_headers_and_writes_dedups_own_fresh(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("named");
    broker.create_topic(&topic, 1).await;
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "idempotency-key",
            value: Some("evt-0"),
        })
        .insert(Header {
            key: "dedup-event-ms",
            value: Some("1700000000000"),
        })
        .insert(Header {
            key: "Dedup-Reason",
            value: Some("an old reason"),
        })
        .insert(Header {
            key: "DEDUP-ATTEMPTS",
            value: Some("9"),
        });
    broker
        .producer()
        .send(
            FutureRecord::<str, str>::to(&topic)
                .partition(0)
                .payload("not json")
                .headers(headers),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "the poison message dead-lettered", || {
        let s = stats.snapshot();
        async move { s.dead_lettered == 1 }
    })
    .await;
    run.stop().await;
    let letter = read_letters(broker, &format!("{topic}.dlq"), 1)
        .await
        .remove(0);
    let named = |name: &str| -> Vec<String> {
        letter
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned())
            .collect()
    };
    assert_eq!(
        named("dedup-event-ms"),
        ["1700000000000"],
        "the user's header is kept: {:?}",
        letter.headers
    );
    assert_eq!(named("idempotency-key"), ["evt-0"]);
    let reasons = named(DLQ_REASON);
    assert!(
        reasons.len() == 1 && reasons[0].contains("payload"),
        "dedup's own, once and fresh: {reasons:?}"
    );
    assert_eq!(named(DLQ_ATTEMPTS), ["1"]);
    assert_eq!(named(DLQ_OFFSET), ["0"]);
}

/// A fatal error of the idempotent dead-letter producer (here the broker answers the first
/// dead letter's produce request with OUT_OF_ORDER_SEQUENCE_NUMBER, which librdkafka holds for
/// a lost sequence and makes fatal) leaves that producer failing every later send: the runner
/// makes the producer anew and the dead letter, and the ones after it, are written once each.
/// Only the mock cluster injects request errors.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_fatal_error_of_the_dead_letter_producer_makes_it_anew(pool: PgPool) {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    effects_table(&pool).await;
    let redis = RedisServer::start();
    let broker = Broker::mock();
    let Broker::Mock(mock) = &broker else {
        unreachable!()
    };
    let topic = unique("fatal");
    broker.create_topic(&topic, 1).await;
    broker.create_topic(&format!("{topic}.dlq"), 1).await;
    let mut events: Vec<Event> = (0..12).map(|i| event(i, 1)).collect();
    for i in [3, 7] {
        events[i].payload = format!("not json {i}");
    }
    produce(&broker, &topic, &events).await;
    // From here on the only producer is the runner's dead-letter producer.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_dead_letter_topic(format!("{topic}.dlq"));
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "12 settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == 12 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!((s.executed, s.dead_lettered), (10, 2));
    assert!(
        s.dead_letter_errors >= 1,
        "the first dead letter met the fatal error: {s:?}"
    );
    let mut dead = read_dead_letters(&broker, &format!("{topic}.dlq"), 2).await;
    dead.sort_by_key(|(_, h)| h[DLQ_OFFSET].parse::<i64>().unwrap());
    assert_eq!(
        dead.iter()
            .map(|(_, h)| h[DLQ_OFFSET].as_str())
            .collect::<Vec<_>>(),
        ["3", "7"]
    );
    assert!(dead[0].1[DLQ_REASON].contains("payload"), "{:?}", dead[0].1);
    let good = events
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 7)
        .filter_map(|(_, e)| e.key.clone());
    assert_one_row_per_key(&pool, good).await;
    assert_eq!(committed(&broker, &group, &topic, 1).await, vec![12]);
}
