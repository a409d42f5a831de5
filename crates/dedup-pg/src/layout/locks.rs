//! The locks of a change of the partitions (docs/ARCHITECTURE.md, invariant 37): the makers'
//! advisory lock, the parent's lock waited for 100 ms a try and [`RANGE_LOCK_TRIES`] tries a
//! round ([`locked`]), a look at `pg_locks` before it ([`holders_check`]), and the tables a
//! change touches locked without a wait once the partitions are read to be as the change was
//! planned on ([`lock_unchanged`]).

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor};

use dedup_core::StoreError;

use super::ranges::Parts;
use super::{is_lock_timeout, lock_pause, lock_timeout};
use crate::classify::classify;

/// How many times a change of the partitions tries for the parent's lock (100 ms each, with a
/// pause between) before it is held back until the next round: a claim queued behind one try
/// waits about 100 ms, so a long transaction beside it costs the claims a few seconds at most.
/// (A partition's lock held by something other than a claim, an autovacuum say, is never
/// waited for: [`lock_unchanged`].)
const RANGE_LOCK_TRIES: u32 = 20;

/// The oids of the partitions, for [`holders_check`].
pub(super) const PARTITION_OIDS: &str =
    "SELECT i.inhrelid FROM pg_inherits i WHERE i.inhparent = 'dedup_records'::regclass";

/// A statement that fails at once with 55P03, as a lock timeout does (the try is given up, and
/// made again after a pause), naming the holder, where a session other than this one holds one
/// of the tables `oids` (SQL that yields their oids) in a mode stronger than a claim's
/// (`ROW EXCLUSIVE`): an autovacuum (`SHARE UPDATE EXCLUSIVE`, for minutes on a large range),
/// an index build, an `ALTER TABLE` or a `LOCK` on a partition by its name. A lock request of a
/// change would queue behind it, and every claim behind the request: for the whole lock
/// timeout, try after try. One that takes its lock between this check and the request is
/// waited for up to the lock timeout, as before it. (Prepared transactions hold their locks
/// with no pid, and count.)
pub(super) fn holders_check(oids: &str) -> String {
    format!(
        "DO $h$ DECLARE h text; BEGIN \
         SELECT format('%s holds %s on %s', CASE WHEN l.pid IS NULL \
         THEN 'a prepared transaction' ELSE coalesce(a.backend_type, 'process') || ' ' || l.pid \
         END, l.mode, l.relation::regclass) INTO h \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'relation' AND l.granted \
         AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) \
         AND l.relation IN ({oids}) AND l.pid IS DISTINCT FROM pg_backend_pid() \
         AND l.mode NOT IN ('AccessShareLock', 'RowShareLock', 'RowExclusiveLock') LIMIT 1; \
         IF h IS NOT NULL THEN \
         RAISE EXCEPTION USING ERRCODE = 'lock_not_available', MESSAGE = h; END IF; END $h$"
    )
}

/// The class of the advisory lock that lets one maintainer make a table, add a check or change
/// the partitions at a time ("deds"): taken first in each of those transactions.
pub(super) const MAKER_LOCK_CLASS: i32 = 0x6465_6473;

/// Takes the makers' lock for the transaction, keyed on the schema of `dedup_records`.
pub(super) const MAKER_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1::int4, hashtext(n.nspname)) \
     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.oid = 'dedup_records'::regclass";

/// Runs `step` in a transaction that waits 100 ms at most for each lock, and is ended by the
/// server if its client goes quiet in it for 5 s (so a maintainer whose host dies mid-change
/// does not hold the parent's lock; its statements are bounded by the session's
/// `statement_timeout`, the retention task's own); again (after a pause) while it
/// fails for want of a lock, up to [`RANGE_LOCK_TRIES`] times; commits what it did. `Busy` if
/// the lock was not had, with the last try's reason (the holder [`holders_check`] named, or
/// the server's message).
pub(super) async fn locked<T>(
    conn: &mut PgConnection,
    mut step: impl for<'t> FnMut(
        &'t mut PgConnection,
    ) -> futures_util::future::BoxFuture<'t, Result<T, sqlx::Error>>,
) -> Result<Result<T, Busy>, StoreError> {
    let mut last = None;
    for _ in 0..RANGE_LOCK_TRIES {
        let attempt = async {
            let mut tx = conn.begin().await?;
            lock_timeout(&mut tx).await?;
            sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', '5s', true)")
                .execute(&mut *tx)
                .await?;
            let out = step(&mut tx).await?;
            tx.commit().await?;
            Ok(out)
        }
        .await;
        match attempt {
            Err(err) if is_lock_timeout(&err) => {
                last = Some(err);
                lock_pause().await;
            }
            other => return other.map(Ok).map_err(|e| classify(e, true)),
        }
    }
    let last = last.map_or_else(String::new, |err: sqlx::Error| {
        err.as_database_error()
            .map_or_else(|| err.to_string(), |d| d.message().to_owned())
    });
    Ok(Err(Busy(last)))
}

