//! Cold ranges of days frozen once (docs/ARCHITECTURE.md, invariant 37).
//!
//! A range gets its keys' first claims while its days last, and few writes after (a late key, a
//! completion of a lease taken then). Postgres must freeze every row it keeps for longer than
//! `autovacuum_freeze_max_age` transactions (200 million by default): an anti-wraparound
//! autovacuum then reads the whole table and writes every page, at a moment of its choosing.
//! Whether a range lives that long depends on the mode: a claim and a completion per message
//! spend two transactions a key (5,000 keys a second: the age in under 6 hours), the batch modes
//! one or two a batch of up to 128 (the age in weeks: a range is dropped first). Freezing costs
//! a full read and write of the range (10 million records: 13.5 s and 1.6 GB of WAL, measured),
//! so it is done only where that vacuum would come anyway.
//!
//! [`freeze_cold`] freezes a range once, in the retention's own round, when it is cold
//! (`freeze_after` past its last day), not yet due for dropping, and half its
//! `autovacuum_freeze_max_age` (the table's, or the server's) has passed since it was last
//! frozen or made: `VACUUM (FREEZE)`, then a comment on the table (`dedup: frozen`), so no later
//! round does it again. Its pages are then all-frozen in the visibility map, which the
//! anti-wraparound vacuums that still come skip. A comment an operator put on the range is left
//! as it is (never overwritten): such a range is not marked, and is frozen again each time half
//! its `autovacuum_freeze_max_age` passes, which reads and writes only the pages changed since
//! (a freezing vacuum skips the all-frozen ones).
//!
//! A freeze cannot take a range's `relfrozenxid` past the oldest transaction the database's
//! vacuums must keep (a long or idle-in-transaction session, a prepared transaction, a
//! replication slot, a standby's feedback). Where that transaction is itself half an
//! `autovacuum_freeze_max_age` old, the range is still due after its VACUUM: the first one
//! still freezes every row older than that transaction, but each round after it would read the
//! range again for nothing (all of it where its rows are newer). So a due range already frozen
//! about as far as that transaction allows (its `relfrozenxid` within a tenth of the half of
//! it) is held back, and the round's report says what holds it and how old it is
//! (`RangeReport::held_back`, a warning in the log): the anti-wraparound vacuum can get no
//! further either, so it is the operator's to end.
//!
//! One range a round. The VACUUM is bounded by the session's `statement_timeout` (the retention
//! task's, 30 s by default) and skips a range whose lock it cannot have at once (`SKIP_LOCKED`:
//! the range is marked only if its `relfrozenxid` did move); one cut short keeps
//! what it froze (the visibility map's bits are set page by page) and the next round goes on
//! from there, since a freezing vacuum skips the pages already all-frozen. Its reads and writes
//! go as fast as the disk allows unless the role's `vacuum_cost_delay` says otherwise.

use std::time::Duration;

use sqlx::Executor;
use sqlx::postgres::PgConnection;
use tracing::{info, warn};

use super::ranges::{DAY_MS, Parts};

/// The comment a frozen range carries.
const MARK: &str = "dedup: frozen";

/// What [`freeze_cold`] came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Freeze {
    /// No range was due, or one was skipped (its lock busy) or failed (logged): next round.
    Nothing,
    /// This range was frozen now.
    Frozen(String),
    /// A range was due, and the oldest transaction the vacuums must keep is too old for its
    /// freeze to bring it back from half its anti-wraparound age: why, for the report.
    HeldBack(String),
}

/// Freezes the oldest range that is cold (`after` past its last day), not due for dropping
/// (`keep` past it), not frozen yet and half-way to its anti-wraparound vacuum (module docs).
/// A failure is logged and left to the next round (it never stops the retention).
pub(super) async fn freeze_cold(
    conn: &mut PgConnection,
    parts: &Parts,
    now_ms: i64,
    after: Option<Duration>,
    keep: Duration,
) -> Freeze {
    let Some(after) = after else {
        return Freeze::Nothing;
    };
    let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
    let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
    for range in parts.ranges() {
        let Some(hi) = range.hi else {
            return Freeze::Nothing;
        };
        let end = i64::from(hi).saturating_mul(DAY_MS);
        if end.saturating_add(keep_ms) <= now_ms {
            // Due for dropping (held back this round): not worth a full write.
            continue;
        }
        if end.saturating_add(after_ms) > now_ms {
            // Oldest first: no later range is colder.
            return Freeze::Nothing;
        }
        match freeze(conn, parts, &range.name).await {
            Ok(Freeze::Nothing) => {}
            Ok(Freeze::Frozen(name)) => {
                info!(range = %name, "dedup_records: a cold range of days frozen");
                return Freeze::Frozen(name);
            }
            Ok(Freeze::HeldBack(why)) => {
                warn!(range = %range.name, reason = %why,
                    "dedup_records: a cold range of days not frozen this round");
                return Freeze::HeldBack(why);
            }
            Err(err) => {
                warn!(range = %range.name, error = %err,
                    "dedup_records: a cold range of days not frozen this round");
                return Freeze::Nothing;
            }
        }
    }
    Freeze::Nothing
}

/// Whether the range `$1` (qualified) is to be frozen: not marked (`$2`), and half its
/// `autovacuum_freeze_max_age` past since its rows were last frozen (the table's setting where
/// it is lower than the server's, which autovacuum caps it at); that half; and the age of its
/// `relfrozenxid`. No row: the table is gone.
const DUE_SQL: &str = "SELECT obj_description(c.oid, 'pg_class') IS DISTINCT FROM $2 \
     AND age(c.relfrozenxid) >= h.half, h.half::int8, age(c.relfrozenxid)::int8 \
     FROM pg_class c CROSS JOIN LATERAL (SELECT least(coalesce((SELECT o.option_value::int8 \
     FROM pg_options_to_table(c.reloptions) o WHERE o.option_name = 'autovacuum_freeze_max_age'), \
     current_setting('autovacuum_freeze_max_age')::int8), \
     current_setting('autovacuum_freeze_max_age')::int8) / 2 AS half) h \
     WHERE c.oid = to_regclass($1)";

