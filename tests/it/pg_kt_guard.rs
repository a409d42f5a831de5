//! What refuses a writer that leaves `kt` out of a record on the table partitioned by the key's
//! time (docs/ARCHITECTURE.md, invariant 36): since generation 10, `kt` has no default there, so
//! such a writer's `kt` is NULL, which no partition takes. Generations 7 to 9 checked
//! `kt = dedup_kt(key)` on the parent instead, compiled again by every statement that wrote;
//! migration `20261204000001` drops that check and the default from a table they switched,
//! asking for the table's lock 100 ms at a time so claims are not held behind it.

use std::time::{Duration, Instant};

use dedup_core::Store;
use dedup_pg::PgStore;
use sqlx::PgPool;
use tokio::time::sleep;

use crate::pg_partitioned::{now_ms, v7};
use crate::support::{acquired, key, misplaced_records, req};

/// The migration, as sqlx runs it: its whole text in one transaction.
const MIGRATION: &str = include_str!("../../migrations/20261204000001_dedup_kt_no_default.sql");

/// Tables of the record tree (the parent and its partitions) whose `kt` has a default.
async fn kt_defaults(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
         WHERE a.attname = 'kt' AND a.atthasdef \
         AND (c.oid = 'dedup_records'::regclass \
         OR c.oid IN (SELECT relid FROM pg_partition_tree('dedup_records'))) ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The tables of the record tree that carry a check named `dedup_records_kt`.
async fn kt_checks(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT conrelid::regclass::text FROM pg_constraint WHERE conname = 'dedup_records_kt' \
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// An insert that names every column but `kt`: the SQLSTATE it fails with, if it fails.
async fn insert_without_kt(pool: &PgPool, name: &str) -> Option<String> {
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, created_at, updated_at, \
         expires_at) VALUES ('by-hand', $1, 'completed', 1, 1, now(), now(), now() + interval '1 day')",
    )
    .bind(name.as_bytes())
    .execute(pool)
    .await
    .err()
    .map(|e| {
        e.as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned())
            .unwrap_or_else(|| e.to_string())
    })
}

async fn generation(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT generation FROM dedup_schema")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A key with a day, claimed and completed by the store, lands in its day's partition.
async fn claim_and_complete(store: &PgStore, name: &str) {
    let lease = acquired(store.claim(&req(&key(name), "guard")).await.unwrap());
    store.complete(&lease, name.as_bytes()).await.unwrap();
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_switched_table_refuses_a_writer_that_leaves_kt_out_and_checks_nothing_per_row(
    pool: PgPool,
) {
    // The single table keeps its default: older binaries that never name kt still write there.
    assert_eq!(kt_defaults(&pool).await, ["dedup_records"]);
    assert_eq!(generation(&pool).await, 10);
    assert_eq!(insert_without_kt(&pool, "untimed-by-hand").await, None);

    dedup_pg::partition_by_key_time(&pool).await.unwrap();
    assert_eq!(kt_defaults(&pool).await, Vec::<String>::new());
    assert_eq!(kt_checks(&pool).await, Vec::<String>::new());
    let with_a_day = v7(now_ms() + 1000, 1);
    assert_eq!(
        insert_without_kt(&pool, &with_a_day).await.as_deref(),
        Some("23514"),
        "a record without kt has no partition"
    );
    assert_eq!(
        insert_without_kt(&pool, "no-day-either").await.as_deref(),
        Some("23514")
    );
    let store = PgStore::new(pool.clone());
    claim_and_complete(&store, &with_a_day).await;
    claim_and_complete(&store, "order-7").await;
    assert_eq!(misplaced_records(&pool).await, 0);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_migration_takes_a_generation_9_switch_to_no_default_without_holding_claims(
    pool: PgPool,
) {
    dedup_pg::partition_by_key_time(&pool).await.unwrap();
    // The table as a binary of generation 9 switched it.
    for sql in [
        "ALTER TABLE dedup_records ALTER COLUMN kt SET DEFAULT '-infinity'",
        "ALTER TABLE dedup_records ADD CONSTRAINT dedup_records_kt \
         CHECK (kt = dedup_kt(key)) NOT VALID",
        "UPDATE dedup_schema SET generation = 9",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    assert!(!kt_checks(&pool).await.is_empty());
    assert!(
        kt_defaults(&pool)
            .await
            .contains(&"dedup_records".to_owned())
    );

    // A reader holds the table for 1.5 s; the migration waits for it, and claims go on meanwhile.
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE dedup_records IN ACCESS SHARE MODE")
        .execute(&mut *reader)
        .await
        .unwrap();
    let migration = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(MIGRATION))
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
    });
    let store = PgStore::new(pool.clone());
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut n = 0;
    while started.elapsed() < Duration::from_millis(1500) {
        let t = Instant::now();
        let claimed = tokio::time::timeout(
            Duration::from_secs(3),
            claim_and_complete(&store, &v7(now_ms() + 1000, 100 + n)),
        )
        .await;
        slowest = slowest.max(t.elapsed());
        if claimed.is_err() {
            break;
        }
        n += 1;
        sleep(Duration::from_millis(20)).await;
    }
    assert!(
        slowest < Duration::from_millis(1000),
        "a claim waited {slowest:?} behind the migration's lock"
    );
    assert!(
        !migration.is_finished(),
        "the migration waits for the reader"
    );
    reader.commit().await.unwrap();
    migration.await.unwrap().unwrap();
    assert!(n >= 10, "{n} claims while the migration waited");

    assert_eq!(kt_checks(&pool).await, Vec::<String>::new());
    assert_eq!(kt_defaults(&pool).await, Vec::<String>::new());
    assert_eq!(generation(&pool).await, 10);
    assert_eq!(
        insert_without_kt(&pool, &v7(now_ms() + 1000, 1))
            .await
            .as_deref(),
        Some("23514")
    );
    claim_and_complete(&store, &v7(now_ms() + 1000, 2)).await;
    assert_eq!(misplaced_records(&pool).await, 0);
}