/// A lock not had in [`RANGE_LOCK_TRIES`] tries: the last one's reason.
#[derive(Debug)]
pub(super) struct Busy(String);

/// Why `what` was held back when the parent's lock was not had.
pub(super) fn lock_busy_why(what: &str, busy: &Busy) -> String {
    format!(
        "{what}: the table's lock not had in {RANGE_LOCK_TRIES} tries of 100 ms (a long \
         transaction on dedup_records, or a vacuum, an index build or a lock on one of its \
         partitions; the last try: {}); next round",
        busy.0
    )
}

/// The partitions a change locks besides the parent.
#[derive(Clone, Copy, Debug)]
pub(super) enum Touched<'a> {
    /// Every partition: a change of the parent that reaches each of them (a default or a
    /// constraint dropped, an index of the parent dropped, partitions detached and attached
    /// again).
    All,
    /// Only these tables (quoted, in the parent's schema): those the change detaches, attaches
    /// or renames. Rows it moves through the parent land in one of them too. Another partition
    /// that something holds (an autovacuum of today's range, say) does not hold it back.
    Only(&'a [String]),
}

/// Takes the makers' lock, then the parent's, answers whether the partitions are still `seen`,
/// and (if they are) locks the partitions `touched`. The makers' lock first: a maintainer
/// adding a check of `late`'s bounds reads the partitions under it, so no change can commit
/// between its read and its add (one that did could leave `late` a check narrower than its new
/// bounds, refusing the records of the days it was widened over).
///
/// The parent alone is waited for (the claims in flight hold it; new ones queue behind the
/// request). The partitions touched are then locked without a wait: every claim goes through
/// the parent, so once it is had, whatever still holds a partition is something else (an
/// autovacuum, an index build, a statement on the partition by name) that may hold it for
/// minutes, and waiting for it would hold every claim behind the parent's lock for the whole
/// timeout. A busy partition fails the try at once (55P03), before the parent's lock is asked
/// for where [`holders_check`] sees it. Under the parent's lock and the makers', no other
/// change can attach, detach or drop a table, so the tables `touched` of a change planned on
/// `seen` are all there once the partitions are read to be `seen` again.
pub(super) async fn lock_unchanged(
    tx: &mut PgConnection,
    seen: &Parts,
    touched: Touched<'_>,
) -> Result<bool, sqlx::Error> {
    let oids = match touched {
        Touched::All => PARTITION_OIDS,
        Touched::Only(tables) => {
            name_tables(tx, tables).await?;
            NAMED_OIDS
        }
    };
    tx.execute(sqlx::AssertSqlSafe(holders_check(oids))).await?;
    sqlx::query(MAKER_LOCK_SQL)
        .bind(MAKER_LOCK_CLASS)
        .execute(&mut *tx)
        .await?;
    tx.execute("LOCK TABLE ONLY dedup_records IN ACCESS EXCLUSIVE MODE")
        .await?;
    if Parts::read(tx).await? != *seen {
        return Ok(false);
    }
    let lock = match touched {
        Touched::All => "LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE NOWAIT".to_owned(),
        Touched::Only([]) => return Ok(true),
        Touched::Only(tables) => {
            format!(
                "LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE NOWAIT",
                tables.join(", ")
            )
        }
    };
    tx.execute(sqlx::AssertSqlSafe(lock)).await?;
    Ok(true)
}

/// SQL that yields the oids of the tables named (quoted) in the transaction's setting
/// `dedup.tables`, those that exist: set by [`name_tables`], so that no name is ever written
/// into the statement.
pub(super) const NAMED_OIDS: &str = "SELECT to_regclass(t)::oid \
     FROM unnest(current_setting('dedup.tables')::text[]) t";

/// Sets the transaction's `dedup.tables` to `tables` (quoted names), bound, for [`NAMED_OIDS`].
pub(super) async fn name_tables(
    tx: &mut PgConnection,
    tables: &[String],
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('dedup.tables', $1::text[]::text, true)")
        .bind(tables)
        .execute(&mut *tx)
        .await
        .map(drop)
}
