//! Retention in the background (`PgStore::spawn_retention`, `EngineBuilder::retention`): the task
//! that holds the database's retention lock purges, in bounded batches until none is left; the
//! others stand by, and one of them takes over when the leader stops. (`dedup purge --every`,
//! killed with SIGKILL, is in the CLI's tests.)

use std::time::Duration;

use dedup::Engine;
use dedup_pg::{PgStore, Retention, RetentionConfig};
use sqlx::PgPool;

use crate::support::until;

/// `n` completed records of `scope` past their retention, and `live` ones within it.
async fn records(pool: &PgPool, scope: &str, n: i64, live: i64) {
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, result, created_at, \
         updated_at, expires_at) SELECT $1, int8send(g), 'completed', nextval('dedup_token_seq'), \
         1, '\\x00', now(), now(), \
         CASE WHEN g <= $2 THEN now() - interval '1 second' ELSE now() + interval '1 day' END \
         FROM generate_series(1, $2 + $3) g",
    )
    .bind(scope)
    .bind(n)
    .bind(live)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, scope: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE scope = $1")
        .bind(scope)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Sessions that hold a retention lock in this database.
async fn holders(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND classid = x'64656472'::int8::oid AND objsubid = 2",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

fn config() -> RetentionConfig {
    RetentionConfig::default()
        .with_every(Duration::from_millis(50))
        .with_batch(1000)
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn an_engine_with_retention_purges_expired_records_in_batches_and_keeps_live_ones(
    pool: PgPool,
) {
    // 2,500 expired records take three statements of 1,000 in one round.
    records(&pool, "r", 2500, 10).await;
    let engine = Engine::builder()
        .postgres(pool.clone())
        .scope("r")
        .retention(config())
        .build()
        .await
        .unwrap();
    until("the expired records purged", || async {
        count(&pool, "r").await == 10
    })
    .await;
    until("the round counted", || async {
        engine.stats().retention.is_some_and(|s| s.purged == 2500)
    })
    .await;
    until("the round ended", || async {
        engine.retention_stats().is_some_and(|s| s.rounds >= 1)
    })
    .await;
    let stats = engine.retention_stats().unwrap();
    assert!(stats.leading(), "{stats:?}");
    // 1,000, 1,000 and 500: the round went on until a statement deleted less than a batch.
    assert_eq!(stats.statements, 3, "{stats:?}");
    assert_eq!((stats.errors, stats.standby), (0, 0), "{stats:?}");
    assert_eq!(holders(&pool).await, 1);
    // Operators see who purges.
    let named: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid \
         WHERE l.locktype = 'advisory' AND l.classid = x'64656472'::int8::oid \
         AND a.datname = current_database() AND a.application_name = 'dedup retention'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(named, 1);

    // Shutdown stops the task and lets its lock go.
    engine.shutdown().await;
    assert!(engine.retention_stats().is_none());
    until("the lock let go", || async { holders(&pool).await == 0 }).await;
    records(&pool, "r", 5, 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&pool, "r").await, 15, "nothing purges after shutdown");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn one_task_purges_at_a_time_and_another_takes_over_when_it_stops(pool: PgPool) {
    let first: Retention = PgStore::new(pool.clone()).spawn_retention(config());
    until("the first task leads", || async { first.stats().leading() }).await;
    let second = PgStore::new(pool.clone()).spawn_retention(config());
    until("the second stands by", || async {
        second.stats().standby >= 3
    })
    .await;
    assert!(!second.stats().leading());
    assert_eq!(holders(&pool).await, 1);

    records(&pool, "s", 1500, 0).await;
    until("purged by the first", || async {
        count(&pool, "s").await == 0
    })
    .await;
    until("counted by the first", || async {
        first.stats().purged == 1500
    })
    .await;
    assert_eq!(second.stats().purged, 0, "{:?}", second.stats());
    assert!(!second.stats().leading());

    first.stop().await;
    until("the second takes over", || async {
        second.stats().leading()
    })
    .await;
    assert_eq!(holders(&pool).await, 1);
    records(&pool, "s", 700, 3).await;
    until("purged by the second", || async {
        count(&pool, "s").await == 3
    })
    .await;
    until("counted by the second", || async {
        second.stats().purged == 700
    })
    .await;
    assert_eq!(second.stats().errors, 0, "{:?}", second.stats());
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_leader_whose_session_was_ended_leads_again_after_its_next_round(pool: PgPool) {
    let task = PgStore::new(pool.clone()).spawn_retention(config());
    until("the task leads", || async { task.stats().leading() }).await;
    // The server ends the leader's session (a failover or an operator would): the lock goes
    // with it, the next round fails, and the one after connects and takes the lock again.
    let ended: bool = sqlx::query_scalar(
        "SELECT bool_or(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' \
         AND classid = x'64656472'::int8::oid AND objsubid = 2 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(ended);
    until("the failed round counted", || async {
        task.stats().errors >= 1
    })
    .await;
    until("leading again", || async { task.stats().leading() }).await;
    records(&pool, "t", 40, 0).await;
    until("purged after the reconnect", || async {
        count(&pool, "t").await == 0
    })
    .await;
    assert_eq!(holders(&pool).await, 1);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_statement_past_the_timeout_fails_its_round_and_deletes_nothing(pool: PgPool) {
    records(&pool, "u", 20_000, 0).await;
    // 1 ms: no statement of the round can finish, so the setting reached the session.
    let task = PgStore::new(pool.clone()).spawn_retention(
        config()
            .with_batch(20_000)
            .with_statement_timeout(Duration::from_millis(1)),
    );
    until("a failed round", || async { task.stats().errors >= 2 }).await;
    let stats = task.stop().await;
    assert_eq!(stats.purged, 0, "{stats:?}");
    assert!(
        stats
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("statement timeout")),
        "{stats:?}"
    );
    assert_eq!(count(&pool, "u").await, 20_000);
}
