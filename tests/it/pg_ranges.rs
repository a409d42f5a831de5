//! The ranges of days of the table partitioned by the key's time (`dedup_pg::maintain_ranges`,
//! docs/ARCHITECTURE.md invariant 37): made ahead out of `dedup_records_future`, dropped whole
//! once their days are past `keep`, with the records still live, leased or named by a parked
//! message moved to `dedup_records_late` in the same transaction; writers of every kind racing
//! through it run each key once; and a maintainer SIGKILLed at any step leaves the partitions
//! whole (the next run takes up a table it made and did not attach). Each partition has its own
//! index on `expires_at`, a BRIN in each range (and a table switched with the parent's btree
//! gets them, killed or not).

use std::process::Stdio;
use std::time::{Duration, SystemTime};

use dedup_core::{ClaimOutcome, Store};
use dedup_pg::{KeyTimeLayout, PgStore, RangePolicy, RetentionConfig};
use sqlx::PgPool;
use tokio::process::Command;
use tokio::time::sleep;

use crate::pg_partitioned::{Writer, each_key_ran_once, spawn_writers, v7};
use crate::support::{
    acquired, effect_rows, effects_table, key, misplaced_records, records_by_partition, req, url_of,
};

pub(crate) const DAY: i64 = 86_400_000;

/// The time `ms` milliseconds after the Unix epoch.
pub(crate) fn at(ms: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap())
}

/// Switches the table to the partitioned layout (which makes the first ranges): `T0`.
pub(crate) async fn switch(pool: &PgPool) -> i64 {
    match dedup_pg::partition_by_key_time(pool).await.unwrap() {
        KeyTimeLayout::Switched { t0_ms, .. } => t0_ms,
        other => panic!("{other:?}"),
    }
}

