//! The index on `expires_at` of each partition of the table partitioned by the key's time
//! (docs/ARCHITECTURE.md, invariant 37): each partition has its own, none is the parent's.
//!
//! - **A BRIN index in each range of days.** The one lookup by `expires_at` a range gets is a
//!   drop's, under the parent's lock: the few records still live in a range whose days are long
//!   past. A range's rows arrive in the order of their keys' time, so their `expires_at` rise
//!   with the heap's pages and a BRIN summary of 128 pages finds them; it takes a few kilobytes
//!   where the btree took about 30 bytes a record, and costs an insert next to nothing. The
//!   bounded DELETE never walks a range (a range goes whole, [`super::ranges`]).
//! - **A btree in `dedup_records_untimed`, `dedup_records_late` and `dedup_records_future`**,
//!   which the bounded DELETE purges in the order of `expires_at`.
//!
//! A table switched by a binary of generation 8 or older has the parent's partitioned btree
//! `dedup_records_expires_at_idx` in every partition (and a range such a binary makes after
//! that has none). [`own_indexes`] turns it into the above at the start of every round of
//! [`super::maintain_ranges`]: each partition's own index built concurrently where it lacks
//! one (a BRIN in each range; the parent's btree's pieces in the others already are theirs),
//! then, while the parent's btree is there, one transaction under the parent's lock that detaches the other three (their
//! btrees stay theirs, standalone), drops the parent's index (and with it the ranges' btrees),
//! and attaches the three again with the bounds they had (`untimed`'s check spares its attach a
//! scan; `late` and `future` are small). Killed anywhere, it is done again by the next round:
//! an index build killed halfway leaves an invalid index, dropped and built again; the
//! transaction rolls back whole.

use sqlx::Executor;
use sqlx::postgres::PgConnection;
use tracing::info;

use dedup_core::StoreError;

use super::locks::{Touched, lock_busy_why, lock_unchanged, locked};
use super::ranges::{Parts, count_limit};
use crate::classify::classify;

/// Which index on `expires_at` a partition gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Expiry {
    /// A range of days: BRIN.
    Brin,
    /// `untimed`, `late`, `future`: a btree.
    Btree,
}

/// The name of the index on `expires_at` of the table `name` (unqualified).
pub(super) fn index_name(name: &str, kind: Expiry) -> String {
    match kind {
        Expiry::Brin => format!("{name}_expires_at_brin"),
        Expiry::Btree => format!("{name}_expires_at_idx"),
    }
}

/// The statement that gives the table `name` (`table` qualified) its index on `expires_at`, in
/// the transaction that makes it (the table is empty then: no build to speak of).
pub(super) fn index_sql(table: &str, name: &str, kind: Expiry) -> String {
    let index = index_name(name, kind);
    match kind {
        Expiry::Brin => {
            format!("CREATE INDEX IF NOT EXISTS {index} ON {table} USING brin (expires_at)")
        }
        Expiry::Btree => format!("CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at)"),
    }
}

/// Whether the parent still has the partitioned btree a switch of generation 8 or older made.
const PARENT_INDEX_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid \
     WHERE i.indrelid = 'dedup_records'::regclass AND c.relname = 'dedup_records_expires_at_idx')";

/// Whether the index `$2` of the table `$1` (qualified) exists, and whether it is valid.
const INDEX_STATE_SQL: &str = "SELECT i.indisvalid FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid \
     WHERE i.indrelid = to_regclass($1) AND c.relname = $2";

/// The partition bound of the table `$1` (qualified), as `ATTACH PARTITION` takes it (printed
/// with no relation, which takes no lock on it: `ranges.rs`'s `PARTS_SQL`).
const BOUND_SQL: &str = "SELECT pg_get_expr(c.relpartbound, 0) FROM pg_class c \
     WHERE c.oid = to_regclass($1)";

/// Makes sure the partition `name` has a valid index on `expires_at` of the `kind` given, built
/// concurrently if it has none (writers go on meanwhile), built again if a killed build left
/// it invalid.
async fn own_index(
    conn: &mut PgConnection,
    parts: &Parts,
    name: &str,
    kind: Expiry,
) -> Result<(), sqlx::Error> {
    let table = parts.q(name);
    let index = index_name(name, kind);
    let state: Option<bool> = sqlx::query_scalar(INDEX_STATE_SQL)
        .bind(&table)
        .bind(&index)
        .fetch_optional(&mut *conn)
        .await?;
    if state == Some(true) {
        return Ok(());
    }
    // Another maintainer building it now: left to it (a drop checks the index under its lock).
    let building: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p \
         WHERE p.relid = to_regclass($1))",
    )
    .bind(&table)
    .fetch_one(&mut *conn)
    .await?;
    if building {
        return Ok(());
    }
    // The schema's quoted name, a fixed prefix and a date: nothing from outside.
    if state == Some(false) {
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {}",
            parts.q(&index)
        )))
        .await?;
    }
    let using = match kind {
        Expiry::Brin => "USING brin ",
        Expiry::Btree => "",
    };
    conn.execute(sqlx::AssertSqlSafe(format!(
        "CREATE INDEX CONCURRENTLY {index} ON {table} {using}(expires_at)"
    )))
    .await
    .map(drop)
}

