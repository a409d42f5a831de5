//! The kill switch: a handler that fails everything for a while (a dropped table, a revoked
//! credential), then recovers. Past the threshold the runner stops taking messages and runs no
//! handler for the pause, probes, and once the handler works again settles everything, each
//! key's effect once, offsets to the end. In transaction mode it withdraws failures instead of
//! recording them (the effect rolled back), so the stream is not dead-lettered; in lease mode,
//! whose effect is outside, it withdraws nothing: a failure keeps its record and attempt, and a
//! final one is held until the switch closes, never run again. The same scenario runs in every
//! mode (here per message; the batch modes in `lease.rs` and `tx.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dedup_core::{HandlerError, LeaseContext};
use dedup_kafka::{Delivery, KillSwitch, Ordering as KeyOrdering, StatsHandle};
use dedup_pg::PgStore;
use sqlx::PgPool;
use tokio::time::sleep;

use super::settings::Settings;
use super::{
    Broker, Event, HandlerFuture, Running, committed_to_the_end, event, eventually, ledger_handler,
    produce, setup, unique,
};
use crate::support::{RedisServer, effect_rows, effects_table};

on_brokers!(
    a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing,
    a_lease_handler_whose_effect_is_made_before_it_fails_never_runs_it_again_for_the_switch,
    poison_alone_on_its_partition_is_held_no_longer_than_a_pause,
);

/// Messages in the outage scenario.
pub(super) const MESSAGES: u32 = 200;
/// Partitions of its topic.
pub(super) const PARTITIONS: i32 = 4;

/// The switch the scenario runs under: a 2 s pause, suspect after 2 failures in a row, open at
/// half of the last 20 outcomes with at least 5 failures.
pub(super) fn switch() -> KillSwitch {
    KillSwitch::new(0.5, Duration::from_secs(2)).with_thresholds(20, 5, 2)
}