/// The partitions and their bounds in days since the epoch (None: MINVALUE, MAXVALUE), lowest
/// first; and whether they cover every day from the lowest timed one on, each exactly once.
pub(crate) async fn parts(pool: &PgPool) -> Vec<(String, Option<i32>, Option<i32>)> {
    let parts: Vec<(String, Option<i32>, Option<i32>)> = sqlx::query_as(
        "SELECT c.relname::text, \
         (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([^'']+)''\\)'))[1]::date \
           - date '1970-01-01', \
         (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::date \
           - date '1970-01-01' \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'dedup_records'::regclass ORDER BY 2 NULLS FIRST",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(parts[0].0, "dedup_records_untimed", "{parts:?}");
    assert_eq!(parts.last().unwrap().0, "dedup_records_future", "{parts:?}");
    assert_eq!(parts.last().unwrap().2, None, "{parts:?}");
    for w in parts[1..].windows(2) {
        assert_eq!(w[0].2, w[1].1, "the days are covered once each: {parts:?}");
    }
    parts
}

pub(crate) fn lo_of(parts: &[(String, Option<i32>, Option<i32>)], name: &str) -> (i32, i32) {
    let p = parts.iter().find(|p| p.0 == name).unwrap();
    (p.1.unwrap(), p.2.unwrap_or(i32::MAX))
}

/// The partition that holds `name`'s record.
pub(crate) async fn partition_of(pool: &PgPool, name: &str) -> Option<String> {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM dedup_records WHERE key = $1")
        .bind(name.as_bytes())
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// `name`'s record was moved to `late`, and a duplicate of it replays its result (its name).
pub(crate) async fn moved_to_late_and_replays(
    pool: &PgPool,
    store: &PgStore,
    name: &str,
    what: &str,
) {
    assert_eq!(
        partition_of(pool, name).await.as_deref(),
        Some("dedup_records_late"),
        "{what}"
    );
    match store.claim(&req(&key(name), "again")).await.unwrap() {
        ClaimOutcome::Completed { result, .. } => assert_eq!(&result[..], name.as_bytes()),
        other => panic!("{what}: a duplicate of a moved record replays: {other:?}"),
    }
}

/// Parks a message that names `name`'s record (as a parked Kafka message does).
async fn park(pool: &PgPool, name: &str) {
    sqlx::query(
        "INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key, \
         ordering_key, header_names, header_values, error, attempts, parked_at, due_at, \
         dedup_scope, dedup_key) VALUES ('g', 't', 0, 1, true, 'k', '{}', '{}', 'boom', 1, \
         now(), now() + interval '1 hour', 'test', $1)",
    )
    .bind(name.as_bytes())
    .execute(pool)
    .await
    .unwrap();
}

/// Expires the records of `names` an hour ago (a drop still moves a record that expired in the
/// last 5 minutes).
async fn expire(pool: &PgPool, names: &[&String]) {
    let keys: Vec<&[u8]> = names.iter().map(|n| n.as_bytes()).collect();
    sqlx::query(
        "UPDATE dedup_records SET expires_at = statement_timestamp() - interval '1 hour' \
         WHERE key = ANY($1) AND kt = ANY (SELECT dedup_kt(k) FROM unnest($1) k)",
    )
    .bind(&keys)
    .execute(pool)
    .await
    .unwrap();
}

/// The indexes on `expires_at` alone of dedup's tables: (table, index, access method, valid),
/// by table.
async fn expiry_indexes(pool: &PgPool) -> Vec<(String, String, String, bool)> {
    sqlx::query_as(
        "SELECT c.relname::text, ic.relname::text, am.amname::text, i.indisvalid \
         FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid \
         JOIN pg_class ic ON ic.oid = i.indexrelid JOIN pg_am am ON am.oid = ic.relam \
         JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'expires_at' \
         WHERE c.relname LIKE 'dedup\\_records%' AND i.indnatts = 1 AND i.indkey[0] = a.attnum \
         ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Each partition has its own index on `expires_at`, and the parent none: one valid BRIN in each
/// range of days, one valid btree in `untimed`, `late` and `future`.
async fn assert_own_expiry_indexes(pool: &PgPool) {
    let indexes = expiry_indexes(pool).await;
    let p = parts(pool).await;
    assert!(
        indexes
            .iter()
            .all(|i| p.iter().any(|(name, ..)| *name == i.0)),
        "no index on expires_at but a partition's own (the parent has none): {indexes:?}"
    );
    for (name, ..) in &p {
        let own: Vec<_> = indexes.iter().filter(|i| i.0 == *name).collect();
        let want = if name
            .trim_start_matches("dedup_records_")
            .parse::<u32>()
            .is_ok()
        {
            "brin"
        } else {
            "btree"
        };
        assert!(
            own.len() == 1 && own[0].2 == want && own[0].3,
            "{name}: one valid {want} on expires_at: {indexes:?}"
        );
    }
}

/// Puts the table in the shape a switch of generation 8 left it: the parent's btree on
/// `expires_at` in every partition, no partition's own.
async fn parents_btree(pool: &PgPool) {
    for (_, index, ..) in expiry_indexes(pool).await {
        // Index names from the catalog.
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP INDEX \"{index}\"")))
            .execute(pool)
            .await
            .unwrap();
    }
    sqlx::query("CREATE INDEX dedup_records_expires_at_idx ON dedup_records (expires_at)")
        .execute(pool)
        .await
        .unwrap();
    let indexes = expiry_indexes(pool).await;
    assert!(
        indexes.iter().any(|i| i.0 == "dedup_records") && indexes.iter().all(|i| i.2 == "btree"),
        "{indexes:?}"
    );
}

/// A table switched by a binary of generation 8 (the parent's btree on `expires_at` in every
/// partition): the next round gives each range a BRIN of its own (building again one a killed
/// build left invalid) and the others their btree, the parent none; every record stays where
/// it was and is found; a drop goes through the BRIN, moving what is live; and a range or
/// `late` without an index on `expires_at` (an older binary made it) gets its own.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_table_switched_with_the_parents_btree_gets_each_partitions_own(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let mut names: Vec<String> = (0..12)
        .map(|d| v7(t0 + d * DAY + 60_000, d as u64))
        .collect();
    names.push("no-time".to_owned());
    for n in &names {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    parents_btree(&pool).await;
    // What a concurrent build killed halfway leaves: an index marked invalid.
    let first = parts(&pool).await[1].0.clone();
    for step in [
        format!("CREATE INDEX {first}_expires_at_brin ON {first} USING brin (expires_at)"),
        format!(
            "UPDATE pg_index SET indisvalid = false \
             WHERE indexrelid = '{first}_expires_at_brin'::regclass"
        ),
    ] {
        // A range's name from the catalog.
        sqlx::query(sqlx::AssertSqlSafe(step))
            .execute(&pool)
            .await
            .unwrap();
    }
    let before = records_by_partition(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0))
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert_own_expiry_indexes(&pool).await;
    assert_eq!(records_by_partition(&pool).await, before);
    for n in &names {
        match store.claim(&req(&key(n), "again")).await.unwrap() {
            ClaimOutcome::Completed { result, .. } => assert_eq!(&result[..], n.as_bytes()),
            other => panic!("{n}: {other:?}"),
        }
    }

    let expired: Vec<&String> = names[1..12].iter().collect();
    expire(&pool, &expired).await;
    let dropped = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 40 * DAY))
        .await
        .unwrap();
    assert!(!dropped.dropped.is_empty(), "{dropped:?}");
    assert_eq!(dropped.held_back, None, "{dropped:?}");
    assert_eq!(
        partition_of(&pool, &names[0]).await.as_deref(),
        Some("dedup_records_late"),
        "the live record of the first range moved"
    );
    assert_eq!(partition_of(&pool, &names[1]).await, None);
    assert_own_expiry_indexes(&pool).await;
    assert_eq!(misplaced_records(&pool).await, 0);

    // A range and `late` as a binary of generation 8 makes them once the parent's btree is
    // gone (no index on expires_at at all): the next round builds theirs.
    let newest = parts(&pool).await.iter().rev().nth(1).unwrap().0.clone();
    for index in [
        format!("{newest}_expires_at_brin"),
        "dedup_records_late_expires_at_idx".to_owned(),
    ] {
        // Names from the catalog.
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP INDEX {index}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 40 * DAY))
        .await
        .unwrap();
    assert_own_expiry_indexes(&pool).await;
}