/// Gives each partition its own index on `expires_at` where it lacks one (a table a binary of
/// generation 8 made), and turns the parent's btree (a switch of generation 8) into the
/// partitions' own (module docs). Answers why it was held back (the parent's lock not had), or
/// None if it is done or there was nothing to do.
pub(super) async fn own_indexes(
    conn: &mut PgConnection,
    seen: &Parts,
    max_move: u64,
) -> Result<Option<String>, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    for part in seen.all() {
        let kind = if seen.is_range(part) {
            Expiry::Brin
        } else {
            Expiry::Btree
        };
        own_index(conn, seen, &part.name, kind).await.map_err(e)?;
    }
    let parent: bool = sqlx::query_scalar(PARENT_INDEX_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(e)?;
    if !parent {
        return Ok(None);
    }
    // `future`'s attach under the lock reads it to check its bound: held back while it holds
    // more than a change may move (the carve that empties it is held back the same way).
    let future = seen.q("dedup_records_future");
    let held: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT 1 FROM {future} LIMIT $1) s"
    )))
    .bind(count_limit(max_move))
    .fetch_one(&mut *conn)
    .await
    .map_err(e)?;
    if u64::try_from(held).unwrap_or(0) > max_move {
        return Ok(Some(format!(
            "the ranges' BRIN indexes on expires_at: dedup_records_future holds more than \
             {max_move} records, which its attach under the lock would read; next round"
        )));
    }
    let others: Vec<String> = ["dedup_records_untimed", "dedup_records_late"]
        .into_iter()
        .filter(|n| seen.named(n).is_some())
        .chain(seen.future().map(|_| "dedup_records_future"))
        .map(|n| seen.q(n))
        .collect();
    let seen = seen.clone();
    let done = locked(conn, |tx| {
        let (seen, others) = (seen.clone(), others.clone());
        Box::pin(async move {
            if !lock_unchanged(tx, &seen, Touched::All).await? {
                return Ok(false);
            }
            let mut bounds = Vec::with_capacity(others.len());
            for table in &others {
                let bound: String = sqlx::query_scalar(BOUND_SQL)
                    .bind(table)
                    .fetch_one(&mut *tx)
                    .await?;
                bounds.push(bound);
            }
            // Names from the catalog (quoted) and bounds as the server printed them.
            for table in &others {
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE dedup_records DETACH PARTITION {table}"
                )))
                .await?;
            }
            tx.execute(sqlx::AssertSqlSafe(format!(
                "DROP INDEX {}",
                seen.q("dedup_records_expires_at_idx")
            )))
            .await?;
            for (table, bound) in others.iter().zip(&bounds) {
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE dedup_records ATTACH PARTITION {table} {bound}"
                )))
                .await?;
            }
            // A binary of generation 8 would make ranges without an index on expires_at now.
            tx.execute("UPDATE dedup_schema SET compat_floor = greatest(compat_floor, 9)")
                .await?;
            Ok(true)
        })
    })
    .await?;
    Ok(match done {
        Err(busy) => Some(lock_busy_why(
            "the ranges' BRIN indexes on expires_at",
            &busy,
        )),
        // Another maintainer changed the partitions first: the next round does it.
        Ok(false) => None,
        Ok(true) => {
            info!("dedup_records: each range of days has its own BRIN index on expires_at");
            None
        }
    })
}

/// Brings the BRIN summary of the range `name` up to date (the pages written since the last
/// one; a page range without a summary is read whole by every lookup), so that the lookup of its
/// live records under the lock reads only the pages that hold them. None where the range has
/// no BRIN index (a table whose [`own_indexes`] is held back: the parent's btree serves).
/// It takes the range's `SHARE UPDATE EXCLUSIVE` lock, which an autovacuum of the range holds
/// for as long as it runs: waited for up to the lock timeout only, then 55P03 (the drop is
/// held back for the round). Claims never wait for that request: their lock does not conflict.
pub(super) async fn summarize(
    conn: &mut PgConnection,
    parts: &Parts,
    name: &str,
) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    super::lock_timeout(&mut tx).await?;
    sqlx::query(
        "SELECT brin_summarize_new_values(i.indexrelid) FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE i.indrelid = to_regclass($1) AND c.relname = $2 AND i.indisvalid",
    )
    .bind(parts.q(name))
    .bind(index_name(name, Expiry::Brin))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Whether the range `name` has a valid index led by `expires_at` (None: the table is gone,
/// dropped by another maintainer since the partitions were read). A drop refuses a range
/// without one: finding its live records would read the whole range under the lock.
pub(super) async fn indexed(
    conn: &mut PgConnection,
    parts: &Parts,
    name: &str,
) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a \
         ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
         WHERE i.indrelid = t.oid AND a.attname = 'expires_at' AND i.indisvalid) \
         FROM (SELECT to_regclass($1) AS oid) t WHERE t.oid IS NOT NULL",
    )
    .bind(parts.q(name))
    .fetch_optional(&mut *conn)
    .await
}
