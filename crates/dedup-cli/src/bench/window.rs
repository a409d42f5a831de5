//! The bench at the size of a production window (`--prefill`, `--expired`, `--purge-during`):
//! the window's scopes filled with completed records, what they take on disk, what the server
//! writes per key, and retention running beside the contenders.
//!
//! The window is the records of the scopes `bench-<tag>-window` of the contenders that keep
//! records (c, d, e, e', f, ek, fk): `--prefill N` tops them up to N records in all (split evenly
//! among the contenders asked for), kept from one bench to the next, so that a second sitting
//! does not fill them again. The records are as a stream leaves them: random UUID-shaped keys in
//! random order, completed, with a fingerprint and a 16-byte result, created over the last 7 days
//! (the default retention) and expiring over the next 7. `--expired M` adds M records already past
//! their retention, among them, for the retention to remove. With `--keys uuidv7` the window is
//! another one, `bench-<tag>-window-v7`: the same records with time-ordered keys (UUIDv7, their
//! creation's time), inserted in that order. The retention (`--purge-during`) is the table's: it
//! removes the expired records of both windows, and each run after the first tops up only the
//! window of its own keys' shape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Keys;
use crate::connect::{CliError, connect_pg};
use dedup_core::Store;
use dedup_pg::PgStore;
use sqlx::PgPool;

/// The contenders that keep records, with the tag of their scope.
pub(super) const KEEPERS: [(&str, &str); 7] = [
    ("c", "c"),
    ("d", "d"),
    ("e", "e"),
    ("e'", "e2"),
    ("f", "f"),
    ("ek", "ek"),
    ("fk", "fk"),
];

/// The scope tag of the contender `name` as the report names it (`(e')`), where it keeps records.
pub(super) fn tag_of(name: &str) -> Option<&'static str> {
    let letter = name.trim_start_matches('(').trim_end_matches(')');
    KEEPERS.iter().find(|(c, _)| *c == letter).map(|(_, t)| *t)
}

/// The window's scope of tag `tag`, for keys of `keys`'s shape.
pub(super) fn window_scope(tag: &str, keys: Keys) -> String {
    format!("bench-{tag}-{}", keys.window())
}

/// The records inserted per statement while filling.
const FILL_CHUNK: i64 = 50_000;

/// The retention the window's records were written with: the default policy's.
const RETENTION_SECS: i64 = 7 * 24 * 3600;

/// One statement of the fill: `$2` completed records under scope `$1`, a fingerprint and a
/// 16-byte result each; live ones (`$3` false) created over the last 7 days and expiring over the
/// next 7, expired ones (`$3` true) expired over the last day; in either, at a random point of
/// the share `[$6, $6 + $7)` of that span. The keys are random UUID-shaped ones, or with `$5`
/// UUIDv7-shaped ones whose time is the record's creation (in whole milliseconds, rounded down),
/// inserted in the order of that time.
const FILL_SQL: &str = concat!(
    "INSERT INTO dedup_records (scope, key, kt, state, owner, token, lease_until, attempts,",
    "  fingerprint, result, created_at, updated_at, expires_at)",
    " SELECT $1, g.k, dedup_kt(g.k), 'completed', NULL, nextval('dedup_token_seq'), NULL, 1,",
    "  sha256(g.k), substring(sha256(g.k || '\\x00'::bytea) FROM 1 FOR 16), g.c, g.c, g.e",
    " FROM (SELECT CASE WHEN $5 THEN convert_to(lpad(to_hex(t.m >> 16), 8, '0') || '-'",
    "      || lpad(to_hex(t.m & 65535), 4, '0') || '-7' || substr(t.u, 16, 3) || substr(t.u, 19),",
    "      'UTF8') ELSE convert_to(t.u, 'UTF8') END AS k, t.c, t.e",
    "   FROM (SELECT gen_random_uuid()::text AS u, s.c, s.e,",
    "       CASE WHEN $5 THEN floor(extract(epoch FROM s.c) * 1000)::int8 END AS m",
    "     FROM (SELECT r.e - $4::float8 * interval '1 second' AS c, r.e",
    "       FROM (SELECT CASE WHEN $3 THEN statement_timestamp()",
    "           - (1 - $6::float8 - random() * $7::float8) * interval '1 day'",
    "         ELSE statement_timestamp()",
    "           + ($6::float8 + random() * $7::float8) * $4::float8 * interval '1 second' END AS e",
    "         FROM generate_series(1, $2)) r) s",
    "     ORDER BY CASE WHEN $5 THEN s.e END) t) g",
    " ON CONFLICT DO NOTHING"
);

