//! One key claimed inside a transaction that stays open for the caller's writes: transaction
//! mode for a single request (the HTTP layer's transactional path), one commit in all.
//!
//! ```text
//! BEGIN; the transaction's idle bound; dedup_probe_one:  one round trip (`begin_sql`)
//!   try-lock the key; once locked, read whether it has a row (a fresh key gets a token from
//!   the sequence)
//!   a key with a row: the claim statement               (replays, takeovers, retries)
//! held: an empty query, after which sqlx counts the transaction as its own
//!                                                       one round trip (`ClaimedTx::hold`)
//! the caller's writes, on the transaction (`ClaimedTx` derefs to a `PgConnection`; its
//!   `begin()` is a savepoint)
//! dedup_complete_one (a fresh key written COMPLETED once); COMMIT; BEGIN
//!                                                       one round trip (`commit_fresh_sql`)
//!   (a key with a row: completed under its token, then COMMIT)
//! ROLLBACK of the empty transaction: sent with the pool's check as the connection goes back
//! ```
//!
//! A fresh key costs three round trips besides the caller's (one of them an empty query), and
//! one WAL flush. The probe and the completion are simple queries with no parameters, the
//! scope, the key, the fingerprint and the result written as hex, that call PL/pgSQL functions
//! (migration 20261207000001, which says why): their plans are made once per connection and are
//! safe by their shape whatever the statistics said then, and a call with constant arguments is
//! cheap to parse. So the result is in the statement's text: a
//! completion that fails is logged with it where the server logs failed statements
//! (`log_min_error_statement`), and `pg_stat_activity` shows it while it runs.
//!
//! As in a batch (`fresh.rs`): the advisory lock keeps every other transactional claimer off the
//! key without waiting (a held lock answers InFlight at once), and a fresh key is written once,
//! at the end. A writer that takes no advisory lock (a lease-mode claim) may write it meanwhile:
//! the final insert fails on its row, the COMMIT after it never runs, and nothing commits (a
//! passing error). The read is a statement after the lock's, so its snapshot sees a first writer
//! that committed before it let go.
//!
//! The transaction is begun by hand on a pooled connection, so that BEGIN shares its round trip
//! with the probe, and COMMIT its own with the completion. sqlx learns of it before the caller
//! writes (`ClaimedTx::hold`): otherwise a caller's `begin()` sends BEGIN (a warning inside a
//! transaction) and its COMMIT commits the claim's transaction early, letting go of the key with
//! the effect written and no record. [`ClaimedTx::rollback`] sends the ROLLBACK; a `ClaimedTx`
//! dropped without [`commit`](ClaimedTx::commit) or `rollback` (a panic, a cancelled future)
//! closes its connection instead of returning it, and Postgres rolls
//! the transaction back as the session ends: nothing was written, the key is free again and no
//! attempt is spent. So does any statement of it that fails. A client stopped mid-request holds
//! the key only until the session's `idle_in_transaction_session_timeout`
//! ([`TxBatchConfig::idle_timeout`]) ends it: a request must end within it. The caller's own
//! statements wait on locks as in any transaction (no `lock_timeout` is set).

use dedup_core::{
    AfterFailure, AfterHandlerError, ClaimOutcome, ClaimRequest, HandlerError, Lease, State, Store,
    StoreError, micros,
};
use futures_util::TryStreamExt as _;
use sqlx::postgres::{PgConnection, PgTransactionManager};
use sqlx::{Row, SqlSafeStr as _};
use sqlx_core::transaction::TransactionManager as _;

use super::fresh::{Taken, fresh_lease, insert_claimed};
use super::parts::record_failure;
use super::{BatchAnswer, TxBatchConfig};
use crate::claim::claim_counted;
use crate::classify::classify;
use crate::rows::token_i64;
use crate::{PgConn, PgStore};

/// The longest bound `idle_in_transaction_session_timeout` takes (an `int` of milliseconds).
const MAX_BOUND_MS: u128 = i32::MAX as u128;

