//! The drop of the ranges of days whose retention has passed ([`drop_ranges`]): every range
//! due at once detached in one transaction under the parent's lock, `dedup_records_late`
//! attached again over their days, the records still live in them (and those a parked message
//! names) copied into it, the ranges renamed out of the way; their files are freed after the
//! commit, a piece at a time ([`clear_gone`]).
//!
//! What a drop costs the claims beside it, whatever the ranges' size, is the wait for the
//! parent's lock and, after each change of the partitions, every session planning its
//! statements again: one lock window and one change for all the ranges due, and none before it
//! where `late` is small (docs/PERFORMANCE.md, "The drop's fixed part").

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor};

use dedup_core::StoreError;

use super::expiry;
use super::expiry::Expiry;
use super::locks::{
    MAKER_LOCK_CLASS, MAKER_LOCK_SQL, NAMED_OIDS, Touched, holders_check, lock_unchanged, locked,
    name_tables,
};
use super::policy::RangePolicy;
use super::ranges::{Parts, Step, civil, count_limit, lock_busy, make_table};
use crate::classify::classify;

/// The most heap pages of `late` its attach over wider bounds may read under the parent's lock
/// (8 kB each: 2 MB, a fraction of a millisecond from memory). A larger `late` gets a check of
/// its new bounds added and validated before the lock instead, which spares the attach its
/// read, at the cost of a lock window of `late`'s own and two changes of its catalog entry.
pub(super) const LATE_SCAN_PAGES: i64 = 256;

/// A range due for dropping: its name and its days, `[lo, hi)` since the Unix epoch.
#[derive(Clone, Debug)]
pub(super) struct Due {
    pub(super) name: String,
    pub(super) lo: i32,
    pub(super) hi: i32,
}

/// The condition on `r` that picks the records of `table` a parked message names, found
/// through its primary key, one probe per parked message (never a scan of the range).
fn parked_ctids(table: &str) -> String {
    format!(
        "r.ctid = ANY (ARRAY(SELECT x.ctid FROM dedup_parked p CROSS JOIN LATERAL \
         (SELECT q.ctid FROM {table} q WHERE q.scope = p.dedup_scope AND q.key = p.dedup_key) x))"
    )
}

/// For the rest of the transaction: a range's live records are found through its indexes, never
/// by reading the whole range (a range never analysed looks to the planner as if a third of it
/// were live).
const NO_SEQSCAN_SQL: &str = "SET LOCAL enable_seqscan = off";

/// What a drop moves out of a range before it goes: the records live by the server's clock, or
/// expired within the last 5 minutes (a claim that waited for the parent's lock measures expiry
/// at its own statement's start, before the wait, so a record that expired during the wait is
/// still live to it), found through the range's BRIN index on `expires_at` (`expiry.rs`).
const LIVE: &str = "r.expires_at > transaction_timestamp() - interval '5 minutes'";

/// Copies the rows of the range `from` that `filter` (a condition on `r`) picks into the
/// parent, every column as it was (so into `late`, by their `kt`), and leaves them in the range,
/// which is dropped next: no delete to write for a table about to go. Answers how many.
fn copy_sql(parts: &Parts, from: &str, filter: &str) -> String {
    format!(
        "WITH i AS (INSERT INTO dedup_records ({}) SELECT {} FROM {from} r WHERE {filter} \
         RETURNING 1) SELECT count(*) FROM i",
        parts.2,
        parts.cols("r"),
    )
}

/// A day since the Unix epoch as a date literal.
fn date_literal(day: i32) -> String {
    let (y, m, d) = civil(day);
    format!("DATE '{y:04}-{m:02}-{d:02}'")
}

