//! The ranges of days of the table partitioned by the key's time ([`maintain_ranges`]): made
//! ahead of their time out of `dedup_records_future`, and dropped whole once their retention has
//! passed, the records still live in them (and every record a parked message names) moved to
//! `dedup_records_late` in the same transaction (docs/ARCHITECTURE.md, invariant 37).
//!
//! The partitions, lowest first: `dedup_records_untimed` (every key without a usable time, its
//! retention the bounded DELETE), `dedup_records_late` (from the first range ever dropped to the
//! oldest range standing: what a drop moved, and keys that arrive after their range went; the
//! bounded DELETE purges it), the ranges `dedup_records_YYYYMMDD` (named after their first day,
//! `days` long and ending on a boundary counted from Monday 1970-01-05), and
//! `dedup_records_future`, from the end of the newest range on (keys from clocks running ahead).
//! Every day from `T0`'s on has exactly one partition at every moment, so no key is ever refused
//! for want of one; there is no DEFAULT partition.
//!
//! Each change of the partitions is one transaction under an ACCESS EXCLUSIVE lock on the
//! parent, taken first and waited for 100 ms at a time (then given way and tried again), that
//! reads the partitions again under the lock and does nothing if another maintainer changed
//! them first. A table it needs is made (empty, with its primary key) in a transaction of its
//! own before it; a run killed between the two leaves that table unattached, and the next run
//! takes it up. Killed anywhere else, the transaction rolls back whole.

use std::time::{Duration, SystemTime};

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor};
use tracing::{info, warn};

use dedup_core::StoreError;

use super::{LOCK_TRIES, is_lock_timeout, lock_pause, lock_timeout};
use crate::classify::classify;

/// Milliseconds in a day.
const DAY_MS: i64 = 86_400_000;

/// Days from the Unix epoch to Monday 1970-01-05, where ranges count their boundaries from.
const MONDAY: i32 = 4;

/// The most ranges one call makes or drops (a clock that jumped years would otherwise make a
/// partition for every week between).
const MOST_PER_CALL: usize = 16;

/// The partitions of `dedup_records` and their bounds in days since the Unix epoch (None for
/// MINVALUE and MAXVALUE), lowest first.
const PARTS_SQL: &str = "SELECT c.relname::text, \
     substring(b FROM $re$FROM \\('([^']+)'\\)$re$)::date - date '1970-01-01', \
     substring(b FROM $re$TO \\('([^']+)'\\)$re$)::date - date '1970-01-01' \
     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     CROSS JOIN LATERAL pg_get_expr(c.relpartbound, c.oid) AS b \
     WHERE i.inhparent = 'dedup_records'::regclass ORDER BY 2 NULLS FIRST";

/// The class of the advisory lock that lets one maintainer make a table at a time ("deds").
const MAKER_LOCK_CLASS: i32 = 0x6465_6473;

/// Takes the makers' lock for the transaction, keyed on the schema of `dedup_records`.
const MAKER_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1::int4, hashtext(n.nspname)) \
     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.oid = 'dedup_records'::regclass";

/// How the ranges of the partitioned table are kept ([`maintain_ranges`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangePolicy {
    /// Days per range. Longer ranges mean fewer partitions (each costs every statement a little
    /// planning and executor set-up), shorter ones give the disk back sooner.
    pub days: u32,
    /// How far ahead of now the ranges are made: new keys land in `future` (and are moved, under
    /// the lock, when their range is made) only once maintenance has not run for this long.
    pub ahead: Duration,
    /// How long after a range's last day it is dropped: at least the longest retention of any
    /// policy, plus the longest a key's first delivery may lag its time. A record still live at
    /// the drop is moved, not lost, so a short `keep` costs moves, never correctness.
    pub keep: Duration,
    /// The most records one change may move under the lock; a change that would move more is
    /// held back (and reported) instead of holding every claim that long.
    pub max_move: u64,
}

impl Default for RangePolicy {
    /// Weeks, made 3 days ahead, dropped 8 days after their end (a 7-day retention and a day of
    /// lag), up to 100,000 records moved under the lock.
    fn default() -> Self {
        Self {
            days: 7,
            ahead: Duration::from_secs(3 * 86_400),
            keep: Duration::from_secs(8 * 86_400),
            max_move: 100_000,
        }
    }
}

impl RangePolicy {
    /// Sets the days per range (1 to 366).
    pub fn with_days(mut self, days: u32) -> Self {
        self.days = days.clamp(1, 366);
        self
    }

    /// Sets how far ahead of now ranges are made.
    pub fn with_ahead(mut self, ahead: Duration) -> Self {
        self.ahead = ahead;
        self
    }

