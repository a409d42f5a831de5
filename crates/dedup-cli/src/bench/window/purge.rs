//! The retention beside a `--purge-during` pass: where the drop of the ranges of days stands, as
//! the events see it, and the retention's task, with what it did.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::connect::{CliError, connect_pg};
use dedup_core::Store;
use dedup_pg::PgStore;
use sqlx::PgPool;

/// The drop of the ranges of days in a `--purge-during` pass, as the events see it: bumped when
/// it starts and when it ends (its files cleared), so odd while it runs.
static DROPPING: AtomicU64 = AtomicU64::new(0);

/// Where the drop of the ranges stands, taken when an event starts (for [`overlapped`]).
pub(in crate::bench) fn drop_phase() -> u64 {
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
pub(in crate::bench) fn overlapped(start: u64) -> bool {
    spans_drop(start, drop_phase())
}

/// Whether an event that started at the drop's phase `start` and ended at `end` overlapped it.
fn spans_drop(start: u64, end: u64) -> bool {
    start % 2 == 1 || end != start
}

/// What the retention did while a pass ran.
#[derive(Debug, Default)]
pub(in crate::bench) struct Purged {
    /// The ranges of days of the partitioned table dropped first (`maintain_ranges`), the
    /// records their drops moved, and how long that took.
    pub(in crate::bench) dropped: Vec<String>,
    pub(in crate::bench) moved: u64,
    pub(in crate::bench) ranges: Duration,
    pub(in crate::bench) records: u64,
    pub(in crate::bench) statements: u64,
    /// From its start until a statement found less than a full batch.
    pub(in crate::bench) elapsed: Duration,
    /// How long, while it ran, at least one other session waited on a lock it held (sampled
    /// every 10 ms).
    pub(in crate::bench) blocked: Duration,
    /// The VACUUM of `dedup_records` after it.
    pub(in crate::bench) vacuum: Duration,
    pub(in crate::bench) error: Option<String>,
}

impl Purged {
    pub(in crate::bench) fn json(&self) -> serde_json::Value {
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
pub(in crate::bench) struct Purge {
    task: tokio::task::JoinHandle<Purged>,
}

impl Purge {
    pub(in crate::bench) async fn start(
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

    pub(in crate::bench) async fn finish(self) -> Purged {
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