/// Drops the ranges `due` (oldest first, each starting where the one before ends) that fit one
/// change: each with a valid index on `expires_at`, and all of them together holding at most
/// `max_move` live or parked records found by reading at most `max_read_pages` of their pages
/// (counted before the lock; a range past what the ranges before it left is dropped in a change
/// of its own, or held back, by the next turn of the caller's loop). In one transaction: detach
/// them, widen `late` over their days (or make `late` of them), copy their live records and
/// those a parked message names into `late`, and rename them out of the way
/// (`dedup_records_gone_...`); after the commit `clear_gone` drops their indexes and heaps one
/// at a time. One step per range dropped, or the one step that held them back.
pub(super) async fn drop_ranges(
    conn: &mut PgConnection,
    seen: &Parts,
    due: &[Due],
    policy: &RangePolicy,
) -> Result<Vec<Step>, StoreError> {
    let e = |e: sqlx::Error| classify(e, true);
    let (max_move, max_pages) = (policy.max_move, policy.max_read_pages);
    let mut taken: Vec<&Due> = Vec::new();
    let (mut live_sum, mut pages_sum) = (0_u64, 0_u64);
    for d in due {
        // What stops the first range is the answer; what stops a later one leaves it (and those
        // after it) to the next change.
        let stop = |step: Step, taken: &[&Due]| taken.is_empty().then_some(vec![step]);
        if taken.last().is_some_and(|t| t.hi != d.lo) {
            break;
        }
        let name = &d.name;
        match expiry::indexed(conn, seen, name).await.map_err(e)? {
            None => match stop(Step::Raced, &taken) {
                Some(s) => return Ok(s),
                None => break,
            },
            Some(false) => {
                let why = format!(
                    "{name} has no valid index on expires_at (its build failed this round): \
                     dropping it would read it whole under the table's lock; next round"
                );
                match stop(Step::HeldBack(why), &taken) {
                    Some(s) => return Ok(s),
                    None => break,
                }
            }
            Some(true) => {}
        }
        let (live, pages) = match counted(conn, seen, name, count_limit(max_move)).await {
            // Another maintainer dropped it since the partitions were read.
            Err(err)
                if err.as_database_error().and_then(|d| d.code()).as_deref() == Some("42P01") =>
            {
                match stop(Step::Raced, &taken) {
                    Some(s) => return Ok(s),
                    None => break,
                }
            }
            // Its BRIN summary not had: the range is held (an autovacuum, an index build).
            Err(ref err) if super::is_lock_timeout(err) => {
                let why = format!(
                    "{name}: its BRIN summary not brought up to date before the drop (the \
                     range's lock not had in 100 ms: a vacuum, an index build or another \
                     maintainer on it); next round"
                );
                match stop(Step::HeldBack(why), &taken) {
                    Some(s) => return Ok(s),
                    None => break,
                }
            }
            other => other.map_err(e)?,
        };
        let live = live_sum.saturating_add(live);
        let pages = pages_sum.saturating_add(pages);
        if live > max_move {
            let why = format!(
                "{name} still holds more than {max_move} live or parked records: dropping it \
                 would move them under the table's lock (is `keep` shorter than the longest \
                 retention, failed records' included?); it stays whole until they expire (or \
                 max_move is raised), its expired records absent to every lookup meanwhile"
            );
            match stop(Step::HeldBack(why), &taken) {
                Some(s) => return Ok(s),
                None => break,
            }
        }
        if pages > max_pages {
            let why = format!(
                "{name}: finding its live or parked records reads {pages} of its pages (they \
                 are spread through it, and its BRIN index narrows a lookup to blocks of 128 \
                 pages): more than max_read_pages ({max_pages}) under the table's lock; it stays \
                 whole until they expire (is `keep` shorter than the longest retention, failed \
                 records' included?)"
            );
            match stop(Step::HeldBack(why), &taken) {
                Some(s) => return Ok(s),
                None => break,
            }
        }
        (live_sum, pages_sum) = (live, pages);
        taken.push(d);
    }
    let (Some(first), Some(last)) = (taken.first(), taken.last()) else {
        return Ok(Vec::new());
    };
    let (lo, hi) = (first.lo, last.hi);
    let late = seen.q("dedup_records_late");
    // `late` must start where the ranges do: it is made of the first range dropped.
    let late_lo = match seen.late() {
        Some(l) if l.hi == Some(lo) => l.lo.unwrap_or(lo),
        Some(l) => {
            return Err(classify(
                sqlx::Error::Protocol(format!(
                    "dedup_records_late ends at day {:?}, not where {} starts ({lo})",
                    l.hi, first.name
                )),
                false,
            ));
        }
        None => lo,
    };
    // `late` widened over the ranges' days. The attach under the lock reads `late` whole to
    // check its rows against the new bounds: where `late` is small that read is cheaper than
    // what sparing it costs (a check of the new bounds added in a lock window of `late`'s own
    // and validated, each a change every session plans its statements again after).
    let bound = format!("dedup_records_late_to_{hi}");
    let checked = match seen.late() {
        None => false,
        Some(_) => late_pages(conn, &late).await.map_err(e)? > LATE_SCAN_PAGES,
    };
    if checked {
        // `late` (the schema's quoted name and a fixed one), `bound` and the dates (day
        // numbers): nothing from the catalog; whether the check is there is asked bound.
        let add = format!(
            "ALTER TABLE {late} ADD CONSTRAINT {bound} CHECK (kt >= {from} AND kt < {to}) \
             NOT VALID",
            from = date_literal(late_lo),
            to = date_literal(hi),
        );
        let added = locked(conn, |tx| {
            let (add, late, bound) = (add.clone(), late.clone(), bound.clone());
            Box::pin(async move {
                // One maker at a time: two adding the same check at once, one would fail; and
                // a maintainer that read the partitions before another dropped this range (and
                // the next) must not put a narrower bound back on `late`: read again under it.
                sqlx::query(MAKER_LOCK_SQL)
                    .bind(MAKER_LOCK_CLASS)
                    .execute(&mut *tx)
                    .await?;
                // `late`'s lock before the read: a change by a binary that does not take the
                // makers' lock commits before it, and the read sees it. Not asked for while
                // something other than a claim holds `late` (an autovacuum after the purge's
                // deletes): every claim would queue behind the request.
                name_tables(tx, std::slice::from_ref(&late)).await?;
                tx.execute(sqlx::AssertSqlSafe(holders_check(NAMED_OIDS)))
                    .await?;
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "LOCK TABLE {late} IN ACCESS EXCLUSIVE MODE"
                )))
                .await?;
                if Parts::read(tx).await?.late().and_then(|l| l.hi) != Some(lo) {
                    return Ok(false);
                }
                let there: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_constraint \
                     WHERE conrelid = $1::regclass AND conname = $2)",
                )
                .bind(&late)
                .bind(&bound)
                .fetch_one(&mut *tx)
                .await?;
                if !there {
                    tx.execute(sqlx::AssertSqlSafe(add)).await?;
                }
                Ok(true)
            })
        })
        .await?;
        match added {
            Err(busy) => return Ok(vec![lock_busy(&first.name, &busy)]),
            Ok(false) => return Ok(vec![Step::Raced]),
            Ok(true) => {}
        }
        let validated = sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {late} VALIDATE CONSTRAINT {bound}"
        )))
        .execute(&mut *conn)
        .await;
        match validated {
            // Another maintainer's change dropped the check since (42704), or widened `late`
            // past it first (23514: its rows of the new days break it): read the partitions
            // again.
            Err(err)
                if matches!(
                    err.as_database_error().and_then(|d| d.code()).as_deref(),
                    Some("42704" | "23514")
                ) =>
            {
                return Ok(vec![Step::Raced]);
            }
            other => other.map_err(e).map(drop)?,
        }
    } else if seen.late().is_none()
        && let Err(busy) = make_table(conn, seen, "dedup_records_late", Expiry::Btree).await?
    {
        return Ok(vec![lock_busy(&first.name, &busy)]);
    }
    // The check the window keeps on `late` (the one just validated); every other is dropped.
    let kept = if checked { bound } else { String::new() };
    // (its name, the range quoted, and the name it is renamed to: RENAME TO takes a name
    // without its schema, the table stays in its own)
    let ranges: Vec<(String, String, String)> = taken
        .iter()
        .map(|d| {
            let gone = d.name.replacen("dedup_records_", "dedup_records_gone_", 1);
            (d.name.clone(), seen.q(&d.name), gone)
        })
        .collect();
    // The tables the change detaches, attaches and renames: the live records it copies through
    // the parent land in `late`.
    let touched: Vec<String> = ranges
        .iter()
        .map(|(_, range, _)| range.clone())
        .chain([late.clone()])
        .collect();
    let seen = seen.clone();
    let moved = locked(conn, |tx| {
        let (seen, ranges, late, kept) = (seen.clone(), ranges.clone(), late.clone(), kept.clone());
        let touched = touched.clone();
        Box::pin(async move {
            if !lock_unchanged(tx, &seen, Touched::Only(&touched)).await? {
                return Ok(None);
            }
            // Their indexes again, under the lock: another maintainer's rebuild of an invalid
            // one may have dropped it since (then the partitions are read again, and the drop
            // held back until the index is there).
            for (name, _, _) in &ranges {
                if expiry::indexed(tx, &seen, name).await? != Some(true) {
                    return Ok(None);
                }
            }
            let mut steps: Vec<String> = ranges
                .iter()
                .map(|(_, range, _)| format!("ALTER TABLE dedup_records DETACH PARTITION {range}"))
                .collect();
            if seen.late().is_some() {
                steps.push(format!("ALTER TABLE dedup_records DETACH PARTITION {late}"));
            }
            steps.push(format!(
                "ALTER TABLE dedup_records ATTACH PARTITION {late} FOR VALUES \
                 FROM (date '1970-01-01' + {late_lo}) TO (date '1970-01-01' + {hi})"
            ));
            for step in steps {
                // Day numbers and the schema's quoted names: nothing from outside.
                tx.execute(sqlx::AssertSqlSafe(step)).await?;
            }
            // The checks of earlier bounds (the partition's own bounds now imply them; kept,
            // they would refuse the records copied in): found bound, and only names of dedup's
            // exact making (`dedup_records_late_to_` and a day number) dropped.
            let old: Vec<String> = sqlx::query_scalar(
                "SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass \
                 AND conname ~ '^dedup_records_late_to_[0-9]+$' AND conname <> $2",
            )
            .bind(&late)
            .bind(&kept)
            .fetch_all(&mut *tx)
            .await?;
            for check in old {
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {late} DROP CONSTRAINT {check}"
                )))
                .await?;
            }
            tx.execute(NO_SEQSCAN_SQL).await?;
            let mut moved = Vec::with_capacity(ranges.len());
            for (name, range, gone) in ranges {
                // The live records, through the range's BRIN index on expires_at (never a scan
                // of the range under the lock, whatever its statistics say); then the others a
                // parked message names, through its primary key (`transaction_timestamp()`: the
                // same moment in both, so no record is copied twice).
                let live: i64 =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(copy_sql(&seen, &range, LIVE)))
                        .fetch_one(&mut *tx)
                        .await?;
                let parked: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(copy_sql(
                    &seen,
                    &range,
                    &format!("{} AND NOT ({LIVE})", parked_ctids(&range)),
                )))
                .fetch_one(&mut *tx)
                .await?;
                // Out of the table, its files are unlinked later, a piece at a time
                // (`clear_gone`): unlinking gigabytes at the commit slows the claims' WAL
                // flushes beside it.
                tx.execute(sqlx::AssertSqlSafe(format!(
                    "ALTER TABLE {range} RENAME TO {gone}"
                )))
                .await?;
                moved.push((name, u64::try_from(live + parked).unwrap_or(0)));
            }
            Ok(Some(moved))
        })
    })
    .await?;
    Ok(match moved {
        Err(busy) => vec![lock_busy(&first.name, &busy)],
        Ok(None) => vec![Step::Raced],
        Ok(Some(moved)) => moved
            .into_iter()
            .map(|(name, moved)| Step::Done { name, moved })
            .collect(),
    })
}

