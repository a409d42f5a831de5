//! The switch of `dedup_records` to the table partitioned by its key's own time
//! (docs/design/window-partitions.md; docs/ARCHITECTURE.md, invariant 36): [`partition_by_key_time`].
//!
//! Not run by the migrations (opt-in, one way). The ranges of days that `future` is cut into,
//! and their retention by dropping, are [`maintain_ranges`]'s (`ranges.rs`), which the switch
//! runs once right after it. What the switch makes, in one transaction under an ACCESS
//! EXCLUSIVE lock on the table:
//!
//! - `T0`, the switch's own time (the server's clock, in milliseconds), chosen under the lock:
//!   every key stored before it keeps `kt = '-infinity'`.
//! - `dedup_kt` replaced, once, by the key's UTC day where the key is shaped like a UUIDv7
//!   (`dedup_key_ms_v1`) and its time lies in `[T0, T0 + span)`, and `-infinity` for every other
//!   key. One reference to the key's time (`nullif`/`greatest`/`least` clamp it), so the planner
//!   still inlines the call. The stored records moved are found by the same function, so a key
//!   has a day exactly when the move took it.
//! - The table as it was becomes the partition `dedup_records_untimed`, `FROM (MINVALUE) TO
//!   ('1970-01-01')`, with its rows, primary key and indexes as they are, under a partitioned
//!   parent of the same name and columns, which has no primary key of its own: a key has one
//!   partition, so each partition's primary key on `(scope, key)` holds it once in the table.
//! - `dedup_records_future`, `FROM (T0's day) TO (MAXVALUE)`: every key with a day, until ranges
//!   of days are carved out of it.
//! - The stored keys whose time is at or after `T0` (made by clocks running ahead) moved to the
//!   partition of their day, with their columns as they were.
//! - `kt` without a default on the parent and every attached partition, so a writer that leaves
//!   `kt` out writes NULL, which no partition takes (23514), instead of `-infinity`, which would
//!   put a key with a day where no lookup finds it. (Binaries of generations 7 to 9 checked
//!   `kt = dedup_kt(key)` on the parent instead and kept the default; the check was compiled
//!   again by every statement that wrote. The retention's next round drops both, `guards.rs`.)
//! - The compatibility floor raised to 9: binaries older than generation 7 neither write nor ask
//!   for `kt`, and their `ON CONFLICT (scope, key)` has no index to name on the parent; those of
//!   generations 7 and 8 would make ranges of days without an index on `expires_at` (the parent
//!   has none) and delete in them in its order. The
//!   floor stops one from starting; one already running must be stopped before the switch.
//! - The parent and `dedup_records_future` get the old table's owner and grants (and `future`
//!   its storage settings), and the functions that returned the old table's row type
//!   (`RETURNS SETOF dedup_records`) are made again for the parent's, with their owner and
//!   grants: a role without DDL rights keeps every right it had.
//!
//! The two scans of the old table the lock would otherwise cover (the check that every row is
//! untimed, the search for keys at or after `T0`) are done before it, without blocking writers:
//! the check is added `NOT VALID` and validated, and an index on the key's time is built
//! concurrently (and dropped again after the switch). A killed build leaves an invalid index,
//! which the next run drops and builds again; an index a run killed after its transaction left
//! is dropped by the next run. Every step that needs the table's lock waits for it 100 ms at a
//! time, and gives way in between, so writers are not held behind a long transaction of someone
//! else's for longer than that.

mod carve;
mod days;
mod drop;
mod expiry;
mod freeze;
mod guards;
mod locks;
mod policy;
mod ranges;

pub use policy::{RangePolicy, RangeReport};
pub use ranges::maintain_ranges;
pub(crate) use ranges::ranged_days;

use sqlx::Executor;
use sqlx::postgres::PgPool;
use tracing::{info, warn};

use dedup_core::StoreError;

use crate::classify::classify;

/// How long each step that needs the table's lock waits for it before it gives way (and tries
/// again): a writer queued behind the step waits about as long.
const LOCK_TIMEOUT: &str = "100ms";

