//! Retention in the background ([`PgStore::spawn_retention`]): one instance at a time deletes the
//! records past their retention, so that no cron job is needed and a fleet of N consumers does
//! not run N purges.
//!
//! Each task keeps a connection of its own (not pooled). Every round it takes a session-level
//! advisory lock on it, `pg_try_advisory_lock(RETENTION_LOCK_CLASS, hashtext(current_schema()))`:
//! the task that holds it leads, and purges on that same session in bounded batches
//! ([`PURGE_SQL`], as `dedup purge` does) until a batch comes back short; the others stand by and
//! try again next round. The lock lives as long as the leader's session, so the server releases
//! it when the leader's process dies or its connection drops, and another task takes it at its
//! next round (docs/ARCHITECTURE.md, invariant 35). Exclusivity is for load, not safety: two
//! purges at once would still delete each expired record once (the purge skips locked rows), and
//! a record past `expires_at` counts as absent whether or not it was purged yet.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use dedup_core::StoreError;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::PgStore;
use crate::classify::classify;
use crate::sql::{PURGE_SQL, RETENTION_LOCK_CLASS, RETENTION_LOCK_SQL};

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
    /// The longest one statement may run (its `statement_timeout`); a round that hits it ends
    /// and the next one goes on.
    pub statement_timeout: Duration,
}

impl Default for RetentionConfig {
    /// A round a minute, 1,000 records a statement, no pause, statements of up to 30 s.
    fn default() -> Self {
        Self {
            every: Duration::from_secs(60),
            batch: 1000,
            pause: Duration::ZERO,
            statement_timeout: Duration::from_secs(30),
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

    /// Sets the longest one statement may run (at least 1 ms).
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout.max(Duration::from_millis(1));
        self
    }
}

/// What a retention task has done ([`Retention::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionStats {
    /// Whether this task holds the lock now: it is the one that purges.
    pub leading: bool,
    /// Rounds this task ran as the leader.
    pub rounds: u64,
    /// Rounds in which another session held the lock.
    pub standby: u64,
    /// Records this task deleted.
    pub purged: u64,
    /// When its last round as the leader ended.
    pub last_round: Option<SystemTime>,
    /// Rounds that ended on an error (the connection is made again at the next round).
    pub errors: u64,
    /// The last error, if the last round ended on one.
    pub last_error: Option<String>,
}

/// A running retention task ([`PgStore::spawn_retention`]). Dropping it stops the task (and its
/// session, so its lock goes to another task); [`stop`](Self::stop) also waits for the end.
#[derive(Debug)]
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

    /// Stops the task: a statement in flight finishes, the session closes (releasing the lock),
    /// and this returns once the task has ended.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Retention {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

impl PgStore {
    /// Starts retention in the background on the current Tokio runtime: every
    /// [`every`](RetentionConfig::every), the one task of all that share this database and schema
    /// which holds the retention lock deletes the records past their retention, `batch` a
    /// statement, until none is left. Parked keys' records are kept, as by `dedup purge`. Run it
    /// in every instance: only one purges at a time, and when it dies another takes over at its
    /// next round.
    pub fn spawn_retention(&self, config: RetentionConfig) -> Retention {
        let (stop, stopped) = watch::channel(false);
        let stats = Arc::new(Mutex::new(RetentionStats::default()));
        let options = self.pool().connect_options();
        let task = tokio::spawn(run(options, config, stopped, Arc::clone(&stats)));
        Retention {
            stop,
            stats,
            task: Some(task),
        }
    }
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

async fn run(
    options: Arc<PgConnectOptions>,
    config: RetentionConfig,
    mut stopped: watch::Receiver<bool>,
    stats: Arc<Mutex<RetentionStats>>,
) {
    let update = |f: &dyn Fn(&mut RetentionStats)| {
        f(&mut stats.lock().unwrap_or_else(PoisonError::into_inner));
    };
    // The session, once connected, and whether it holds the lock (it keeps it while it lives).
    let mut session: Option<(PgConnection, bool)> = None;
    loop {
        match round(&mut session, &options, config, &mut stopped).await {
            Ok(Round::Standby) => update(&|s| {
                s.leading = false;
                s.standby += 1;
            }),
            Ok(Round::Led(n)) => update(&|s| {
                s.leading = true;
                s.rounds += 1;
                s.purged += n;
                s.last_round = Some(SystemTime::now());
                s.last_error = None;
            }),
            Err(e) => {
                warn!(error = %e, "retention: a round failed; connecting again next round");
                // A session in an unknown state is closed: its lock, if any, goes with it.
                session = None;
                let text = e.to_string();
                update(&|s| {
                    s.leading = false;
                    s.errors += 1;
                    s.last_error = Some(text.clone());
                });
            }
        }
        if pause(&mut stopped, config.every).await {
            break;
        }
    }
    if let Some((conn, _)) = session.take() {
        // Closing the session releases the lock at once; dropping would too, less politely.
        let _ = conn.close().await;
    }
    update(&|s| s.leading = false);
    debug!("retention stopped");
}

enum Round {
    /// Another session holds the lock.
    Standby,
    /// This one led, and deleted this many records.
    Led(u64),
}

async fn round(
    session: &mut Option<(PgConnection, bool)>,
    options: &PgConnectOptions,
    config: RetentionConfig,
    stopped: &mut watch::Receiver<bool>,
) -> Result<Round, StoreError> {
    if session.is_none() {
        let timeout_ms = u64::try_from(config.statement_timeout.as_millis()).unwrap_or(u64::MAX);
        let options = options
            .clone()
            .options([("statement_timeout", timeout_ms.to_string())]);
        let conn = PgConnection::connect_with(&options)
            .await
            .map_err(|e| classify(e, false))?;
        *session = Some((conn, false));
    }
    let Some((conn, leading)) = session.as_mut() else {
        return Ok(Round::Standby);
    };
    // A session lock is taken once per session and never let go while the session lives (taking
    // it again would stack it, and one unlock would not release it).
    if !*leading {
        let got: bool = sqlx::query_scalar(RETENTION_LOCK_SQL)
            .bind(RETENTION_LOCK_CLASS)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| classify(e, false))?;
        if !got {
            return Ok(Round::Standby);
        }
        *leading = true;
        info!("retention: this instance leads the purge");
    }
    let mut purged = 0u64;
    loop {
        let n = sqlx::query(PURGE_SQL)
            .bind(i64::from(config.batch))
            .execute(&mut *conn)
            .await
            .map_err(|e| classify(e, true))?
            .rows_affected();
        purged += n;
        if n < u64::from(config.batch) || pause(stopped, config.pause).await {
            break;
        }
    }
    if purged > 0 {
        debug!(purged, "retention: round done");
    }
    Ok(Round::Led(purged))
}
