//! Retention in the background ([`PgStore::spawn_retention`]): one instance at a time deletes the
//! records past their retention, so that no cron job is needed and a fleet of N consumers does
//! not run N purges.
//!
//! Each task keeps a session of its own: a connection made by the store's pool (so the pool's
//! settings and `after_connect` apply) and then detached from it. Every round it tries a
//! session-level advisory lock on it, keyed on the schema that holds `dedup_records`: the task
//! that holds it leads, and purges on that same session in bounded batches ([`PURGE_SQL`], as
//! `dedup purge` does) until a batch comes back short; the others stand by and try again next
//! round. On the table partitioned by the key's time, the leader first keeps the ranges of days
//! ([`maintain_ranges`]: the ranges due made ahead, the expired ones dropped whole), and the
//! bounded DELETE leaves the ranges alone. The lock lives as long as the leader's session, so the server releases it when the
//! leader's process dies or closes its connection (a connection cut without a word is seen by the
//! server's TCP keepalive, which the session sets to about a minute), and another task takes it
//! at its next round (docs/ARCHITECTURE.md, invariant 35). Every call has a client-side deadline,
//! so a network that swallows packets costs a round, not the task. Session locks need a session:
//! behind PgBouncer, use session pooling for dedup. Exclusivity is for load, not safety: two
//! purges at once would still delete each expired record once (the purge skips locked rows), and
//! a record past `expires_at` counts as absent whether or not it was purged yet.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use dedup_core::StoreError;
use sqlx::Connection;
use sqlx::postgres::{PgConnection, PgPool};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::PgStore;
use crate::classify::classify;
use crate::layout::{RangePolicy, RangeReport, maintain_ranges};
use crate::sql::{PURGE_SQL, RETENTION_LOCK_CLASS, RETENTION_LOCK_SQL};

/// The longest `statement_timeout` Postgres takes (an `int4` of milliseconds).
const MAX_STATEMENT_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);
/// What a call may take beyond the statement's own timeout before the client gives up on it.
const CLIENT_MARGIN: Duration = Duration::from_secs(5);
/// What keeping the ranges of days may take beyond a statement's limit: up to 20 waits of
/// 100 ms for the table's lock per change, the pauses between them, a few changes.
const RANGES_MARGIN: Duration = Duration::from_secs(60);
/// How long [`Retention::stop`] waits for a statement in flight before it drops the session.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// How a background retention task runs ([`PgStore::spawn_retention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionConfig {
    /// Time between rounds (each round purges until nothing expired is left).
    pub every: Duration,
    /// Records deleted per statement.
    pub batch: u32,
    /// Time between two statements of a round, to leave room for the claims beside it.
    pub pause: Duration,
    /// The longest one statement may run (its `statement_timeout`; the client gives up a few
    /// seconds later); a round that hits it fails, and the next one goes on.
    pub statement_timeout: Duration,
    /// How the ranges of days of the table partitioned by the key's time are made and dropped,
    /// at the start of each round (nothing to do on the single table).
    pub ranges: RangePolicy,
}

impl Default for RetentionConfig {
    /// A round a minute, 1,000 records a statement, no pause, statements of up to 30 s.
    fn default() -> Self {
        Self {
            every: Duration::from_secs(60),
            batch: 1000,
            pause: Duration::ZERO,
            statement_timeout: Duration::from_secs(30),
            ranges: RangePolicy::default(),
        }
    }
}

impl RetentionConfig {
    /// Sets the time between rounds (at least 1 ms).
    pub fn with_every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(1));
        self
    }

    /// Sets how many records one statement deletes (at least 1).
    pub fn with_batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Sets the pause between two statements of a round.
    pub fn with_pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Sets how the ranges of days of the partitioned table are kept.
    pub fn with_ranges(mut self, ranges: RangePolicy) -> Self {
        self.ranges = ranges;
        self
    }

    /// Sets the longest one statement may run (1 ms to about 24 days, Postgres's bounds).
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout.clamp(Duration::from_millis(1), MAX_STATEMENT_TIMEOUT);
        self
    }
}