/// How many times a step that needs the table's lock tries for it.
const LOCK_TRIES: u32 = 200;

/// The span of key times after `T0` that get a day: 20 years. A key whose time is past it (a
/// random 16-byte key that happens to parse as a UUIDv7, most of which are centuries ahead)
/// stays untimed.
const SPAN_MS: i64 = 20 * 36_525 * 86_400_000 / 100;

/// What [`partition_by_key_time`] found or did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyTimeLayout {
    /// The table was partitioned now.
    Switched {
        /// `T0`, in milliseconds since the Unix epoch: keys made from then on get a day.
        t0_ms: i64,
        /// Stored records whose key's time was at or after `T0`, moved to their day's partition.
        moved: u64,
        /// The schema's compatibility floor once switched, as `dedup_schema` holds it: stop
        /// every dedup binary of an older generation.
        compat_floor: i32,
    },
    /// The table was partitioned already; nothing changed.
    AlreadyPartitioned,
}

/// Whether `dedup_records` is partitioned.
const PARTITIONED_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table \
     WHERE partrelid = 'dedup_records'::regclass)";

/// The check that every row of the old table is untimed, added without a scan.
const UNTIMED_CHECK_SQL: &str = "ALTER TABLE dedup_records ADD CONSTRAINT \
     dedup_records_untimed_kt CHECK (kt < '1970-01-01') NOT VALID";

/// Whether the untimed check exists, and whether it was validated.
const UNTIMED_CHECK_STATE_SQL: &str = "SELECT convalidated FROM pg_constraint \
     WHERE conname = 'dedup_records_untimed_kt' AND conrelid = 'dedup_records'::regclass";

/// The index on the key's time, for the keys at or after `T0`, and whether it is valid.
const KEY_TIME_INDEX_STATE_SQL: &str = "SELECT i.indisvalid FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid \
     WHERE c.relname = 'dedup_records_key_time_idx' AND i.indrelid = 'dedup_records'::regclass";

const KEY_TIME_INDEX_SQL: &str = "CREATE INDEX CONCURRENTLY dedup_records_key_time_idx \
     ON dedup_records (dedup_key_ms_v1(key)) WHERE dedup_key_ms_v1(key) IS NOT NULL";

/// The statements of the switch before `dedup_kt` is replaced.
const SWITCH_SQL: [&str; 10] = [
    "ALTER TABLE dedup_records RENAME TO dedup_records_untimed",
    "ALTER INDEX dedup_records_pkey RENAME TO dedup_records_untimed_pkey",
    "ALTER INDEX dedup_records_expires_at_idx RENAME TO dedup_records_untimed_expires_at_idx",
    "ALTER INDEX dedup_records_live_owner_idx RENAME TO dedup_records_untimed_live_owner_idx",
    "CREATE TABLE dedup_records (LIKE dedup_records_untimed INCLUDING DEFAULTS \
     INCLUDING CONSTRAINTS) PARTITION BY RANGE (kt)",
    "ALTER TABLE dedup_records DROP CONSTRAINT dedup_records_untimed_kt",
    "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_untimed \
     FOR VALUES FROM (MINVALUE) TO ('1970-01-01')",
    "CREATE TABLE dedup_records_future (LIKE dedup_records INCLUDING DEFAULTS \
     INCLUDING CONSTRAINTS)",
    "ALTER TABLE dedup_records_future ADD CONSTRAINT dedup_records_future_pkey \
     PRIMARY KEY (scope, key)",
    // The future's own btree on expires_at (each partition has its own: a BRIN in the ranges of
    // days, expiry.rs); the untimed partition keeps the one it had.
    "CREATE INDEX dedup_records_future_expires_at_idx ON dedup_records_future (expires_at)",
];

