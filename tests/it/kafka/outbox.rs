//! The outbox through a transaction-mode consumer and the relay, on both brokers: every message
//! a committed batch queued is published once, with its derived key and its cause, and nothing a
//! rolled-back attempt queued; two relays run at once and one publishes; a position set back
//! (a relay killed between the broker's ack and its position write) publishes the same messages
//! again byte for byte, and a downstream consumer with the default key source books each once.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use dedup::outbox::{OUTBOX_CAUSE_KEY, OUTBOX_CAUSE_SCOPE, OUTBOX_KEY, OutboxRelay, RelayConfig};
use dedup_core::{IdempotencyKey, Scope};
use dedup_pg::outbox::RelayStore;
use sqlx::PgPool;
use tokio::sync::oneshot;

use super::tx::RunningTx;
use super::tx::batch_ledger::BatchLedger;
use super::{Broker, Event, event, eventually, produce, read_letters, unique};
use crate::support::{effect_rows, effects_table};

on_brokers!(
    outbox_a_chain_publishes_each_committed_message_once_and_the_next_consumer_books_it_once,
    outbox_an_engines_relay_publishes_its_consumers_commits_and_health_says_when_rows_wait,
    outbox_a_message_refused_for_good_is_dead_lettered_and_stops_nothing,
);

/// The relay's client properties for `broker` (a producer's).
fn relay_client(broker: &Broker) -> rdkafka::ClientConfig {
    let mut client = broker.client_config();
    client.remove("group.protocol");
    client.remove("session.timeout.ms");
    client.remove("heartbeat.interval.ms");
    client
}

/// A relay on `engine`'s store, stopped by dropping the answer's sender.
fn relay(
    broker: &Broker,
    engine: &dedup::Engine,
    name: &str,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), dedup::outbox::RelayError>>,
    dedup::outbox::RelayStatsHandle,
) {
    let client = relay_client(broker);
    let config = RelayConfig::default()
        .with_poll(Duration::from_millis(50))
        .with_lease(Duration::from_secs(1));
    let r = OutboxRelay::new(engine.postgres().unwrap(), client, config)
        .unwrap()
        .named(name);
    let stats = r.stats();
    let (tx, rx) = oneshot::channel::<()>();
    let h = tokio::spawn(r.run(async move {
        let _ = rx.await;
    }));
    (tx, h, stats)
}