/// Where a retention task stands ([`RetentionStats::state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetentionState {
    /// Before its first round.
    #[default]
    Starting,
    /// It holds the lock: it is the one that purges.
    Leading,
    /// Another session holds the lock.
    StandingBy,
    /// Its last round failed (Postgres unreachable, a statement refused or timed out); it
    /// connects again at the next round.
    Failed,
}

/// What a retention task has done ([`Retention::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionStats {
    /// Where it stands now.
    pub state: RetentionState,
    /// Rounds it ran as the leader, to their end.
    pub rounds: u64,
    /// Rounds in which another session held the lock.
    pub standby: u64,
    /// Records it deleted (counted after each statement).
    pub purged: u64,
    /// Its statements that deleted at least one record.
    pub statements: u64,
    /// Ranges of days it made (the partitioned table).
    pub ranges_made: u64,
    /// Ranges of days it dropped whole.
    pub ranges_dropped: u64,
    /// Ranges of days frozen (`RangeReport::frozen`).
    pub ranges_frozen: u64,
    /// Records it moved under the table's lock while making and dropping ranges.
    pub moved: u64,
    /// Days from its last round to the first day without a range of its own (the partitioned
    /// table): under one, new keys are about to land in `dedup_records_future`.
    pub margin_days: Option<i64>,
    /// Why its last round held a range back, if it did.
    pub held_back: Option<String>,
    /// When its last round as the leader ended.
    pub last_round: Option<SystemTime>,
    /// Rounds that failed.
    pub errors: u64,
    /// The error of the last round, if it failed.
    pub last_error: Option<String>,
}

impl RetentionStats {
    /// Whether it holds the lock now.
    pub fn leading(&self) -> bool {
        self.state == RetentionState::Leading
    }
}

/// A running retention task ([`PgStore::spawn_retention`]). Dropping it stops the task (and its
/// session, so its lock goes to another task); [`stop`](Self::stop) also waits for the end.
#[derive(Debug)]
#[must_use = "dropping a Retention stops its task"]
pub struct Retention {
    stop: watch::Sender<bool>,
    stats: Arc<Mutex<RetentionStats>>,
    task: Option<JoinHandle<()>>,
}