/// Moves the stored records whose key now has a day out of the untimed partition, every column
/// as it was but `kt`. $1 `T0`, $2 its end. Answers how many.
const MOVE_SQL: &str = "WITH m AS (DELETE FROM dedup_records_untimed r \
     WHERE dedup_key_ms_v1(r.key) >= $1 AND dedup_key_ms_v1(r.key) < $2 RETURNING r.*), \
     i AS (INSERT INTO dedup_records SELECT (jsonb_populate_record(NULL::dedup_records, \
     to_jsonb(m) || jsonb_build_object('kt', dedup_kt(m.key)))).* FROM m RETURNING 1) \
     SELECT count(*) FROM i";

/// Gives the new parent and `dedup_records_future` what the old table had (its owner, every
/// grant, and the future partition its storage settings), and makes the functions that return
/// the old table's row type (`RETURNS SETOF dedup_records`, now the untimed partition's type)
/// again, the same but for that type, with their owner and grants: only dedup's (named
/// `dedup_...`, in the table's schema), never a function elsewhere run through as DDL.
const CARRY_OVER_SQL: &str = r#"DO $carry$
DECLARE
    owner_name text;
    opts text[];
    g record;
    f record;
    def text;
BEGIN
    SELECT c.relowner::regrole::text, c.reloptions INTO owner_name, opts
        FROM pg_class c WHERE c.oid = 'dedup_records_untimed'::regclass;
    EXECUTE format('ALTER TABLE dedup_records OWNER TO %s', owner_name);
    EXECUTE format('ALTER TABLE dedup_records_future OWNER TO %s', owner_name);
    IF opts IS NOT NULL THEN
        EXECUTE format('ALTER TABLE dedup_records_future SET (%s)', array_to_string(opts, ', '));
    END IF;
    FOR g IN SELECT a.privilege_type, a.is_grantable, a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'dedup_records_untimed'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON dedup_records, dedup_records_future TO %s%s',
            g.privilege_type,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
            CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    FOR f IN SELECT p.oid, p.oid::regprocedure::text AS sig, p.proowner::regrole::text AS fowner,
            p.proacl
        FROM pg_proc p WHERE p.prorettype = 'dedup_records_untimed'::regtype
            AND p.proname ~ '^dedup_' AND p.pronamespace = (SELECT c.relnamespace
                FROM pg_class c WHERE c.oid = 'dedup_records_untimed'::regclass)
    LOOP
        def := regexp_replace(pg_get_functiondef(f.oid),
            'SETOF (\S*\.)?dedup_records_untimed', 'SETOF \1dedup_records');
        EXECUTE format('DROP FUNCTION %s', f.sig);
        EXECUTE def;
        EXECUTE format('ALTER FUNCTION %s OWNER TO %s', f.sig, f.fowner);
        IF f.proacl IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f.sig);
            FOR g IN SELECT a.privilege_type, a.is_grantable, a.grantee FROM aclexplode(f.proacl) a
            LOOP
                EXECUTE format('GRANT %s ON FUNCTION %s TO %s%s', g.privilege_type, f.sig,
                    CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
                    CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
            END LOOP;
        END IF;
    END LOOP;
END
$carry$"#;

/// Partitions `dedup_records` by its key's time (module docs), or answers that it is already.
/// Run it with nothing else changing dedup's schema (it is not a migration), and with every
/// binary older than generation 7 stopped: the floor keeps one from starting, but one already
/// running would find its statements refused (its `ON CONFLICT (scope, key)` has no index to
/// name on the parent, 42P10, final) and dead-letter. Claims and completions of generation 7 may
/// run meanwhile: each step that needs the table's lock waits for it at most 100 ms at a time
/// (then gives way and tries again, up to 200 times), so a writer queued behind it waits about
/// as long, and the final transaction holds the lock for its own statements only. Takes about a
/// sequential read of the table (the check) and an index build over its UUIDv7-shaped keys
/// before that transaction; what the lock covers does not grow with the table.
///
/// # Errors
///
/// A [`StoreError`] as [`classify`] sorts it: the table's lock not had in 200 tries (retryable:
/// run it again once the long transaction holding it is gone), a lost connection, a schema it
/// does not know.
pub async fn partition_by_key_time(pool: &PgPool) -> Result<KeyTimeLayout, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    if partitioned(pool).await? {
        drop_key_time_index(pool).await;
        return Ok(KeyTimeLayout::AlreadyPartitioned);
    }
    // Before the lock: the untimed check, validated without blocking writers.
    let check: Option<bool> = sqlx::query_scalar(UNTIMED_CHECK_STATE_SQL)
        .fetch_optional(pool)
        .await
        .map_err(e)?;
    if check.is_none() {
        with_lock_retries(|| async {
            let mut tx = pool.begin().await?;
            lock_timeout(&mut tx).await?;
            tx.execute(UNTIMED_CHECK_SQL).await?;
            tx.commit().await
        })
        .await?;
    }
    if check != Some(true) {
        sqlx::query("ALTER TABLE dedup_records VALIDATE CONSTRAINT dedup_records_untimed_kt")
            .execute(pool)
            .await
            .map_err(e)?;
    }
    // Before the lock: the index that finds the keys at or after T0.
    let index: Option<bool> = sqlx::query_scalar(KEY_TIME_INDEX_STATE_SQL)
        .fetch_optional(pool)
        .await
        .map_err(e)?;
    if index == Some(false) {
        sqlx::query("DROP INDEX CONCURRENTLY dedup_records_key_time_idx")
            .execute(pool)
            .await
            .map_err(e)?;
    }
    if index != Some(true) {
        sqlx::query(KEY_TIME_INDEX_SQL)
            .execute(pool)
            .await
            .map_err(e)?;
    }
    let switched = with_lock_retries(|| switch(pool)).await?;
    // The index served the move; new keys with a day go to their own partitions.
    drop_key_time_index(pool).await;
    let Some((t0_ms, moved)) = switched else {
        return Ok(KeyTimeLayout::AlreadyPartitioned);
    };
    info!(t0_ms, moved, "dedup_records partitioned by the key's time");
    // The first ranges of days, so that new keys do not gather in `future` until the retention
    // task's first round (which makes them too, if this fails).
    let first = async {
        let mut conn = pool.acquire().await.map_err(e)?;
        // The server's clock, as T0 is.
        let now = std::time::SystemTime::UNIX_EPOCH
            + std::time::Duration::from_millis(u64::try_from(t0_ms).unwrap_or(0));
        maintain_ranges(&mut conn, &RangePolicy::default(), now).await
    };
    if let Err(err) = first.await {
        warn!(error = %err, "the first ranges of days not made; the retention task makes them");
    }
    // The floor as the switch wrote it, for the operator: read back, never restated here.
    let compat_floor: i32 = sqlx::query_scalar("SELECT compat_floor FROM dedup_schema WHERE id")
        .fetch_one(pool)
        .await
        .map_err(e)?;
    Ok(KeyTimeLayout::Switched {
        t0_ms,
        moved,
        compat_floor,
    })
}

