//! Recovery after a crash, with consumer processes killed with SIGKILL on a nisshi broker process:
//! the kill loop (with a Redis flush and a Postgres crash in it), and the recovery measurement
//! that docs/RECOVERY.md quotes (`scripts/recovery`, ignored in the ordinary run).
//!
//! The kill loop, with a Postgres and a Redis of the test's own: a stream with redeliveries
//! produced in six parts while `dedup-consume-and-die` processes (one identity; partition order,
//! key order, lease mode by the batch in key order, and transaction mode with offsets in the
//! transaction, in turn) are SIGKILLed twelve times at seeded random moments (every fourth while
//! it joins), Redis flushed under one and Postgres crashed in immediate mode and restarted under
//! another; a last process runs to the end: one ledger row per key and the group's offsets
//! committed at the end of every partition. `measure_recovery_after_sigkill` is the measurement.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use super::{
    Broker, Event, assert_one_row_per_key, committed_to_the_end_within, consumer_args_for, event,
    produce, unique,
};
use crate::support::{PgServer, RedisServer, effects_table};

/// A seeded generator for the kill moments and the redeliveries (the same run every time).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// A count from the test's own Postgres, or None while it is down (it is crashed on purpose).
async fn count(pool: &PgPool, sql: &'static str) -> Option<i64> {
    sqlx::query_scalar(sql).fetch_one(pool).await.ok()
}

/// A pool on a Postgres of the test's own, migrated, with the `effects` table.
async fn own_postgres(pg: &PgServer) -> PgPool {
    let pool = pg.migrated_pool().await;
    effects_table(&pool).await;
    pool
}

/// The kill loop: a stream with redeliveries, produced in six parts while consumer processes are
/// started and killed with SIGKILL twelve times at random moments of their work (a few before
/// they settled anything), in four ways of consuming (one message at a time in partition
/// order, in key order, lease mode by the batch in key order (rounds 4 and 8, the first under
/// the Redis flush), and transaction mode by the batch with offsets in the transaction), all
/// under one instance identity, so each restart adopts what the last one left in flight. Redis
/// is flushed under one of them, and Postgres is crashed (`pg_ctl stop -m immediate`) and
/// started again under another. A last process runs to the end: one ledger row per key, and the
/// group's committed offsets at the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_loop_with_a_redis_flush_and_a_postgres_crash_loses_and_doubles_nothing() {
    kill_loop(false).await;
}

/// The kill loop over `dedup_records` partitioned by `kt` (docs/ARCHITECTURE.md, invariant 36),
/// with the tests' stand-in mapping (`support::partition_records`), which spreads the loop's
/// keys over three partitions of days and the untimed one: every way of consuming writes each
/// record where its lookups look, through the kills, the flush and the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kill_loop_over_the_partitioned_records_loses_and_doubles_nothing() {
    kill_loop(true).await;
}