/// The share `[from, from + width)` of the fill's span that records `done..done + count` of `n`
/// are made in: all of it for random keys (they go in in random order), for time-ordered ones the
/// slice of it that is theirs, so that the statements that follow one another go on in time.
#[allow(clippy::cast_precision_loss)]
fn slice(keys: Keys, n: u64, done: u64, count: u64) -> (f64, f64) {
    if !keys.time_ordered() || n == 0 {
        return (0.0, 1.0);
    }
    let all = n as f64;
    (done as f64 / all, count as f64 / all)
}

/// What [`fill`] found and did.
#[derive(Debug, Default)]
pub(super) struct Filled {
    /// Records in the window's scopes before, and inserted.
    pub(super) found: u64,
    /// Of them, past their retention.
    pub(super) found_expired: u64,
    pub(super) inserted_live: u64,
    pub(super) inserted_expired: u64,
    /// Past their retention, in the whole table, after the fill.
    pub(super) expired: u64,
    pub(super) fill: Duration,
    /// The VACUUM (ANALYZE) after it, and the CHECKPOINT after that.
    pub(super) vacuum: Duration,
}

/// Tops the window of `tags` (for keys of `keys`'s shape) up to `live` records in all that have
/// not expired and `expired` records past their retention, split evenly among the scopes, then
/// VACUUMs and checkpoints, so that the passes that follow start from a settled table. Random keys
/// go in in random order; time-ordered ones in the order of their time, one share of the span per
/// statement, as a stream of them would. Each scope's rows are counted through
/// the primary key, and its expired ones through the `expires_at` index (which reads the heap for
/// the expired rows alone; in the ranges of the partitioned table a BRIN, which reads the pages
/// whose summary says they may hold one).
pub(super) async fn fill(
    pool: &PgPool,
    tags: &[&str],
    keys: Keys,
    live: u64,
    expired: u64,
    note: &dyn Fn(&str),
) -> Result<Filled, CliError> {
    let e =
        |what: &str, e: sqlx::Error| CliError::Failed(format!("filling the window: {what}: {e}"));
    let mut filled = Filled::default();
    let started = Instant::now();
    let share = |n: u64| n / u64::try_from(tags.len().max(1)).unwrap_or(1);
    let mut plan: Vec<(String, u64, bool)> = Vec::new();
    for tag in tags {
        let scope = window_scope(tag, keys);
        let have: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE scope = $1")
            .bind(&scope)
            .fetch_one(pool)
            .await
            .map_err(|x| e("counting", x))?;
        let past: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM dedup_records \
             WHERE expires_at <= statement_timestamp() AND scope = $1",
        )
        .bind(&scope)
        .fetch_one(pool)
        .await
        .map_err(|x| e("counting", x))?;
        let (have, past) = (
            u64::try_from(have).unwrap_or(0),
            u64::try_from(past).unwrap_or(0),
        );
        filled.found += have;
        filled.found_expired += past;
        let live_have = have.saturating_sub(past);
        // The expired first: their keys (for time-ordered ones) are the older.
        plan.push((scope.clone(), share(expired).saturating_sub(past), true));
        plan.push((scope, share(live).saturating_sub(live_have), false));
    }
    let total: u64 = plan.iter().map(|p| p.1).sum();
    if total > 0 {
        note(&format!(
            "filling the window: {total} records to insert ({} found in its scopes)",
            filled.found
        ));
    }
    let mut done = 0u64;
    let mut told = 0u64;
    for (scope, n, past) in plan {
        let mut left = n;
        while left > 0 {
            // Two statements at once: the server's two cores.
            let a =
                i64::try_from(left.min(2 * u64::try_from(FILL_CHUNK).unwrap_or(1))).unwrap_or(0);
            let (x, y) = (a / 2 + a % 2, a / 2);
            // The two statements' records are adjacent slices of the span (time-ordered keys).
            let done_here = n - left;
            let one = |count: i64, from: u64| {
                let count_u = u64::try_from(count).unwrap_or(0);
                let (start, width) = slice(keys, n, from, count_u);
                sqlx::query(FILL_SQL)
                    .bind(&scope)
                    .bind(count)
                    .bind(past)
                    .bind(RETENTION_SECS)
                    .bind(keys.time_ordered())
                    .bind(start)
                    .bind(width)
                    .execute(pool)
            };
            let x_u = u64::try_from(x).unwrap_or(0);
            let (rx, ry) = tokio::join!(one(x, done_here), async {
                if y > 0 {
                    one(y, done_here + x_u).await.map(Some)
                } else {
                    Ok(None)
                }
            });
            let rows = rx.map_err(|x| e("inserting", x))?.rows_affected()
                + ry.map_err(|x| e("inserting", x))?
                    .map_or(0, |r| r.rows_affected());
            left = left.saturating_sub(u64::try_from(a).unwrap_or(0));
            done += rows;
            if past {
                filled.inserted_expired += rows;
            } else {
                filled.inserted_live += rows;
            }
            if done - told > total / 20 {
                told = done;
                note(&format!(
                    "filling the window: {done} of {total} ({:.0} s)",
                    started.elapsed().as_secs_f64()
                ));
            }
        }
    }
    filled.fill = started.elapsed();
    let settled = Instant::now();
    sqlx::query("VACUUM (ANALYZE) dedup_records")
        .execute(pool)
        .await
        .map_err(|x| e("VACUUM", x))?;
    // Not every role may; the passes then start with whatever checkpoint comes.
    let _ = sqlx::query("CHECKPOINT").execute(pool).await;
    filled.vacuum = settled.elapsed();
    filled.expired = count_expired(pool).await.map_err(|x| e("counting", x))?;
    Ok(filled)
}