/// The switch's transaction: `T0` and how many records it moved, or None where another run
/// partitioned the table first.
async fn switch(pool: &PgPool) -> Result<Option<(i64, u64)>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    lock_timeout(&mut tx).await?;
    // The table alone: one partitioned already is left as it is, and waiting for one of its
    // partitions' locks (an autovacuum's) would hold every claim behind this one.
    tx.execute("LOCK TABLE ONLY dedup_records IN ACCESS EXCLUSIVE MODE")
        .await?;
    if sqlx::query_scalar::<_, bool>(PARTITIONED_SQL)
        .fetch_one(&mut *tx)
        .await?
    {
        return Ok(None);
    }
    let t0_ms: i64 =
        sqlx::query_scalar("SELECT floor(extract(epoch FROM statement_timestamp()) * 1000)::int8")
            .fetch_one(&mut *tx)
            .await?;
    let end_ms = t0_ms + SPAN_MS;
    for step in SWITCH_SQL {
        tx.execute(step).await?;
    }
    let day = t0_ms.div_euclid(86_400_000);
    let steps = [
        format!(
            "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_future \
             FOR VALUES FROM (date '1970-01-01' + {day}) TO (MAXVALUE)"
        ),
        "CREATE INDEX dedup_records_live_owner_idx ON dedup_records (owner text_pattern_ops) \
         WHERE state = 'in_progress'"
            .to_owned(),
        // The key's day if its time is in [T0, end), else -infinity: one reference to the time.
        format!(
            "CREATE OR REPLACE FUNCTION dedup_kt(p_key bytea) RETURNS date \
             LANGUAGE sql IMMUTABLE PARALLEL SAFE \
             RETURN coalesce(date '1970-01-01' + (nullif(least(nullif(greatest( \
             dedup_key_ms_v1(p_key), {before}::int8), {before}::int8), {end_ms}::int8), \
             {end_ms}::int8) / 86400000)::int4, '-infinity'::date)",
            before = t0_ms - 1
        ),
        // No default: a writer that leaves kt out writes NULL, which no partition takes.
        "ALTER TABLE dedup_records ALTER COLUMN kt DROP DEFAULT".to_owned(),
        CARRY_OVER_SQL.to_owned(),
    ];
    for step in steps {
        // Integers computed above, and fixed names: nothing from outside.
        sqlx::query(sqlx::AssertSqlSafe(step))
            .execute(&mut *tx)
            .await?;
    }
    let moved: i64 = sqlx::query_scalar(MOVE_SQL)
        .bind(t0_ms)
        .bind(end_ms)
        .fetch_one(&mut *tx)
        .await?;
    tx.execute("UPDATE dedup_schema SET compat_floor = greatest(compat_floor, 9)")
        .await?;
    tx.commit().await?;
    Ok(Some((t0_ms, u64::try_from(moved).unwrap_or(0))))
}