/// `bytes` as lowercase hex: the form the scope, the key, a fingerprint and a result take in the
/// simple queries below, which carry no parameters (only `[0-9a-f]`: nothing in them can end the
/// literal they are written in).
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// The claim's one round trip, a simple query with no parameters (the scope and the key as hex,
/// the bound as an integer): BEGIN; the transaction's idle bound, and `dedup_probe_one`
/// (migration 20261207000001), which tries the key's advisory lock and, once locked, reads
/// whether it has a row, with a fencing token from the sequence if not, and the server's clock.
fn begin_sql(scope: &str, key: &[u8], config: TxBatchConfig) -> String {
    format!(
        "BEGIN; SELECT set_config('idle_in_transaction_session_timeout', '{bound}ms', true), \
         p.locked, p.fresh, p.token, p.now_us FROM dedup_probe_one(\
         convert_from(decode('{scope}', 'hex'), 'UTF8'), decode('{key}', 'hex')) AS p",
        scope = hex(scope.as_bytes()),
        key = hex(key),
        bound = config.idle_timeout.as_millis().clamp(1, MAX_BOUND_MS),
    )
}

/// A fresh key written COMPLETED under its lease (`dedup_complete_one`, migration
/// 20261207000001), then COMMIT: one simple query, one round trip. The insert has no
/// `ON CONFLICT`: a row another writer put there meanwhile fails it (a unique violation), the
/// COMMIT after it never runs, and nothing of the transaction commits. The empty transaction
/// begun after the COMMIT is sqlx's to end: it counts the claim's transaction as its own
/// ([`ClaimedTx::hold`]), and ends it with a ROLLBACK sent when the connection goes back to the
/// pool (no round trip of its own, and no warning, as a ROLLBACK outside a transaction gives).
fn commit_fresh_sql(lease: &Lease, result: &[u8]) -> String {
    let fingerprint = lease.fingerprint.as_ref().map_or_else(
        || "NULL".to_owned(),
        |f| format!("decode('{}', 'hex')", hex(f.as_bytes())),
    );
    format!(
        "SELECT dedup_complete_one(convert_from(decode('{scope}', 'hex'), 'UTF8'), \
         decode('{key}', 'hex'), {token}, {fingerprint}, decode('{result}', 'hex'), {retention}); \
         COMMIT; BEGIN",
        scope = hex(lease.key.scope().as_str().as_bytes()),
        key = hex(lease.key.key_bytes()),
        token = token_i64(lease.token),
        result = hex(result),
        retention = micros(lease.policy.retention),
    )
}

/// Whether `e` is Postgres refusing a row whose key is taken (`unique_violation`).
fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(sqlx::error::DatabaseError::code)
        .is_some_and(|code| code == "23505")
}

/// The claim's simple query answered no row for its probe.
#[derive(Debug, thiserror::Error)]
#[error("the claim's probe of the key answered no row")]
struct NoProbeRow;

/// The claim's transaction was rolled back while the caller held it: sqlx's guard of a nested
/// `begin()` that failed or was cancelled sends a ROLLBACK of the whole transaction (it rolls back
/// at the depth it counts, and the claim's transaction is the first). Writes the caller made
/// after that ran on their own.
#[derive(Debug, thiserror::Error)]
#[error(
    "the claim's transaction was rolled back under its caller (a nested begin() failed or was \
     cancelled): nothing of it commits, and writes made after that committed on their own"
)]
struct RolledBackUnder;

/// What [`PgStore::begin_claim`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum TxClaim {
    /// The key is this transaction's: write on it, then [`ClaimedTx::commit`].
    Acquired(ClaimedTx),
    /// The key is answered without running (done before, in flight elsewhere, failed for good,
    /// reused with another payload); the transaction is over.
    Answered(ClaimOutcome),
}