/// A range without an index on `expires_at` (an older binary made it) whose build cannot finish
/// in the round (a transaction with an older snapshot is open, and the session's statement
/// timeout is 2 s): the round goes on, holds the range's drop back instead of reading it whole
/// under the lock, and says why; the next round builds the index and drops the range.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_range_whose_index_is_not_built_is_not_dropped(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let name = v7(t0 + 60_000, 1);
    let lease = acquired(store.claim(&req(&key(&name), "w")).await.unwrap());
    store.complete(&lease, b"ok").await.unwrap();
    expire(&pool, &[&name]).await;
    let first = partition_of(&pool, &name).await.unwrap();
    // The range's name, from the catalog.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP INDEX {first}_expires_at_brin"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let mut older = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *older)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *older).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET statement_timeout = '2s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let held = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(
        held.held_back
            .as_deref()
            .is_some_and(|w| w.contains("no valid index on expires_at")),
        "{held:?}"
    );
    assert!(!held.made.is_empty(), "the round went on: {held:?}");
    assert!(held.dropped.is_empty(), "{held:?}");
    assert_eq!(partition_of(&pool, &name).await, Some(first.clone()));

    older.commit().await.unwrap();
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await
        .unwrap();
    let dropped = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert_eq!(dropped.held_back, None, "{dropped:?}");
    assert!(dropped.dropped.contains(&first), "{dropped:?}");
    assert_eq!(partition_of(&pool, &name).await, None);
    assert_own_expiry_indexes(&pool).await;
}

