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
//!
//! Here: the partitions as read (`Parts`), the maintainer's round and its tally, and what the
//! changes share (`Step`, `lock_busy`, `count_limit`, `look_alike`). A range's making is
//! `carve.rs`; the days, their boundaries and the ranges' names are `days.rs`.

use std::time::SystemTime;

use sqlx::postgres::PgConnection;
use tracing::{info, warn};

use dedup_core::StoreError;

use super::carve::carve;
use super::days::{day_of, next_boundary};
use super::drop::{self, Due, clear_gone};
use super::expiry;
use super::freeze;
use super::guards;
use super::locks::{Busy, lock_busy_why};
use super::policy::{MOST_AHEAD, RangePolicy, RangeReport};
use crate::classify::classify;

// What `drop.rs` and `freeze.rs` import from here, though `carve.rs` and `days.rs` hold it.
pub(super) use super::carve::make_table;
pub(super) use super::days::{DAY_MS, civil};

/// The most ranges one call makes, and the most it drops (a clock that jumped years would
/// otherwise make a partition for every week between).
const MOST_PER_CALL: usize = 16;

/// The partitions of `dedup_records` and their bounds in days since the Unix epoch (None for
/// MINVALUE and MAXVALUE), lowest first. The bounds are printed with no relation (`0`): given
/// one, `pg_get_expr` takes an ACCESS SHARE lock on it, and a read of the partitions under the
/// parent's lock would wait for every partition something holds in ACCESS EXCLUSIVE mode (a
/// `VACUUM FULL`, a `TRUNCATE`, an autovacuum cutting a table's tail), every claim queued
/// behind it. A bound holds only constants.
///
/// A partition's name is written into statements as it is, so only names of dedup's exact
/// making count (`dedup_records_untimed`, `_late`, `_future`, `_YYYYMMDD`: lower-case letters,
/// digits and underscores, never a quote); any other partition is left out, with one warning
/// (`Parts::read`). Its owner is not asked: attaching a partition takes the parent's owner, and
/// `ALTER TABLE dedup_records OWNER TO` leaves the partitions' owners as they were.
const PARTS_SQL: &str = "SELECT c.relname::text, \
     substring(b FROM $re$FROM \\('([^']+)'\\)$re$)::date - date '1970-01-01', \
     substring(b FROM $re$TO \\('([^']+)'\\)$re$)::date - date '1970-01-01', \
     c.relname ~ '^dedup_records_(untimed|late|future|[0-9]{8})$' \
     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
     CROSS JOIN LATERAL pg_get_expr(c.relpartbound, 0) AS b \
     WHERE i.inhparent = 'dedup_records'::regclass ORDER BY 2 NULLS FIRST";

/// Warns once per process about a table that looks like one of dedup's and is not (its name is
/// not of dedup's making, or another role owns it): it is left alone.
pub(super) fn look_alike(what: &str, name: &str) {
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if warned.iter().any(|n| n == name) {
        return;
    }
    warned.push(name.to_owned());
    warn!(table = %name.escape_debug(), what,
        "dedup_records: a table that is not dedup's (a name not of its making, or another \
         owner's) is left alone");
}

/// The schema of `dedup_records`, quoted: the partitions' tables are made and named in it.
const SCHEMA_SQL: &str = "SELECT quote_ident(n.nspname), (SELECT string_agg(quote_ident(a.attname), \
     ',' ORDER BY a.attnum) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 \
     AND NOT a.attisdropped) FROM pg_class c \
     JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'dedup_records'::regclass";

/// A partition and its bounds in days since the Unix epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Part {
    pub(super) name: String,
    pub(super) lo: Option<i32>,
    pub(super) hi: Option<i32>,
}

/// The partitions as they stand, the parent's schema (quoted), which their tables are in, and
/// the parent's columns (quoted, in order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Parts(Vec<Part>, String, pub(super) String);

