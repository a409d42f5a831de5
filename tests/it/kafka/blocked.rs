//! Messages blocked on another holder's live lease (a key a dead process left in flight, or one
//! another consumer runs): they wait outside the in-flight bound, their lane behind them, and
//! other lanes keep flowing; past `max_blocked` only the blocked partitions pause.

use std::time::Duration;

use dedup_core::{ClaimRequest, OwnerId, Policy, Store};
use dedup_kafka::Ordering as KeyOrdering;
use dedup_pg::PgStore;
use sqlx::PgPool;

use super::{
    Broker, Event, Running, assert_one_row_per_key, committed_to_the_end, event, eventually,
    produce, setup, unique,
};
use crate::support::{RedisServer, acquired, effects_table, key_in};

on_brokers!(
    a_held_key_frees_its_in_flight_slot_and_other_keys_flow_past_it,
    past_the_blocked_bound_only_the_blocked_partition_pauses,
);

/// Claims `name` in `group`'s scope as another holder would, with a ten-minute lease.
pub(super) async fn hold(pool: &PgPool, group: &str, name: &str) -> dedup_core::Lease {
    let req = ClaimRequest::new(key_in(group, name), OwnerId::new("elsewhere#1"))
        .with_policy(Policy::default().with_lease(Duration::from_secs(600)));
    acquired(PgStore::new(pool.clone()).claim(&req).await.unwrap())
}

fn keyed(name: &str, account: &str, partition: i32) -> Event {
    let mut e = event(0, 1);
    e.key = Some(name.to_owned());
    e.message_key = Some(account.to_owned());
    e.partition = partition;
    e
}

async fn ledger_has(pool: &PgPool, key: &str) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
        > 0
}

/// With one message in flight allowed, a key held elsewhere would stop the consumer for the
/// holder's ten-minute lease; instead it leaves the bound, the 40 other accounts run past it,
/// and the held account's later message waits behind it. Once the holder completes, the key is
/// replayed and the account's next message runs after it.
async fn a_held_key_frees_its_in_flight_slot_and_other_keys_flow_past_it(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("blocked");
    broker.create_topic(&topic, 1).await;
    let group = unique("g");
    let lease = hold(&pool, &group, "held-1").await;
    let mut events = vec![keyed("held-1", "acct-h", 0)];
    events.extend((1..=40).map(|i| keyed(&format!("evt-{i}"), &format!("acct-{i}"), 0)));
    events.push(keyed("held-2", "acct-h", 0));
    produce(broker, &topic, &events).await;

    let config = broker
        .config(&group, &topic)
        .with_ordering(KeyOrdering::PerKey)
        .with_max_in_flight(1);
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(60, "the 40 other accounts booked", || {
        let s = stats.snapshot();
        async move { s.executed == 40 }
    })
    .await;
    let s = stats.snapshot();
    assert!(s.blocked >= 1, "{s:?}");
    assert_eq!(s.max_held, 1, "the in-flight bound held: {s:?}");
    assert!(
        s.max_blocked >= 2,
        "the held account's later message waited in its blocked lane: {s:?}"
    );
    assert!(!ledger_has(&pool, "held-2").await, "held-2 overtook held-1");

    PgStore::new(pool.clone())
        .complete(&lease, b"theirs")
        .await
        .unwrap();
    eventually(60, "held-1 replayed and held-2 booked after it", || {
        let s = stats.snapshot();
        async move { s.replayed == 1 && s.executed == 41 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    let s = run.stop().await;
    assert_eq!(s.dead_lettered, 0, "{s:?}");
    assert_one_row_per_key(
        &pool,
        (1..=40)
            .map(|i| format!("evt-{i}"))
            .chain(["held-2".to_owned()]),
    )
    .await;
    assert!(!ledger_has(&pool, "held-1").await, "held-1 ran twice");
}

/// Per-partition order: partition 0 is blocked behind a held key, and its later messages fill
/// the blocked bound of 5; partition 0 is then paused while partition 1 books all of its own.
async fn past_the_blocked_bound_only_the_blocked_partition_pauses(broker: &Broker, pool: PgPool) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("blocked");
    broker.create_topic(&topic, 2).await;
    let group = unique("g");
    let lease = hold(&pool, &group, "held-p").await;
    let mut events = vec![keyed("held-p", "a", 0)];
    events.extend((0..60u32).map(|i| event(i, 2)));
    produce(broker, &topic, &events).await;

    let config = broker.config(&group, &topic).with_max_blocked(5);
    let run = Running::spawn(config, setup(&pool, &redis), "a").await;
    let stats = run.stats.clone();
    eventually(
        60,
        "partition 1 booked while partition 0 is blocked",
        || {
            let s = stats.snapshot();
            async move { s.executed == 30 && s.blocked_pauses > 0 }
        },
    )
    .await;
    for i in (0..60).step_by(2) {
        assert!(!ledger_has(&pool, &format!("evt-{i}")).await, "evt-{i} ran");
    }
    let s = stats.snapshot();
    assert!(s.max_blocked >= 5, "{s:?}");

    PgStore::new(pool.clone())
        .complete(&lease, b"theirs")
        .await
        .unwrap();
    eventually(60, "partition 0 resumed and booked", || {
        let s = stats.snapshot();
        async move { s.replayed == 1 && s.executed == 60 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 2).await;
    let s = run.stop().await;
    assert_eq!(s.dead_lettered, 0, "{s:?}");
    assert_one_row_per_key(&pool, (0..60).map(|i| format!("evt-{i}"))).await;
}