    /// Sets how long after its last day a range is dropped.
    pub fn with_keep(mut self, keep: Duration) -> Self {
        self.keep = keep;
        self
    }

    /// Sets the most records one change may move under the lock.
    pub fn with_max_move(mut self, max_move: u64) -> Self {
        self.max_move = max_move;
        self
    }
}

/// What [`maintain_ranges`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangeReport {
    /// Whether `dedup_records` is partitioned by the key's time (if not, nothing was done).
    pub partitioned: bool,
    /// Ranges made, by name.
    pub made: Vec<String>,
    /// Ranges dropped, by name.
    pub dropped: Vec<String>,
    /// Records moved under the lock (out of `future` into a range made, or out of a range
    /// dropped into `late`).
    pub moved: u64,
    /// Days from now to the first day without a range of its own (`future`'s first day): under
    /// a day, new keys are about to land in `future`.
    pub margin_days: Option<i64>,
    /// Why a change was held back, if one was.
    pub held_back: Option<String>,
    /// The days the ranges cover, `[first, end)` in days since the Unix epoch: the bounded
    /// DELETE leaves them alone (a range goes whole).
    pub ranged_days: Option<(i32, i32)>,
}

/// A partition and its bounds in days since the Unix epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Part {
    name: String,
    lo: Option<i32>,
    hi: Option<i32>,
}

/// The partitions as they stand.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Parts(Vec<Part>);

impl Parts {
    async fn read(conn: &mut PgConnection) -> Result<Self, sqlx::Error> {
        let rows: Vec<(String, Option<i32>, Option<i32>)> =
            sqlx::query_as(PARTS_SQL).fetch_all(&mut *conn).await?;
        Ok(Self(
            rows.into_iter()
                .map(|(name, lo, hi)| Part { name, lo, hi })
                .collect(),
        ))
    }

    fn named(&self, name: &str) -> Option<&Part> {
        self.0.iter().find(|p| p.name == name)
    }

    fn future(&self) -> Option<&Part> {
        self.named("dedup_records_future")
    }

    fn late(&self) -> Option<&Part> {
        self.named("dedup_records_late")
    }

    /// The ranges of days, oldest first.
    fn ranges(&self) -> impl Iterator<Item = &Part> {
        self.0.iter().filter(|p| {
            p.lo.is_some()
                && p.hi.is_some()
                && p.name != "dedup_records_late"
                && p.name != "dedup_records_untimed"
        })
    }

    fn ranged_days(&self) -> Option<(i32, i32)> {
        let first = self.ranges().next()?.lo?;
        Some((first, self.future()?.lo?))
    }
}

/// Makes the ranges of days due by `now` (those that hold a day before `now + ahead`) out of
/// `dedup_records_future`, and drops those whose last day is more than `keep` before `now`,
/// moving their live records (and every record a parked message names) to `dedup_records_late`
/// (module docs). Does nothing on a table not partitioned by the key's time. Run by the
/// retention task's leader each round, by `dedup purge`, and by the switch right after it;
/// two at once are safe (each change checks under the lock that the partitions are still as it
/// read them), but one is enough. `now` decides what is due only; what is live is the server's
/// clock's business.
///
/// # Errors
///
/// A [`StoreError`] as [`classify`] sorts it: the parent's lock not had in 200 tries of 100 ms
/// (retryable), a lost connection, a table in the way that is not dedup's.
pub async fn maintain_ranges(
    conn: &mut PgConnection,
    policy: &RangePolicy,
    now: SystemTime,
) -> Result<RangeReport, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let mut report = RangeReport::default();
    let now_ms = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let days = i32::try_from(policy.days.clamp(1, 366)).unwrap_or(7);
    let ahead_ms = i64::try_from(policy.ahead.as_millis()).unwrap_or(i64::MAX);
    let keep_ms = i64::try_from(policy.keep.as_millis()).unwrap_or(i64::MAX);
    // The last day that must have a range of its own.
    let due = day_of(now_ms.saturating_add(ahead_ms));
    for _ in 0..MOST_PER_CALL {
        let parts = Parts::read(conn).await.map_err(e)?;
        let Some(lo) = parts.future().and_then(|f| f.lo) else {
            return Ok(report);
        };
        report.partitioned = true;
        if lo > due {
            break;
        }
        let hi = next_boundary(lo, days);
        match carve(conn, &parts, lo, hi, policy.max_move).await? {
            Step::Done { name, moved } => {
                info!(range = %name, moved, "dedup_records: a range of days made");
                report.made.push(name);
                report.moved += moved;
            }
            Step::HeldBack(why) => {
                warn!(reason = %why, "dedup_records: a range held back");
                report.held_back = Some(why);
                break;
            }
            Step::Raced => {}
        }
    }
    for _ in 0..MOST_PER_CALL {
        let parts = Parts::read(conn).await.map_err(e)?;
        if parts.future().is_none() {
            return Ok(report);
        }
        report.partitioned = true;
        let Some(oldest) = parts.ranges().next().cloned() else {
            break;
        };
        let (Some(lo), Some(hi)) = (oldest.lo, oldest.hi) else {
            break;
        };
        // Never the range that ends where `future` starts (the newest), and only once `keep`
        // has passed since its last day.
        if parts.future().and_then(|f| f.lo) == Some(hi)
            || i64::from(hi).saturating_mul(DAY_MS).saturating_add(keep_ms) > now_ms
        {
            break;
        }
        match drop_range(conn, &parts, &oldest.name, lo, hi, policy.max_move).await? {
            Step::Done { name, moved } => {
                info!(range = %name, moved, "dedup_records: a range of days dropped");
                report.dropped.push(name);
                report.moved += moved;
            }
            Step::HeldBack(why) => {
                warn!(reason = %why, "dedup_records: a drop held back");
                report.held_back = Some(why);
                break;
            }
            Step::Raced => {}
        }
    }
    let parts = Parts::read(conn).await.map_err(e)?;
    report.margin_days = parts
        .future()
        .and_then(|f| f.lo)
        .map(|lo| i64::from(lo) - now_ms.div_euclid(DAY_MS));
    if let Some(margin) = report.margin_days
        && margin < 1
    {
        warn!(
            margin,
            "dedup_records: new keys land in dedup_records_future (no range made ahead); \
             is the retention task running?"
        );
    }
    report.ranged_days = parts.ranged_days();
    Ok(report)
}