async fn outbox_a_chain_publishes_each_committed_message_once_and_the_next_consumer_books_it_once(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let (input, output) = (unique("orders"), unique("charged"));
    broker.create_topic(&input, 3).await;
    broker.create_topic(&output, 3).await;
    // 150 events over 100 keys (every third a redelivery), and one poison.
    let mut events: Vec<Event> = (0..150u32)
        .map(|i| event(if i % 3 == 2 { i / 3 } else { i }, 3))
        .collect();
    let mut poison = event(1000, 3);
    poison.payload = r#"{"id":1000,"amount":-1}"#.to_owned();
    events.push(poison);
    let keys: BTreeSet<String> = events
        .iter()
        .filter_map(|e| e.key.clone())
        .filter(|k| k != "evt-1000")
        .collect();
    produce(broker, &input, &events).await;
    let group = unique("a");
    let a = RunningTx::spawn(
        broker.config(&group, &input),
        &pool,
        BatchLedger {
            worker: "a".to_owned(),
            publish_to: Some(output.clone()),
            ..BatchLedger::default()
        },
    )
    .await;
    let (stop1, h1, s1) = relay(broker, &a.engine, "r1");
    let (stop2, h2, s2) = relay(broker, &a.engine, "r2");
    let stats = a.stats.clone();
    eventually(60, "A settled every message", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == 151 }
    })
    .await;
    let relays = RelayStore::new(a.engine.postgres().unwrap().clone());
    eventually(30, "every committed message published", || {
        let relays = relays.clone();
        async move { relays.status().await.unwrap().unpublished == 0 }
    })
    .await;
    let (p1, p2) = (s1.snapshot(), s2.snapshot());
    assert!(p1.leading != p2.leading, "one leader: {p1:?} {p2:?}");
    assert_eq!(
        p1.published + p2.published,
        keys.len() as u64,
        "{p1:?} {p2:?}"
    );
    let letters = read_letters(broker, &output, keys.len()).await;
    let mut idem = BTreeSet::new();
    let mut causes = BTreeSet::new();
    for l in &letters {
        let h: HashMap<&str, &[u8]> = l
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref().unwrap_or_default()))
            .collect();
        let cause = String::from_utf8(h[OUTBOX_CAUSE_KEY].to_vec()).unwrap();
        assert_eq!(h[OUTBOX_CAUSE_SCOPE], a_scope(&group).as_bytes());
        assert_eq!(
            l.key.as_deref(),
            Some(cause.as_bytes()),
            "keyed by the cause"
        );
        let payload: serde_json::Value =
            serde_json::from_slice(l.payload.as_deref().unwrap()).unwrap();
        assert_eq!(payload["charged"], cause.as_str());
        let k = IdempotencyKey::new(Scope::new("next").unwrap(), h[OUTBOX_KEY]).unwrap();
        assert!(k.uuid7_millis().is_some(), "a time-ordered derived key");
        idem.insert(h[OUTBOX_KEY].to_vec());
        causes.insert(cause);
    }
    assert_eq!(
        causes, keys,
        "one message per booked key; none for the poison"
    );
    assert_eq!(idem.len(), keys.len(), "one derived key each");
    // The relay killed between the broker's ack and its position write: set back, it publishes
    // the same messages again, byte for byte.
    let _ = (stop1.send(()), stop2.send(()));
    h1.await.unwrap().unwrap();
    h2.await.unwrap().unwrap();
    sqlx::query(
        "UPDATE dedup_outbox_relay SET position = (SELECT min(xid8)::text || ':' || \
         min(xid8)::text || ':' FROM dedup_outbox)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (stop3, h3, s3) = relay(broker, &a.engine, "r3");
    let unique_keys = keys.len() as u64;
    eventually(30, "the same messages published again", || {
        let s = s3.snapshot();
        async move { s.published == unique_keys }
    })
    .await;
    let twice = read_letters(broker, &output, 2 * keys.len()).await;
    let mut by_key: HashMap<Vec<u8>, Vec<&super::Letter>> = HashMap::new();
    for l in &twice {
        let k = l
            .headers
            .iter()
            .find(|(n, _)| n == OUTBOX_KEY)
            .and_then(|(_, v)| v.clone())
            .unwrap();
        by_key.entry(k).or_default().push(l);
    }
    assert_eq!(by_key.len(), keys.len());
    for (k, copies) in &by_key {
        assert_eq!(copies.len(), 2, "{k:?}");
        assert_eq!(copies[0].payload, copies[1].payload);
        assert_eq!(copies[0].headers, copies[1].headers);
        assert_eq!(copies[0].key, copies[1].key);
    }
    // B: a dedup consumer of the published topic with the default key source (the derived key
    // in `idempotency-key`) books each message once, duplicates dropped with no code.
    let b = RunningTx::spawn(
        broker.config(&unique("b"), &output),
        &pool,
        BatchLedger {
            worker: "b".to_owned(),
            ..BatchLedger::default()
        },
    )
    .await;
    let bstats = b.stats.clone();
    let n = 2 * keys.len() as u64;
    eventually(60, "B settled every copy", || {
        let s = bstats.snapshot();
        async move { s.executed + s.replayed == n }
    })
    .await;
    let sb = b.stop().await;
    assert_eq!(
        (sb.executed, sb.replayed),
        (keys.len() as u64, keys.len() as u64)
    );
    let rows = effect_rows(&pool).await;
    let booked_b: BTreeSet<String> = rows
        .iter()
        .filter(|(_, _, w)| w == "b")
        .map(|(k, _, _)| k.clone())
        .collect();
    assert_eq!(booked_b.len(), keys.len());
    assert_eq!(rows.iter().filter(|(_, _, w)| w == "b").count(), keys.len());
    let _ = stop3.send(());
    h3.await.unwrap().unwrap();
    a.stop().await;
}

/// The scope a consumer of `group` keys under (its group id, by default).
fn a_scope(group: &str) -> String {
    group.to_owned()
}