impl Retention {
    /// What the task has done so far.
    pub fn stats(&self) -> RetentionStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the task and answers what it did: a statement in flight may finish (up to a few
    /// seconds; after that the session is dropped, which ends it on the server), then the session
    /// closes, releasing the lock.
    pub async fn stop(mut self) -> RetentionStats {
        self.stop.send_replace(true);
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(STOP_WAIT, &mut task).await.is_err()
        {
            task.abort();
            let _ = task.await;
        }
        self.stats()
    }
}

impl Drop for Retention {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

impl PgStore {
    /// Starts retention in the background on the current Tokio runtime: every
    /// [`every`](RetentionConfig::every), the one task of all that share this database and the
    /// schema of `dedup_records` which holds the retention lock deletes the records past their
    /// retention, `batch` a statement, until none is left (on the table partitioned by the key's
    /// time, after making the ranges of days due and dropping the expired ones whole, as
    /// [`RetentionConfig::ranges`] says). Parked keys' records are kept, as by `dedup purge`. Run it in every instance: only one purges at a time, and when it dies
    /// another takes over at its next round. Its session comes from this store's pool (made by
    /// it, then detached), and needs a real session: behind PgBouncer, session pooling.
    #[must_use = "dropping the Retention stops the task at once"]
    pub fn spawn_retention(&self, config: RetentionConfig) -> Retention {
        let (stop, stopped) = watch::channel(false);
        let stats = Arc::new(Mutex::new(RetentionStats::default()));
        let task = tokio::spawn(run(
            self.pool().clone(),
            config,
            stopped,
            Arc::clone(&stats),
        ));
        Retention {
            stop,
            stats,
            task: Some(task),
        }
    }
}

/// What [`PgStore::retention_round`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionRound {
    /// The ranges of days made and dropped (the partitioned table).
    pub ranges: RangeReport,
    /// Records the bounded DELETE took.
    pub purged: u64,
}

impl PgStore {
    /// One round of retention, now, without the retention lock (a cron job's step, as
    /// `dedup purge` runs it): the ranges of days of the partitioned table made and dropped
    /// ([`maintain_ranges`]), then the records past their retention outside them deleted,
    /// `batch` a statement, until a statement comes back short. Two at once are safe, only
    /// wasteful.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] as [`classify`] sorts it; what was done before it stays done.
    pub async fn retention_round(
        &self,
        config: &RetentionConfig,
    ) -> Result<RetentionRound, StoreError> {
        let limit = config.statement_timeout + CLIENT_MARGIN;
        let mut conn = bounded(limit, self.pool().acquire()).await?;
        let ranges = keep_ranges(&mut conn, config, limit).await?;
        let ranged = ranges.ranged_days.unwrap_or((0, 0));
        let mut purged = 0;
        loop {
            let n = purge_batch(&mut conn, config.batch, ranged, limit).await?;
            purged += n;
            if n < u64::from(config.batch) {
                return Ok(RetentionRound { ranges, purged });
            }
        }
    }
}

/// The ranges of days made and dropped as `config` says, by the server's clock, the whole of it
/// given up on after `limit` beyond the longest its waits for the table's lock can take. A
/// failure is reported (`held_back`) and does not stop retention: the bounded DELETE after it
/// purges the other partitions as ever, and leaves the ranges (read again from the catalog)
/// alone, as it always does (a range goes whole; walking one in the order of `expires_at` has
/// no index to follow).
async fn keep_ranges(
    conn: &mut PgConnection,
    config: &RetentionConfig,
    limit: Duration,
) -> Result<RangeReport, StoreError> {
    let deadline = limit + RANGES_MARGIN;
    let kept = tokio::time::timeout(deadline, async {
        // What is due is judged by the server's clock, as every lease and expiry is.
        let now_ms: i64 = sqlx::query_scalar(
            "SELECT floor(extract(epoch FROM statement_timestamp()) * 1000)::int8",
        )
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| classify(e, false))?;
        let now =
            SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(now_ms).unwrap_or(0));
        maintain_ranges(conn, &config.ranges, now).await
    })
    .await;
    let failed = match kept {
        Ok(Ok(report)) => return Ok(report),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("not done within {deadline:?}"),
    };
    warn!(error = %failed, "retention: the ranges of days not kept this round");
    let ranged_days = crate::layout::ranged_days(conn).await?;
    Ok(RangeReport {
        partitioned: ranged_days.is_some(),
        held_back: Some(format!("the ranges of days not kept: {failed}")),
        ranged_days,
        ..RangeReport::default()
    })
}

/// One statement of the bounded DELETE: up to `batch` records past their retention, outside
/// the ranges of days `[ranged.0, ranged.1)`. Answers how many.
async fn purge_batch(
    conn: &mut PgConnection,
    batch: u32,
    ranged: (i32, i32),
    limit: Duration,
) -> Result<u64, StoreError> {
    Ok(bounded(
        limit,
        sqlx::query(PURGE_SQL)
            .bind(i64::from(batch))
            .bind(ranged.0)
            .bind(ranged.1)
            .execute(&mut *conn),
    )
    .await?
    .rows_affected())
}

/// Sleeps `d`, or less if the task is told to stop; true when it should stop.
async fn pause(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    if *stopped.borrow() {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(d) => *stopped.borrow(),
        _ = stopped.changed() => true,
    }
}

/// `f`, given up on `limit` from now: a network that swallows packets is an error, not a hang.
async fn bounded<T>(
    limit: Duration,
    f: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(|e| classify(e, false)),
        Err(_) => Err(StoreError::unavailable(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from Postgres within {limit:?}"),
        ))),
    }
}

struct Task {
    pool: PgPool,
    config: RetentionConfig,
    stats: Arc<Mutex<RetentionStats>>,
}