/// A key claimed inside an open transaction ([`PgStore::begin_claim`]). Write the effect on it
/// (it derefs to a `PgConnection`), then [`commit`](Self::commit) the result: the effect, the
/// key's completion and anything else written on it commit together, or nothing does.
/// [`rollback`](Self::rollback) (or a drop, which closes the connection) leaves the key free
/// again, no attempt spent; [`fail`](Self::fail) records a failed attempt instead.
#[derive(Debug)]
pub struct ClaimedTx {
    /// `None` once the transaction ended.
    conn: Option<PgConn>,
    lease: Lease,
    /// The key has no row yet: it is written at the end.
    fresh: bool,
    /// sqlx counts the transaction as its own ([`ClaimedTx::hold`]).
    held: bool,
    store: PgStore,
}

impl std::ops::Deref for ClaimedTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Some(c) => c,
            None => unreachable!("a ClaimedTx is consumed when its transaction ends"),
        }
    }
}

impl std::ops::DerefMut for ClaimedTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            Some(c) => c,
            None => unreachable!("a ClaimedTx is consumed when its transaction ends"),
        }
    }
}

impl Drop for ClaimedTx {
    fn drop(&mut self) {
        // Neither committed nor rolled back: the session ends, and its transaction with it.
        if let Some(mut conn) = self.conn.take() {
            conn.0.close_on_drop();
        }
    }
}

/// Ends the transaction on `conn` with COMMIT or ROLLBACK, through sqlx where it counts the
/// transaction as its own ([`ClaimedTx::hold`]), so that its count goes back to none.
async fn end(conn: &mut PgConn, commit: bool) -> Result<(), sqlx::Error> {
    let raw: &mut PgConnection = conn;
    match (PgTransactionManager::get_transaction_depth(raw), commit) {
        (0, true) => sqlx::Executor::execute(raw, "COMMIT").await.map(drop),
        (0, false) => sqlx::Executor::execute(raw, "ROLLBACK").await.map(drop),
        (1, true) => PgTransactionManager::commit(raw).await,
        (1, false) => PgTransactionManager::rollback(raw).await,
        // The caller left a transaction of its own open (a savepoint, forgotten): end the whole
        // transaction, and the session with it rather than pool it with sqlx's count off.
        (_, commit) => {
            conn.0.close_on_drop();
            let sql = if commit { "COMMIT" } else { "ROLLBACK" };
            sqlx::Executor::execute(&mut ***conn, sql).await.map(drop)
        }
    }
}

impl PgStore {
    /// Begins a transaction and claims `req`'s key in it, holding it for the caller's writes
    /// until [`ClaimedTx::commit`]: one commit for the claim, the effect and the completion. A
    /// key another transaction holds answers [`ClaimOutcome::InFlight`] at once (nothing waits);
    /// a key done before answers its stored result. `config.idle_timeout` bounds how long the
    /// transaction may sit idle (its client stopped, or busy elsewhere) before Postgres ends it.
    ///
    /// # Errors
    /// Postgres failed (nothing was claimed), or the request's policy is invalid.
    pub async fn begin_claim(
        &self,
        req: &ClaimRequest,
        config: TxBatchConfig,
    ) -> Result<TxClaim, StoreError> {
        req.policy.validate()?;
        let (scope, key) = (req.key.scope().as_str(), req.key.key_bytes());
        // From before BEGIN is sent, a failure, or this future dropped mid-statement, closes the
        // connection (the transaction may be open or aborted): `ClaimedTx`'s drop.
        let mut tx = ClaimedTx {
            conn: Some(self.conn().await?),
            lease: fresh_lease(req, 0, 0),
            fresh: false,
            held: false,
            store: self.clone(),
        };
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(begin_sql(scope, key, config)))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| classify(e, false))?;
        self.count(3);
        let Some(row) = rows.last() else {
            return Err(StoreError::unavailable(NoProbeRow));
        };
        let locked: bool = row.try_get("locked").map_err(|e| classify(e, false))?;
        let fresh: bool = row.try_get("fresh").map_err(|e| classify(e, false))?;
        let token: Option<i64> = row.try_get("token").map_err(|e| classify(e, false))?;
        let now_us: i64 = row.try_get("now_us").map_err(|e| classify(e, false))?;
        if !locked {
            tx.rollback().await;
            return Ok(TxClaim::Answered(ClaimOutcome::InFlight {
                owner: None,
                lease_until: None,
            }));
        }
        if let (true, Some(token)) = (fresh, token) {
            tx.lease = fresh_lease(req, token, now_us);
            tx.fresh = true;
            tx.hold().await?;
            return Ok(TxClaim::Acquired(tx));
        }
        // A row: the claim statement says what it is (a replay, a takeover, a retry).
        let (answer, statements) = claim_counted(&mut tx, req).await;
        self.count(statements);
        match answer? {
            ClaimOutcome::Acquired(lease) => {
                tx.lease = lease;
                tx.hold().await?;
                Ok(TxClaim::Acquired(tx))
            }
            other => {
                tx.rollback().await;
                Ok(TxClaim::Answered(other))
            }
        }
    }
}