/// Ranges made ahead by the switch; 40 days of keys (one a day) later, the ranges of those
/// days dropped whole: what was still live, the leased one and the one a parked message names
/// are moved to `late`, where their lookups find them (a duplicate replays, the lease
/// completes); what had expired is gone; a new key of a dropped day goes to `late`; the bounded
/// DELETE purges `late` and leaves the ranges alone; a second run changes nothing.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn ranges_are_made_ahead_and_dropped_whole_with_what_is_live_moved(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let t0_day = i32::try_from(t0 / DAY).unwrap();
    let p = parts(&pool).await;
    assert_eq!(
        p[1].1,
        Some(t0_day),
        "the first range starts on T0's day: {p:?}"
    );
    assert!(
        lo_of(&p, "dedup_records_future").0 > t0_day + 3,
        "ranges made 3 days ahead: {p:?}"
    );

    let names: Vec<String> = (0..40)
        .map(|d| v7(t0 + d * DAY + 60_000, d as u64))
        .collect();
    for n in &names {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    let held_name = v7(t0 + 11 * DAY + 120_000, 100);
    let held = acquired(store.claim(&req(&key(&held_name), "w")).await.unwrap());
    let live = |d: usize| d.is_multiple_of(5);
    let expired: Vec<&String> = (0..40).filter(|&d| !live(d)).map(|d| &names[d]).collect();
    expire(&pool, &expired).await;
    park(&pool, &names[7]).await;
    // Expired a minute ago: a claim that waited for the drop's lock may still see it live.
    sqlx::query(
        "UPDATE dedup_records SET expires_at = statement_timestamp() - interval '1 minute' \
         WHERE key = $1 AND kt = dedup_kt($1)",
    )
    .bind(names[3].as_bytes())
    .execute(&pool)
    .await
    .unwrap();

    // The keys of the days without a range yet went to `future`; making their ranges moves them.
    let in_future: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_records_future")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(in_future > 30, "{in_future}");
    let mut conn = pool.acquire().await.unwrap();
    // A session in another date style: the bounds are read right, and its style is kept.
    sqlx::query("SET DateStyle = 'SQL, DMY'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 60 * DAY))
        .await
        .unwrap();
    assert!(report.partitioned);
    let style: String = sqlx::query_scalar("SHOW DateStyle")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(style, "SQL, DMY");
    assert_eq!(
        unattached(&pool).await,
        Vec::<String>::new(),
        "the dropped ranges' tables cleared"
    );
    assert_eq!(
        report.moved,
        u64::try_from(in_future).unwrap() + 11,
        "those of future, then 8 live, 1 just expired, 1 parked, 1 leased: {report:?}"
    );
    // Every range due went in one change: what was copied out of them into `late` was written
    // by one transaction. `late` small, its attach read it, and no check of its bounds was added.
    assert!(report.dropped.len() >= 5, "{report:?}");
    let writers: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM dedup_records_late")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(writers, 1, "the ranges dropped in one transaction");
    assert_eq!(late_checks(&pool).await, Vec::<(String, bool)>::new());
    // The tables the retention makes (the ranges, `late`) lead their primary key with the key,
    // so that time-ordered keys of every scope land at its right edge; the switch's keep theirs.
    let pkeys: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relname::text, (SELECT string_agg(a.attname, ', ' ORDER BY k.n) \
           FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) \
           JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum) \
         FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid \
         JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary \
         WHERE h.inhparent = 'dedup_records'::regclass ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(pkeys.len() >= 5, "{pkeys:?}");
    for (table, cols) in &pkeys {
        let want = match table.as_str() {
            "dedup_records_untimed" | "dedup_records_future" => "scope, key",
            _ => "key, scope",
        };
        assert_eq!(cols, want, "{table}: {pkeys:?}");
    }
    let p = parts(&pool).await;
    let (late_lo, late_hi) = lo_of(&p, "dedup_records_late");
    assert_eq!(late_lo, t0_day, "{p:?}");
    assert!(
        late_hi > t0_day + 40 && late_hi <= t0_day + 52,
        "every range 8 days past its end dropped: {p:?}"
    );
    assert!(lo_of(&p, "dedup_records_future").0 > t0_day + 63, "{p:?}");
    assert!(report.margin_days.unwrap() > 3, "{report:?}");
    assert_eq!(
        report.ranged_days,
        Some((late_hi, lo_of(&p, "dedup_records_future").0))
    );

    for (d, n) in names.iter().enumerate() {
        let found = partition_of(&pool, n).await;
        if live(d) {
            moved_to_late_and_replays(&pool, &store, n, &format!("day {d}")).await;
        } else if d == 7 || d == 3 {
            assert_eq!(
                found.as_deref(),
                Some("dedup_records_late"),
                "parked, just expired"
            );
            assert!(store.get(&key(n)).await.unwrap().is_some());
        } else {
            assert_eq!(found, None, "day {d}: dropped with its range");
        }
    }
    assert_eq!(
        partition_of(&pool, &held_name).await.as_deref(),
        Some("dedup_records_late")
    );
    store.complete(&held, b"held").await.unwrap();
    assert!(matches!(
        store.claim(&req(&key(&held_name), "again")).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));

    // A new key of a dropped day goes where a record of it would be.
    let again = v7(t0 + 2 * DAY + 999, 500);
    let lease = acquired(store.claim(&req(&key(&again), "w")).await.unwrap());
    store.complete(&lease, b"again").await.unwrap();
    assert_eq!(
        partition_of(&pool, &again).await.as_deref(),
        Some("dedup_records_late")
    );

    // The bounded DELETE purges late (not the parked record) and leaves the ranges alone.
    let standing = v7(t0 + 55 * DAY, 55);
    let lease = acquired(store.claim(&req(&key(&standing), "w")).await.unwrap());
    store.complete(&lease, b"standing").await.unwrap();
    expire(&pool, &[&again, &standing]).await;
    let round = store
        .retention_round(&RetentionConfig::default())
        .await
        .unwrap();
    assert_eq!(
        round.purged, 2,
        "the new key's and the one just expired: {round:?}"
    );
    assert_eq!(partition_of(&pool, &again).await, None);
    assert!(partition_of(&pool, &standing).await.is_some());
    assert!(partition_of(&pool, &names[7]).await.is_some());

    let second = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 60 * DAY))
        .await
        .unwrap();
    assert_eq!(
        (second.made.len(), second.dropped.len(), second.moved),
        (0, 0, 0),
        "{second:?}"
    );
    assert_eq!(misplaced_records(&pool).await, 0);
    assert_own_expiry_indexes(&pool).await;
}

/// Completed records inserted by SQL, one for each `i` of `millis` with a UUIDv7-shaped key of
/// the time `from_ms + i` (the rest random), expiring at `expires_at` (an SQL expression).
pub(crate) async fn fill(
    pool: &PgPool,
    from_ms: i64,
    millis: std::ops::RangeInclusive<i64>,
    expires_at: &str,
) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO dedup_records (scope, key, kt, state, owner, token, attempts, result, \
         created_at, updated_at, expires_at) \
         SELECT 'test', g.k, dedup_kt(g.k), 'completed', 'fill', nextval('dedup_token_seq'), 1, \
         '\\x00'::bytea, now(), now(), {expires_at} \
         FROM (SELECT convert_to(lpad(to_hex(m >> 16), 8, '0') || '-' || \
         lpad(to_hex(m & 65535), 4, '0') || '-7' || substr(u, 16, 3) || substr(u, 19), 'UTF8') \
         AS k FROM (SELECT $1::int8 + i AS m, gen_random_uuid()::text AS u \
         FROM generate_series($2::int8, $3::int8) i) s) g"
    )))
    .bind(from_ms)
    .bind(*millis.start())
    .bind(*millis.end())
    .execute(pool)
    .await
    .unwrap();
}

