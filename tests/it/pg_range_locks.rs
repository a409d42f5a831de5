//! The locks a change of the partitions takes, against what else holds a partition (an
//! autovacuum's `SHARE UPDATE EXCLUSIVE`, a statement on a partition by its name): such a
//! holder holds the change back for the round, and never the claims. A change waits only for
//! the parent's lock (the claims in flight); a request that waited for a partition's lock while
//! holding the parent's, or that queued on a partition every claim locks, would hold every
//! claim for the whole lock timeout, try after try (`crates/dedup-pg/src/layout/locks.rs`,
//! `lock_unchanged` and `holders_check`; docs/ARCHITECTURE.md invariant 37). A change locks
//! only the tables it touches: a holder of another partition holds nothing back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dedup_core::Store;
use dedup_pg::{PgStore, RangePolicy};
use sqlx::{PgConnection, PgPool};
use tokio::task::JoinHandle;

use crate::pg_partitioned::v7;
use crate::pg_ranges::{DAY, at, fill, moved_to_late_and_replays, partition_of, parts, switch};
use crate::support::{acquired, key, misplaced_records, req};

/// What runs beside a round: a watch of the maintainer's lock requests and a claimer.
struct Beside {
    stop: Arc<AtomicBool>,
    waits: JoinHandle<Vec<String>>,
    claims: JoinHandle<u64>,
}

impl Beside {
    /// Watches the session `pid` for a lock request of a table other than the parent that it
    /// is waiting for, every 2 ms: in a mode a claim's `ROW EXCLUSIVE` conflicts with (claims
    /// would queue behind it), or in any mode while it holds the parent's lock (every claim
    /// queues behind that); and (with `claims`) claims new keys one after another. (The BRIN
    /// summary's `SHARE UPDATE EXCLUSIVE` may wait, before the parent's lock: claims do not
    /// queue behind it.)
    fn start(pool: &PgPool, pid: i32, (t0, salt): (i64, u64), claims: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let waits = {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let now: Vec<String> = sqlx::query_scalar(
                        "SELECT format('%s %s', l.relation::regclass, l.mode) FROM pg_locks l \
                         WHERE l.pid = $1 AND NOT l.granted AND l.locktype = 'relation' \
                         AND l.relation <> 'dedup_records'::regclass AND (l.mode IN \
                         ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', \
                         'AccessExclusiveLock') OR EXISTS (SELECT 1 FROM pg_locks p \
                         WHERE p.pid = $1 AND p.granted AND p.locktype = 'relation' \
                         AND p.relation = 'dedup_records'::regclass \
                         AND p.mode = 'AccessExclusiveLock'))",
                    )
                    .bind(pid)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    for wait in now {
                        if !seen.contains(&wait) {
                            seen.push(wait);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                seen
            })
        };
        let claims = {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let store = PgStore::new(pool);
                let mut n = 0_u64;
                while claims && !stop.load(Ordering::Relaxed) {
                    let name = v7(t0 + 120_000 + i64::try_from(n).unwrap(), salt << 32 | n);
                    let lease = acquired(store.claim(&req(&key(&name), "beside")).await.unwrap());
                    store.complete(&lease, b"ok").await.unwrap();
                    n += 1;
                }
                n
            })
        };
        Self {
            stop,
            waits,
            claims,
        }
    }

    /// Stops both: the lock requests the maintainer waited for, and the claims made.
    async fn stop(self) -> (Vec<String>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        (self.waits.await.unwrap(), self.claims.await.unwrap())
    }
}

/// The session's pid.
async fn pid_of(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// A round run while `lock` (taken on a partition by another session, in a transaction left
/// open) holds it: held back for the lock, the maintainer never waiting for a partition's lock,
/// the claims beside it all through. Answers the round's report.
async fn held_back_beside(
    pool: &PgPool,
    lock: &str,
    policy: &RangePolicy,
    now: std::time::SystemTime,
    (t0, salt): (i64, u64),
) -> dedup_pg::RangeReport {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(lock.to_owned()))
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let beside = Beside::start(pool, pid_of(&mut conn).await, (t0, salt), true);
    let report = dedup_pg::maintain_ranges(&mut conn, policy, now)
        .await
        .unwrap();
    let (waits, claims) = beside.stop().await;
    holder.rollback().await.unwrap();
    assert!(
        waits.is_empty(),
        "{lock}: the maintainer waited for a partition's lock: {waits:?}"
    );
    assert!(claims > 0, "{lock}: claims went on beside the round");
    let why = report.held_back.clone().unwrap_or_default();
    assert!(why.contains("lock not had"), "{lock}: {report:?}");
    report
}

