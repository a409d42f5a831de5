//! A range of days made: its table made, empty, in a transaction of its own (`make_table`, which
//! `drop.rs` makes `dedup_records_late` with too), then carved out of `dedup_records_future`
//! under the parent's lock, `future`'s records of its days moved into it (`carve`).

use sqlx::Executor;
use sqlx::postgres::PgConnection;

use dedup_core::StoreError;

use super::days::range_name;
use super::expiry::{self, Expiry};
use super::locks::{Busy, MAKER_LOCK_CLASS, MAKER_LOCK_SQL, Touched, lock_unchanged, locked};
use super::ranges::{Parts, Step, count_limit, lock_busy};
use crate::classify::classify;

/// Gives the table just made (setting `dedup.made`) the storage settings of `future` (setting
/// `dedup.future`) and the parent's owner. Each name is read as a `regclass` and printed back
/// by Postgres, quoted.
const CARRY_SQL: &str = "DO $s$ DECLARE \
     made regclass := current_setting('dedup.made')::regclass; \
     o text[] := (SELECT reloptions FROM pg_class \
         WHERE oid = current_setting('dedup.future')::regclass); BEGIN \
     IF o IS NOT NULL THEN EXECUTE format('ALTER TABLE %s SET (%s)', made, \
         array_to_string(o, ', ')); END IF; \
     EXECUTE format('ALTER TABLE %s OWNER TO %s', made, (SELECT relowner::regrole \
         FROM pg_class WHERE oid = 'dedup_records'::regclass)); END $s$";

/// Makes `table` in the parent's schema (empty, the parent's columns, defaults and checks, its
/// own primary key and index on `expires_at` of the `kind` given, `future`'s storage settings,
/// the parent's owner) if it is not there: in a
/// transaction of its own, so the table is there whole or not at all. The role that runs this
/// must be able to give it to the parent's owner (be it, or a member of it) and to create in
/// the schema; grants on the table do not matter, since every statement goes through the
/// parent. None if the makers' lock was not had.
pub(super) async fn make_table(
    conn: &mut PgConnection,
    parts: &Parts,
    name: &str,
    kind: Expiry,
) -> Result<Result<(), Busy>, StoreError> {
    let table = parts.q(name);
    let future = parts.q("dedup_records_future");
    let index = expiry::index_sql(&table, name, kind);
    locked(conn, |tx| {
        let (table, future, index) = (table.clone(), future.clone(), index.clone());
        Box::pin(async move {
            // Two `CREATE TABLE` of one name at once: one fails on the catalog's unique index.
            // One maker at a time; the second then finds the table there.
            sqlx::query(MAKER_LOCK_SQL)
                .bind(MAKER_LOCK_CLASS)
                .execute(&mut *tx)
                .await?;
            // Made already (by a maintainer that read the partitions after this one did, or a
            // run killed before its attach): whole, since it is made in one transaction. Left
            // alone: an index or owner change on it now would take its lock in steps, and
            // writers may be using it.
            let there: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(&table)
                .fetch_one(&mut *tx)
                .await?;
            if there {
                return Ok(());
            }
            // The schema's quoted name and a fixed prefix and a date: nothing from outside. The
            // primary key leads with the key: time-ordered keys of every scope then land at its
            // right edge, whose pages split full. Led by the scope, each scope but the last
            // sorting one inserts in the middle, where a page splits in halves that stay half
            // full (116 bytes a record against 74 for three scopes, docs/PERFORMANCE.md). Both
            // orders find a key by its scope and key alike, and the parent has no index whose
            // columns a partition's must match.
            tx.execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {table} (LIKE dedup_records INCLUDING DEFAULTS \
                 INCLUDING CONSTRAINTS, PRIMARY KEY (key, scope))"
            )))
            .await?;
            tx.execute(sqlx::AssertSqlSafe(index)).await?;
            // The storage settings the table had before the switch (a fillfactor that leaves
            // room for the completion's update), which `future` carries; the parent's owner.
            // The names go in bound, through the transaction's settings: none is formatted
            // into a literal, and the DO block is the same text whatever they are.
            sqlx::query(
                "SELECT set_config('dedup.made', $1, true), set_config('dedup.future', $2, true)",
            )
            .bind(&table)
            .bind(&future)
            .execute(&mut *tx)
            .await?;
            tx.execute(CARRY_SQL).await.map(drop)
        })
    })
    .await
}

/// Moves the rows of `from` that `filter` (a condition on `r`) picks into the parent, every
/// column as it was: the parent routes them by their `kt`. Answers how many.
fn move_sql(parts: &Parts, from: &str, filter: &str) -> String {
    format!(
        "WITH m AS (DELETE FROM {from} r WHERE {filter} RETURNING {}), \
         i AS (INSERT INTO dedup_records ({}) SELECT {} FROM m RETURNING 1) \
         SELECT count(*) FROM i",
        parts.cols("r"),
        parts.2,
        parts.cols("m"),
    )
}

/// Makes the range `[lo, hi)` out of `dedup_records_future`: detach `future`, attach the range,
/// move `future`'s records of those days into it, attach `future` again from `hi`.
pub(super) async fn carve(
    conn: &mut PgConnection,
    seen: &Parts,
    lo: i32,
    hi: i32,
    max_move: u64,
) -> Result<Step, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let name = range_name(lo);
    let (range, future) = (seen.q(&name), seen.q("dedup_records_future"));
    // Counted before the lock; under it the same condition moves whatever is there by then.
    let due: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT 1 FROM {future} \
         WHERE kt < date '1970-01-01' + $1 LIMIT $2) s"
    )))
    .bind(hi)
    .bind(count_limit(max_move))
    .fetch_one(&mut *conn)
    .await
    .map_err(e)?;
    if u64::try_from(due).unwrap_or(0) > max_move {
        return Ok(Step::HeldBack(format!(
            "dedup_records_future holds more than {max_move} records of the days of {name}: \
             making it would move them under the table's lock (the retention did not run for \
             longer than `ahead`; raise max_move to make it at a quiet hour)"
        )));
    }
    if let Err(busy) = make_table(conn, seen, &name, Expiry::Brin).await? {
        return Ok(lock_busy(&name, &busy));
    }
    let seen = seen.clone();
    let moved = locked(conn, |tx| {
        let (seen, range, future) = (seen.clone(), range.clone(), future.clone());
        Box::pin(async move {
            if !lock_unchanged(tx, &seen, Touched::Only(&[future.clone(), range.clone()])).await? {
                return Ok(None);
            }
            // Day numbers and the schema's quoted name: nothing from outside.
            for step in [
                format!("ALTER TABLE dedup_records DETACH PARTITION {future}"),
                format!(
                    "ALTER TABLE dedup_records ATTACH PARTITION {range} FOR VALUES \
                     FROM (date '1970-01-01' + {lo}) TO (date '1970-01-01' + {hi})"
                ),
            ] {
                tx.execute(sqlx::AssertSqlSafe(step)).await?;
            }
            let moved: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(move_sql(
                &seen,
                &future,
                &format!("r.kt < date '1970-01-01' + {hi}"),
            )))
            .fetch_one(&mut *tx)
            .await?;
            tx.execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE dedup_records ATTACH PARTITION {future} FOR VALUES \
                 FROM (date '1970-01-01' + {hi}) TO (MAXVALUE)"
            )))
            .await?;
            Ok(Some(u64::try_from(moved).unwrap_or(0)))
        })
    })
    .await?;
    Ok(match moved {
        Err(busy) => lock_busy(&name, &busy),
        Ok(None) => Step::Raced,
        Ok(Some(moved)) => Step::Done { name, moved },
    })
}