/// The checks of `late`'s bounds dedup adds (`dedup_records_late_to_<day>`), and whether each
/// is validated.
async fn late_checks(pool: &PgPool) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT conname::text, convalidated FROM pg_constraint \
         WHERE conrelid = 'dedup_records_late'::regclass \
         AND conname LIKE 'dedup\\_records\\_late\\_to\\_%' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A `late` too large for its attach to read under the lock (more than 256 pages) gets a
/// check of its new bounds, validated before the lock, that spares the attach its read: the
/// drop goes all the same, the check is left valid, and what it moved is found in `late`.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_large_late_is_widened_through_a_check_validated_before_the_lock(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let first = v7(t0 + 60_000, 1);
    let second = v7(t0 + 20 * DAY + 60_000, 2);
    for n in [&first, &second] {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    let mut conn = pool.acquire().await.unwrap();
    let policy = RangePolicy::default();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 17 * DAY))
        .await
        .unwrap();
    assert!(!report.dropped.is_empty(), "{report:?}");
    assert_eq!(
        partition_of(&pool, &first).await.as_deref(),
        Some("dedup_records_late")
    );
    assert_eq!(late_checks(&pool).await, Vec::<(String, bool)>::new());
    // 20,000 live records of T0's day in `late` (as a drop that moved many would leave it).
    fill(&pool, t0 + 120_000, 1..=20_000, "now() + interval '1 day'").await;
    let pages: i64 = sqlx::query_scalar(
        "SELECT pg_relation_size('dedup_records_late') / current_setting('block_size')::int8",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(pages > 256, "{pages}");

    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 40 * DAY))
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    let range = report.dropped.last().cloned().unwrap();
    let p = parts(&pool).await;
    let (_, late_hi) = lo_of(&p, "dedup_records_late");
    assert_eq!(
        late_checks(&pool).await,
        vec![(format!("dedup_records_late_to_{late_hi}"), true)],
        "dropped {range}"
    );
    for n in [&first, &second] {
        moved_to_late_and_replays(&pool, &store, n, n).await;
    }
    let in_late: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_records_late")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_late, 20_002);
    assert_eq!(misplaced_records(&pool).await, 0);
}

/// A maintainer between its read of `late`'s bounds and its add of a check of them (holding the
/// makers' lock, as a binary of the last generation adds one for the oldest range's bounds
/// alone) keeps a drop of several ranges out of its window until it commits; the drop then
/// removes that narrower check, so `late` refuses none of the records of the days it was
/// widened over. (A window that committed between the read and the add would leave `late` a
/// check narrower than its bounds: new keys of those days refused until the next drop.)
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_drop_waits_for_a_check_being_added_and_leaves_no_narrower_one(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    for d in [0_i64, 10, 20] {
        let n = v7(t0 + d * DAY + 60_000, d as u64);
        let lease = acquired(store.claim(&req(&key(&n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    // Every range made to 43 days, and those that end within 8 days of T0 dropped: `late` is
    // there, and several ranges are due at 40 days with the default `keep`.
    let mut conn = pool.acquire().await.unwrap();
    let first = RangePolicy::default().with_keep(Duration::from_secs(32 * 86_400));
    let report = dedup_pg::maintain_ranges(&mut conn, &first, at(t0 + 40 * DAY))
        .await
        .unwrap();
    assert!(!report.dropped.is_empty(), "{report:?}");
    let p = parts(&pool).await;
    let (late_lo, lo) = lo_of(&p, "dedup_records_late");
    let next_hi = p.iter().find(|x| x.1 == Some(lo)).unwrap().2.unwrap();

    // The other maintainer: the makers' lock, and `late` read to end at `lo`.
    let mut adder = pool.begin().await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_xact_lock(1684366451, hashtext(n.nspname)) FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'dedup_records'::regclass",
    )
    .execute(&mut *adder)
    .await
    .unwrap();
    let drop = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 40 * DAY))
                .await
                .unwrap()
        })
    };
    sleep(Duration::from_millis(500)).await;
    // Its add, for the next range's bounds alone.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE dedup_records_late ADD CONSTRAINT dedup_records_late_to_{next_hi} \
         CHECK (kt >= date '1970-01-01' + {late_lo} AND kt < date '1970-01-01' + {next_hi}) \
         NOT VALID"
    )))
    .execute(&mut *adder)
    .await
    .unwrap();
    adder.commit().await.unwrap();
    let report = drop.await.unwrap();
    assert!(report.dropped.len() >= 2, "{report:?}");
    assert_eq!(report.held_back, None, "{report:?}");
    assert_eq!(late_checks(&pool).await, Vec::<(String, bool)>::new());
    // A new key of day 20, past the narrower bound, goes to `late`.
    let n = v7(t0 + 20 * DAY + 120_000, 99);
    let lease = acquired(store.claim(&req(&key(&n), "w")).await.unwrap());
    store.complete(&lease, b"ok").await.unwrap();
    assert_eq!(
        partition_of(&pool, &n).await.as_deref(),
        Some("dedup_records_late")
    );
    assert_eq!(misplaced_records(&pool).await, 0);
}

