//! What refuses a writer that leaves `kt` out of a record on the table partitioned by the key's
//! time (docs/ARCHITECTURE.md, invariant 36): since 00d3a16 (a binary of generation 9 and every
//! later one), `kt` has no default there, so such a writer's `kt` is NULL, which no partition
//! takes. Binaries of generations 7 to 9 before it checked `kt = dedup_kt(key)` on the parent
//! instead, compiled again by every statement that wrote, and kept the default; the retention's
//! round drops both from a table they switched and from a table they made and did not attach, as
//! a change of the partitions (held back while the table's lock is not had).

use std::time::SystemTime;

use dedup_core::Store;
use dedup_pg::{PgStore, RangePolicy};
use sqlx::PgPool;

use crate::pg_partitioned::{now_ms, v7};
use crate::support::{acquired, key, misplaced_records, req};

/// Tables of the records' family (`dedup_records%`, attached or not) whose `kt` has a default.
async fn kt_defaults(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
         WHERE a.attname = 'kt' AND a.atthasdef AND c.relkind IN ('r', 'p') \
         AND c.relname LIKE 'dedup\\_records%' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The tables that carry a check named `dedup_records_kt`.
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
async fn the_retention_takes_generation_9s_check_and_default_off_once_it_has_the_lock(
    pool: PgPool,
) {
    dedup_pg::partition_by_key_time(&pool).await.unwrap();
    // The table as a binary of generation 9 switched it, and a range it made and did not attach.
    for sql in [
        "ALTER TABLE dedup_records ALTER COLUMN kt SET DEFAULT '-infinity'",
        "ALTER TABLE dedup_records ADD CONSTRAINT dedup_records_kt \
         CHECK (kt = dedup_kt(key)) NOT VALID",
        "CREATE TABLE dedup_records_20991228 \
         (LIKE dedup_records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let before = kt_checks(&pool).await;
    assert!(before.contains(&"dedup_records".to_owned()), "{before:?}");
    assert!(
        before.contains(&"dedup_records_20991228".to_owned()),
        "{before:?}"
    );
    assert!(
        kt_defaults(&pool)
            .await
            .contains(&"dedup_records_20991228".to_owned())
    );

    // A transaction on the table holds the round's change back; claims go on.
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE dedup_records IN ACCESS SHARE MODE")
        .execute(&mut *reader)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let held = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), SystemTime::now())
        .await
        .unwrap();
    let why = held.held_back.unwrap_or_default();
    assert!(why.contains("kt's check"), "{why}");
    assert_eq!(kt_checks(&pool).await, before);
    let store = PgStore::new(pool.clone());
    claim_and_complete(&store, &v7(now_ms() + 1000, 1)).await;
    reader.commit().await.unwrap();

    let done = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), SystemTime::now())
        .await
        .unwrap();
    assert_eq!(done.held_back, None);
    assert_eq!(kt_checks(&pool).await, Vec::<String>::new());
    assert_eq!(kt_defaults(&pool).await, Vec::<String>::new());
    assert_eq!(
        insert_without_kt(&pool, &v7(now_ms() + 1000, 2))
            .await
            .as_deref(),
        Some("23514")
    );
    claim_and_complete(&store, &v7(now_ms() + 1000, 3)).await;
    assert_eq!(misplaced_records(&pool).await, 0);
}
