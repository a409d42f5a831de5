//! Why a partition is paused is a set of reasons, and a partition resumes only when none holds
//! it: blocked lanes at `max_blocked` and a full parked queue on one partition do not undo each
//! other, whichever lets go first. Seen from outside: a partition still held by one reason
//! fetches nothing new (`received` stays put) after the other reason let go.

use std::sync::atomic::Ordering;
use std::time::Duration;

use dedup_core::Store;
use dedup_kafka::{AfterGiveUp, Ordering as KeyOrdering, StatsHandle};
use dedup_pg::PgStore;
use sqlx::PgPool;

use super::blocked::hold;
use super::parked::{
    Scene, booked_of, keyed, parking, parking_engine, scene, spawn_parking_config, until_booked,
};
use super::settings::Settings;
use super::{Broker, committed_to_the_end, eventually, produce};

on_brokers!(
    blocked_lanes_draining_leave_a_partition_whose_parked_queue_is_full_paused,
    parked_room_coming_back_leaves_a_partition_with_blocked_lanes_at_the_bound_paused,
);

/// One partition held for both reasons: `held-1..3` of account `acct-h` blocked behind a key
/// held elsewhere (three blocked messages, at `max_blocked` 2), and `bad-1`, `bad-2` of account
/// `acct-bad`, whose service is down, parked with room for one message per key (so `bad-2` waits
/// for room). Answers the lease held elsewhere and the stats once both reasons hold.
async fn both_reasons(
    broker: &Broker,
    pool: &PgPool,
    scene: &Scene,
) -> (dedup_core::Lease, StatsHandle, super::Running) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene;
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    let lease = hold(pool, group, "held-1").await;
    produce(
        broker,
        topic,
        &[
            keyed("held-1", "acct-h"),
            keyed("held-2", "acct-h"),
            keyed("held-3", "acct-h"),
            keyed("bad-1", "acct-bad"),
            keyed("bad-2", "acct-bad"),
            keyed("ok-1", "acct-ok"),
        ],
    )
    .await;
    let config: Settings = broker
        .config(group, topic)
        .with_ordering(KeyOrdering::PerKey)
        .with_dead_letter_topic(format!("{topic}.dlq"))
        .with_max_blocked(2);
    let dedup = parking_engine(pool, redis, 1000);
    let running = spawn_parking_config(
        config,
        pool,
        dedup,
        switches,
        parking(AfterGiveUp::Proceed).with_bounds(1, 100),
    )
    .await;
    let stats = running.stats.clone();
    eventually(60, "blocked at the bound and the parked queue full", || {
        let s = stats.snapshot();
        async move { s.blocked_pauses >= 1 && s.park_full >= 1 && s.received == 6 }
    })
    .await;
    eventually(30, "ok-1 booked", || async move {
        booked_of(pool, "acct-ok").await == ["ok-1"]
    })
    .await;
    (lease, stats, running)
}

/// Produces `n` more messages of `account` and checks, after a while, that none was fetched.
async fn nothing_fetched(broker: &Broker, topic: &str, stats: &StatsHandle, account: &str) {
    let before = stats.snapshot().received;
    let events: Vec<_> = (1..=20)
        .map(|i| keyed(&format!("{account}-late-{i}"), account))
        .collect();
    produce(broker, topic, &events).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s = stats.snapshot();
    assert_eq!(
        s.received, before,
        "the partition was resumed while a reason still held it: {s:?}"
    );
}

/// The blocked lanes drain first (the holder completes): the full parked queue still holds the
/// partition, so messages produced now are not fetched (before, the blocked lanes' resume let
/// them pile up behind the waiting message). Once the parked key drains, all of it runs.
async fn blocked_lanes_draining_leave_a_partition_whose_parked_queue_is_full_paused(
    broker: &Broker,
    pool: PgPool,
) {
    let scene = scene(broker, &pool).await;
    let (lease, stats, running) = both_reasons(broker, &pool, &scene).await;
    PgStore::new(pool.clone())
        .complete(&lease, b"theirs")
        .await
        .unwrap();
    eventually(60, "held-1 replayed, held-2 and held-3 booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-h").await == ["held-2", "held-3"] }
    })
    .await;
    nothing_fetched(broker, &scene.topic, &stats, "acct-late").await;
    scene.switches.open.store(true, Ordering::SeqCst);
    // ok-1, held-2, held-3, bad-1, bad-2 and the 20 late ones.
    until_booked(&pool, 25).await;
    assert_eq!(booked_of(&pool, "acct-bad").await, ["bad-1", "bad-2"]);
    running.stop().await;
    committed_to_the_end(broker, &scene.group, &scene.topic, 1).await;
}

/// The parked queue drains first (the service comes back): the blocked lanes at their bound
/// still hold the partition, so more messages of the blocked account are not fetched (before,
/// letting the waiting message in resumed the partition and they piled up in the blocked lane
/// past `max_blocked`). Once the holder completes, all of it runs.
async fn parked_room_coming_back_leaves_a_partition_with_blocked_lanes_at_the_bound_paused(
    broker: &Broker,
    pool: PgPool,
) {
    let scene = scene(broker, &pool).await;
    let (lease, stats, running) = both_reasons(broker, &pool, &scene).await;
    scene.switches.open.store(true, Ordering::SeqCst);
    eventually(60, "bad-1 and bad-2 booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-bad").await == ["bad-1", "bad-2"] }
    })
    .await;
    nothing_fetched(broker, &scene.topic, &stats, "acct-h").await;
    assert!(stats.snapshot().max_blocked <= 3, "{:?}", stats.snapshot());
    PgStore::new(pool.clone())
        .complete(&lease, b"theirs")
        .await
        .unwrap();
    // ok-1, bad-1, bad-2, held-2, held-3 and the 20 late ones.
    until_booked(&pool, 25).await;
    running.stop().await;
    committed_to_the_end(broker, &scene.group, &scene.topic, 1).await;
}