/// Records past their retention, in the whole table.
async fn count_expired(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_records WHERE expires_at <= statement_timestamp()",
    )
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// What `dedup_records` takes on disk, summed over its partition tree (a partitioned parent's own
/// size is 0), read after a VACUUM so that the record count (`reltuples`) is exact enough.
#[derive(Debug, Default)]
pub(super) struct Size {
    pub(super) records: u64,
    pub(super) heap: u64,
    pub(super) toast: u64,
    /// Each index, by name, largest first.
    pub(super) indexes: Vec<(String, u64)>,
}

impl Size {
    pub(super) fn total(&self) -> u64 {
        self.heap + self.toast + self.indexes.iter().map(|i| i.1).sum::<u64>()
    }

    /// Bytes per record, and the heap's and the indexes' shares of them.
    pub(super) fn per_record(&self) -> (f64, f64, f64) {
        #[allow(clippy::cast_precision_loss)]
        let per = |b: u64| b as f64 / self.records.max(1) as f64;
        (
            per(self.total()),
            per(self.heap + self.toast),
            per(self.indexes.iter().map(|i| i.1).sum()),
        )
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let (all, heap, idx) = self.per_record();
        serde_json::json!({
            "records": self.records,
            "bytes": self.total(),
            "heap_bytes": self.heap,
            "toast_bytes": self.toast,
            "indexes": self.indexes.iter().map(|(n, b)| serde_json::json!({"name": n, "bytes": b})).collect::<Vec<_>>(),
            "bytes_per_record": all,
            "heap_bytes_per_record": heap,
            "index_bytes_per_record": idx,
        })
    }
}