async fn kill_loop(partitioned: bool) {
    const KILLS: u32 = 12;
    const PARTS: u32 = 6;
    const PART: u32 = 300;
    let pg = PgServer::start();
    let pool = own_postgres(&pg).await;
    if partitioned {
        crate::support::partition_records(&pool).await;
    }
    let redis = RedisServer::start();
    let broker = Broker::nisshi();
    let topic = unique("loop");
    broker.create_topic(&topic, 4).await;
    let group = unique("g");
    let instance = unique("node");
    let mut rng = Lcg(0x5eed_0001);

    // Each part: 300 new events and 100 redeliveries of earlier ones (same key, same payload).
    let parts: Vec<Vec<Event>> = (0..PARTS)
        .map(|p| {
            let mut part: Vec<Event> = (p * PART..(p + 1) * PART).map(|i| event(i, 4)).collect();
            for _ in 0..100 {
                let upto = u64::from((p + 1) * PART);
                part.push(event(u32::try_from(rng.below(upto)).unwrap(), 4));
            }
            part
        })
        .collect();
    let keys: Vec<String> = (0..PARTS * PART).map(|i| format!("evt-{i}")).collect();

    let spawn = |round: u32| -> Child {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"));
        c.args(consumer_args_for(
            &broker,
            &group,
            &topic,
            &pg.url(),
            &redis,
        ))
        .env("DEDUP_INSTANCE", &instance)
        .env("DEDUP_COMMIT_MS", "300")
        .env("DEDUP_HANDLER_MS", "10")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true);
        match round % 4 {
            // Lease mode by the batch, in key order.
            _ if round == 4 || round == 8 => {
                c.env("DEDUP_ORDERING", "per-key")
                    .env("DEDUP_LEASE_BATCH", "1");
            }
            1 => {
                c.env("DEDUP_ORDERING", "per-key");
            }
            3 => {
                c.env("DEDUP_TX_DELAY_MS", "20")
                    .env("DEDUP_TX_OFFSETS", "1");
            }
            _ => {}
        }
        c.spawn().unwrap()
    };
    let effects = || count(&pool, "SELECT count(*) FROM effects");

    let mut produced = 0;
    let mut kills = 0;
    for round in 0..KILLS {
        if round % 2 == 0 && produced < parts.len() {
            produce(&broker, &topic, &parts[produced]).await;
            produced += 1;
        }
        let before = loop {
            if let Some(n) = effects().await {
                break n;
            }
            sleep(Duration::from_millis(100)).await;
        };
        let mut child = spawn(round);
        // Every fourth process is killed while it joins the group, before it settled anything;
        // the others once they have booked something of their own (or after 30 s without).
        if round % 4 != 2 {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline && effects().await.is_none_or(|n| n <= before) {
                sleep(Duration::from_millis(20)).await;
            }
        }
        match round {
            4 => {
                let mut c = redis.client().await;
                let _: () = dedup_redis::redis::cmd("FLUSHALL")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            7 => {
                pg.crash();
                sleep(Duration::from_millis(500)).await;
                pg.start_again();
            }
            _ => {}
        }
        sleep(Duration::from_millis(rng.below(1500))).await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "consumer {round} exited by itself"
        );
        child.kill().await.unwrap(); // SIGKILL
        child.wait().await.unwrap();
        kills += 1;
    }
    while produced < parts.len() {
        produce(&broker, &topic, &parts[produced]).await;
        produced += 1;
    }
    assert!(kills >= 10);

    // The last one runs to the end.
    let mut last = spawn(0);
    committed_to_the_end_within(&broker, &group, &topic, 4, 240).await;
    last.kill().await.unwrap();
    last.wait().await.unwrap();
    assert_one_row_per_key(&pool, keys).await;
    // The kills landed inside effects: keys were taken over under a second attempt.
    let again = count(
        &pool,
        "SELECT count(*) FROM dedup_records WHERE state = 'completed' AND attempts > 1",
    )
    .await
    .unwrap();
    assert!(again > 0, "no kill left a key in flight");
    if partitioned {
        assert_eq!(crate::support::misplaced_records(&pool).await, 0);
        let spread = crate::support::records_by_partition(&pool).await;
        assert_eq!(spread.len(), 4, "{spread:?}");
    }
}

