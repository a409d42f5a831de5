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
//!
//! Here the window's fill; `measure.rs` measures the table and the WAL the server writes,
//! `purge.rs` runs the retention beside a pass and marks, for the events, when it drops ranges.

use std::time::{Duration, Instant};

use super::Keys;
use crate::connect::CliError;
use sqlx::PgPool;

mod measure;
mod purge;

pub(super) use measure::{Size, row_bytes, size, wal, wal_since};
pub(super) use purge::{Purge, Purged, drop_phase, overlapped};

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
}