/// The scenario's topic (4 partitions, 200 events of distinct keys and accounts), group and
/// configuration (per-key order, the switch on).
pub(super) async fn stream(broker: &Broker) -> (String, String, Settings) {
    let topic = unique("outage");
    broker.create_topic(&topic, PARTITIONS).await;
    let events: Vec<Event> = (0..MESSAGES)
        .map(|id| {
            let mut e = event(id, PARTITIONS);
            e.message_key = Some(format!("acct-{id}"));
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker
        .config(&group, &topic)
        .with_ordering(KeyOrdering::PerKey)
        .with_kill_switch(switch());
    (topic, group, config)
}

/// A ledger handler that fails every message permanently while `broken` reads true, counting
/// its calls.
pub(super) fn breakable(
    store: PgStore,
    broken: Arc<AtomicBool>,
    calls: Arc<AtomicU64>,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    let ledger = ledger_handler(store, "ks");
    move |d, lease| {
        calls.fetch_add(1, Ordering::SeqCst);
        if broken.load(Ordering::SeqCst) {
            return Box::pin(async {
                Err(HandlerError::Permanent(
                    "relation \"effects\" does not exist".to_owned(),
                ))
            });
        }
        ledger(d, lease)
    }
}

/// Drives the outage against a running consumer and checks what it must leave: the switch
/// opens, no handler runs while it is open, a failed probe opens it again; once the handler is
/// fixed every message settles, no key left FAILED that was not dead-lettered, each other key's
/// effect once, and offsets committed to the end. In transaction mode (`lease` false) at most a
/// few dead letters (the failure before the switch grew suspect), the rest withdrawn; in lease
/// mode nothing withdrawn, the failures held, and no key's handler run twice.
#[allow(clippy::too_many_arguments)]
pub(super) async fn outage(
    broker: &Broker,
    pool: &PgPool,
    topic: &str,
    group: &str,
    stats: &StatsHandle,
    broken: &AtomicBool,
    calls: &AtomicU64,
    lease: bool,
) {
    eventually(60, "the switch open", || {
        let s = stats.snapshot();
        async move { s.kill_switch_trips >= 1 && s.kill_switch_open == 1 }
    })
    .await;
    // Runs already past their claim when it opened finish; then no handler starts.
    sleep(Duration::from_millis(300)).await;
    let (trips, before) = (
        stats.snapshot().kill_switch_trips,
        calls.load(Ordering::SeqCst),
    );
    sleep(Duration::from_millis(1000)).await;
    let s = stats.snapshot();
    if s.kill_switch_trips == trips && s.kill_switch_open == 1 {
        assert_eq!(
            calls.load(Ordering::SeqCst),
            before,
            "a handler ran while the switch was open: {s:?}"
        );
    }
    // In transaction mode every failure was withdrawn and its message runs again: a probe.
    // In lease mode a message that ran is never run again for the switch, and where every
    // message had run before it opened (each key its own lane) nothing is left to probe with.
    if !lease {
        eventually(60, "a failed probe opening it again", || {
            let s = stats.snapshot();
            async move { s.kill_switch_trips >= 2 }
        })
        .await;
    }
    broken.store(false, Ordering::SeqCst);
    eventually(90, "every message settled after the fix", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == u64::from(MESSAGES) }
    })
    .await;
    committed_to_the_end(broker, group, topic, PARTITIONS).await;
    let s = stats.snapshot();
    if lease {
        // Every failure recorded as it was (after the switch closed), none run again: the
        // handler broke with permanent failures, so each key ran exactly once.
        assert_eq!(s.kill_switch_withdrawn, 0, "{s:?}");
        assert!(s.kill_switch_held >= 1, "{s:?}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            u64::from(MESSAGES),
            "a key's handler ran again: {s:?}"
        );
    } else {
        // The failure before the switch grew suspect, and runs that read the handler broken
        // just as it was fixed, after a probe had closed the switch.
        assert!(s.dead_lettered <= 3, "the stream was dead-lettered: {s:?}");
        assert!(s.kill_switch_withdrawn >= 1, "{s:?}");
    }
    // Runs started while it probed may all have settled while a last failure held it open:
    // it shuts once that pause is over.
    eventually(30, "the switch shut", || {
        let s = stats.snapshot();
        async move { s.kill_switch_open == 0 }
    })
    .await;
    let failed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE state = 'failed'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        u64::try_from(failed).unwrap(),
        s.dead_lettered,
        "keys left FAILED that were not dead-lettered: {s:?}"
    );
    let mut rows: BTreeMap<String, usize> = BTreeMap::new();
    for (k, _, _) in effect_rows(pool).await {
        *rows.entry(k).or_default() += 1;
    }
    assert!(rows.values().all(|n| *n == 1), "a key's effect twice");
    assert_eq!(
        rows.len() as u64,
        u64::from(MESSAGES) - s.dead_lettered,
        "{s:?}"
    );
}

async fn a_handler_that_fails_everything_for_a_while_trips_the_switch_and_loses_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let (topic, group, config) = stream(broker).await;
    let dedup = setup(&pool, &redis);
    let store = dedup.pg();
    let (broken, calls) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicU64::new(0)));
    let run = Running::spawn_with(
        config,
        dedup,
        breakable(store, broken.clone(), calls.clone()),
    )
    .await;
    let stats = run.stats.clone();
    outage(broker, &pool, &topic, &group, &stats, &broken, &calls, true).await;
    run.stop().await;
}