impl ClaimedTx {
    /// Makes sqlx count the transaction, begun by hand to share the claim's round trip, as its
    /// own, before the caller writes on it: a caller's `begin()` (sqlx's `Connection::begin`,
    /// as composable repository code calls it) is then a savepoint, and its COMMIT releases the
    /// savepoint. Without it sqlx sends BEGIN (a warning in a transaction) and then a COMMIT
    /// that commits the claim's transaction early: the key let go with the effect written and no
    /// record, so that a retry ran the effect again. sqlx counts a transaction only once
    /// Postgres says one is open, so this is an empty query: one round trip that Postgres
    /// neither parses nor plans.
    async fn hold(&mut self) -> Result<(), StoreError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        let raw: &mut PgConnection = conn;
        PgTransactionManager::begin(raw, Some(sqlx::AssertSqlSafe("").into_sql_str()))
            .await
            .map_err(|e| classify(e, false))?;
        self.held = true;
        Ok(())
    }

    /// Refuses to end a transaction that sqlx no longer counts, though it held it: rolled back
    /// under the caller ([`RolledBackUnder`]). Nothing is sent (a completion now would commit
    /// on its own, over whatever the caller's later writes left), and the session is closed.
    fn still_held(&mut self) -> Result<(), StoreError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        let raw: &mut PgConnection = conn;
        if !self.held || PgTransactionManager::get_transaction_depth(raw) > 0 {
            return Ok(());
        }
        conn.0.close_on_drop();
        Err(StoreError::backend(RolledBackUnder))
    }

    /// The lease the key is held under (for its fencing token and its stored-form limits).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Completes the key with `result` inside the transaction and commits: the caller's writes,
    /// the completion and the claim together. A commit whose outcome is unknown is read back
    /// (COMPLETED under this lease's token means it committed).
    ///
    /// # Errors
    /// The result is too large for the policy; a lease-mode writer took the fresh key meanwhile
    /// (a passing error: nothing committed, and a retry finds its record); the lease was lost;
    /// the transaction was rolled back under the caller (sqlx's guard of a nested `begin()`
    /// that failed or was cancelled: a final error, and writes made after that committed on
    /// their own); Postgres failed. Nothing committed, unless the error [is an unknown
    /// outcome](StoreError::is_outcome_unknown) that could not be read back.
    pub async fn commit(mut self, result: &[u8]) -> Result<(), StoreError> {
        self.lease.policy.check_result(result)?;
        self.still_held()?;
        if self.fresh {
            return self.commit_fresh(result).await;
        }
        let lease = self.lease.clone();
        PgStore::complete_in(&mut self, &lease, result).await?;
        self.store.count(1);
        self.finish(true).await
    }

    /// A fresh key's completion and the COMMIT, in one round trip (`commit_fresh_sql`).
    async fn commit_fresh(&mut self, result: &[u8]) -> Result<(), StoreError> {
        let sql = commit_fresh_sql(&self.lease, result);
        // The connection stays in `self` until Postgres has answered: this future dropped
        // meanwhile closes it (the drop) instead of pooling a transaction left open or aborted.
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        self.store.count(2);
        // Statements completed before an error: an error at the first is the insert's.
        let mut done = 0_usize;
        let err = {
            let mut results = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).fetch_many(&mut ***conn);
            loop {
                match results.try_next().await {
                    Ok(Some(_)) => done += 1,
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            }
        };
        let Some(err) = err else {
            // Committed, and in the empty transaction begun after: sqlx ends it with a ROLLBACK
            // sent as the connection goes back to the pool, and counts no transaction again.
            if let Some(mut conn) = self.conn.take() {
                let raw: &mut PgConnection = &mut conn;
                if PgTransactionManager::get_transaction_depth(raw) == 1 {
                    PgTransactionManager::start_rollback(raw);
                } else {
                    // The caller left a transaction of its own open: not pooled with sqlx's
                    // count off.
                    conn.0.close_on_drop();
                }
            }
            return Ok(());
        };
        // Whatever became of the transaction, the connection is closed with `self`.
        if done == 0 && is_unique_violation(&err) {
            // A lease-mode writer wrote the key meanwhile: nothing committed, and a retry finds
            // its record.
            return Err(StoreError::unavailable(Taken));
        }
        self.read_back(classify(err, true)).await
    }

    /// Rolls the transaction back: nothing it wrote stays, the key is free again and no attempt
    /// is spent.
    pub async fn rollback(mut self) {
        // A failed ROLLBACK closes the connection (the drop), which rolls back as well.
        let _ = self.finish(false).await;
    }

    /// Records a failed attempt of the key in the transaction and commits it (after the caller's
    /// own writes were rolled back: call it on a transaction that wrote nothing else): released
    /// for a later attempt, or FAILED where `permanent` or out of attempts. Answers whether the
    /// key failed for good.
    ///
    /// # Errors
    /// Postgres failed: nothing was recorded.
    pub async fn fail(mut self, reason: &str, permanent: bool) -> Result<AfterFailure, StoreError> {
        self.still_held()?;
        let lease = self.lease.clone();
        if self.fresh {
            insert_claimed(&mut self, &[&lease]).await?;
        }
        let error = if permanent {
            HandlerError::Permanent(reason)
        } else {
            HandlerError::Retryable(reason)
        };
        let answer = record_failure(&mut self, &lease, error).await?;
        self.store.count(2);
        self.finish(true).await?;
        Ok(match answer {
            BatchAnswer::Handler {
                after: AfterHandlerError::Failed { attempts },
                ..
            } => AfterFailure::Failed { attempts },
            _ => AfterFailure::Released {
                attempts: lease.attempts,
            },
        })
    }

    /// Ends the transaction: COMMIT (an unknown outcome read back) or ROLLBACK.
    async fn finish(&mut self, commit: bool) -> Result<(), StoreError> {
        // As in `commit_fresh`: the connection stays in `self` until Postgres has answered.
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        self.store.count(1);
        let sent = end(conn, commit).await;
        let err = match sent {
            Ok(()) => {
                drop(self.conn.take());
                return Ok(());
            }
            Err(e) => classify(e, commit),
        };
        // Whatever became of it, the connection is closed with `self`, not reused.
        if !commit {
            return Err(err);
        }
        self.read_back(err).await
    }

    /// Resolves a COMMIT that failed with `err`: an unknown outcome is read back (COMPLETED under
    /// this lease's token means it committed).
    async fn read_back(&self, err: StoreError) -> Result<(), StoreError> {
        if !err.is_outcome_unknown() {
            return Err(err);
        }
        match self.store.get(&self.lease.key).await {
            Ok(Some(r)) if r.token == self.lease.token && r.state == State::Completed => Ok(()),
            Ok(Some(r)) if r.token == self.lease.token && r.state == State::InProgress => {
                // Not committed (yet): any later fenced call is refused if it lands after all.
                Err(match err {
                    StoreError::OutcomeUnknown { source } => StoreError::Unavailable { source },
                    other => other,
                })
            }
            // A fresh key's row absent: not committed yet, or never; still unknown.
            Ok(None) if self.fresh => Err(err),
            Ok(_) => Err(StoreError::LeaseLost {
                key: self.lease.key.clone(),
                token: self.lease.token,
            }),
            Err(_) => Err(err),
        }
    }
}
