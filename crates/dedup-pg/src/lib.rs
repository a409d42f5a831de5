//! dedup-pg: the Postgres store, dedup's durable source of truth.
//!
//! Postgres alone grants leases and issues fencing tokens (from one sequence, so they never
//! repeat), on its own clock. Every call that changes a claimed record is fenced: it applies only
//! where the key's token and state still match, and otherwise fails with
//! [`StoreError::LeaseLost`] having changed nothing.
//!
//! # Two ways to hold a key
//! - **Lease mode** ([`Store`] on [`PgStore`]): the claim commits an IN_PROGRESS row with a lease;
//!   the handler runs outside any transaction while `Dedup::process` extends the lease; the
//!   completion is fenced by the token.
//! - **Transactional completion** ([`PgStore::transact`], or [`PgStore::complete_in`] plus
//!   [`PgStore::commit`]): the handler's business writes and the fenced completion commit in one
//!   transaction, so a zombie whose lease was taken over cannot commit its writes either.
//! - **Transaction mode** ([`PgStore::claim_in`]): the claim itself runs inside the caller's
//!   transaction; until it ends, the uncommitted row is the lock (a second claimer waits, or
//!   answers `InFlight` after the caller's `lock_timeout`), and a crash rolls it back.
//!
//! Queries are plain `sqlx::query` strings (not the compile-time checked macros) so that building
//! dedup needs no database and no `.sqlx/` data that can drift; every statement is exercised by the
//! conformance and Postgres tests against a real server.
//!
//! # Example
//! ```no_run
//! use dedup_core::{Dedup, Fingerprint, HandlerError, IdempotencyKey, Scope};
//! use dedup_pg::PgStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//! dedup_pg::migrate(&pool).await?;
//! let store = PgStore::new(pool);
//! let dedup = Dedup::new(store.clone());
//!
//! let key = IdempotencyKey::new(Scope::new("orders")?, "order-created-981")?;
//! let payload = br#"{"order": 981, "total": 4200}"#;
//! let done = dedup
//!     .process(&key, Some(Fingerprint::of(payload)), |lease| {
//!         let store = store.clone();
//!         async move {
//!             // The business write and the fenced completion commit together.
//!             store
//!                 .transact(&lease, |tx| {
//!                     Box::pin(async move {
//!                         sqlx::query("INSERT INTO orders (id, total) VALUES (981, 4200)")
//!                             .execute(&mut *tx)
//!                             .await
//!                             .map_err(HandlerError::Retryable)?;
//!                         Ok(bytes::Bytes::from_static(b"order 981 stored"))
//!                     })
//!                 })
//!                 .await
//!         }
//!     })
//!     .await?;
//! println!("{:?} (executed: {})", done.result(), done.executed());
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::machine::{self, ClaimStep};
use dedup_core::{
    AfterFailure, ClaimOutcome, ClaimRequest, Completion, FencingToken, Fingerprint, HandlerError,
    IdempotencyKey, Lease, LeaseContext, OwnerId, Record, State, Store, StoreError, Timestamp,
    micros,
};
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{Postgres, Row, Transaction};
use tracing::{debug, warn};

/// The embedded migrations (the workspace's top-level `migrations/`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Applies the migrations that have not run yet.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// How many times a claim that lost a race to a concurrent writer is re-run before giving up
/// with [`StoreError::Unavailable`]. Each re-run sees the winner's committed row.
const CLAIM_RACE_TRIES: u32 = 16;

/// The record's columns, with times as microseconds since the epoch.
macro_rules! record_cols {
    ($t:literal) => {
        concat!(
            $t,
            ".scope, ",
            $t,
            ".key, ",
            $t,
            ".state, ",
            $t,
            ".owner, ",
            $t,
            ".token, ",
            "(extract(epoch FROM ",
            $t,
            ".lease_until) * 1000000)::int8 AS lease_until_us, ",
            $t,
            ".attempts, ",
            $t,
            ".fingerprint, ",
            $t,
            ".result, ",
            $t,
            ".failure, ",
            "(extract(epoch FROM ",
            $t,
            ".created_at) * 1000000)::int8 AS created_us, ",
            "(extract(epoch FROM ",
            $t,
            ".updated_at) * 1000000)::int8 AS updated_us, ",
            "(extract(epoch FROM ",
            $t,
            ".expires_at) * 1000000)::int8 AS expires_us"
        )
    };
}

