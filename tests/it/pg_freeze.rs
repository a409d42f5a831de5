//! Cold ranges of days of the table partitioned by the key's time, frozen once
//! (`crates/dedup-pg/src/layout/freeze.rs`, docs/ARCHITECTURE.md invariant 37): when their
//! anti-wraparound vacuum nears, not before and not twice, an operator's comment kept; and not
//! vacuumed round after round for nothing while a transaction the vacuums must keep is too old
//! for the freeze to pass.

use dedup_core::{ClaimOutcome, Store};
use dedup_pg::{PgStore, RangePolicy};
use sqlx::{PgConnection, PgPool};

use crate::pg_partitioned::v7;
use crate::pg_ranges::{DAY, at, lo_of, partition_of, parts, switch};
use crate::support::{acquired, key, req};

/// Whether every row of `table` is frozen: its `relfrozenxid` newer than every row's `xmin`
/// (a vacuum sets it no later than the oldest row it left unfrozen); and its comment.
async fn frozen(pool: &PgPool, table: &str) -> (bool, Option<String>) {
    // A range's name, from the catalog.
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT age(c.relfrozenxid) FROM pg_class c WHERE c.oid = '{table}'::regclass) \
         < (SELECT min(age(xmin)) FROM {table}), obj_description('{table}'::regclass, 'pg_class')"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs each statement on `conn` (made here of ranges' names from the catalog).
async fn run_all(conn: &mut PgConnection, steps: impl IntoIterator<Item = String>) {
    for step in steps {
        sqlx::query(sqlx::AssertSqlSafe(step))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
}

/// Three keys of T0's day claimed and completed, their names as results: the names, their
/// range and the range's end (a day since the epoch).
async fn written_range(pool: &PgPool, store: &PgStore, t0: i64) -> (Vec<String>, String, i32) {
    let names: Vec<String> = (0..3).map(|i| v7(t0 + 60_000 + i, i as u64)).collect();
    for n in &names {
        let lease = acquired(store.claim(&req(&key(n), "w")).await.unwrap());
        store.complete(&lease, n.as_bytes()).await.unwrap();
    }
    let range = partition_of(pool, &names[0]).await.unwrap();
    let (_, hi) = lo_of(&parts(pool).await, &range);
    (names, range, hi)
}

/// `n` transaction ids spent, each a subtransaction that writes (in a temp table `burn`).
async fn burn(conn: &mut PgConnection, n: u32) {
    run_all(
        conn,
        [
            "CREATE TEMP TABLE IF NOT EXISTS burn (x int)".to_owned(),
            format!(
                "DO $b$ BEGIN FOR i IN 1..{n} LOOP BEGIN INSERT INTO burn VALUES (i); \
                 RAISE EXCEPTION 'next'; EXCEPTION WHEN raise_exception THEN NULL; END; \
                 END LOOP; END $b$"
            ),
        ],
    )
    .await;
}

/// The range's `autovacuum_freeze_max_age` set to 100,000, the least there is (its half,
/// 50,000, is when it is due).
async fn least_max_age(conn: &mut PgConnection, range: &str) {
    run_all(
        conn,
        [format!(
            "ALTER TABLE {range} SET (autovacuum_freeze_max_age = 100000)"
        )],
    )
    .await;
}

/// The range half-way to its anti-wraparound vacuum and past: its least
/// `autovacuum_freeze_max_age`, then 60,000 transaction ids spent.
async fn half_way(conn: &mut PgConnection, range: &str) {
    least_max_age(conn, range).await;
    burn(conn, 60_000).await;
}

/// A transaction opened and left idle, with an id: its pid.
async fn idle_holder(pool: &PgPool) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut holder = pool.begin().await.unwrap();
    let (_, pid): (i64, i32) = sqlx::query_as("SELECT txid_current(), pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    (holder, pid)
}

/// The round's reason names the range, the session and the half.
fn names_the_holder(why: &str, range: &str, pid: i32) {
    assert!(
        why.contains(&format!("{range} not frozen"))
            && why.contains(&format!("session {pid} "))
            && why.contains("idle in transaction")
            && why.contains("(half the range's autovacuum_freeze_max_age is 50000)"),
        "{why}"
    );
}

/// Each of `names` replays its own name.
async fn replays(store: &PgStore, names: &[String]) {
    for n in names {
        match store.claim(&req(&key(n), "again")).await.unwrap() {
            ClaimOutcome::Completed { result, .. } => assert_eq!(&result[..], n.as_bytes()),
            other => panic!("{n}: {other:?}"),
        }
    }
}

/// A cold range (a day past its last day, not due for dropping) is frozen once an
/// anti-wraparound vacuum nears (half its `autovacuum_freeze_max_age` spent), not before and
/// not twice; an operator's comment on it is kept; its records stay and are found.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_cold_range_is_frozen_once_when_its_anti_wraparound_vacuum_nears(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let (names, range, hi) = written_range(&pool, &store, t0).await;
    let cold = at(i64::from(hi) * DAY + DAY + 3_600_000);
    let mut conn = pool.acquire().await.unwrap();
    let young = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert!(young.frozen.is_empty(), "far from its vacuum: {young:?}");
    assert_eq!(frozen(&pool, &range).await, (false, None));

    half_way(&mut conn, &range).await;
    let early = dedup_pg::maintain_ranges(
        &mut conn,
        &RangePolicy::default(),
        at(i64::from(hi) * DAY + 3_600_000),
    )
    .await
    .unwrap();
    assert!(early.frozen.is_empty(), "not cold yet: {early:?}");
    let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert_eq!(report.frozen, vec![range.clone()], "{report:?}");
    assert_eq!(
        frozen(&pool, &range).await,
        (true, Some("dedup: frozen".to_owned()))
    );
    let again = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert!(again.frozen.is_empty(), "once: {again:?}");
    // An operator's comment on the range (which takes the mark's place) is never overwritten;
    // such a range is frozen again when its vacuum nears again (only what changed since).
    run_all(
        &mut conn,
        [format!(
            "COMMENT ON TABLE {range} IS 'ops: keep until the audit'"
        )],
    )
    .await;
    burn(&mut conn, 60_000).await;
    // (What says it was frozen again is the report: its rows' xmins were frozen the first time.)
    let refrozen = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert_eq!(refrozen.frozen, vec![range.clone()], "{refrozen:?}");
    assert_eq!(
        frozen(&pool, &range).await,
        (true, Some("ops: keep until the audit".to_owned()))
    );
    let unmarked = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert!(unmarked.frozen.is_empty(), "not every round: {unmarked:?}");
    let never = RangePolicy::default().with_freeze_after(None);
    assert!(
        dedup_pg::maintain_ranges(&mut conn, &never, cold)
            .await
            .unwrap()
            .frozen
            .is_empty()
    );
    replays(&store, &names).await;
}

