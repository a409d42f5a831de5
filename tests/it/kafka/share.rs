//! A fair share of the in-flight bound: under a deep backlog on several partitions, every
//! partition makes progress from the start, instead of the first partition's fetched messages
//! filling `max_in_flight` while the others wait for it to drain.
//!
//! The handler holds every run until a run has started on each of the four partitions (or 30 s
//! have passed): with a fair share all four start at once; without one the first partition's
//! messages hold the whole bound, nothing settles, and the others never start.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{Completion, HandlerError, LeaseContext};
use dedup_kafka::{Batching, Delivery, Ordering as KeyOrdering, StatsHandle};
use rdkafka::mocking::MockCoordinator;
use sqlx::PgPool;
use tokio::sync::Notify;

use super::{
    Broker, Event, Running, Shim, committed_to_the_end, consumer_for, event, eventually, produce,
    setup, unique,
};
use crate::support::RedisServer;

on_brokers!(
    a_deep_backlog_on_four_partitions_runs_all_four_from_the_start,
    lease_a_deep_backlog_on_four_partitions_runs_all_four_from_the_start,
    a_runner_dropped_mid_run_leaves_its_partitions_to_the_next_member,
);

const PARTITIONS: i32 = 4;
const PER_PARTITION: u32 = 100;
const IN_FLIGHT: usize = 40;