/// The oldest transaction this database's vacuums must keep, as Postgres 15 counts it for a
/// table that is not shared: its age and what holds it. A session of this database (its
/// transaction id or its snapshot's xmin; not this one, not an autovacuum worker, which other
/// vacuums do not wait for: the one process without a role), one of no database (a standby's
/// feedback through its walsender), a replication slot's `xmin` (not its `catalog_xmin`, which
/// holds only the catalogs), a prepared transaction of this database; each older by
/// `vacuum_defer_cleanup_age` where the server has it. (Every role sees these ids; a manual
/// VACUUM elsewhere, which vacuums do not wait for, is counted: a freeze held back one round
/// more.) No row: none.
const HORIZON_SQL: &str = "SELECT h.age::int8 + d.defer, h.what FROM ( \
     SELECT greatest(age(a.backend_xid), age(a.backend_xmin)) AS age, \
         format('session %s (%s, %s)', a.pid, coalesce(a.backend_type, '?'), \
         coalesce(a.state, '?')) AS what \
     FROM pg_stat_activity a \
     WHERE (a.datname = current_database() OR a.datid IS NULL) \
         AND a.pid <> pg_backend_pid() AND a.usesysid IS NOT NULL \
         AND a.backend_type IS DISTINCT FROM 'autovacuum worker' \
     UNION ALL SELECT age(s.xmin), format('replication slot %s', s.slot_name) \
     FROM pg_replication_slots s \
     UNION ALL SELECT age(p.transaction), format('prepared transaction %s', p.gid) \
     FROM pg_prepared_xacts p WHERE p.database = current_database()) h \
     CROSS JOIN (SELECT coalesce(current_setting('vacuum_defer_cleanup_age', true), '0')::int8 \
     AS defer) d \
     WHERE h.age IS NOT NULL ORDER BY h.age DESC LIMIT 1";

/// How far a freeze must be able to move a range's `relfrozenxid` forward to be worth its
/// read: a tenth of the range's half `autovacuum_freeze_max_age` (10 million transaction ids
/// at the default). A range frozen as far as the oldest transaction kept allows is left until
/// that one ends.
const WORTH_DIVISOR: i64 = 10;

/// Whether the range `table` (qualified) is due for freezing, half its anti-wraparound age and
/// the age of its `relfrozenxid` (`DUE_SQL`); None if it is gone.
async fn due(
    conn: &mut PgConnection,
    table: &str,
) -> Result<Option<(bool, i64, i64)>, sqlx::Error> {
    sqlx::query_as(DUE_SQL)
        .bind(table)
        .bind(MARK)
        .fetch_optional(&mut *conn)
        .await
}

/// Freezes the range `name` if it is due and its freeze can take it back from due.
async fn freeze(conn: &mut PgConnection, parts: &Parts, name: &str) -> Result<Freeze, sqlx::Error> {
    let table = parts.q(name);
    // Gone (dropped by another maintainer since the partitions were read), frozen already, or
    // far from its anti-wraparound vacuum.
    let Some((true, half, frozen_age)) = due(conn, &table).await? else {
        return Ok(Freeze::Nothing);
    };
    // A freeze cannot take the range's relfrozenxid past the oldest transaction kept. Where
    // that one is as old as half, the range stays due after it; where the range is frozen
    // about as far as that one allows already (a round before did it), a VACUUM would read the
    // range again for nothing.
    let oldest: Option<(i64, String)> = sqlx::query_as(HORIZON_SQL)
        .fetch_optional(&mut *conn)
        .await?;
    let worth = (half / WORTH_DIVISOR).max(1);
    if let Some((age, what)) =
        oldest.filter(|(age, _)| *age >= half && frozen_age.saturating_sub(*age) < worth)
    {
        return Ok(Freeze::HeldBack(format!(
            "{name} not frozen: it is frozen as far as the oldest transaction the vacuums must \
             keep allows, {age} transaction ids old (half the range's \
             autovacuum_freeze_max_age is {half}), held by {what}; a freeze, or the \
             anti-wraparound vacuum, can take it no further until that one ends"
        )));
    }
    // Never waits for the range's lock (a change of the partitions, another vacuum): skipped
    // then, with a warning only, which the check after it sees (no session setting to put back
    // if this future is dropped midway).
    // The schema's quoted name, a fixed prefix and a date: nothing from outside.
    conn.execute(sqlx::AssertSqlSafe(format!(
        "VACUUM (FREEZE, SKIP_LOCKED) {table}"
    )))
    .await?;
    if !matches!(due(conn, &table).await?, Some((false, _, _))) {
        // Skipped (or gone): the next round tries again.
        return Ok(Freeze::Nothing);
    }
    // Marked only where the range has no comment: an operator's stays. Asked bound (a name
    // from the catalog never goes into a literal), then marked by its name, of dedup's making.
    let bare: bool = sqlx::query_scalar("SELECT obj_description($1::regclass, 'pg_class') IS NULL")
        .bind(&table)
        .fetch_one(&mut *conn)
        .await?;
    if bare {
        conn.execute(sqlx::AssertSqlSafe(format!(
            "COMMENT ON TABLE {table} IS '{MARK}'"
        )))
        .await?;
    }
    Ok(Freeze::Frozen(name.to_owned()))
}