impl Parts {
    pub(super) async fn read(conn: &mut PgConnection) -> Result<Self, sqlx::Error> {
        let rows: Vec<(String, Option<i32>, Option<i32>, bool)> =
            sqlx::query_as(PARTS_SQL).fetch_all(&mut *conn).await?;
        let (schema, cols): (String, String) =
            sqlx::query_as(SCHEMA_SQL).fetch_one(&mut *conn).await?;
        // Written into statements (and format() strings in DO blocks): a schema whose quoted
        // name holds a quote, `%` or `$` would break them, and a backslash would read another
        // way in a string literal where `standard_conforming_strings` is off.
        if schema.contains(['\'', '%', '$', '\\']) {
            return Err(sqlx::Error::Protocol(format!(
                "the schema of dedup_records ({schema}) has a quote, %, $ or backslash in its \
                 name: ranges of days are not kept in it"
            )));
        }
        Ok(Self(
            rows.into_iter()
                .filter(|(name, _, _, ours)| {
                    if !ours {
                        look_alike("a partition of dedup_records", name);
                    }
                    *ours
                })
                .map(|(name, lo, hi, _)| Part { name, lo, hi })
                .collect(),
            schema,
            cols,
        ))
    }

    /// The parent's columns, quoted, in order, each prefixed with `alias.`.
    pub(super) fn cols(&self, alias: &str) -> String {
        self.2
            .split(',')
            .map(|c| format!("{alias}.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `name` in the parent's schema.
    pub(super) fn q(&self, name: &str) -> String {
        format!("{}.{name}", self.1)
    }

    pub(super) fn named(&self, name: &str) -> Option<&Part> {
        self.0.iter().find(|p| p.name == name)
    }

    pub(super) fn future(&self) -> Option<&Part> {
        self.named("dedup_records_future")
    }

    pub(super) fn late(&self) -> Option<&Part> {
        self.named("dedup_records_late")
    }

    /// Every partition, lowest first.
    pub(super) fn all(&self) -> impl Iterator<Item = &Part> {
        self.0.iter()
    }

    /// Whether `p` is a range of days (not `untimed`, `late` or `future`, whose upper bound is
    /// MAXVALUE).
    pub(super) fn is_range(&self, p: &Part) -> bool {
        p.lo.is_some()
            && p.hi.is_some()
            && p.name != "dedup_records_late"
            && p.name != "dedup_records_untimed"
    }

    /// The ranges of days, oldest first.
    pub(super) fn ranges(&self) -> impl Iterator<Item = &Part> {
        self.0.iter().filter(|p| self.is_range(p))
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
/// A [`StoreError`] as [`classify`] sorts it: a lost connection, a statement past the session's
/// `statement_timeout`, a table in the way that is not dedup's. (The parent's lock not had in
/// 20 tries of 100 ms is not an error: the change is held back, `held_back` says so.)
pub async fn maintain_ranges(
    conn: &mut PgConnection,
    policy: &RangePolicy,
    now: SystemTime,
) -> Result<RangeReport, StoreError> {
    // The partitions' bounds are read as text and cast back: in the style sqlx sets at connect,
    // whatever the session's, which is put back after.
    let style: String = sqlx::query_scalar("SELECT current_setting('DateStyle')")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| classify(e, false))?;
    if style != "ISO, MDY" {
        sqlx::query("SELECT set_config('DateStyle', 'ISO, MDY', false)")
            .execute(&mut *conn)
            .await
            .map_err(|e| classify(e, false))?;
    }
    let kept = keep(conn, policy, now).await;
    if style != "ISO, MDY" {
        let _ = sqlx::query("SELECT set_config('DateStyle', $1, false)")
            .bind(&style)
            .execute(&mut *conn)
            .await;
    }
    kept
}

/// [`maintain_ranges`], in the date style it reads bounds in.
async fn keep(
    conn: &mut PgConnection,
    policy: &RangePolicy,
    now: SystemTime,
) -> Result<RangeReport, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let mut report = RangeReport::default();
    // What a run killed before it cleared left.
    clear_gone(conn).await.map_err(e)?;
    // Each partition's own index on expires_at (a table switched or kept by an older binary
    // lacks some). Not had this round (a build past the statement timeout, the lock busy): the
    // ranges are made and dropped all the same, through whichever index is there.
    let parts = Parts::read(conn).await.map_err(e)?;
    if parts.future().is_some() {
        report.partitioned = true;
        let why = match expiry::own_indexes(conn, &parts, policy.max_move).await {
            Ok(why) => why,
            Err(err) => Some(format!(
                "each partition's own index on expires_at not made: {err}; next round"
            )),
        };
        if let Some(why) = why {
            warn!(reason = %why, "dedup_records: a change held back");
            report.hold_back(why);
        }
        // kt's check and default, where a binary of generation 9 or older left them.
        if let Some(why) = guards::drop_left(conn, &parts).await? {
            warn!(reason = %why, "dedup_records: a change held back");
            report.hold_back(why);
        }
    }
    let now_ms = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let days = i32::try_from(policy.days.clamp(1, 366)).unwrap_or(7);
    let ahead_ms = i64::try_from(policy.ahead.min(MOST_AHEAD).as_millis()).unwrap_or(0);
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
        let step = carve(conn, &parts, lo, hi, policy.max_move).await?;
        if report.tally(step, Change::Made) {
            break;
        }
    }
    for _ in 0..MOST_PER_CALL {
        let parts = Parts::read(conn).await.map_err(e)?;
        let Some(future_lo) = parts.future().map(|f| f.lo) else {
            return Ok(report);
        };
        report.partitioned = true;
        // The ranges due, oldest first: never the one that ends where `future` starts (the
        // newest), and only once `keep` has passed since its last day.
        let due: Vec<Due> = parts
            .ranges()
            .map_while(|p| {
                let (lo, hi) = (p.lo?, p.hi?);
                let kept_until = i64::from(hi).saturating_mul(DAY_MS).saturating_add(keep_ms);
                (future_lo != Some(hi) && kept_until <= now_ms).then(|| Due {
                    name: p.name.clone(),
                    lo,
                    hi,
                })
            })
            .take(MOST_PER_CALL.saturating_sub(report.dropped.len()))
            .collect();
        if due.is_empty() {
            break;
        }
        let mut held = false;
        for step in drop::drop_ranges(conn, &parts, &due, policy).await? {
            held |= report.tally(step, Change::Dropped);
        }
        if held {
            break;
        }
    }
    if !report.dropped.is_empty() {
        clear_gone(conn).await.map_err(e)?;
    }
    let parts = Parts::read(conn).await.map_err(e)?;
    match freeze::freeze_cold(conn, &parts, now_ms, policy.freeze_after, policy.keep).await {
        freeze::Freeze::Nothing => {}
        freeze::Freeze::Frozen(name) => report.frozen.push(name),
        freeze::Freeze::HeldBack(why) => report.hold_back(why),
    }
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

/// The days the ranges cover, `[first, end)` in days since the Unix epoch (None on a table not
/// partitioned by the key's time, or without ranges): what the bounded DELETE leaves alone.
///
/// # Errors
///
/// The catalog not read (a lost connection).
pub(crate) async fn ranged_days(conn: &mut PgConnection) -> Result<Option<(i32, i32)>, StoreError> {
    // One read of the catalog (no rows on the single table); the schema is not needed here.
    let rows: Vec<(String, Option<i32>, Option<i32>)> = sqlx::query_as(PARTS_SQL)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let parts = rows
        .into_iter()
        .map(|(name, lo, hi)| Part { name, lo, hi })
        .collect();
    Ok(Parts(parts, String::new(), String::new()).ranged_days())
}

/// Which change of the partitions.
#[derive(Clone, Copy, Debug)]
enum Change {
    Made,
    Dropped,
}

impl RangeReport {
    /// Notes why something was held back, after what already was this round.
    fn hold_back(&mut self, why: String) {
        match &mut self.held_back {
            Some(all) => {
                all.push_str("; ");
                all.push_str(&why);
            }
            None => self.held_back = Some(why),
        }
    }

    /// Counts what a change came to; true if it was held back (the loop stops).
    fn tally(&mut self, step: Step, change: Change) -> bool {
        match step {
            Step::Done { name, moved } => {
                info!(range = %name, moved, ?change, "dedup_records: a range of days");
                self.moved += moved;
                match change {
                    Change::Made => self.made.push(name),
                    Change::Dropped => self.dropped.push(name),
                }
                false
            }
            Step::HeldBack(why) => {
                warn!(reason = %why, ?change, "dedup_records: a change held back");
                self.hold_back(why);
                true
            }
            Step::Raced => false,
        }
    }
}

/// What one change of the partitions came to.
pub(super) enum Step {
    Done {
        name: String,
        moved: u64,
    },
    HeldBack(String),
    /// Another maintainer changed the partitions first: read them again.
    Raced,
}

/// Why a change was held back when the parent's lock was not had.
pub(super) fn lock_busy(what: &str, busy: &Busy) -> Step {
    Step::HeldBack(lock_busy_why(what, busy))
}

/// The `LIMIT` of a count that only needs to know whether more than `max_move` rows are there.
pub(super) fn count_limit(max_move: u64) -> i64 {
    i64::try_from(max_move)
        .unwrap_or(i64::MAX)
        .saturating_add(1)
}
