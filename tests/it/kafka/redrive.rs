//! Re-driving dead letters after a fix (docs/RECOVERY.md, "Re-driving dead letters"): a handler
//! with a bug dead-letters some keys (their records FAILED); the bug is fixed; the keys the dead
//! letters name in `dedup-scope` and `dedup-key` are forgotten (`PgStore::forget_keys`, and their
//! copies in Redis dropped, as `dedup forget` does with `REDIS_URL`); the dead letters are
//! produced back to the source topic as they are (payload, key, every header); the runner runs
//! each once. Every key's effect runs exactly once in all, and a re-driven message dead-lettered
//! again carries one set of dedup headers, not two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Completion, HandlerError, IdempotencyKey, LeaseContext, Scope};
use dedup_kafka::{DLQ_ATTEMPTS, DLQ_OFFSET, DLQ_PARTITION, DLQ_REASON, DLQ_TOPIC, Delivery};
use dedup_pg::PgStore;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use super::{
    Broker, Event, HandlerFuture, Letter, Running, committed_to_the_end, event, eventually,
    produce, read_letters, setup, unique,
};
use crate::support::RedisServer;

/// The dead-letter headers naming the idempotency key (`dedup_kafka::dead_letter`).
const DLQ_SCOPE: &str = "dedup-scope";
const DLQ_KEY: &str = "dedup-key";

on_brokers!(dead_letters_re_driven_after_a_fix_run_each_effect_once);

/// Effects per idempotency key.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// Events in the stream, over two partitions.
const EVENTS: u32 = 20;
/// A key the fix does not mend: it fails again when re-driven.
const STILL_BROKEN: &str = "evt-7";

/// The keys the bug breaks.
fn buggy(id: u32) -> bool {
    id % 5 == 2
}

/// Books an effect per key; while `bug` is set, fails for good on the buggy keys, and always on
/// [`STILL_BROKEN`].
fn handler(
    effects: Effects,
    bug: Arc<AtomicBool>,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    move |d, _lease| {
        let (effects, bug) = (Arc::clone(&effects), Arc::clone(&bug));
        Box::pin(async move {
            let key = d
                .header("idempotency-key")
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_default();
            if key == STILL_BROKEN && !bug.load(Ordering::SeqCst) {
                return Err(HandlerError::Permanent(format!(
                    "second bug: {key} still cannot be booked"
                )));
            }
            let id: u32 = key
                .strip_prefix("evt-")
                .and_then(|n| n.parse().ok())
                .unwrap_or(u32::MAX);
            if bug.load(Ordering::SeqCst) && buggy(id) {
                return Err(HandlerError::Permanent(format!("first bug: {key}")));
            }
            *effects.lock().unwrap().entry(key).or_default() += 1;
            Ok(Completion::store(Bytes::new()))
        })
    }
}

impl Letter {
    /// Every value of the header `name`.
    fn all(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }

    /// The header `name`, which must be there once.
    fn one(&self, name: &str) -> String {
        let v = self.all(name);
        assert_eq!(v.len(), 1, "{name} once: {:?}", self.text());
        String::from_utf8_lossy(v[0]).into_owned()
    }

    fn text(&self) -> Vec<(String, String)> {
        self.headers
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned(),
                )
            })
            .collect()
    }

    /// The idempotency key it names.
    fn named_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(
            Scope::new(self.one(DLQ_SCOPE)).unwrap(),
            self.all(DLQ_KEY)[0],
        )
        .unwrap()
    }
}

