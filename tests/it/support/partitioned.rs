//! `dedup_records` partitioned by its key's partition day (`kt`), for the tests that hold every
//! statement to the rule the partitioned window needs (docs/design/window-partitions.md): each
//! record is written with `kt = dedup_kt(key)` of the key it was given, and found by naming it.
//!
//! [`partition_records`] turns a test's freshly migrated database into that layout, the way the
//! switch to it will: the table as it is becomes the partition of keys without a day
//! (`dedup_records_untimed`), under a partitioned parent of the same name and columns, beside
//! partitions of days; `dedup_kt` is replaced, in the same transaction, by a mapping that gives
//! most keys a day; and `kt` loses its default, so a statement that wrote a record without naming
//! `kt` (which would have taken `-infinity` for a key that has a day) writes NULL, which no
//! partition takes, and fails instead of putting the key where no lookup finds it. A statement
//! that named `kt` but computed it some other way is what [`misplaced_records`] finds.
//!
//! The mapping here is not the product's (the day of a UUIDv7 key): it is a hash of the key's
//! bytes, so that the keys the suites use anyway (`invoice-1`, `k-17`) spread over three
//! partitions of days and the untimed one, and two keys of one batch often land apart.

use sqlx::PgPool;

/// The stand-in mapping: 6 of 8 hash buckets get one of 6 days (2 days a partition), the other 2
/// none. Total over every byte string, a plain expression, as the product's must be.
const TEST_KT: &str = "CREATE OR REPLACE FUNCTION dedup_kt(p_key bytea) RETURNS date \
     LANGUAGE sql IMMUTABLE PARALLEL SAFE \
     RETURN CASE WHEN (hashtext(encode(p_key, 'hex')) & 7) < 6 \
     THEN date '2026-01-01' + (hashtext(encode(p_key, 'hex')) & 7) \
     ELSE '-infinity'::date END";

/// The day partitions: `[from, to)`.
const DAYS: [(&str, &str, &str); 3] = [
    ("dedup_records_d0", "2026-01-01", "2026-01-03"),
    ("dedup_records_d1", "2026-01-03", "2026-01-05"),
    ("dedup_records_d2", "2026-01-05", "2026-01-07"),
];

/// Turns this database's `dedup_records` into the partitioned layout (above), in one transaction.
pub(crate) async fn partition_records(pool: &PgPool) {
    let mut tx = pool.begin().await.unwrap();
    let mut steps: Vec<String> = vec![
        "LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE".into(),
        "ALTER TABLE dedup_records RENAME TO dedup_records_untimed".into(),
        "ALTER INDEX dedup_records_pkey RENAME TO dedup_records_untimed_pkey".into(),
        "ALTER INDEX dedup_records_expires_at_idx RENAME TO dedup_records_untimed_expires_at_idx"
            .into(),
        "ALTER INDEX dedup_records_live_owner_idx RENAME TO dedup_records_untimed_live_owner_idx"
            .into(),
        "CREATE TABLE dedup_records (LIKE dedup_records_untimed INCLUDING DEFAULTS \
         INCLUDING CONSTRAINTS) PARTITION BY RANGE (kt)"
            .into(),
        "ALTER TABLE dedup_records_untimed ADD CONSTRAINT dedup_records_untimed_kt \
         CHECK (kt < '1970-01-01')"
            .into(),
        "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_untimed \
         FOR VALUES FROM (MINVALUE) TO ('1970-01-01')"
            .into(),
    ];
    for (name, from, to) in DAYS {
        steps.push(format!(
            "CREATE TABLE {name} (LIKE dedup_records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        ));
        steps.push(format!("ALTER TABLE {name} ADD PRIMARY KEY (scope, key)"));
        steps.push(format!(
            "ALTER TABLE dedup_records ATTACH PARTITION {name} FOR VALUES FROM ('{from}') TO ('{to}')"
        ));
    }
    steps.extend([
        "CREATE INDEX dedup_records_expires_at_idx ON dedup_records (expires_at)".into(),
        "CREATE INDEX dedup_records_live_owner_idx ON dedup_records (owner text_pattern_ops) \
         WHERE state = 'in_progress'"
            .into(),
        TEST_KT.into(),
        "ALTER TABLE dedup_records ALTER COLUMN kt DROP DEFAULT".into(),
    ]);
    for step in steps {
        // Fixed identifiers and literals of this file only.
        sqlx::query(sqlx::AssertSqlSafe(step.clone()))
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{step}: {e}"));
    }
    tx.commit().await.unwrap();
}

/// How many records each partition holds, by name, for tests that check the keys spread.
pub(crate) async fn records_by_partition(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT tableoid::regclass::text, count(*) FROM dedup_records GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Records whose `kt` is not what `dedup_kt` says of their key (none, if every writer named it).
pub(crate) async fn misplaced_records(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE kt <> dedup_kt(key)")
        .fetch_one(pool)
        .await
        .unwrap()
}