/// Counts, before the lock, the live records of the range `name` and those a parked message
/// names (up to `limit` of each), through its BRIN index on expires_at (its summary brought up
/// to date first) and its primary key; and the range's heap pages that reading took.
async fn counted(
    conn: &mut PgConnection,
    seen: &Parts,
    name: &str,
    limit: i64,
) -> Result<(u64, u64), sqlx::Error> {
    let range = seen.q(name);
    expiry::summarize(conn, seen, name).await?;
    let mut tx = conn.begin().await?;
    tx.execute(NO_SEQSCAN_SQL).await?;
    // The range's heap pages the lookup reads, counted by the server for this transaction.
    let pages_sql = "SELECT pg_stat_get_xact_blocks_fetched($1::regclass)";
    let before: i64 = sqlx::query_scalar(pages_sql)
        .bind(&range)
        .fetch_one(&mut *tx)
        .await?;
    let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM {range} r WHERE {LIVE} LIMIT $1) s) + \
         (SELECT count(*) FROM (SELECT 1 FROM dedup_parked p CROSS JOIN LATERAL \
         (SELECT 1 FROM {range} q WHERE q.scope = p.dedup_scope AND q.key = p.dedup_key) x \
         LIMIT $1) s)"
    )))
    .bind(limit)
    .fetch_one(&mut *tx)
    .await?;
    let after: i64 = sqlx::query_scalar(pages_sql)
        .bind(&range)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok((n(live), n(after - before)))
}