/// A drop that would move more live records than `max_move` under the lock is held back (and
/// says why), and goes through once they have expired.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_drop_that_would_move_too_much_is_held_back(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let names: Vec<String> = (0..5).map(|i| v7(t0 + 60_000 + i, i as u64)).collect();
    for n in &names {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, b"ok").await.unwrap();
    }
    let policy = RangePolicy::default().with_max_move(3);
    let mut conn = pool.acquire().await.unwrap();
    let held = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(held.held_back.is_some(), "{held:?}");
    assert!(held.dropped.is_empty(), "{held:?}");
    assert!(
        held.ranged_days.is_some(),
        "the bounded DELETE leaves the ranges alone meanwhile: {held:?}"
    );
    assert!(!held.made.is_empty(), "ranges are still made: {held:?}");
    let refs: Vec<&String> = names.iter().collect();
    expire(&pool, &refs).await;
    let dropped = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(!dropped.dropped.is_empty(), "{dropped:?}");
    assert_eq!(dropped.held_back, None);
    for n in &names {
        assert_eq!(partition_of(&pool, n).await, None);
    }
}

/// Ranges due together go in one change only as far as their live records fit `max_move`
/// together: two ranges of 2 live records each under a `max_move` of 3 go in two changes,
/// nothing held back.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn ranges_due_together_past_max_move_go_in_changes_of_their_own(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    // The ranges of the days up to t0 + 11 made first, whatever weekday t0 is: the second pair
    // of keys, 8 days on, lands in a range of its own and not in `future` (the first range ends
    // within 7 days of t0; on a Sunday it is one day long, and the switch makes ranges only 3
    // days ahead).
    let mut conn = pool.acquire().await.unwrap();
    dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 8 * DAY))
        .await
        .unwrap();
    drop(conn);
    let names: Vec<String> = [0, 1, 10, 11]
        .iter()
        .map(|&i| v7(t0 + 60_000 + (i / 10) * 8 * DAY + i, i as u64))
        .collect();
    for n in &names {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    let ranges = [
        partition_of(&pool, &names[0]).await.unwrap(),
        partition_of(&pool, &names[2]).await.unwrap(),
    ];
    assert_ne!(ranges[0], ranges[1]);
    let policy = RangePolicy::default().with_max_move(3);
    let mut conn = pool.acquire().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert!(
        ranges.iter().all(|r| report.dropped.contains(r)),
        "{report:?}"
    );
    let writers: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM dedup_records_late")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(writers, 2, "two changes");
    for n in &names {
        assert_eq!(
            partition_of(&pool, n).await.as_deref(),
            Some("dedup_records_late")
        );
    }
}