/// A lease-mode handler that makes its effect (a row written outside the record's transaction)
/// and then fails while "broken": even keys permanently, odd ones retryably. A withdrawal would
/// give the key back as if its run had not happened, and every probe would make the effect
/// again; instead a failure keeps its record and attempt: at most one row for an even key, at
/// most the attempt limit for an odd one, across the switch opening and closing.
async fn a_lease_handler_whose_effect_is_made_before_it_fails_never_runs_it_again_for_the_switch(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let (topic, group, config) = stream(broker).await;
    let max = 3;
    let dedup = setup(&pool, &redis).with_policy(
        dedup_core::Policy::default()
            .with_lease(Duration::from_secs(5))
            .with_max_attempts(max),
    );
    let store = dedup.pg();
    let broken = Arc::new(AtomicBool::new(true));
    let handler = {
        let broken = broken.clone();
        move |d: Arc<Delivery>, _: Option<LeaseContext>| -> HandlerFuture {
            let (store, broken) = (store.clone(), broken.clone());
            Box::pin(async move {
                let key = d
                    .header("idempotency-key")
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default();
                // The effect, outside: it stands whatever the handler answers next.
                sqlx::query("INSERT INTO effects VALUES ($1, 0, 'outside')")
                    .bind(&key)
                    .execute(store.pool())
                    .await
                    .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                if broken.load(Ordering::SeqCst) {
                    let odd = key.bytes().last().is_some_and(|b| b % 2 == 1);
                    let why = "the provider's reply could not be read".to_owned();
                    return Err(if odd {
                        HandlerError::Retryable(why)
                    } else {
                        HandlerError::Permanent(why)
                    });
                }
                Ok(dedup_core::Completion::store(bytes::Bytes::new()))
            })
        }
    };
    let run = Running::spawn_with(config, dedup, handler).await;
    let stats = run.stats.clone();
    eventually(60, "the switch open", || {
        let s = stats.snapshot();
        async move { s.kill_switch_trips >= 1 }
    })
    .await;
    eventually(60, "a failed probe opening it again", || {
        let s = stats.snapshot();
        async move { s.kill_switch_trips >= 2 }
    })
    .await;
    broken.store(false, Ordering::SeqCst);
    eventually(120, "every message settled after the fix", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == u64::from(MESSAGES) }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, PARTITIONS).await;
    run.stop().await;
    let s = stats.snapshot();
    let mut rows: BTreeMap<String, u32> = BTreeMap::new();
    for (k, _, _) in effect_rows(&pool).await {
        *rows.entry(k).or_default() += 1;
    }
    assert_eq!(rows.len(), MESSAGES as usize, "{s:?}");
    for (key, n) in &rows {
        let odd = key.bytes().last().is_some_and(|b| b % 2 == 1);
        let most = if odd { max } else { 1 };
        assert!(
            *n <= most,
            "{key}'s effect made {n} times (at most {most}): {s:?}"
        );
    }
    assert_eq!(s.kill_switch_withdrawn, 0, "{s:?}");
    // No key FAILED that was not dead-lettered.
    let failed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE state = 'failed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(u64::try_from(failed).unwrap(), s.dead_lettered, "{s:?}");
}

/// Two poison messages in a row on a partition under per-partition order (the default): the
/// second's failure is final while the switch is suspect, and nothing else on its partition can
/// run to close the switch. It is held for at most a pause of quiet, then recorded and
/// dead-lettered, and the partition goes on: never a partition stopped for good.
async fn poison_alone_on_its_partition_is_held_no_longer_than_a_pause(
    broker: &Broker,
    pool: PgPool,
) {
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("poison");
    broker.create_topic(&topic, 1).await;
    let events: Vec<Event> = (0..12u32)
        .map(|id| {
            let mut e = event(id, 1);
            if id < 2 {
                e.payload = format!(r#"{{"id":{id},"amount":-1}}"#);
            }
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let config = broker.config(&group, &topic).with_kill_switch(switch());
    let dedup = setup(&pool, &redis);
    let store = dedup.pg();
    let run = Running::spawn_with(config, dedup, ledger_handler(store, "ks")).await;
    let stats = run.stats.clone();
    eventually(60, "every message settled", || {
        let s = stats.snapshot();
        async move { s.executed + s.replayed + s.dead_lettered == 12 }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    run.stop().await;
    let s = stats.snapshot();
    assert_eq!((s.executed, s.dead_lettered), (10, 2), "{s:?}");
    assert!(s.kill_switch_held >= 1, "{s:?}");
    assert_eq!(s.kill_switch_withdrawn, 0, "{s:?}");
}