/// `late`'s heap in pages, as its file stands.
async fn late_pages(conn: &mut PgConnection, late: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::int8",
    )
    .bind(late)
    .fetch_one(&mut *conn)
    .await
}

/// The ranges dropped and not cleared yet: tables out of the parent named
/// `dedup_records_gone_YYYYMMDD` (exactly: a name of dedup's making) that the parent's owner
/// owns, each with its indexes, every name quoted and every relation also by its oid (which is
/// what the size query binds: a name from the catalog never goes into a literal). Another
/// role's look-alike is left alone (named in the last column, warned of once).
const GONE_SQL: &str = "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), \
     c.oid::int8, \
     array(SELECT quote_ident(n.nspname) || '.' || quote_ident(ic.relname) FROM pg_index i \
     JOIN pg_class ic ON ic.oid = i.indexrelid WHERE i.indrelid = c.oid ORDER BY ic.relname), \
     array(SELECT i.indexrelid::int8 FROM pg_index i \
     JOIN pg_class ic ON ic.oid = i.indexrelid WHERE i.indrelid = c.oid ORDER BY ic.relname), \
     (SELECT quote_ident(conname) FROM pg_constraint WHERE conrelid = c.oid AND contype = 'p'), \
     c.relname ~ '^dedup_records_gone_[0-9]{8}$' AND c.relowner = (SELECT relowner \
     FROM pg_class WHERE oid = 'dedup_records'::regclass), c.relname::text \
     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.relname LIKE 'dedup\\_records\\_gone\\_%' AND c.relkind = 'r' \
     AND NOT c.relispartition AND n.oid = (SELECT relnamespace FROM pg_class \
     WHERE oid = 'dedup_records'::regclass)";