/// A range due held by an autovacuum's lock, then by a statement that names it (a lock a claim
/// takes too, had without the parent's), then `future` held by an autovacuum's lock: each
/// holds back the change that touches it (the drop of the range, the range made out of
/// `future`) and nothing else, and the maintainer never waits for it (so never holds the
/// claims behind the parent's lock while it does); once it is gone, the change goes through.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_partition_held_by_a_vacuum_or_by_name_holds_a_change_back_and_not_the_claims(
    pool: PgPool,
) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let today = v7(t0 + 60_000, 1);
    let lease = acquired(store.claim(&req(&key(&today), "w")).await.unwrap());
    store.complete(&lease, b"ok").await.unwrap();
    let range = partition_of(&pool, &today).await.unwrap();
    let (policy, later) = (RangePolicy::default(), at(t0 + 30 * DAY));
    // The drop of `range` is held back at its BRIN summary (which waits 100 ms for the
    // vacuum's lock, not a statement timeout), then at the lock of the tables it touches. The
    // ranges made ahead out of `future` go through the first time (their change does not touch
    // `range`).
    let tries = [
        (
            1,
            "SHARE UPDATE EXCLUSIVE",
            "its BRIN summary not brought up to date",
            None,
        ),
        (
            2,
            "ROW EXCLUSIVE",
            "the table's lock not had",
            Some(format!(
                "could not obtain lock on relation \"public.{range}\""
            )),
        ),
    ];
    for (salt, mode, drop, last) in tries {
        let lock = format!("LOCK TABLE {range} IN {mode} MODE");
        let report = held_back_beside(&pool, &lock, &policy, later, (t0, salt)).await;
        let why = report.held_back.clone().unwrap_or_default();
        assert!(why.contains(&format!("{range}: {drop}")), "{lock}: {why}");
        assert_eq!(
            why.matches("next round").count(),
            1,
            "{lock}: one change held back: {why}"
        );
        assert_eq!(report.made.is_empty(), salt != 1, "{lock}: {report:?}");
        if let Some(last) = last {
            assert!(
                why.contains("the last try: ") && why.contains(&last),
                "{lock}: {why}"
            );
        }
    }
    // `future` held by an autovacuum's lock a week later: the look at pg_locks names it before
    // the parent's lock is asked for, and the range due is dropped all the same.
    let week_later = at(t0 + 37 * DAY);
    let lock = "LOCK TABLE dedup_records_future IN SHARE UPDATE EXCLUSIVE MODE";
    let report = held_back_beside(&pool, lock, &policy, week_later, (t0, 4)).await;
    let why = report.held_back.clone().unwrap_or_default();
    assert!(
        why.contains("the table's lock not had")
            && why.contains("the last try: ")
            && why.contains("holds ShareUpdateExclusiveLock on dedup_records_future"),
        "{lock}: {why}"
    );
    assert!(
        report.made.is_empty() && report.dropped.contains(&range),
        "{lock}: {report:?}"
    );
    let mut conn = pool.acquire().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, week_later)
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert!(!report.made.is_empty(), "{report:?}");
    assert_eq!(misplaced_records(&pool).await, 0);
}

/// A `late` too large for its attach to read under the lock gets a check of its new bounds
/// under a lock of its own first; while an autovacuum's lock holds `late`, that lock is not
/// asked for (every claim locks `late`, and would queue behind the request): the drop is held
/// back, the claims go on; once the vacuum is gone, the drop goes through.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_large_late_held_by_a_vacuum_holds_the_drop_back_and_not_the_claims(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let first = v7(t0 + 60_000, 1);
    let lease = acquired(store.claim(&req(&key(&first), "w")).await.unwrap());
    store.complete(&lease, b"ok").await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let policy = RangePolicy::default();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 17 * DAY))
        .await
        .unwrap();
    assert!(!report.dropped.is_empty(), "{report:?}");
    // More than 256 pages of live records of T0's day in `late`.
    fill(&pool, t0 + 120_000, 1..=20_000, "now() + interval '1 day'").await;
    drop(conn);
    let lock = "LOCK TABLE dedup_records_late IN SHARE UPDATE EXCLUSIVE MODE";
    // The first range due for the drop: the oldest.
    let due = parts(&pool)
        .await
        .into_iter()
        .find(|p| p.0.starts_with("dedup_records_2"))
        .unwrap()
        .0;
    let report = held_back_beside(&pool, lock, &policy, at(t0 + 40 * DAY), (t0, 1)).await;
    let why = report.held_back.unwrap_or_default();
    assert!(
        why.contains(&format!("{due}: the table's lock not had")),
        "the drop of {due} was held back: {why}"
    );
    let mut conn = pool.acquire().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 40 * DAY))
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert!(!report.dropped.is_empty(), "{report:?}");
    assert_eq!(misplaced_records(&pool).await, 0);
}