/// One round trip: read the row; insert it if absent, or take it over if its lease expired, it
/// was released, or it is past its retention (a fresh claim); otherwise answer from what was read.
/// A duplicate costs a plain read: no row lock, no WAL. `src` says which branch produced the row.
///
/// $1 scope, $2 key, $3 owner, $4 fingerprint, $5 lease (µs), $6 retention (µs), $7 max attempts.
const CLAIM_SQL: &str = concat!(
    "WITH clock AS (SELECT statement_timestamp() AS t), ",
    "cur AS (SELECT r.* FROM dedup_records r WHERE r.scope = $1 AND r.key = $2), ",
    "ins AS (",
    "  INSERT INTO dedup_records AS r (scope, key, state, owner, token, lease_until, attempts,",
    "    fingerprint, created_at, updated_at, expires_at)",
    "  SELECT $1, $2, 'in_progress', $3, nextval('dedup_token_seq'),",
    "    c.t + $5::float8 * interval '1 microsecond', 1, $4, c.t, c.t,",
    "    c.t + ($5 + $6)::float8 * interval '1 microsecond'",
    "  FROM clock c WHERE NOT EXISTS (SELECT 1 FROM cur)",
    "  ON CONFLICT (scope, key) DO NOTHING RETURNING r.*), ",
    "upd AS (",
    "  UPDATE dedup_records AS r SET state = 'in_progress', owner = $3,",
    "    token = nextval('dedup_token_seq'),",
    "    lease_until = c.t + $5::float8 * interval '1 microsecond',",
    "    attempts = CASE WHEN r.expires_at <= c.t THEN 1 ELSE r.attempts + 1 END,",
    "    fingerprint = CASE WHEN r.expires_at <= c.t THEN $4 ELSE coalesce(r.fingerprint, $4) END,",
    "    result = NULL,",
    "    failure = CASE WHEN r.expires_at <= c.t THEN NULL ELSE r.failure END,",
    "    created_at = CASE WHEN r.expires_at <= c.t THEN c.t ELSE r.created_at END,",
    "    updated_at = c.t,",
    "    expires_at = c.t + ($5 + $6)::float8 * interval '1 microsecond'",
    "  FROM clock c",
    "  WHERE r.scope = $1 AND r.key = $2 AND (r.expires_at <= c.t OR (r.attempts < $7",
    "    AND ($4::bytea IS NULL OR r.fingerprint IS NULL OR r.fingerprint = $4)",
    "    AND (r.state = 'released' OR (r.state = 'in_progress' AND r.lease_until <= c.t))))",
    "  RETURNING r.*) ",
    "SELECT 'ins' AS src, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8 AS now_us, ",
    record_cols!("ins"),
    " FROM ins ",
    "UNION ALL SELECT 'upd', (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8, ",
    record_cols!("upd"),
    " FROM upd ",
    "UNION ALL SELECT 'cur', (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8, ",
    record_cols!("cur"),
    " FROM cur ",
    "WHERE NOT EXISTS (SELECT 1 FROM ins) AND NOT EXISTS (SELECT 1 FROM upd)"
);

/// A claim found the key out of attempts: mark it FAILED, fenced on what was read.
/// $1 scope, $2 key, $3 token, $4 state read, $5 reason, $6 failed retention (µs), $7 max attempts.
const EXHAUST_SQL: &str = concat!(
    "UPDATE dedup_records SET state = 'failed', lease_until = NULL, failure = $5,",
    " updated_at = statement_timestamp(),",
    " expires_at = statement_timestamp() + $6::float8 * interval '1 microsecond'",
    " WHERE scope = $1 AND key = $2 AND token = $3 AND state = $4 AND attempts >= $7",
    " AND expires_at > statement_timestamp()",
    " AND (state = 'released' OR lease_until <= statement_timestamp())"
);

/// Every fenced end of a lease (complete, release, fail): applies only under the live token.
/// $1 scope, $2 key, $3 token, $4 new state, $5 result, $6 failure, $7 retention (µs).
const FINISH_SQL: &str = concat!(
    "UPDATE dedup_records SET state = $4, lease_until = NULL, result = $5, failure = $6,",
    " updated_at = statement_timestamp(),",
    " expires_at = statement_timestamp() + $7::float8 * interval '1 microsecond'",
    " WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'"
);