/// What one change of the partitions came to.
enum Step {
    Done {
        name: String,
        moved: u64,
    },
    HeldBack(String),
    /// Another maintainer changed the partitions first: read them again.
    Raced,
}

/// The day (since the Unix epoch) of a time in milliseconds.
fn day_of(ms: i64) -> i32 {
    i32::try_from(ms.div_euclid(DAY_MS)).unwrap_or(i32::MAX)
}

/// The first boundary after `day`, boundaries being every `days` days from Monday 1970-01-05.
fn next_boundary(day: i32, days: i32) -> i32 {
    day + days - (day - MONDAY).rem_euclid(days)
}

/// The range's table name: `dedup_records_` and its first day, `YYYYMMDD`.
fn range_name(day: i32) -> String {
    let (y, m, d) = civil(day);
    format!("dedup_records_{y:04}{m:02}{d:02}")
}

/// The proleptic Gregorian date of a day since the Unix epoch (H. Hinnant's `civil_from_days`).
fn civil(day: i32) -> (i32, u32, u32) {
    let z = day + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i32::from(m <= 2);
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

/// Makes `table` (empty, the parent's columns, defaults and checks, its own primary key, and
/// `future`'s storage settings) if it is not there: in a transaction of its own, so the table is
/// there whole or not at all. Its owner is the role that runs this (which must own the parent
/// to attach it); grants on it do not matter, since every statement goes through the parent.
async fn make_table(conn: &mut PgConnection, table: &str) -> Result<(), StoreError> {
    let table = table.to_owned();
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {table} (LIKE dedup_records INCLUDING DEFAULTS \
         INCLUDING CONSTRAINTS, PRIMARY KEY (scope, key))"
    );
    locked(conn, |tx| {
        let (sql, table) = (sql.clone(), table.clone());
        Box::pin(async move {
            // Two `CREATE TABLE IF NOT EXISTS` of one name at once: one fails on the catalog's
            // unique index. One maker at a time; the second then finds the table there.
            sqlx::query(MAKER_LOCK_SQL)
                .bind(MAKER_LOCK_CLASS)
                .execute(&mut *tx)
                .await?;
            // A fixed prefix and a date: nothing from outside.
            tx.execute(sqlx::AssertSqlSafe(sql)).await?;
            // The storage settings the table had before the switch (a fillfactor that leaves
            // room for the completion's update), which `future` carries.
            tx.execute(sqlx::AssertSqlSafe(format!(
                "DO $s$ DECLARE o text[] := (SELECT reloptions FROM pg_class \
                 WHERE oid = 'dedup_records_future'::regclass); BEGIN \
                 IF o IS NOT NULL THEN EXECUTE format('ALTER TABLE {table} SET (%s)', \
                 array_to_string(o, ', ')); END IF; END $s$"
            )))
            .await
            .map(drop)
        })
    })
    .await
}