/// 400 messages on 4 partitions, all produced before the consumer starts.
async fn backlog(broker: &Broker) -> (String, String) {
    let topic = unique("backlog");
    broker.create_topic(&topic, PARTITIONS).await;
    let events: Vec<Event> = (0..PER_PARTITION * 4)
        .map(|id| {
            let mut e = event(id, PARTITIONS);
            e.message_key = Some(format!("acct-{id}"));
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    (topic, unique("g"))
}

/// Holds runs until every partition has one started.
#[derive(Default)]
struct Gate {
    started: Mutex<HashSet<i32>>,
    open: AtomicBool,
    /// Opened by the wait running out, not by the fourth partition.
    timed_out: AtomicBool,
    notify: Notify,
}

type HandlerFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Completion, HandlerError<String>>> + Send>,
>;

fn gated(
    gate: Arc<Gate>,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    move |d, _lease| {
        let gate = gate.clone();
        Box::pin(async move {
            let all = {
                let mut started = gate.started.lock().unwrap();
                started.insert(d.partition);
                started.len() == PARTITIONS as usize
            };
            if all {
                gate.open.store(true, Ordering::SeqCst);
                gate.notify.notify_waiters();
            }
            if !gate.open.load(Ordering::SeqCst) {
                let wait = gate.notify.notified();
                if !gate.open.load(Ordering::SeqCst)
                    && tokio::time::timeout(Duration::from_secs(30), wait)
                        .await
                        .is_err()
                {
                    gate.timed_out.store(true, Ordering::SeqCst);
                    gate.open.store(true, Ordering::SeqCst);
                    gate.notify.notify_waiters();
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(Completion::store(bytes::Bytes::new()))
        })
    }
}

/// Every message executed, offsets at the end, the four partitions started side by side, and
/// never more than the bound held.
async fn all_four_side_by_side(
    broker: &Broker,
    topic: &str,
    group: &str,
    stats: &StatsHandle,
    gate: &Gate,
) {
    let total = u64::from(PER_PARTITION * 4);
    eventually(120, "every message executed", || {
        let s = stats.snapshot();
        async move { s.executed == total }
    })
    .await;
    committed_to_the_end(broker, group, topic, PARTITIONS).await;
    let s = stats.snapshot();
    assert!(
        !gate.timed_out.load(Ordering::SeqCst),
        "the partitions did not all start while the first ones ran: started {:?}; {s:?}",
        gate.started.lock().unwrap()
    );
    assert!(s.max_held <= IN_FLIGHT as u64, "{s:?}");
}

/// The per-message runner, one message at a time per partition, 40 in flight.
async fn a_deep_backlog_on_four_partitions_runs_all_four_from_the_start(
    broker: &Broker,
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let (topic, group) = backlog(broker).await;
    let gate = Arc::new(Gate::default());
    let config = broker.config(&group, &topic).with_max_in_flight(IN_FLIGHT);
    let run = Running::spawn_with(config, setup(&pool, &redis), gated(gate.clone())).await;
    let stats = run.stats.clone();
    all_four_side_by_side(broker, &topic, &group, &stats, &gate).await;
    run.stop().await;
}

/// The lease-mode batch runner, per-key order (each message its own key), 40 in flight.
async fn lease_a_deep_backlog_on_four_partitions_runs_all_four_from_the_start(
    broker: &Broker,
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let (topic, group) = backlog(broker).await;
    let gate = Arc::new(Gate::default());
    let config = broker
        .config(&group, &topic)
        .with_ordering(KeyOrdering::PerKey)
        .with_max_in_flight(IN_FLIGHT);
    let run = Running::spawn_full(
        config,
        setup(&pool, &redis),
        Some(Batching::new(10, Duration::from_millis(5))),
        gated(gate.clone()),
    )
    .await;
    let stats = run.stats.clone();
    all_four_side_by_side(broker, &topic, &group, &stats, &gate).await;
    run.stop().await;
}

/// A handler that takes a little while and records each message it executed.
fn slow(
    executed: Arc<Mutex<Vec<i64>>>,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    move |d, _lease| {
        let executed = executed.clone();
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            executed
                .lock()
                .unwrap()
                .push(i64::from(d.partition) * 1_000_000 + d.offset);
            Ok(Completion::store(bytes::Bytes::new()))
        })
    }
}

/// A runner whose future is dropped mid-run (a task aborted, a `select!` that lost) leaves no
/// partition task behind holding its consumer: the consumer closes and leaves the group, so a
/// new member of the group gets every partition at once and finishes the stream, each message
/// executed once across the two. With a task left behind, the old consumer would stay in the
/// group, unpolled, holding its partitions until `max.poll.interval.ms` (5 minutes).
async fn a_runner_dropped_mid_run_leaves_its_partitions_to_the_next_member(
    broker: &Broker,
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let (topic, group) = backlog(broker).await;
    let setup = setup(&pool, &redis);
    let executed = Arc::new(Mutex::new(Vec::new()));
    let config = broker.config(&group, &topic).with_max_in_flight(IN_FLIGHT);
    let engine = setup.build(&config).await;
    let first = consumer_for(&engine, &config)
        .build(Shim(slow(executed.clone())))
        .unwrap();
    let first_stats = first.stats();
    let handle = tokio::spawn(first.run());
    eventually(60, "the first runner executed some messages", || {
        let s = first_stats.snapshot();
        async move { s.executed >= 20 }
    })
    .await;
    // Dropped mid-run: no drain, no commit, no goodbye.
    handle.abort();
    assert!(handle.await.unwrap_err().is_cancelled());
    let second = Running::spawn_with(config, setup, slow(executed.clone())).await;
    let total = u64::from(PER_PARTITION * 4);
    // Counted by the handler: the first runner's tasks still running when it was dropped
    // finish their messages, with no loop left to count them in its stats.
    eventually(60, "every message executed across the two runners", || {
        let n = executed.lock().unwrap().len() as u64;
        async move { n >= total }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, PARTITIONS).await;
    let second = second.stop().await;
    let mut ids = executed.lock().unwrap().clone();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), n, "a message was executed twice");
    assert_eq!(n as u64, total, "{second:?}");
}

/// A partition whose first fetch answers late (its leader's round trip is 1.5 s, the others'
/// none) still gets its share: a partition newly assigned counts as having work until its queue
/// first answers, so the partitions whose data came first do not take the whole bound meanwhile.
/// (A loaded machine delays a first fetch the same way; counting a partition for a fixed half
/// second after its assignment lost this race.) The mock cluster only: it sets a broker's
/// round trip.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_partition_whose_first_fetch_answers_late_still_gets_its_share(pool: PgPool) {
    let broker = Broker::mock_of(2);
    let (topic, group) = backlog(&broker).await;
    if let Broker::Mock(cluster) = &broker {
        cluster
            .coordinator(MockCoordinator::Group(group.clone()), 1)
            .unwrap();
        for p in 0..PARTITIONS - 1 {
            cluster.partition_leader(&topic, p, Some(1)).unwrap();
        }
        cluster
            .partition_leader(&topic, PARTITIONS - 1, Some(2))
            .unwrap();
        cluster
            .broker_round_trip_time(2, Duration::from_millis(1500))
            .unwrap();
    }
    let redis = RedisServer::start();
    let gate = Arc::new(Gate::default());
    let config = broker.config(&group, &topic).with_max_in_flight(IN_FLIGHT);
    let run = Running::spawn_with(config, setup(&pool, &redis), gated(gate.clone())).await;
    let stats = run.stats.clone();
    all_four_side_by_side(&broker, &topic, &group, &stats, &gate).await;
    run.stop().await;
}
