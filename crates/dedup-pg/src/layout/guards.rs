//! What refuses a record without `kt` on the partitioned table: `kt` has no default (module docs
//! of `layout`; docs/ARCHITECTURE.md, invariant 36). Binaries of generations 7 to 9 gave the
//! parent a check `kt = dedup_kt(key)` instead, with the default kept, and Postgres compiled that
//! check again for every statement that wrote (14% of its CPU in a profile of transaction mode by
//! the batch, docs/PERFORMANCE.md). [`drop_left`] takes both off a table they switched, and off
//! any table of theirs not attached yet, in a change of the partitions like any other.

use sqlx::Executor;
use sqlx::postgres::PgConnection;
use tracing::info;

use dedup_core::StoreError;

use super::locks::{Touched, lock_busy_why, lock_unchanged, locked};
use super::ranges::Parts;
use crate::classify::classify;

/// The tables of the records' family in the parent's schema (the parent, its partitions, a
/// table made for a range and not attached yet; not the ones renamed to be dropped) that still
/// have the check `dedup_records_kt` or a default for `kt`, quoted, the parent first. Only names
/// of dedup's exact making, of tables the parent's owner owns: a look-alike another role made
/// (with a `kt` default of its own) is not dedup's to change, and would fail every round.
const LEFT_SQL: &str = "SELECT quote_ident(c.relname) FROM pg_class c \
     WHERE c.relnamespace = (SELECT relnamespace FROM pg_class \
         WHERE oid = 'dedup_records'::regclass) \
     AND c.relowner = (SELECT relowner FROM pg_class WHERE oid = 'dedup_records'::regclass) \
     AND c.relkind IN ('r', 'p') \
     AND c.relname ~ '^dedup_records(_untimed|_late|_future|_[0-9]{8})?$' \
     AND (EXISTS (SELECT 1 FROM pg_constraint k \
             WHERE k.conrelid = c.oid AND k.conname = 'dedup_records_kt') \
         OR EXISTS (SELECT 1 FROM pg_attribute a \
             WHERE a.attrelid = c.oid AND a.attname = 'kt' AND a.atthasdef)) \
     ORDER BY c.oid <> 'dedup_records'::regclass, c.relname";

/// Drops the check `dedup_records_kt` and the default of `kt` wherever [`LEFT_SQL`] finds them,
/// under the makers' and the parent's locks. Answers why it was held back (the parent's lock not
/// had), or None if it is done or there was nothing to do.
pub(super) async fn drop_left(
    conn: &mut PgConnection,
    seen: &Parts,
) -> Result<Option<String>, StoreError> {
    let left: Vec<String> = sqlx::query_scalar(LEFT_SQL)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    if left.is_empty() {
        return Ok(None);
    }
    let seen = seen.clone();
    let done = locked(conn, |tx| {
        let seen = seen.clone();
        Box::pin(async move {
            if !lock_unchanged(tx, &seen, Touched::All).await? {
                return Ok(false);
            }
            // The parent's first: both reach every attached partition.
            let mut left: Vec<String> = sqlx::query_scalar(LEFT_SQL).fetch_all(&mut *tx).await?;
            if left.first().is_some_and(|t| t == "dedup_records") {
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {} ALTER COLUMN kt DROP DEFAULT",
                    seen.q("dedup_records")
                )))
                .await?;
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {} DROP CONSTRAINT IF EXISTS dedup_records_kt",
                    seen.q("dedup_records")
                )))
                .await?;
                left = sqlx::query_scalar(LEFT_SQL).fetch_all(&mut *tx).await?;
            }
            // Then each table left with its own: one not attached, or one that had it locally.
            for table in &left {
                let table = seen.q(table);
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {table} ALTER COLUMN kt DROP DEFAULT"
                )))
                .await?;
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS dedup_records_kt"
                )))
                .await?;
            }
            Ok(true)
        })
    })
    .await?;
    Ok(match done {
        Err(busy) => Some(lock_busy_why(
            "kt's check and default of generation 9 dropped",
            &busy,
        )),
        // Another maintainer changed the partitions first: the next round does it.
        Ok(false) => None,
        Ok(true) => {
            info!(
                tables = left.len(),
                "dedup_records: kt's check and default dropped"
            );
            None
        }
    })
}