/// Runs `step` in a transaction with a 100 ms `lock_timeout`, again (after a pause) while it
/// fails for want of a lock, up to [`LOCK_TRIES`] times; commits what it did.
async fn locked<T>(
    conn: &mut PgConnection,
    mut step: impl for<'t> FnMut(
        &'t mut PgConnection,
    ) -> futures_util::future::BoxFuture<'t, Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    let mut tries = 0;
    loop {
        let attempt = async {
            let mut tx = conn.begin().await?;
            lock_timeout(&mut tx).await?;
            let out = step(&mut tx).await?;
            tx.commit().await?;
            Ok(out)
        }
        .await;
        match attempt {
            Err(err) if tries + 1 < LOCK_TRIES && is_lock_timeout(&err) => {
                tries += 1;
                lock_pause().await;
            }
            other => return other.map_err(|e| classify(e, true)),
        }
    }
}

/// Takes the parent's lock and answers whether the partitions are still `seen`.
async fn lock_unchanged(tx: &mut PgConnection, seen: &Parts) -> Result<bool, sqlx::Error> {
    tx.execute("LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE")
        .await?;
    Ok(Parts::read(tx).await? == *seen)
}

/// Moves the rows of `from` that `filter` (a condition on `r`) picks into the parent, every
/// column as it was: the parent routes them by their `kt`. Answers how many.
fn move_sql(from: &str, filter: &str) -> String {
    format!(
        "WITH m AS (DELETE FROM {from} r WHERE {filter} RETURNING r.*), \
         i AS (INSERT INTO dedup_records SELECT (jsonb_populate_record(NULL::dedup_records, \
         to_jsonb(m))).* FROM m RETURNING 1) SELECT count(*) FROM i"
    )
}

/// The condition on `r` that picks the records of `table` a parked message names, found
/// through its primary key, one probe per parked message (never a scan of the range).
fn parked_ctids(table: &str) -> String {
    format!(
        "r.ctid = ANY (ARRAY(SELECT x.ctid FROM dedup_parked p CROSS JOIN LATERAL \
         (SELECT q.ctid FROM {table} q WHERE q.scope = p.dedup_scope AND q.key = p.dedup_key) x))"
    )
}

/// Makes the range `[lo, hi)` out of `dedup_records_future`: detach `future`, attach the range,
/// move `future`'s records of those days into it, attach `future` again from `hi`.
async fn carve(
    conn: &mut PgConnection,
    seen: &Parts,
    lo: i32,
    hi: i32,
    max_move: u64,
) -> Result<Step, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let name = range_name(lo);
    // Counted before the lock; under it the same condition moves whatever is there by then.
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM dedup_records_future \
         WHERE kt < date '1970-01-01' + $1 LIMIT $2) s",
    )
    .bind(hi)
    .bind(
        i64::try_from(max_move)
            .unwrap_or(i64::MAX)
            .saturating_add(1),
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(e)?;
    if u64::try_from(due).unwrap_or(0) > max_move {
        return Ok(Step::HeldBack(format!(
            "dedup_records_future holds more than {max_move} records of the days of {name}: \
             making it would move them under the table's lock (raise max_move, or make it at \
             a quiet hour)"
        )));
    }
    make_table(conn, &name).await?;
    let seen = seen.clone();
    let moved = locked(conn, |tx| {
        let (seen, name) = (seen.clone(), name.clone());
        Box::pin(async move {
            if !lock_unchanged(tx, &seen).await? {
                return Ok(None);
            }
            tx.execute("ALTER TABLE dedup_records DETACH PARTITION dedup_records_future")
                .await?;
            // Day numbers and fixed names: nothing from outside.
            let attach = format!(
                "ALTER TABLE dedup_records ATTACH PARTITION {name} FOR VALUES \
                 FROM (date '1970-01-01' + {lo}) TO (date '1970-01-01' + {hi})"
            );
            tx.execute(sqlx::AssertSqlSafe(attach)).await?;
            let moved: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(move_sql(
                "dedup_records_future",
                &format!("r.kt < date '1970-01-01' + {hi}"),
            )))
            .fetch_one(&mut *tx)
            .await?;
            let future = format!(
                "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_future FOR VALUES \
                 FROM (date '1970-01-01' + {hi}) TO (MAXVALUE)"
            );
            tx.execute(sqlx::AssertSqlSafe(future)).await?;
            Ok(Some(u64::try_from(moved).unwrap_or(0)))
        })
    })
    .await?;
    Ok(moved.map_or(Step::Raced, |moved| Step::Done { name, moved }))
}