/// The manual vacuums the range `table` has had.
async fn vacuums(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar("SELECT vacuum_count FROM pg_stat_all_tables WHERE relid = to_regclass($1)")
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A cold range due for its freeze while a transaction older than half its
/// `autovacuum_freeze_max_age` stays open in its database: no round runs a VACUUM that could
/// not pass that transaction (the range would be due again right after, and read again the
/// round after), and the round says what holds it; once it ends, the next round freezes.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_cold_range_is_not_vacuumed_for_nothing_behind_a_transaction_too_old(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    // Opened before the records are written, so that no freeze can touch them while it lasts.
    let (holder, pid) = idle_holder(&pool).await;
    let (names, range, hi) = written_range(&pool, &store, t0).await;
    let cold = at(i64::from(hi) * DAY + DAY + 3_600_000);
    let mut conn = pool.acquire().await.unwrap();
    // The range was made (by the switch) before the transaction opened: other tests' transaction
    // ids spent in between would leave it worth one freeze up to that transaction. Frozen that
    // far now, it is what this test is about: a range no freeze can take further.
    run_all(&mut conn, [format!("VACUUM (FREEZE) {range}")]).await;
    half_way(&mut conn, &range).await;
    let before = vacuums(&pool, &range).await;
    for round in 0..2 {
        let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
            .await
            .unwrap();
        assert!(report.frozen.is_empty(), "round {round}: {report:?}");
        names_the_holder(&report.held_back.unwrap_or_default(), &range, pid);
        assert_eq!(
            vacuums(&pool, &range).await,
            before,
            "round {round}: no VACUUM that could not pass the transaction"
        );
    }
    assert_eq!(frozen(&pool, &range).await, (false, None));
    holder.commit().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert_eq!(report.frozen, vec![range.clone()], "{report:?}");
    assert_eq!(report.held_back, None, "{report:?}");
    assert_eq!(vacuums(&pool, &range).await, before + 1);
    assert_eq!(
        frozen(&pool, &range).await,
        (true, Some("dedup: frozen".to_owned()))
    );
    replays(&store, &names).await;
}

/// Rows older than a transaction that then stays open past half the range's
/// `autovacuum_freeze_max_age`: the first round still freezes them (its VACUUM takes the
/// range's `relfrozenxid` up to that transaction, and the range stays due), the rounds after it
/// hold back without a VACUUM, and once the transaction ends, the range is frozen and marked.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_cold_range_is_frozen_as_far_as_a_transaction_too_old_allows_then_held_back(
    pool: PgPool,
) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let (names, range, hi) = written_range(&pool, &store, t0).await;
    let cold = at(i64::from(hi) * DAY + DAY + 3_600_000);
    let mut conn = pool.acquire().await.unwrap();
    least_max_age(&mut conn, &range).await;
    burn(&mut conn, 20_000).await;
    let (holder, pid) = idle_holder(&pool).await;
    burn(&mut conn, 60_000).await;
    let before = vacuums(&pool, &range).await;
    let first = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert!(first.frozen.is_empty(), "still due after it: {first:?}");
    assert_eq!(first.held_back, None, "worth its read: {first:?}");
    assert_eq!(vacuums(&pool, &range).await, before + 1);
    assert_eq!(frozen(&pool, &range).await, (true, None), "its rows frozen");
    for round in 0..2 {
        let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
            .await
            .unwrap();
        assert!(report.frozen.is_empty(), "round {round}: {report:?}");
        names_the_holder(&report.held_back.unwrap_or_default(), &range, pid);
        assert_eq!(vacuums(&pool, &range).await, before + 1, "round {round}");
    }
    holder.commit().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), cold)
        .await
        .unwrap();
    assert_eq!(report.frozen, vec![range.clone()], "{report:?}");
    assert_eq!(vacuums(&pool, &range).await, before + 2);
    replays(&store, &names).await;
}