/// The heartbeat. $1 scope, $2 key, $3 token, $4 lease (µs), $5 retention (µs).
const EXTEND_SQL: &str = concat!(
    "UPDATE dedup_records SET updated_at = statement_timestamp(),",
    " lease_until = statement_timestamp() + $4::float8 * interval '1 microsecond',",
    " expires_at = greatest(expires_at,",
    "   statement_timestamp() + ($4 + $5)::float8 * interval '1 microsecond')",
    " WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'",
    " RETURNING (extract(epoch FROM lease_until) * 1000000)::int8"
);

const GET_SQL: &str = concat!(
    "SELECT ",
    record_cols!("r"),
    " FROM dedup_records r WHERE r.scope = $1 AND r.key = $2"
);

/// Bounded retention purge; skips rows another transaction holds.
const PURGE_SQL: &str = concat!(
    "WITH doomed AS (SELECT scope, key FROM dedup_records",
    "  WHERE expires_at <= statement_timestamp() ORDER BY expires_at LIMIT $1",
    "  FOR UPDATE SKIP LOCKED) ",
    "DELETE FROM dedup_records r USING doomed d WHERE r.scope = d.scope AND r.key = d.key"
);

/// The Postgres store. Cheap to clone (it holds a pool).
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
}

/// The body of a transaction run by [`PgStore::transact`]: business writes on the transaction's
/// connection, returning the result to store.
pub type TxBody<'c, E> = Pin<Box<dyn Future<Output = Result<Bytes, HandlerError<E>>> + Send + 'c>>;

impl PgStore {
    /// A store on `pool`. Run [`migrate`] once before use.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Claims inside the caller's transaction (transaction mode). Until that transaction ends,
    /// the uncommitted row is the lock: another claimer of the key waits on it, or answers
    /// [`ClaimOutcome::InFlight`] once the transaction's `lock_timeout` runs out (that error aborts
    /// the caller's transaction, which must then roll back). Use READ COMMITTED (the default).
    pub async fn claim_in(
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        req.policy.validate()?;
        let mut tries = 0;
        loop {
            tries += 1;
            if let Some(outcome) = claim_once(conn, req).await? {
                return Ok(outcome);
            }
            if tries >= CLAIM_RACE_TRIES {
                return Err(StoreError::unavailable(Contention(req.key.to_string())));
            }
            debug!(key = %req.key, tries, "claim lost a race; re-reading");
        }
    }

    /// Completes `lease` inside the caller's transaction: the completion commits or rolls back
    /// with the caller's business writes. Fails with [`StoreError::LeaseLost`] (and the caller must
    /// roll back) where the lease was taken over.
    pub async fn complete_in(
        conn: &mut PgConnection,
        lease: &Lease,
        result: &[u8],
    ) -> Result<(), StoreError> {
        lease.policy.check_result(result)?;
        finish(
            conn,
            lease,
            State::Completed,
            Some(result),
            None,
            lease.policy.retention,
        )
        .await
    }

    /// Commits a transaction that completed `lease` with [`complete_in`](Self::complete_in). A
    /// commit whose outcome is unknown (the connection dropped) is resolved by reading the record
    /// back on another connection: COMPLETED under our token means it committed.
    pub async fn commit(
        &self,
        tx: Transaction<'_, Postgres>,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let err = match tx.commit().await {
            Ok(()) => return Ok(()),
            Err(e) => classify(e, true),
        };
        if !err.is_outcome_unknown() {
            return Err(err);
        }
        warn!(key = %lease.key, error = %err, "commit outcome unknown; reading it back");
        match self.get(&lease.key).await {
            Ok(Some(r)) if r.token == lease.token && r.state == State::Completed => Ok(()),
            Ok(Some(r)) if r.token == lease.token && r.state == State::InProgress => {
                // Not committed (yet). Any later fenced call is refused if it lands after all.
                Err(match err {
                    StoreError::OutcomeUnknown { source } => StoreError::Unavailable { source },
                    other => other,
                })
            }
            Ok(_) => Err(StoreError::LeaseLost {
                key: lease.key.clone(),
                token: lease.token,
            }),
            Err(_) => Err(err),
        }
    }

    /// Transactional completion for `Dedup::process`: begins a transaction, runs `body` on it (the
    /// business writes), completes the lease in the same transaction and commits. If the lease
    /// was taken over, the completion is refused and the body's writes roll back with it.
    pub async fn transact<E, F>(
        &self,
        lease: &LeaseContext,
        body: F,
    ) -> Result<Completion, HandlerError<E>>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxBody<'c, E>,
    {
        let lease = lease.lease();
        let mut tx = self.pool.begin().await.map_err(|e| classify(e, false))?;
        let result = body(&mut tx).await?;
        Self::complete_in(&mut tx, lease, &result).await?;
        self.commit(tx, lease).await?;
        Ok(Completion::committed(result))
    }
}