/// A partition the round's changes do not touch (`untimed`, and a range kept), held by an
/// autovacuum's lock and by a statement that names it, and then in ACCESS EXCLUSIVE mode: the
/// round makes a range ahead and drops the ranges due all the same (each change locks only the
/// tables it detaches, attaches or renames, and `late`, where the live records it moves land),
/// the claims go on, the maintainer never waits for a lock with the parent's held, and the live
/// records of the ranges dropped are in `late`.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_partition_no_change_touches_held_by_a_vacuum_holds_nothing_back(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let t0 = switch(&pool).await;
    let policy = RangePolicy::default();
    let mut conn = pool.acquire().await.unwrap();
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    // No autovacuum or autoanalyze of the records below, whose lock would hold a summary back.
    no_autovacuum(&pool).await;
    // Live records in a range the next round drops, one by a claim.
    fill(&pool, t0 + 23 * DAY, 1..=100, "now() + interval '60 days'").await;
    let live = v7(t0 + 23 * DAY + 1_000, 1);
    let lease = acquired(store.claim(&req(&key(&live), "w")).await.unwrap());
    store.complete(&lease, live.as_bytes()).await.unwrap();
    let due = partition_of(&pool, &live).await.unwrap();
    let kept = newest_range(&pool).await;
    let untimed = "dedup_records_untimed";
    assert!(parts(&pool).await.iter().any(|p| p.0 == untimed));
    let mut holder = pool.begin().await.unwrap();
    for lock in [
        format!("LOCK TABLE {untimed} IN SHARE UPDATE EXCLUSIVE MODE"),
        format!("LOCK TABLE {kept} IN SHARE UPDATE EXCLUSIVE MODE"),
        format!("LOCK TABLE {kept} IN ROW EXCLUSIVE MODE"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(lock))
            .execute(&mut *holder)
            .await
            .unwrap();
    }
    let beside = Beside::start(&pool, pid_of(&mut conn).await, (t0, 3), true);
    let report = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 40 * DAY))
        .await
        .unwrap();
    let (waits, claims) = beside.stop().await;
    holder.rollback().await.unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert!(!report.made.is_empty(), "a range made ahead: {report:?}");
    assert!(report.dropped.contains(&due), "{due} dropped: {report:?}");
    assert!(!report.dropped.contains(&kept), "{kept} kept: {report:?}");
    assert!(report.moved >= 101, "the live records moved: {report:?}");
    assert!(waits.is_empty(), "the maintainer waited: {waits:?}");
    assert!(claims > 0, "claims went on beside the round");
    moved_to_late_and_replays(&pool, &store, &live, "a live record of a range dropped").await;
    // A week later `untimed` and a range kept held in ACCESS EXCLUSIVE mode (a `VACUUM FULL`, a
    // `TRUNCATE`, an autovacuum cutting a table's tail), no claim beside it (every claim's plan
    // locks every partition, and would wait for the holder itself): the round reads the
    // partitions without a lock on any of them, and never waits with the parent's lock held.
    no_autovacuum(&pool).await;
    let kept = newest_range(&pool).await;
    let mut holder = pool.begin().await.unwrap();
    for table in [untimed, &kept] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
        )))
        .execute(&mut *holder)
        .await
        .unwrap();
    }
    let beside = Beside::start(&pool, pid_of(&mut conn).await, (t0, 4), false);
    let round = dedup_pg::maintain_ranges(&mut conn, &policy, at(t0 + 47 * DAY));
    let report = tokio::time::timeout(Duration::from_secs(60), round)
        .await
        .expect("the round waits for no holder of a partition it does not touch")
        .unwrap();
    let (waits, _) = beside.stop().await;
    holder.rollback().await.unwrap();
    assert_eq!(report.held_back, None, "{report:?}");
    assert!(
        !report.made.is_empty() && !report.dropped.is_empty(),
        "{report:?}"
    );
    assert!(!report.dropped.contains(&kept), "{kept} kept: {report:?}");
    assert!(waits.is_empty(), "the maintainer waited: {waits:?}");
    assert_eq!(misplaced_records(&pool).await, 0);
}

/// The newest range of days (one no round due soon drops).
async fn newest_range(pool: &PgPool) -> String {
    parts(pool)
        .await
        .into_iter()
        .rev()
        .find(|p| p.0.starts_with("dedup_records_2"))
        .unwrap()
        .0
}

/// Turns autovacuum off on every partition.
async fn no_autovacuum(pool: &PgPool) {
    for (name, _, _) in parts(pool).await {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {name} SET (autovacuum_enabled = false)"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
}