/// A relation's size in bytes by its oid (0 once it is gone).
const SIZE_SQL: &str = "SELECT coalesce(pg_total_relation_size($1::oid), 0)";

/// The pause after a piece of a dropped range is cleared, where the piece was large (its unlink
/// is what slows the claims' WAL flushes beside it).
const GONE_PAUSE: Duration = Duration::from_millis(200);

/// A piece larger than this (bytes) is followed by [`GONE_PAUSE`].
const GONE_LARGE: i64 = 64 << 20;

/// Clears the ranges dropped: each index of each, then its heap, one statement and one unlink at
/// a time with a pause after each large one, outside any lock of the parent's (no one reads
/// them).
pub(super) async fn clear_gone(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    type Gone = (
        String,
        i64,
        Vec<String>,
        Vec<i64>,
        Option<String>,
        bool,
        String,
    );
    let gone: Vec<Gone> = sqlx::query_as(GONE_SQL).fetch_all(&mut *conn).await?;
    for (table, oid, indexes, index_oids, pkey, ours, name) in gone {
        if !ours {
            super::ranges::look_alike("a dropped range's name", &name);
            continue;
        }
        // (the statement, the oid of the relation whose files it unlinks)
        let mut steps: Vec<(String, i64)> = Vec::new();
        for (index, index_oid) in indexes.iter().zip(&index_oids) {
            let is_pkey = pkey
                .as_deref()
                .is_some_and(|k| index.ends_with(&format!(".{k}")));
            let step = match pkey.as_deref() {
                Some(k) if is_pkey => {
                    format!("ALTER TABLE IF EXISTS {table} DROP CONSTRAINT IF EXISTS {k}")
                }
                _ => format!("DROP INDEX IF EXISTS {index}"),
            };
            steps.push((step, *index_oid));
        }
        steps.push((format!("DROP TABLE IF EXISTS {table}"), oid));
        for (step, piece) in steps {
            let size: i64 = sqlx::query_scalar(SIZE_SQL)
                .bind(piece)
                .fetch_one(&mut *conn)
                .await?;
            // Names of dedup's making from the catalog, quoted, outside any literal.
            conn.execute(sqlx::AssertSqlSafe(step)).await?;
            if size > GONE_LARGE {
                tokio::time::sleep(GONE_PAUSE).await;
            }
        }
    }
    Ok(())
}