/// A claim that kept losing races to concurrent writers.
#[derive(Debug)]
struct Contention(String);

impl std::fmt::Display for Contention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "claim of {} kept losing races to concurrent writers",
            self.0
        )
    }
}

impl std::error::Error for Contention {}

/// One run of the claim statement; `None` when it lost a race and must run again.
async fn claim_once(
    conn: &mut PgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, StoreError> {
    let p = req.policy;
    let row = sqlx::query(CLAIM_SQL)
        .bind(req.key.scope().as_str())
        .bind(req.key.key_bytes())
        .bind(req.owner.as_str())
        .bind(req.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
        .bind(micros(p.lease))
        .bind(micros(p.retention))
        .bind(attempts_i32(p.max_attempts))
        .fetch_optional(&mut *conn)
        .await;
    let row = match row {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(None),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
            // lock_timeout while an uncommitted claim (transaction mode) holds the key.
            return Ok(Some(ClaimOutcome::InFlight {
                owner: None,
                lease_until: None,
            }));
        }
        Err(e) => return Err(classify(e, true)),
    };
    let src: String = row.try_get("src").map_err(|e| classify(e, false))?;
    let now = Timestamp::from_micros(row.try_get("now_us").map_err(|e| classify(e, false))?);
    let record = record_from_row(&req.key, &row)?;
    Ok(match (src.as_str(), record.state) {
        ("ins" | "upd", State::InProgress) => {
            Some(ClaimOutcome::Acquired(Lease::granted(&record, req)))
        }
        ("cur", _) => match machine::claim(Some(&record), req, now, || record.token) {
            ClaimStep::Answer(outcome) => Some(outcome),
            ClaimStep::Exhaust { record: failed } => exhaust(conn, &record, &failed, req).await?,
            // It was claimable when read, but a concurrent writer changed it first.
            _ => None,
        },
        _ => {
            return Err(StoreError::Corrupt {
                key: req.key.clone(),
                detail: format!("claim wrote a row in state {}", record.state),
            });
        }
    })
}

/// Marks a key that ran out of attempts FAILED, fenced on the record that was read.
async fn exhaust(
    conn: &mut PgConnection,
    read: &Record,
    failed: &Record,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, StoreError> {
    let done = sqlx::query(EXHAUST_SQL)
        .bind(req.key.scope().as_str())
        .bind(req.key.key_bytes())
        .bind(token_i64(read.token))
        .bind(read.state.as_str())
        .bind(failed.failure.as_deref())
        .bind(micros(req.policy.failed_retention))
        .bind(attempts_i32(req.policy.max_attempts))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    Ok((done.rows_affected() == 1).then(|| machine::failed_outcome(failed)))
}

async fn finish(
    conn: &mut PgConnection,
    lease: &Lease,
    state: State,
    result: Option<&[u8]>,
    failure: Option<&str>,
    retention: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(FINISH_SQL)
        .bind(lease.key.scope().as_str())
        .bind(lease.key.key_bytes())
        .bind(token_i64(lease.token))
        .bind(state.as_str())
        .bind(result)
        .bind(failure)
        .bind(micros(retention))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(StoreError::LeaseLost {
            key: lease.key.clone(),
            token: lease.token,
        })
    }
}

impl Store for PgStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, false))?;
        Self::claim_in(&mut conn, req).await
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, false))?;
        Self::complete_in(&mut conn, lease, result).await
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, false))?;
        // The token pins the attempt count: it changes only with a takeover, which changes the
        // token too. So the lease's count is the record's.
        let p = lease.policy;
        if lease.attempts >= p.max_attempts {
            let reason = machine::exhausted_reason(lease.attempts, p.max_attempts, Some(error));
            finish(
                &mut conn,
                lease,
                State::Failed,
                None,
                Some(&reason),
                p.failed_retention,
            )
            .await?;
            Ok(AfterFailure::Failed {
                attempts: lease.attempts,
            })
        } else {
            finish(
                &mut conn,
                lease,
                State::Released,
                None,
                Some(error),
                p.retention,
            )
            .await?;
            Ok(AfterFailure::Released {
                attempts: lease.attempts,
            })
        }
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| classify(e, false))?;
        let retention = lease.policy.failed_retention;
        finish(
            &mut conn,
            lease,
            State::Failed,
            None,
            Some(reason),
            retention,
        )
        .await
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        let until: Option<i64> = sqlx::query_scalar(EXTEND_SQL)
            .bind(lease.key.scope().as_str())
            .bind(lease.key.key_bytes())
            .bind(token_i64(lease.token))
            .bind(micros(lease.policy.lease))
            .bind(micros(lease.policy.retention))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| classify(e, true))?;
        until
            .map(Timestamp::from_micros)
            .ok_or_else(|| StoreError::LeaseLost {
                key: lease.key.clone(),
                token: lease.token,
            })
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(GET_SQL)
            .bind(key.scope().as_str())
            .bind(key.key_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| classify(e, false))?;
        row.map(|row| record_from_row(key, &row)).transpose()
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE_SQL)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(|e| classify(e, true))?;
        Ok(done.rows_affected())
    }
}