/// One progress line of a consumer process: `tick <unix ms> <assigned> <settled> <executed>
/// <blocked>`.
#[derive(Clone, Copy, Debug)]
struct Tick {
    at: u128,
    assigned: u64,
    settled: u64,
    executed: u64,
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// A consumer process printing its progress, and the lines it printed so far.
struct Watched {
    child: Child,
    ticks: Arc<Mutex<Vec<Tick>>>,
    spawned: u128,
}

impl Watched {
    fn spawn(mut command: Command) -> Self {
        let spawned = now_ms();
        let mut child = command
            .env("DEDUP_REPORT", "1")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let ticks = Arc::new(Mutex::new(Vec::new()));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let sink = Arc::clone(&ticks);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let f: Vec<&str> = line.split(' ').collect();
                if let ["tick", at, assigned, settled, executed, _blocked] = f.as_slice() {
                    sink.lock().unwrap().push(Tick {
                        at: at.parse().unwrap(),
                        assigned: assigned.parse().unwrap(),
                        settled: settled.parse().unwrap(),
                        executed: executed.parse().unwrap(),
                    });
                }
            }
        });
        Self {
            child,
            ticks,
            spawned,
        }
    }

    fn ticks(&self) -> Vec<Tick> {
        self.ticks.lock().unwrap().clone()
    }

    /// When its partitions were first assigned.
    fn assigned_at(&self) -> Option<u128> {
        self.ticks().iter().find(|t| t.assigned > 0).map(|t| t.at)
    }

    /// Messages settled per second over the second before each tick, from the first tick one
    /// second after `from` on.
    fn rates(&self, from: u128) -> Vec<(u128, f64)> {
        let ticks = self.ticks();
        let mut out = Vec::new();
        let mut j = 0;
        for t in ticks.iter().filter(|t| t.at >= from + 1000) {
            while ticks[j + 1].at <= t.at - 1000 {
                j += 1;
            }
            #[allow(clippy::cast_precision_loss)]
            let r = (t.settled - ticks[j].settled) as f64 * 1000.0 / (t.at - ticks[j].at) as f64;
            out.push((t.at, r));
        }
        out
    }
}

/// What one recovery showed, in milliseconds from the restarted process's assignment.
#[derive(Debug)]
struct Recovery {
    /// Steady rate of the killed process (settled/s).
    steady: f64,
    /// Keys the killed process left in flight (live leases).
    left: usize,
    /// From spawn to assignment (the group's rebalance).
    join: u128,
    first_settled: Option<u128>,
    first_executed: Option<u128>,
    /// Until every key left in flight was completed.
    left_done: Option<u128>,
    /// Until the rate over one second reached 90% of the steady rate.
    full_rate: Option<u128>,
}

/// The keys of a scope under a live lease.
const LIVE_LEASES: &str = "SELECT key FROM dedup_records \
     WHERE scope = $1 AND state = 'in_progress' AND lease_until > now()";