/// Runs `step` again while it fails for want of a lock (55P03, its `lock_timeout`), after a
/// pause of 20 to 120 ms, up to [`LOCK_TRIES`] times.
async fn with_lock_retries<T, F, Fut>(mut step: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut tries = 0;
    loop {
        match step().await {
            Err(err) if tries + 1 < LOCK_TRIES && is_lock_timeout(&err) => {
                tries += 1;
                lock_pause().await;
            }
            other => return other.map_err(|e| classify(e, true)),
        }
    }
}

/// Whether `err` is a statement that gave up waiting for a lock (55P03).
fn is_lock_timeout(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// The pause before a step that gave way tries for its lock again: 20 to 120 ms.
async fn lock_pause() {
    let jitter = dedup_core::Timestamp::now().as_micros().rem_euclid(100);
    tokio::time::sleep(std::time::Duration::from_millis(
        20 + u64::try_from(jitter).unwrap_or(0),
    ))
    .await;
}

/// Drops the index the switch built to find the keys to move, if it is there (a switch killed
/// after its transaction, or whose drop failed, leaves it: every insert into the untimed
/// partition would keep paying for it).
async fn drop_key_time_index(pool: &PgPool) {
    let dropped = sqlx::query("DROP INDEX CONCURRENTLY IF EXISTS dedup_records_key_time_idx")
        .execute(pool)
        .await;
    if let Err(err) = dropped {
        info!(error = %err, "dedup_records_key_time_idx left in place; drop it at leisure");
    }
}

/// Bounds how long the transaction's statements wait for a lock ([`LOCK_TIMEOUT`]).
async fn lock_timeout(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(LOCK_TIMEOUT)
        .execute(&mut **tx)
        .await
        .map(drop)
}

async fn partitioned(pool: &PgPool) -> Result<bool, StoreError> {
    sqlx::query_scalar(PARTITIONED_SQL)
        .fetch_one(pool)
        .await
        .map_err(|e| classify(e, false))
}

#[cfg(test)]
mod tests {
    use super::SPAN_MS;

    #[test]
    fn the_span_is_twenty_years_of_days() {
        assert_eq!(SPAN_MS, 7305 * 86_400_000);
    }
}