fn token_i64(token: FencingToken) -> i64 {
    // Tokens come from a bigint sequence with MINVALUE 1, so they always fit.
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

fn attempts_i32(n: u32) -> i32 {
    // Policy::validate keeps max_attempts within 31 bits.
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Reads a row as a record of `key`; anything that is not a dedup record is [`StoreError::Corrupt`].
fn record_from_row(key: &IdempotencyKey, row: &PgRow) -> Result<Record, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        key: key.clone(),
        detail,
    };
    let get_err = |e: sqlx::Error| corrupt(e.to_string());
    let scope: String = row.try_get("scope").map_err(get_err)?;
    let key_bytes: Vec<u8> = row.try_get("key").map_err(get_err)?;
    if scope != key.scope().as_str() || key_bytes != key.key_bytes() {
        return Err(corrupt("the row belongs to another key".into()));
    }
    let state: String = row.try_get("state").map_err(get_err)?;
    let state = State::parse(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?;
    let token: i64 = row.try_get("token").map_err(get_err)?;
    let token = u64::try_from(token).map_err(|_| corrupt(format!("negative token {token}")))?;
    let attempts: i32 = row.try_get("attempts").map_err(get_err)?;
    let attempts =
        u32::try_from(attempts).map_err(|_| corrupt(format!("negative attempts {attempts}")))?;
    let ts = |col: &str| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(col)
            .map(Timestamp::from_micros)
            .map_err(get_err)
    };
    let mut record = Record::new(
        key.clone(),
        state,
        FencingToken::new(token),
        attempts,
        ts("created_us")?,
        ts("expires_us")?,
    );
    record.updated_at = ts("updated_us")?;
    record.owner = row
        .try_get::<Option<String>, _>("owner")
        .map_err(get_err)?
        .map(OwnerId::new);
    record.lease_until = row
        .try_get::<Option<i64>, _>("lease_until_us")
        .map_err(get_err)?
        .map(Timestamp::from_micros);
    record.fingerprint = match row
        .try_get::<Option<Vec<u8>>, _>("fingerprint")
        .map_err(get_err)?
    {
        None => None,
        Some(b) => Some(
            Fingerprint::from_slice(&b)
                .ok_or_else(|| corrupt("fingerprint is not 32 bytes".into()))?,
        ),
    };
    record.result = row
        .try_get::<Option<Vec<u8>>, _>("result")
        .map_err(get_err)?
        .map(Bytes::from);
    record.failure = row.try_get("failure").map_err(get_err)?;
    Ok(record)
}

/// Classifies a sqlx error. `write` says whether the statement may have changed data: a dropped
/// connection after a write leaves its outcome unknown.
pub fn classify(e: sqlx::Error, write: bool) -> StoreError {
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            // 40: serialization failure, deadlock; 53: out of resources; 55P03: lock timeout;
            // 57P01-03: server shutting down or starting; 08: connection exceptions.
            // The server reported the failure, so the statement did not apply.
            let passing = code.starts_with("40")
                || code.starts_with("53")
                || code.starts_with("08")
                || matches!(code.as_str(), "55P03" | "57P01" | "57P02" | "57P03");
            if passing {
                StoreError::unavailable(e)
            } else {
                StoreError::backend(e)
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => {
            if write {
                StoreError::outcome_unknown(e)
            } else {
                StoreError::unavailable(e)
            }
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::BeginFailed => StoreError::unavailable(e),
        _ => StoreError::backend(e),
    }
}