/// Kills a consumer after a steady run and measures its successor (see docs/RECOVERY.md). Keys
/// live in the group's scope, so each run counts only its own.
async fn recover(
    broker: &Broker,
    pg: &PgServer,
    pool: &PgPool,
    redis: &RedisServer,
    ordering: &str,
    identity: bool,
) -> Recovery {
    let topic = unique("rec");
    broker.create_topic(&topic, 4).await;
    // A backlog that outlasts both processes: 64 accounts (the Kafka message key) over 4
    // partitions.
    let events: Vec<Event> = (0..60_000)
        .map(|i| {
            let mut e = event(i, 4);
            e.message_key = Some(format!("acct-{}", i % 64));
            e
        })
        .collect();
    produce(broker, &topic, &events).await;
    let group = unique("g");
    let instance = unique("node");
    let command = || {
        let mut c = Command::new(consumer_bin());
        c.args(consumer_args_for(broker, &group, &topic, &pg.url(), redis))
            .env("DEDUP_COMMIT_MS", "1000")
            .env("DEDUP_HANDLER_MS", "20")
            .env("DEDUP_ORDERING", ordering);
        if identity {
            // The engine's identity only: the measurement is of adoption, not of the broker's
            // static membership.
            c.env("DEDUP_INSTANCE", &instance).env("DEDUP_STATIC", "0");
        }
        c
    };

    let mut first = Watched::spawn(command());
    let deadline = Instant::now() + Duration::from_secs(120);
    let started = loop {
        if let Some(t) = first.ticks().iter().find(|t| t.settled > 0) {
            break t.at;
        }
        assert!(
            Instant::now() < deadline,
            "the first consumer settled nothing"
        );
        sleep(Duration::from_millis(50)).await;
    };
    while now_ms() < started + 6000 {
        sleep(Duration::from_millis(50)).await;
    }
    let rates = first.rates(started + 2000);
    #[allow(clippy::cast_precision_loss)]
    let steady = rates.iter().map(|r| r.1).sum::<f64>() / rates.len().max(1) as f64;
    first.child.kill().await.unwrap();
    first.child.wait().await.unwrap();
    let left_keys: Vec<Vec<u8>> = sqlx::query_scalar(LIVE_LEASES)
        .bind(&group)
        .fetch_all(pool)
        .await
        .unwrap();
    let left = left_keys.len();

    let second = Watched::spawn(command());
    let deadline = Instant::now() + Duration::from_secs(180);
    let assigned = loop {
        if let Some(at) = second.assigned_at() {
            break at;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted consumer was never assigned"
        );
        sleep(Duration::from_millis(20)).await;
    };
    let mut left_done = None;
    let mut full_rate = None;
    let until = now_ms() + 60_000;
    while now_ms() < until && (left_done.is_none() || full_rate.is_none()) {
        if left_done.is_none() {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM dedup_records \
                 WHERE scope = $1 AND key = ANY($2) AND state <> 'completed'",
            )
            .bind(&group)
            .bind(&left_keys)
            .fetch_one(pool)
            .await
            .unwrap();
            if open == 0 {
                left_done = Some(now_ms().saturating_sub(assigned));
            }
        }
        if full_rate.is_none() {
            full_rate = second
                .rates(assigned)
                .iter()
                .find(|r| r.1 >= 0.9 * steady)
                .map(|r| r.0 - assigned);
        }
        sleep(Duration::from_millis(50)).await;
    }
    let ticks = second.ticks();
    let after = |f: fn(&Tick) -> bool| ticks.iter().find(|t| f(t)).map(|t| t.at - assigned);
    let out = Recovery {
        steady,
        left,
        join: assigned - second.spawned,
        first_settled: after(|t| t.settled > 0),
        first_executed: after(|t| t.executed > 0),
        left_done,
        full_rate,
    };
    let mut child = second.child;
    child.kill().await.unwrap();
    child.wait().await.unwrap();
    out
}

/// The consumer the measurement runs: this build's, or with `DEDUP_RECOVERY_BIN` an older build
/// of `dedup-consume-and-die` that prints the same progress lines (for the figures before a
/// change; it is measured without an identity only).
fn consumer_bin() -> std::path::PathBuf {
    std::env::var_os("DEDUP_RECOVERY_BIN").map_or_else(
        || env!("CARGO_BIN_EXE_dedup-consume-and-die").into(),
        std::path::PathBuf::from,
    )
}

/// The recovery measurement (`scripts/recovery`): for each ordering, a consumer killed with
/// SIGKILL after a steady run with the default lease (30 s), restarted without an identity and
/// with one. Prints the table docs/RECOVERY.md quotes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: scripts/recovery runs it"]
#[allow(clippy::print_stdout)] // the table is the measurement's output
async fn measure_recovery_after_sigkill() {
    let pg = PgServer::start_configured(|_| "max_connections = 100\n".to_owned());
    let pool = own_postgres(&pg).await;
    let redis = RedisServer::start();
    let broker = Broker::nisshi();
    let ms = |v: Option<u128>| v.map_or_else(|| "> 60000".to_owned(), |v| v.to_string());
    println!(
        "| ordering | identity | steady/s | left in flight | join ms | first settled ms | first executed ms | left keys done ms | 90% rate ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let identities: &[bool] = if std::env::var_os("DEDUP_RECOVERY_BIN").is_some() {
        println!("(consumer: {})", consumer_bin().display());
        &[false]
    } else {
        &[false, true]
    };
    for ordering in ["per-partition", "per-key"] {
        for &identity in identities {
            let r = recover(&broker, &pg, &pool, &redis, ordering, identity).await;
            println!(
                "| {ordering} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
                if identity { "adopted" } else { "none" },
                r.steady,
                r.left,
                r.join,
                ms(r.first_settled),
                ms(r.first_executed),
                ms(r.left_done),
                ms(r.full_rate),
            );
        }
    }
}
