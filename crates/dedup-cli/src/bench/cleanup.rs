//! Removing what a run wrote: its contenders' records, in batches.

use sqlx::PgPool;

/// The tags of the scopes a run's dedup contenders write records under (`bench-<tag>-<run>`):
/// (c), (d), (e), (e'), (f), (ek), (fk) and the claim statement alone.
pub(super) const SCOPE_TAGS: [&str; 15] = [
    "c", "d", "e", "e2", "f", "ek", "fk", "g", "g2", "g3", "h1", "h2", "h2l", "h3", "claim",
];

/// Rows deleted per statement when cleaning up.
pub(super) const CLEANUP_BATCH: i64 = 10_000;

/// What [`cleanup`] deleted, and what it could not.
#[derive(Debug, Default)]
pub(super) struct Cleaned {
    pub(super) records: u64,
    pub(super) ledger: u64,
    pub(super) usual: u64,
    /// The first error, per table: rows of the run are left there.
    pub(super) errors: Vec<String>,
}

impl Cleaned {
    pub(super) fn summary(&self, run_id: &str) -> String {
        let scopes = SCOPE_TAGS
            .iter()
            .map(|t| format!("bench-{t}-{run_id}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut out = format!(
            "[bench] cleaned up: deleted {} record(s) under the run's scopes ({scopes}), {} ledger \
             row(s), {} row(s) of the usual patterns",
            self.records, self.ledger, self.usual
        );
        for e in &self.errors {
            out.push_str(&format!("\n[bench] cleanup incomplete: {e}"));
        }
        out
    }
}

/// Deletes a run's rows (records under its scopes, rows of (a) and (a'), ledger rows) in
/// bounded batches (`CLEANUP_BATCH` rows a statement), and says how many. `keys_from` is the
/// first UUIDv7 text a key of this bench can have ([`keys_floor`]).
pub(super) async fn cleanup(pool: &PgPool, run_id: &str, keys_from: &str) -> Cleaned {
    let scopes: Vec<String> = SCOPE_TAGS
        .iter()
        .map(|t| format!("bench-{t}-{run_id}"))
        .collect();
    let mut cleaned = Cleaned::default();
    // The time-ordered records first, in the ranges of days, whose primary key leads with the
    // key (layout/ranges.rs): found from the first key this bench can have made, page after
    // page in the order of the keys (a range's rows are not found by their scope alone but by
    // reading all of it, and without the pages each statement would read again past the rows
    // the last one deleted and the other scopes' keys since the bench began).
    match cleanup_time_ordered(pool, &scopes, keys_from).await {
        Ok(n) => cleaned.records += n,
        Err(e) => cleaned.errors.push(format!("dedup_records: {e}")),
    }
    for (sql, arg, what) in [
        // A ctid is a row's place in its own table: on the partitioned table, with the
        // partition's oid beside it. Then the keys without a time (every key of the single
        // table, whose `kt` is `-infinity`; the untimed partition), found by the scope that
        // leads its primary key.
        (
            "DELETE FROM dedup_records WHERE (tableoid, ctid) IN (SELECT tableoid, ctid \
             FROM dedup_records WHERE scope = ANY($1::text[]) AND kt < date '1970-01-01' \
             LIMIT $2)",
            scopes,
            "dedup_records",
        ),
        (
            "DELETE FROM dedup_bench_ledger WHERE ctid IN (SELECT ctid FROM dedup_bench_ledger \
             WHERE run = ANY($1::text[]) LIMIT $2)",
            vec![run_id.to_owned()],
            "dedup_bench_ledger",
        ),
        (
            "DELETE FROM dedup_bench_ledger_unique WHERE ctid IN (SELECT ctid FROM \
             dedup_bench_ledger_unique WHERE run = ANY($1::text[]) LIMIT $2)",
            vec![run_id.to_owned()],
            "dedup_bench_ledger_unique",
        ),
        (
            "DELETE FROM dedup_bench_usual WHERE ctid IN (SELECT ctid FROM dedup_bench_usual \
             WHERE starts_with(key, ($1::text[])[1]) LIMIT $2)",
            vec![format!("{run_id}:")],
            "dedup_bench_usual",
        ),
    ] {
        let mut deleted = 0;
        let error = loop {
            match sqlx::query(sql)
                .bind(arg.clone())
                .bind(CLEANUP_BATCH)
                .execute(pool)
                .await
            {
                Ok(d) if d.rows_affected() > 0 => deleted += d.rows_affected(),
                Ok(_) => break None,
                // (a) and (a') did not run, ever: no table, no rows.
                Err(e)
                    if e.as_database_error()
                        .and_then(|d| d.code())
                        .is_some_and(|c| c == "42P01") =>
                {
                    break None;
                }
                Err(e) => break Some(e),
            }
        };
        match what {
            "dedup_records" => cleaned.records += deleted,
            "dedup_bench_ledger" | "dedup_bench_ledger_unique" => cleaned.ledger += deleted,
            _ => cleaned.usual = deleted,
        }
        if let Some(e) = error {
            cleaned.errors.push(format!("{what}: {e}"));
        }
    }
    cleaned
}

/// Deletes the records of `scopes` in the ranges of days (`kt` from 1970 on) whose key sorts
/// at or after `keys_from`, `CLEANUP_BATCH` a statement in the order of the keys, each statement
/// going on from the last key the one before it deleted. Says how many.
pub(super) async fn cleanup_time_ordered(
    pool: &PgPool,
    scopes: &[String],
    keys_from: &str,
) -> Result<u64, sqlx::Error> {
    let mut from = keys_from.as_bytes().to_vec();
    let mut deleted = 0_u64;
    loop {
        let (gone, last): (i64, Option<Vec<u8>>) = sqlx::query_as(
            "WITH doomed AS MATERIALIZED (SELECT tableoid, ctid, key FROM dedup_records \
               WHERE scope = ANY($1::text[]) AND key >= $3 AND kt >= date '1970-01-01' \
               ORDER BY key LIMIT $2), \
             gone AS (DELETE FROM dedup_records \
               WHERE (tableoid, ctid) IN (SELECT tableoid, ctid FROM doomed) RETURNING 1) \
             SELECT (SELECT count(*) FROM gone), \
               (SELECT key FROM doomed ORDER BY key DESC LIMIT 1)",
        )
        .bind(scopes)
        .bind(CLEANUP_BATCH)
        .bind(&from)
        .fetch_one(pool)
        .await?;
        deleted += u64::try_from(gone).unwrap_or(0);
        match last {
            Some(last) if gone > 0 => from = last,
            _ => return Ok(deleted),
        }
    }
}

/// The wall clock in milliseconds since the Unix epoch: the time of the bench's time-ordered
/// keys, and of the floor its cleanup finds them from.
pub(super) fn unix_ms_now() -> u64 {
    u64::try_from(dedup_core::Timestamp::now().as_micros() / 1000).unwrap_or(0)
}

/// The text every UUIDv7 made at `unix_ms` or later sorts at or after: its first 48 bits, as
/// the key's text writes them (`tttttttt-tttt`). Every time-ordered key of this bench is made
/// at its start or later ([`EventKeys::new`](super::args::EventKeys::new)).
pub(super) fn keys_floor(unix_ms: u64) -> String {
    format!("{:08x}-{:04x}", unix_ms >> 16, unix_ms & 0xffff)
}