/// A drop that would read more than `max_read_pages` of its range under the lock to find what
/// is still live there (live records among thousands of expired ones: the range's BRIN index
/// narrows a lookup to blocks of 128 pages) is held back and says why; with the default it goes,
/// the live records moved to `late` and found there.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_drop_that_would_read_too_much_of_its_range_is_held_back(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let live: Vec<String> = (0..2).map(|i| v7(t0 + 60_000 + i, i as u64)).collect();
    for n in &live {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    // 3,000 expired records of the same day (UUIDv7-shaped keys of the 3 s after the live
    // ones), then a live one after them: the live records sit at both ends of the range's heap.
    fill(&pool, t0 + 60_000, 10..=3_009, "now() - interval '1 hour'").await;
    let last = v7(t0 + 63_100, 9);
    let lease = acquired(store.claim(&req(&key(&last), "w")).await.unwrap());
    store.complete(&lease, last.as_bytes()).await.unwrap();
    let range = partition_of(&pool, &last).await.unwrap();
    assert_eq!(
        partition_of(&pool, &live[0]).await.as_deref(),
        Some(range.as_str())
    );
    let mut conn = pool.acquire().await.unwrap();
    let narrow = RangePolicy::default().with_max_read_pages(8);
    let held = dedup_pg::maintain_ranges(&mut conn, &narrow, at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(
        held.held_back
            .as_deref()
            .is_some_and(|w| w.contains(&range) && w.contains("max_read_pages (8)")),
        "{held:?}"
    );
    assert!(!held.dropped.contains(&range), "{held:?}");
    assert_eq!(
        partition_of(&pool, &last).await.as_deref(),
        Some(range.as_str())
    );

    let dropped = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(dropped.dropped.contains(&range), "{dropped:?}");
    for n in live.iter().chain([&last]) {
        moved_to_late_and_replays(&pool, &store, n, n).await;
    }
}

/// A transaction held open on the table (a caller's `claim_in`) holds a change back for the
/// round (20 tries of 100 ms), without an error; and a round whose change is held back still
/// purges the partitions the bounded DELETE keeps (the untimed one here), and leaves the ranges
/// whole (as `Store::purge` does): an expired record in one is absent to a claim all the same.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_change_held_back_leaves_the_purge_going(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let today = v7(t0 + 60_000, 1);
    let ahead = v7(t0 + 10 * DAY, 2);
    for n in [&today, &ahead] {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, b"ok").await.unwrap();
    }
    expire(&pool, &[&today]).await;

    let mut open = pool.begin().await.unwrap();
    acquired(
        PgStore::claim_in(&mut open, &req(&key("held-open"), "caller"))
            .await
            .unwrap(),
    );
    let mut conn = pool.acquire().await.unwrap();
    let started = std::time::Instant::now();
    let busy = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        busy.held_back
            .as_deref()
            .is_some_and(|w| w.contains("lock not had")),
        "{busy:?}"
    );
    assert!(busy.ranged_days.is_some(), "{busy:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    open.commit().await.unwrap();

    // A carve held back (`ahead`'s record would be moved, and no move is allowed): the bounded
    // DELETE of that round purges the untimed partition's expired record, not today's range's.
    let (first, untimed) = ("untimed-first".to_owned(), "untimed-expired".to_owned());
    for n in [&first, &untimed] {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, b"ok").await.unwrap();
    }
    // `Store::purge` alone (no ranges kept): the same, it leaves the ranges whole.
    expire(&pool, &[&first]).await;
    assert_eq!(store.purge(100).await.unwrap(), 1);
    assert_eq!(partition_of(&pool, &first).await, None);
    assert!(partition_of(&pool, &today).await.is_some());
    expire(&pool, &[&untimed]).await;
    let config = RetentionConfig::default().with_ranges(
        RangePolicy::default()
            .with_ahead(Duration::from_secs(31 * 86_400))
            .with_max_move(0),
    );
    let round = store.retention_round(&config).await.unwrap();
    assert!(round.ranges.held_back.is_some(), "{round:?}");
    assert_eq!(round.purged, 1, "{round:?}");
    assert_eq!(partition_of(&pool, &untimed).await, None);
    assert!(partition_of(&pool, &today).await.is_some());
    assert!(partition_of(&pool, &ahead).await.is_some());
    // Expired, so absent: its claim is a first one, the record taken over in its range.
    acquired(store.claim(&req(&key(&today), "again")).await.unwrap());
}