/// Drops the range `name`, `[lo, hi)`: detach it, widen `late` over its days (or make `late`
/// of them), move its live records and those a parked message names into `late`, drop it.
async fn drop_range(
    conn: &mut PgConnection,
    seen: &Parts,
    name: &str,
    lo: i32,
    hi: i32,
    max_move: u64,
) -> Result<Step, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let limit = i64::try_from(max_move)
        .unwrap_or(i64::MAX)
        .saturating_add(1);
    // Counted before the lock, through the range's index on expires_at and its primary key.
    let live: Result<i64, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM {name} \
         WHERE expires_at > statement_timestamp() LIMIT $1) s) + \
         (SELECT count(*) FROM dedup_parked p CROSS JOIN LATERAL (SELECT 1 FROM {name} q \
         WHERE q.scope = p.dedup_scope AND q.key = p.dedup_key) x)"
    )))
    .bind(limit)
    .fetch_one(&mut *conn)
    .await;
    let live = match live {
        // Another maintainer dropped it since the partitions were read.
        Err(err) if err.as_database_error().and_then(|d| d.code()).as_deref() == Some("42P01") => {
            return Ok(Step::Raced);
        }
        other => other.map_err(e)?,
    };
    if u64::try_from(live).unwrap_or(0) > max_move {
        return Ok(Step::HeldBack(format!(
            "{name} still holds more than {max_move} live or parked records: dropping it would \
             move them under the table's lock (is `keep` shorter than the longest retention?)"
        )));
    }
    // `late` must start where the ranges do: it is made of the first range dropped.
    let late_lo = match seen.late() {
        Some(late) if late.hi == Some(lo) => late.lo.unwrap_or(lo),
        Some(late) => {
            return Err(classify(
                sqlx::Error::Protocol(format!(
                    "dedup_records_late ends at day {:?}, not where {name} starts ({lo})",
                    late.hi
                )),
                false,
            ));
        }
        None => lo,
    };
    if seen.late().is_none() {
        make_table(conn, "dedup_records_late").await?;
    }
    let (seen, name) = (seen.clone(), name.to_owned());
    let moved = locked(conn, |tx| {
        let (seen, name) = (seen.clone(), name.clone());
        Box::pin(async move {
            if !lock_unchanged(tx, &seen).await? {
                return Ok(None);
            }
            let widen = format!(
                "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_late FOR VALUES \
                 FROM (date '1970-01-01' + {late_lo}) TO (date '1970-01-01' + {hi})"
            );
            tx.execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE dedup_records DETACH PARTITION {name}"
            )))
            .await?;
            if seen.late().is_some() {
                tx.execute("ALTER TABLE dedup_records DETACH PARTITION dedup_records_late")
                    .await?;
            }
            tx.execute(sqlx::AssertSqlSafe(widen)).await?;
            // The live records, through the range's index on expires_at; then the expired
            // ones a parked message names, through its primary key.
            let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(move_sql(
                &name,
                "r.expires_at > statement_timestamp()",
            )))
            .fetch_one(&mut *tx)
            .await?;
            let parked: i64 =
                sqlx::query_scalar(sqlx::AssertSqlSafe(move_sql(&name, &parked_ctids(&name))))
                    .fetch_one(&mut *tx)
                    .await?;
            tx.execute(sqlx::AssertSqlSafe(format!("DROP TABLE {name}")))
                .await?;
            Ok(Some(u64::try_from(live + parked).unwrap_or(0)))
        })
    })
    .await?;
    Ok(moved.map_or(Step::Raced, |moved| Step::Done { name, moved }))
}

#[cfg(test)]
mod tests {
    use super::{civil, next_boundary, range_name};

    #[test]
    fn ranges_are_named_after_their_first_day() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(-1), (1969, 12, 31));
        assert_eq!(civil(20_419), (2025, 11, 27));
        assert_eq!(civil(11_016), (2000, 2, 29));
        assert_eq!(range_name(20_784), "dedup_records_20261127");
    }

    #[test]
    fn weeks_end_on_mondays() {
        // 2026-11-27 is a Friday; the next Monday is 2026-11-30, day 20,787.
        assert_eq!(next_boundary(20_784, 7), 20_787);
        assert_eq!(next_boundary(20_787, 7), 20_794);
        assert_eq!(next_boundary(20_784, 1), 20_785);
        assert_eq!(next_boundary(4, 7), 11);
        assert_eq!(next_boundary(3, 7), 4);
    }
}
