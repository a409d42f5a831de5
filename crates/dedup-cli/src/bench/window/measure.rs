//! What the window takes and what the server writes: `dedup_records`'s size on disk, a record's
//! size in the heap, and the server's WAL between two marks.

use std::time::{Duration, Instant};

use crate::connect::CliError;
use sqlx::PgPool;

/// What `dedup_records` takes on disk, summed over its partition tree (a partitioned parent's own
/// size is 0), read after a VACUUM so that the record count (`reltuples`) is exact enough.
#[derive(Debug, Default)]
pub(in crate::bench) struct Size {
    pub(in crate::bench) records: u64,
    pub(in crate::bench) heap: u64,
    pub(in crate::bench) toast: u64,
    /// Each index, by name, largest first.
    pub(in crate::bench) indexes: Vec<(String, u64)>,
}

impl Size {
    pub(in crate::bench) fn total(&self) -> u64 {
        self.heap + self.toast + self.indexes.iter().map(|i| i.1).sum::<u64>()
    }

    /// Bytes per record, and the heap's and the indexes' shares of them.
    pub(in crate::bench) fn per_record(&self) -> (f64, f64, f64) {
        #[allow(clippy::cast_precision_loss)]
        let per = |b: u64| b as f64 / self.records.max(1) as f64;
        (
            per(self.total()),
            per(self.heap + self.toast),
            per(self.indexes.iter().map(|i| i.1).sum()),
        )
    }

    pub(in crate::bench) fn json(&self) -> serde_json::Value {
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
pub(in crate::bench) async fn size(pool: &PgPool) -> Result<Size, CliError> {
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
pub(in crate::bench) async fn row_bytes(pool: &PgPool, scope: &str) -> Option<f64> {
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
pub(in crate::bench) struct WalMark {
    position: u64,
    counted: Option<u64>,
    fpi: Option<u64>,
}

/// The server's WAL now; `None` where the position cannot be read (a server in recovery).
pub(in crate::bench) async fn wal(pool: &PgPool) -> Option<WalMark> {
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
pub(in crate::bench) async fn wal_since(
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