impl Task {
    fn update(&self, f: impl FnOnce(&mut RetentionStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn limit(&self) -> Duration {
        self.config.statement_timeout + CLIENT_MARGIN
    }

    /// A session of its own: made by the pool (its options and `after_connect`), then detached,
    /// with the statement timeout, a TCP keepalive that lets the server see a silent death
    /// within about a minute, and `application_name` "dedup retention" (who purges, in
    /// `pg_stat_activity`).
    async fn connect(&self) -> Result<PgConnection, StoreError> {
        let limit = self.limit();
        let mut conn = bounded(limit, self.pool.acquire()).await?.detach();
        let timeout_ms = self.config.statement_timeout.as_millis().to_string();
        bounded(
            limit,
            sqlx::query(
                "SELECT set_config('statement_timeout', $1, false), \
                 set_config('tcp_keepalives_idle', '30', false), \
                 set_config('tcp_keepalives_interval', '10', false), \
                 set_config('tcp_keepalives_count', '3', false), \
                 set_config('application_name', 'dedup retention', false)",
            )
            .bind(timeout_ms)
            .execute(&mut conn),
        )
        .await?;
        Ok(conn)
    }

    /// One round: connects if needed, takes the lock if it can (once per session), and as the
    /// leader purges until a statement deletes less than a full batch.
    async fn round(
        &self,
        session: &mut Option<(PgConnection, bool)>,
        stopped: &mut watch::Receiver<bool>,
    ) -> Result<bool, StoreError> {
        let limit = self.limit();
        let (conn, leading) = match session {
            Some(held) => held,
            None => session.insert((self.connect().await?, false)),
        };
        // A session lock is taken once per session and never let go while the session lives
        // (taking it again would stack it, and one unlock would not release it).
        if !*leading {
            let got: Option<bool> = bounded(
                limit,
                sqlx::query_scalar(RETENTION_LOCK_SQL)
                    .bind(RETENTION_LOCK_CLASS)
                    .fetch_optional(&mut *conn),
            )
            .await?;
            if got != Some(true) {
                return Ok(false);
            }
            *leading = true;
            self.update(|s| s.state = RetentionState::Leading);
            info!("retention: this instance leads the purge");
        }
        let ranges = keep_ranges(conn, &self.config, limit).await?;
        self.update(|s| {
            s.ranges_made += ranges.made.len() as u64;
            s.ranges_dropped += ranges.dropped.len() as u64;
            s.ranges_frozen += ranges.frozen.len() as u64;
            s.moved += ranges.moved;
            s.margin_days = ranges.margin_days;
            s.held_back.clone_from(&ranges.held_back);
        });
        let ranged = ranges.ranged_days.unwrap_or((0, 0));
        loop {
            let n = purge_batch(conn, self.config.batch, ranged, limit).await?;
            self.update(|s| {
                s.purged += n;
                s.statements += u64::from(n > 0);
            });
            if n < u64::from(self.config.batch) || pause(stopped, self.config.pause).await {
                return Ok(true);
            }
        }
    }
}

async fn run(
    pool: PgPool,
    config: RetentionConfig,
    mut stopped: watch::Receiver<bool>,
    stats: Arc<Mutex<RetentionStats>>,
) {
    let task = Task {
        pool,
        config,
        stats,
    };
    // The session, once made, and whether it holds the lock (it keeps it while it lives).
    let mut session: Option<(PgConnection, bool)> = None;
    loop {
        match task.round(&mut session, &mut stopped).await {
            Ok(false) => task.update(|s| {
                s.state = RetentionState::StandingBy;
                s.standby += 1;
                s.last_error = None;
            }),
            Ok(true) => task.update(|s| {
                s.state = RetentionState::Leading;
                s.rounds += 1;
                s.last_round = Some(SystemTime::now());
                s.last_error = None;
            }),
            Err(e) => {
                warn!(error = %e, "retention: a round failed; connecting again next round");
                // A session in an unknown state is dropped: its lock, if any, goes with it.
                session = None;
                let text = e.to_string();
                task.update(|s| {
                    s.state = RetentionState::Failed;
                    s.errors += 1;
                    s.last_error = Some(text);
                });
            }
        }
        if pause(&mut stopped, config.every).await {
            break;
        }
    }
    if let Some((conn, _)) = session.take() {
        // Closing the session releases the lock at once; dropping it would too, less politely.
        let _ = tokio::time::timeout(CLIENT_MARGIN, conn.close()).await;
    }
    debug!("retention stopped");
}