/// Measures `dedup_records` (see [`Size`]).
pub(super) async fn size(pool: &PgPool) -> Result<Size, CliError> {
    let e = |e: sqlx::Error| CliError::Failed(format!("measuring dedup_records: {e}"));
    let tables: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT greatest(c.reltuples, 0)::int8, pg_relation_size(c.oid)::int8,
                coalesce(pg_total_relation_size(c.reltoastrelid), 0)::int8
         FROM (SELECT relid FROM pg_partition_tree('dedup_records') WHERE isleaf
               UNION SELECT 'dedup_records'::regclass WHERE NOT EXISTS
                 (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'dedup_records'::regclass))
           AS t JOIN pg_class c ON c.oid = t.relid",
    )
    .fetch_all(pool)
    .await
    .map_err(e)?;
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT i.relname::text, pg_relation_size(i.oid)::int8
         FROM (SELECT relid FROM pg_partition_tree('dedup_records') WHERE isleaf
               UNION SELECT 'dedup_records'::regclass WHERE NOT EXISTS
                 (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'dedup_records'::regclass))
           AS t JOIN pg_index x ON x.indrelid = t.relid
         JOIN pg_class i ON i.oid = x.indexrelid ORDER BY 2 DESC",
    )
    .fetch_all(pool)
    .await
    .map_err(e)?;
    let u = |n: i64| u64::try_from(n).unwrap_or(0);
    Ok(Size {
        records: tables.iter().map(|t| u(t.0)).sum(),
        heap: tables.iter().map(|t| u(t.1)).sum(),
        toast: tables.iter().map(|t| u(t.2)).sum(),
        indexes: indexes.into_iter().map(|(n, b)| (n, u(b))).collect(),
    })
}

/// The average size of one of `scope`'s rows as the heap holds it (`pg_column_size` of the row:
/// its columns and tuple header, without the line pointer and the free space around it).
pub(super) async fn row_bytes(pool: &PgPool, scope: &str) -> Option<f64> {
    sqlx::query_scalar::<_, Option<f64>>(
        "SELECT avg(pg_column_size(r.*))::float8 FROM dedup_records r WHERE r.scope = $1",
    )
    .bind(scope)
    .fetch_one(pool)
    .await
    .ok()
    .flatten()
}

/// Where the server's WAL stood: its insert position, and what `pg_stat_wal` (Postgres 14 and
/// later) had counted, bytes and full-page images.
#[derive(Clone, Copy, Debug)]
pub(super) struct WalMark {
    position: u64,
    counted: Option<u64>,
    fpi: Option<u64>,
}

/// The server's WAL now; `None` where the position cannot be read (a server in recovery).
pub(super) async fn wal(pool: &PgPool) -> Option<WalMark> {
    let position: i64 =
        sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8")
            .fetch_one(pool)
            .await
            .ok()?;
    // Postgres 14 and later; before, no images are counted.
    let (counted, fpi): (i64, i64) =
        sqlx::query_as("SELECT wal_bytes::int8, wal_fpi::int8 FROM pg_stat_wal")
            .fetch_one(pool)
            .await
            .unwrap_or((-1, -1));
    Some(WalMark {
        position: u64::try_from(position).ok()?,
        counted: u64::try_from(counted).ok(),
        fpi: u64::try_from(fpi).ok(),
    })
}