/// An engine built with `.outbox(..)` runs the relay: its consumer's commits are published, the
/// stats count them. While another holder keeps the lease (a relay paused elsewhere), the rows
/// wait and the health says so; once that lease runs out the engine's relay takes over and
/// publishes them; shutdown lets its lease go.
async fn outbox_an_engines_relay_publishes_its_consumers_commits_and_health_says_when_rows_wait(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let (input, output) = (unique("orders"), unique("charged"));
    broker.create_topic(&input, 2).await;
    broker.create_topic(&output, 2).await;
    // A leader elsewhere holds the lease for a minute (its host paused, say).
    sqlx::query(
        "UPDATE dedup_outbox_relay SET leader = 'elsewhere', epoch = epoch + 1, \
         lease_until = clock_timestamp() + interval '1 minute'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let group = unique("a");
    let settings = broker.config(&group, &input);
    let engine = dedup::Engine::builder()
        .postgres(pool.clone())
        .scope(settings.scope())
        .outbox(
            relay_client(broker),
            RelayConfig::default()
                .with_poll(Duration::from_millis(50))
                .with_lease(Duration::from_secs(1)),
        )
        .build()
        .await
        .unwrap();
    let consumer = super::consumer_for(&engine, &settings)
        .batching(dedup_kafka::Batching::default())
        .build(BatchLedger {
            worker: "a".to_owned(),
            publish_to: Some(output.clone()),
            ..BatchLedger::default()
        })
        .unwrap();
    let stats = consumer.stats();
    let run = tokio::spawn(consumer.run());
    let events: Vec<Event> = (0..20u32).map(|i| event(i, 2)).collect();
    produce(broker, &input, &events).await;
    eventually(60, "A booked all 20", || {
        let s = stats.snapshot();
        async move { s.executed == 20 }
    })
    .await;
    let stall = Duration::from_millis(500);
    eventually(30, "the health says the rows wait", || {
        let h = engine.health(stall);
        async move {
            !h.ready
                && h.outbox_problems
                    .iter()
                    .any(|p| p.contains("unpublished messages has waited"))
        }
    })
    .await;
    assert_eq!(engine.stats().outbox.unwrap().published, 0);
    // The other leader's lease runs out: the engine's relay takes over and publishes.
    sqlx::query("UPDATE dedup_outbox_relay SET lease_until = '-infinity'")
        .execute(&pool)
        .await
        .unwrap();
    let letters = read_letters(broker, &output, 20).await;
    assert_eq!(letters.len(), 20);
    let o = engine.outbox_stats().unwrap();
    assert!(o.leading && o.published == 20, "{o:?}");
    eventually(30, "the health is clear again", || {
        let h = engine.health(Duration::from_secs(30));
        async move { h.outbox_problems.is_empty() }
    })
    .await;
    engine.shutdown().await;
    run.await.unwrap().unwrap();
    let (leader, until_past): (Option<String>, bool) =
        sqlx::query_as("SELECT leader, lease_until < clock_timestamp() FROM dedup_outbox_relay")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(leader.is_some_and(|l| l.starts_with("relay-")));
    assert!(until_past, "shutdown let the lease go");
    assert!(engine.outbox_stats().is_none());
}

/// A transaction open for 60 s elsewhere in the database (it took an id, and queued a message of
/// its own on the outbox) holds nothing back: every message committed meanwhile is acknowledged
/// about as fast as before it opened; its own is published once it commits.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn outbox_a_transaction_open_for_a_minute_leaves_the_commit_to_ack_lag_flat(pool: PgPool) {
    use dedup::outbox::{OutboxMessage, OutboxWriter};
    let broker = Broker::mock();
    broker.create_topic("flat", 1).await;
    let store = dedup_pg::PgStore::new(pool.clone());
    let config = RelayConfig::default()
        .with_poll(Duration::from_millis(50))
        .with_lease(Duration::from_secs(1));
    let r = OutboxRelay::new(&store, relay_client(&broker), config).unwrap();
    let stats = r.stats();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(r.run(async move {
        let _ = rx.await;
    }));
    let mut n = 0u64;
    // Commits one message and answers how long until the relay has it acknowledged.
    let mut one = async || {
        let mut tx = pool.begin().await.unwrap();
        let cause = IdempotencyKey::new(Scope::new("flat").unwrap(), format!("m{n}")).unwrap();
        let mut w = OutboxWriter::new(cause, 1_700_000_000_000);
        w.publish(OutboxMessage::new("flat", format!("m{n}")))
            .unwrap();
        w.write(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        store.wake_outbox();
        let t = tokio::time::Instant::now();
        n += 1;
        while stats.snapshot().published < n {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "message {n} not acknowledged"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        t.elapsed()
    };
    let mut before = Vec::new();
    for _ in 0..20 {
        before.push(one().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The long transaction: an id, and a message of its own queued.
    let mut long = pool.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id()")
        .execute(&mut long)
        .await
        .unwrap();
    let mut w = OutboxWriter::new(
        IdempotencyKey::new(Scope::new("flat").unwrap(), "long").unwrap(),
        1_700_000_000_000,
    );
    w.publish(OutboxMessage::new("flat", "long")).unwrap();
    w.write(&mut long).await.unwrap();
    let opened = tokio::time::Instant::now();
    let mut during = Vec::new();
    while opened.elapsed() < Duration::from_secs(60) {
        during.push(one().await);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sqlx::raw_sql("COMMIT").execute(&mut long).await.unwrap();
    let t = tokio::time::Instant::now();
    while stats.snapshot().published < n + 1 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the long transaction's message"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    let p = |v: &mut Vec<Duration>, q: usize| {
        v.sort_unstable();
        v[(v.len() * q).div_ceil(100).clamp(1, v.len()) - 1]
    };
    let (b50, b_max) = (p(&mut before, 50), p(&mut before, 100));
    let (d50, d99) = (p(&mut during, 50), p(&mut during, 99));
    assert!(during.len() > 150, "{}", during.len());
    eprintln!("before: p50 {b50:?}, max {b_max:?}; during: p50 {d50:?}, p99 {d99:?}");
    // Flat: the median within a few polls of before, and no message waits a second.
    assert!(
        d50 <= b50 + Duration::from_millis(100) && d99 < Duration::from_secs(1),
        "before: p50 {b50:?}, max {b_max:?}; during: p50 {d50:?}, p99 {d99:?}"
    );
}

/// A message the broker refuses for good (its topic does not exist) is kept in
/// `dedup_outbox_dead` with the reason, and stops nothing else: the messages around it are
/// published, and the position moves past it.
async fn outbox_a_message_refused_for_good_is_dead_lettered_and_stops_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    use dedup::outbox::{OutboxMessage, OutboxWriter};
    let topic = unique("kept");
    broker.create_topic(&topic, 1).await;
    let store = dedup_pg::PgStore::new(pool.clone());
    let mut tx = pool.begin().await.unwrap();
    let mut w = OutboxWriter::new(
        IdempotencyKey::new(Scope::new("t").unwrap(), "k").unwrap(),
        1_700_000_000_000,
    );
    for (t, p) in [
        (topic.as_str(), "before"),
        ("no-such-topic-here", "lost"),
        (topic.as_str(), "after"),
    ] {
        w.publish(OutboxMessage::new(t, p)).unwrap();
    }
    w.write(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
    let mut client = relay_client(broker);
    client.set("topic.metadata.propagation.max.ms", "1000");
    client.set("allow.auto.create.topics", "false");
    let config = RelayConfig::default()
        .with_poll(Duration::from_millis(50))
        .with_lease(Duration::from_secs(1));
    let r = OutboxRelay::new(&store, client, config).unwrap();
    let stats = r.stats();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(r.run(async move {
        let _ = rx.await;
    }));
    let letters = read_letters(broker, &topic, 2).await;
    let got: Vec<_> = letters
        .iter()
        .map(|l| String::from_utf8(l.payload.clone().unwrap()).unwrap())
        .collect();
    assert_eq!(got, ["before", "after"]);
    eventually(30, "the refused message kept", || {
        let s = stats.snapshot();
        async move { s.dead_lettered == 1 && s.published == 2 }
    })
    .await;
    let (payload, reason): (Vec<u8>, String) =
        sqlx::query_as("SELECT payload, reason FROM dedup_outbox_dead")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(payload, b"lost");
    assert!(!reason.is_empty());
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    let status = RelayStore::new(store).status().await.unwrap();
    assert_eq!((status.unpublished, status.dead_letters), (0, 1));
}