/// The tables a maintainer makes belong to the parent's owner, whoever runs it; and a role that
/// owns the table and may create in its schema keeps the ranges without being a superuser.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_ranges_belong_to_the_tables_owner(pool: PgPool) {
    let role = format!("dedup_ranges_owner_{}", std::process::id());
    for sql in [
        format!("DROP ROLE IF EXISTS {role}"),
        format!("CREATE ROLE {role}"),
        format!("GRANT CREATE ON SCHEMA public TO {role}"),
        format!("ALTER TABLE dedup_records OWNER TO {role}"),
        // The purge and the drop read the parked messages' keys.
        format!("GRANT SELECT ON dedup_parked TO {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    // The switch run by a superuser: the ranges it makes are the owner's all the same.
    let t0 = switch(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    let r = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(!r.made.is_empty() && !r.dropped.is_empty(), "{r:?}");
    sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();
    let owners: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relname::text, c.relowner::regrole::text FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'dedup_records'::regclass \
         ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(owners.len() >= 5, "{owners:?}");
    assert!(owners.iter().all(|(_, o)| *o == role), "{owners:?}");
    for sql in [
        format!("REASSIGN OWNED BY {role} TO CURRENT_USER"),
        format!("DROP OWNED BY {role}"),
        format!("DROP ROLE {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// The keys of the racing tests: 48 UUIDv7s over 24 days from `t0`.
fn racing_keys(t0: i64) -> Vec<String> {
    (0..48)
        .map(|i: i64| v7(t0 + (i % 24) * DAY + i * 1000, i as u64))
        .collect()
}

const WRITERS: [Writer; 6] = [
    Writer::TxBatch,
    Writer::LeaseBatch,
    Writer::LeaseOne,
    Writer::InTx,
    Writer::TxBatch,
    Writer::LeaseOne,
];

/// The policy of the racing tests: one-day ranges made a day ahead and dropped as they end, so
/// that every key's range is made and then dropped (its live record moved) while they run.
fn daily() -> RangePolicy {
    RangePolicy::default()
        .with_days(1)
        .with_ahead(Duration::from_secs(86_400))
        .with_keep(Duration::ZERO)
}

/// Every kind of writer racing for keys of 24 days while those days' ranges are made (their
/// keys moved out of `future`) and dropped (their live records moved to `late`) by two
/// maintainers at once: each key runs once and is found where its key puts it.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn writers_racing_through_ranges_made_and_dropped_run_each_key_once(pool: PgPool) {
    effects_table(&pool).await;
    let t0 = switch(&pool).await;
    let tasks = spawn_writers(&pool, &WRITERS, &racing_keys(t0), 4);
    while effect_rows(&pool).await.is_empty() {
        sleep(Duration::from_millis(2)).await;
    }
    // Two maintainers at once, as the days go by: each change is made by one of them.
    let maintainer = |pause: u64| {
        let pool = pool.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            let (mut made, mut dropped, mut moved) = (0, 0, 0);
            for d in 0..=30 {
                let r = dedup_pg::maintain_ranges(&mut conn, &daily(), at(t0 + d * DAY))
                    .await
                    .unwrap();
                made += r.made.len();
                dropped += r.dropped.len();
                moved += r.moved;
                sleep(Duration::from_millis(pause)).await;
            }
            (made, dropped, moved)
        }
    };
    let (a, b) = tokio::join!(maintainer(5), maintainer(3));
    let (made, dropped, moved) = (a.0 + b.0, a.1 + b.1, a.2 + b.2);
    for t in tasks {
        t.await.unwrap();
    }
    each_key_ran_once(&pool).await;
    assert!(
        made >= 20 && dropped >= 20,
        "{made} made, {dropped} dropped"
    );
    assert!(moved > 0, "records were moved while the writers ran");
    assert_eq!(
        records_by_partition(&pool).await,
        vec![("dedup_records_late".to_owned(), 48)],
        "every key's range was dropped, its record moved"
    );
    parts(&pool).await;
}

/// dedup's tables that are not partitions of `dedup_records` (a range or `late` made by a run
/// killed before it attached them).
async fn unattached(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT relname::text FROM pg_class WHERE relname LIKE 'dedup\\_records\\_%' \
         AND relkind = 'r' AND NOT relispartition",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A maintainer SIGKILLed at random points while it makes and drops ranges (and writers race
/// for the keys of those days): after a run to the end, the days are covered once each, no
/// table it made is left unattached, and each key ran once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_maintainer_killed_at_any_step_leaves_the_partitions_whole(pool: PgPool) {
    effects_table(&pool).await;
    let t0 = switch(&pool).await;
    // As a switch of generation 8 left it: the kills land in the move to each range's BRIN too.
    parents_btree(&pool).await;
    let tasks = spawn_writers(&pool, &WRITERS, &racing_keys(t0), 4);
    let url = url_of(&pool);
    let maintainer = || {
        Command::new(env!("CARGO_BIN_EXE_dedup-keep-ranges"))
            .args([url.as_str(), &t0.to_string(), "150"])
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    // Killed at least 12 times, and until two kills have left a table made and not attached
    // (between its creation and the transaction that attaches it) for the next run to take up.
    let (mut kills, mut killed_running, mut left_unattached) = (0, 0, 0);
    while kills < 12 || (left_unattached < 2 && kills < 40) {
        let mut child = maintainer();
        let jitter = dedup_core::Timestamp::now().as_micros().rem_euclid(300);
        sleep(Duration::from_millis(
            40 + 20 * (kills % 12) + u64::try_from(jitter).unwrap(),
        ))
        .await;
        if child.try_wait().unwrap().is_none() {
            killed_running += 1;
        }
        child.kill().await.unwrap(); // SIGKILL
        kills += 1;
        left_unattached += usize::from(!unattached(&pool).await.is_empty());
    }
    assert!(
        killed_running * 2 >= kills,
        "most kills land while it works: {killed_running} of {kills}"
    );
    assert!(
        left_unattached >= 1,
        "some kill left a table made and not attached ({kills} kills)"
    );
    let status = maintainer().wait().await.unwrap();
    assert!(status.success(), "{status:?}");
    for t in tasks {
        t.await.unwrap();
    }
    each_key_ran_once(&pool).await;
    let p = parts(&pool).await;
    let t0_day = i32::try_from(t0 / DAY).unwrap();
    assert!(lo_of(&p, "dedup_records_future").0 > t0_day + 30, "{p:?}");
    assert_eq!(
        unattached(&pool).await,
        Vec::<String>::new(),
        "the next run took up every table a killed one left"
    );
    assert_own_expiry_indexes(&pool).await;
}