/// The WAL the server wrote since `before` (the contender's and anything else's, such as an
/// autovacuum): its bytes, from the insert position, and with `settle` its full-page images.
/// Those come from `pg_stat_wal`, which each backend adds to when it is idle a second or more
/// after its last report (up to 10 s): settling waits (up to 12 s) until the bytes it counted
/// come within 5% of the position's move (which also covers page headers and each record's
/// alignment), so that its images are all but complete.
pub(super) async fn wal_since(
    pool: &PgPool,
    before: WalMark,
    settle: bool,
) -> Option<(u64, Option<u64>)> {
    let mut after = wal(pool).await?;
    let bytes = after.position.saturating_sub(before.position);
    if !settle {
        return Some((bytes, None));
    }
    let deadline = Instant::now() + Duration::from_secs(12);
    loop {
        let (Some(c0), Some(c1), Some(f0), Some(f1)) =
            (before.counted, after.counted, before.fpi, after.fpi)
        else {
            return Some((bytes, None));
        };
        if c1.saturating_sub(c0).saturating_mul(100) >= bytes.saturating_mul(95) {
            return Some((bytes, Some(f1.saturating_sub(f0))));
        }
        if Instant::now() >= deadline {
            return Some((bytes, None));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = wal(pool).await?;
    }
}

/// The drop of the ranges of days in a `--purge-during` pass, as the events see it: bumped when
/// it starts and when it ends (its files cleared), so odd while it runs.
static DROPPING: AtomicU64 = AtomicU64::new(0);

/// Where the drop of the ranges stands, taken when an event starts (for [`overlapped`]).
pub(super) fn drop_phase() -> u64 {
    DROPPING.load(Ordering::Acquire)
}

/// Opens the drop's span ([`DROPPING`]) and closes it when dropped, so that a panic of the
/// retention's task cannot leave it open for the rest of the bench.
struct DropSpan;

impl DropSpan {
    fn open() -> Self {
        DROPPING.fetch_add(1, Ordering::AcqRel);
        Self
    }
}

impl Drop for DropSpan {
    fn drop(&mut self) {
        DROPPING.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether an event that started at the drop's phase `start` and ends now overlapped the drop:
/// it started while the drop ran, or the drop started or ended while it ran.
pub(super) fn overlapped(start: u64) -> bool {
    spans_drop(start, drop_phase())
}

/// Whether an event that started at the drop's phase `start` and ended at `end` overlapped it.
fn spans_drop(start: u64, end: u64) -> bool {
    start % 2 == 1 || end != start
}

/// What the retention did while a pass ran.
#[derive(Debug, Default)]
pub(super) struct Purged {
    /// The ranges of days of the partitioned table dropped first (`maintain_ranges`), the
    /// records their drops moved, and how long that took.
    pub(super) dropped: Vec<String>,
    pub(super) moved: u64,
    pub(super) ranges: Duration,
    pub(super) records: u64,
    pub(super) statements: u64,
    /// From its start until a statement found less than a full batch.
    pub(super) elapsed: Duration,
    /// How long, while it ran, at least one other session waited on a lock it held (sampled
    /// every 10 ms).
    pub(super) blocked: Duration,
    /// The VACUUM of `dedup_records` after it.
    pub(super) vacuum: Duration,
    pub(super) error: Option<String>,
}

impl Purged {
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "ranges_dropped": self.dropped,
            "ranges_moved": self.moved,
            "ranges_s": self.ranges.as_secs_f64(),
            "records": self.records,
            "statements": self.statements,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "blocked_others_s": self.blocked.as_secs_f64(),
            "vacuum_after_s": self.vacuum.as_secs_f64(),
            "error": self.error,
        })
    }
}

/// The retention, started beside a pass, as the table's retention runs it: on a connection of
/// its own, the ranges of days of the partitioned table made and dropped
/// ([`dedup_pg::maintain_ranges`], by the server's clock; nothing on the single table), then
/// [`Store::purge`] in statements of `batch` records until a statement finds less than a full
/// batch; and a sampler of the sessions it blocks. [`Purge::finish`] waits for it and VACUUMs.
pub(super) struct Purge {
    task: tokio::task::JoinHandle<Purged>,
}