async fn dead_letters_re_driven_after_a_fix_run_each_effect_once(broker: &Broker, pool: PgPool) {
    let redis = RedisServer::start();
    let topic = unique("redrive");
    let dlq = format!("{topic}.dlq");
    broker.create_topic(&topic, 2).await;
    let events: Vec<Event> = (0..EVENTS).map(|i| event(i, 2)).collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let effects: Effects = Arc::default();
    let bug = Arc::new(AtomicBool::new(true));
    let broken = (0..EVENTS).filter(|i| buggy(*i)).count();

    // Round 1: the bug dead-letters its keys; their records are FAILED.
    let run = Running::spawn_with(
        broker.config(&group, &topic),
        setup(&pool, &redis),
        handler(Arc::clone(&effects), Arc::clone(&bug)),
    )
    .await;
    let stats = run.stats.clone();
    eventually(60, "every event settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered == u64::from(EVENTS) }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 2).await;
    let s = run.stop().await;
    assert_eq!(s.dead_lettered, broken as u64, "{s:?}");
    let first = read_letters(broker, &dlq, broken).await;
    let mut keys = Vec::new();
    for l in &first {
        // One set of dedup headers, naming the key the message was claimed under.
        for name in [
            DLQ_REASON,
            DLQ_ATTEMPTS,
            DLQ_TOPIC,
            DLQ_PARTITION,
            DLQ_OFFSET,
        ] {
            l.one(name);
        }
        assert!(l.one(DLQ_REASON).contains("first bug"), "{:?}", l.text());
        let key = l.named_key();
        assert_eq!(key.scope().as_str(), group, "the scope is the group's");
        assert_eq!(
            key.key_bytes(),
            l.one("idempotency-key").as_bytes(),
            "{:?}",
            l.text()
        );
        keys.push(key);
    }

    // The fix; then the dead letters' keys are forgotten.
    bug.store(false, Ordering::SeqCst);
    let store = PgStore::new(pool.clone());
    let report = store.forget_keys(&keys).await.unwrap();
    assert_eq!(report.forgotten.len(), broken, "{report:?}");
    assert!(
        report.busy.is_empty() && report.parked.is_empty() && report.absent.is_empty(),
        "{report:?}"
    );
    // A tiered store's Redis holds FAILED copies for `failed_retention`: drop them (what
    // `dedup forget` does when given REDIS_URL). The next runner is a new process: its L1 is empty.
    // The engine's Redis keys (its default prefix).
    let fast = dedup_redis::RedisFastPath::connect(&redis.url())
        .await
        .unwrap();
    let mut conn = redis.client().await;
    for k in &keys {
        let name = fast.redis_key(k);
        let _: i64 = dedup_redis::redis::cmd("DEL")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    // The re-drive: each dead letter back to its partition of the source topic, as it is.
    let producer = broker.producer();
    for l in &first {
        let partition: i32 = l.one(DLQ_PARTITION).parse().unwrap();
        let mut headers = OwnedHeaders::new();
        for (k, v) in &l.headers {
            headers = headers.insert(Header {
                key: k.as_str(),
                value: v.as_deref(),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic)
            .partition(partition)
            .headers(headers);
        if let Some(p) = &l.payload {
            record = record.payload(&p[..]);
        }
        if let Some(k) = &l.key {
            record = record.key(&k[..]);
        }
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    // Round 2: the same group goes on from its committed offsets, through a new engine.
    let run = Running::spawn_with(
        broker.config(&group, &topic),
        setup(&pool, &redis),
        handler(Arc::clone(&effects), Arc::clone(&bug)),
    )
    .await;
    let stats = run.stats.clone();
    eventually(60, "every re-driven message settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.dead_lettered + s.replayed >= broken as u64 }
    })
    .await;
    let s = run.stop().await;
    assert_eq!(
        (s.executed, s.dead_lettered, s.replayed),
        (broken as u64 - 1, 1, 0),
        "{s:?}"
    );

    // Every key's effect ran once in all; the key the fix did not mend, never.
    let effects = effects.lock().unwrap().clone();
    for i in 0..EVENTS {
        let key = format!("evt-{i}");
        let expected = u32::from(key != STILL_BROKEN);
        assert_eq!(
            effects.get(&key).copied().unwrap_or(0),
            expected,
            "{key}: {effects:?}"
        );
    }

    // The re-driven message dead-lettered again carries one set of dedup headers, fresh: the
    // copy it arrived with was replaced, not stacked. (The originals were at offsets 0 to 9 of
    // each partition; the re-driven ones follow.)
    let all = read_letters(broker, &dlq, broken + 1).await;
    let again: Vec<&Letter> = all
        .iter()
        .filter(|l| l.one(DLQ_OFFSET).parse::<i64>().unwrap() >= i64::from(EVENTS / 2))
        .collect();
    assert_eq!(
        again.len(),
        1,
        "{:?}",
        all.iter().map(Letter::text).collect::<Vec<_>>()
    );
    let l = again[0];
    for name in [
        DLQ_REASON,
        DLQ_ATTEMPTS,
        DLQ_TOPIC,
        DLQ_PARTITION,
        DLQ_OFFSET,
        DLQ_SCOPE,
        DLQ_KEY,
        "idempotency-key",
    ] {
        l.one(name);
    }
    let reason = l.one(DLQ_REASON);
    assert!(
        reason.contains("second bug") && !reason.contains("first bug"),
        "{reason}"
    );
    assert_eq!(l.one("idempotency-key"), STILL_BROKEN);
    assert_eq!(l.named_key().key_bytes(), STILL_BROKEN.as_bytes());
}