impl Purge {
    pub(super) async fn start(
        url: &str,
        pool: &PgPool,
        batch: u32,
        pause: Duration,
    ) -> Result<Self, CliError> {
        let own = connect_pg(url, 1).await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&own)
            .await
            .map_err(|e| CliError::Failed(format!("the retention's connection: {e}")))?;
        // The sampler on a connection of its own too, not one the contenders wait for.
        let watch = connect_pg(url, 1).await?;
        let (pool, store) = (pool.clone(), PgStore::new(own));
        let task = tokio::spawn(async move {
            let (done_tx, mut done_rx) = tokio::sync::watch::channel(false);
            let sampler = tokio::spawn(async move {
                let mut blocked = Duration::ZERO;
                let tick = Duration::from_millis(10);
                let mut last = Instant::now();
                while !*done_rx.borrow() {
                    // `pg_blocking_pids` takes the lock manager's locks: asked only of the
                    // sessions waiting on a lock.
                    let waiting: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE wait_event_type = 'Lock' AND $1 = ANY(pg_blocking_pids(pid))",
                    )
                    .bind(pid)
                    .fetch_one(&watch)
                    .await
                    .unwrap_or(0);
                    // The time since the last sample, counted whole when someone waits now.
                    let now = Instant::now();
                    if waiting > 0 {
                        blocked += now - last;
                    }
                    last = now;
                    let _ = tokio::time::timeout(tick, done_rx.changed()).await;
                }
                blocked
            });
            let mut purged = Purged::default();
            let started = Instant::now();
            let span = DropSpan::open();
            let ranges = async {
                let mut conn = store.pool().acquire().await?;
                let now_ms: i64 = sqlx::query_scalar(
                    "SELECT floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
                )
                .fetch_one(&mut *conn)
                .await?;
                let now = std::time::SystemTime::UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(now_ms).unwrap_or(0));
                dedup_pg::maintain_ranges(&mut conn, &dedup_pg::RangePolicy::default(), now)
                    .await
                    .map_err(|e| sqlx::Error::Protocol(e.to_string()))
            }
            .await;
            drop(span);
            match ranges {
                Ok(r) => {
                    purged.dropped = r.dropped;
                    purged.moved = r.moved;
                }
                Err(e) => purged.error = Some(format!("the ranges of days: {e}")),
            }
            purged.ranges = started.elapsed();
            loop {
                match store.purge(batch).await {
                    Ok(n) => {
                        purged.records += n;
                        purged.statements += u64::from(n > 0);
                        // A window's live records expire all the time (a 7-day window of 50
                        // million, some 80 a second): done once a statement finds less than a
                        // full batch, as a scheduled purge would be.
                        if n < u64::from(batch) {
                            break;
                        }
                        if !pause.is_zero() {
                            tokio::time::sleep(pause).await;
                        }
                    }
                    Err(e) => {
                        purged.error = Some(e.to_string());
                        break;
                    }
                }
            }
            purged.elapsed = started.elapsed();
            let _ = done_tx.send(true);
            purged.blocked = sampler.await.unwrap_or_default();
            let vacuumed = Instant::now();
            if let Err(e) = sqlx::query("VACUUM dedup_records").execute(&pool).await {
                purged.error.get_or_insert(format!("VACUUM: {e}"));
            }
            purged.vacuum = vacuumed.elapsed();
            purged
        });
        Ok(Self { task })
    }

    pub(super) async fn finish(self) -> Purged {
        self.task.await.unwrap_or_else(|e| Purged {
            error: Some(format!("the retention's task: {e}")),
            ..Purged::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_ordered_fills_go_on_in_slices_and_random_ones_take_the_whole_span() {
        assert_eq!(slice(Keys::Uuid, 300, 100, 50), (0.0, 1.0));
        assert_eq!(slice(Keys::Uuidv7, 0, 0, 0), (0.0, 1.0));
        // Two statements of 50 after 100 of 400: adjacent, in order, inside the span.
        let a = slice(Keys::Uuidv7, 400, 100, 50);
        let b = slice(Keys::Uuidv7, 400, 150, 50);
        assert_eq!(a, (0.25, 0.125));
        assert!((a.0 + a.1 - b.0).abs() < f64::EPSILON);
        // The last ends the span.
        let last = slice(Keys::Uuidv7, 400, 350, 50);
        assert!((last.0 + last.1 - 1.0).abs() < f64::EPSILON);
    }

    #[test]
    fn an_event_overlaps_the_drop_if_it_started_during_it_or_saw_it_start_or_end() {
        // Before any drop, and between two.
        assert!(!spans_drop(0, 0));
        assert!(!spans_drop(2, 2));
        // Started during it (it ended then or not), saw it start, saw it start and end.
        assert!(spans_drop(1, 1));
        assert!(spans_drop(1, 2));
        assert!(spans_drop(0, 1));
        assert!(spans_drop(0, 2));
    }
}
