//! One key claimed inside a transaction that stays open for the caller's writes: transaction
//! mode for a single request (the HTTP layer's transactional path), one commit in all.
//!
//! ```text
//! BEGIN; try-lock the key; set the transaction's bounds   one round trip (`begin_sql`)
//!   once locked, read whether it has a row (a fresh key gets a token from the sequence)
//!                                                       (`PROBE_SQL`)
//!   a key with a row: the claim statement               (replays, takeovers, retries)
//! the caller's writes, on the transaction (`ClaimedTx` derefs to a `PgConnection`)
//!   a fresh key written COMPLETED once; another completed under its token
//! COMMIT                                                (one WAL flush for the request)
//! ```
//!
//! As in a batch (`fresh.rs`): the advisory lock keeps every other transactional claimer off the
//! key without waiting (a held lock answers InFlight at once), and a fresh key is written once,
//! at the end. A writer that takes no advisory lock (a lease-mode claim) may write it meanwhile:
//! the final insert says so and nothing commits (a passing error). The read is a statement after
//! the lock's, so its snapshot sees a first writer that committed before it let go. Both are
//! plain single-key statements (a batch's go through PL/pgSQL functions, whose fixed cost one key
//! cannot share: `pg_stat_statements` showed the batch function at 240 µs a call for one key).
//!
//! A transaction dropped without [`ClaimedTx::commit`] rolls back (its connection goes back to
//! the pool, which sends the ROLLBACK at once): nothing was written, the key is free again and
//! no attempt is spent. A client stopped mid-request holds the key only until the session's
//! `idle_in_transaction_session_timeout` ([`TxBatchConfig::idle_timeout`]) ends it.

use dedup_core::{ClaimOutcome, ClaimRequest, Lease, StoreError};
use sqlx::postgres::{PgConnection, Postgres};
use sqlx::{Row, Transaction};

use super::TxBatchConfig;
use super::fresh::{fresh_lease, insert_completed};
use crate::PgStore;
use crate::claim::claim_counted;
use crate::classify::classify;

/// BEGIN, the key's transaction-scoped advisory lock (the hash transaction mode's batches take,
/// so that a batch and a request never hold one key at once) tried without waiting and noted in
/// the transaction's `dedup.locked`, and the transaction's bounds: one simple query, one round
/// trip, with no parameters, so the scope and the key go in as hex (only `[0-9a-f]`: nothing in
/// them can end the literal) and the bounds as integers.
fn begin_sql(scope: &str, key: &[u8], config: TxBatchConfig) -> String {
    use std::fmt::Write as _;
    let hex = |bytes: &[u8]| {
        bytes
            .iter()
            .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
                let _ = write!(s, "{b:02x}");
                s
            })
    };
    format!(
        "BEGIN; SELECT set_config('dedup.locked', pg_try_advisory_xact_lock(hashtextextended(\
         convert_from(decode('{}', 'hex'), 'UTF8') || E'\\n' || '{}', 0))::text, true), \
         set_config('idle_in_transaction_session_timeout', '{}ms', true), \
         set_config('lock_timeout', '{}ms', true)",
        hex(scope.as_bytes()),
        hex(key),
        config.idle_timeout.as_millis().max(1),
        config.lock_timeout.as_millis().max(1)
    )
}

/// Whether the key was locked and, where it was, whether it has a row, a fencing token from the
/// sequence if not, and the server's clock. A statement of its own, after the lock's, so that its
/// snapshot sees a first writer that committed before it let go of the key. $1 scope, $2 key.
const PROBE_SQL: &str = concat!(
    "SELECT l.locked, r.state IS NULL AS fresh,",
    " CASE WHEN l.locked AND r.state IS NULL THEN nextval('dedup_token_seq') END AS token,",
    " (extract(epoch FROM statement_timestamp()) * 1000000)::int8 AS now_us",
    " FROM (SELECT current_setting('dedup.locked')::bool AS locked) AS l",
    " LEFT JOIN dedup_records r ON l.locked AND r.scope = $1 AND r.key = $2",
    "   AND r.kt = dedup_kt($2)"
);

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
/// key's completion and anything else written on it commit together, or nothing does. Dropped,
/// it rolls back: the key is free again, no attempt spent.
#[derive(Debug)]
pub struct ClaimedTx {
    tx: Transaction<'static, Postgres>,
    lease: Lease,
    /// The key has no row yet: it is written COMPLETED at the commit.
    fresh: bool,
    store: PgStore,
}

impl std::ops::Deref for ClaimedTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for ClaimedTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl PgStore {
    /// Begins a transaction and claims `req`'s key in it, holding it for the caller's writes
    /// until [`ClaimedTx::commit`]: one commit for the claim, the effect and the completion. A
    /// key another transaction holds answers [`ClaimOutcome::InFlight`] at once (nothing waits);
    /// a key done before answers its stored result. `config` bounds the transaction: how long it
    /// may sit idle (its client stopped) and how long one statement may wait on a lock.
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
        let mut tx = self
            .pool()
            .begin_with(sqlx::AssertSqlSafe(begin_sql(scope, key, config)))
            .await
            .map_err(|e| classify(e, false))?;
        let row = sqlx::query(PROBE_SQL)
            .bind(scope)
            .bind(key)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| classify(e, false))?;
        self.count(3);
        let locked: bool = row.try_get("locked").map_err(|e| classify(e, false))?;
        let fresh: bool = row.try_get("fresh").map_err(|e| classify(e, false))?;
        let token: Option<i64> = row.try_get("token").map_err(|e| classify(e, false))?;
        let now_us: i64 = row.try_get("now_us").map_err(|e| classify(e, false))?;
        if !locked {
            self.end(tx).await;
            return Ok(TxClaim::Answered(ClaimOutcome::InFlight {
                owner: None,
                lease_until: None,
            }));
        }
        if let (true, Some(token)) = (fresh, token) {
            return Ok(TxClaim::Acquired(ClaimedTx {
                tx,
                lease: fresh_lease(req, token, now_us),
                fresh: true,
                store: self.clone(),
            }));
        }
        // A row: the claim statement says what it is (a replay, a takeover, a retry).
        let (answer, statements) = claim_counted(&mut tx, req).await;
        self.count(statements);
        match answer {
            Ok(ClaimOutcome::Acquired(lease)) => Ok(TxClaim::Acquired(ClaimedTx {
                tx,
                lease,
                fresh: false,
                store: self.clone(),
            })),
            Ok(other) => {
                self.end(tx).await;
                Ok(TxClaim::Answered(other))
            }
            Err(e) => Err(e),
        }
    }

    /// Rolls back a transaction that claimed nothing.
    async fn end(&self, tx: Transaction<'static, Postgres>) {
        self.count(1);
        // A failed ROLLBACK leaves the connection to the pool, which closes it.
        let _ = tx.rollback().await;
    }
}

impl ClaimedTx {
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
    /// Postgres failed. Nothing committed, unless the error [is an unknown
    /// outcome](StoreError::is_outcome_unknown) that could not be read back.
    pub async fn commit(mut self, result: &[u8]) -> Result<(), StoreError> {
        self.lease.policy.check_result(result)?;
        if self.fresh {
            let item = [(self.lease.clone(), bytes::Bytes::copy_from_slice(result))];
            insert_completed(&mut self.tx, &item).await?;
        } else {
            PgStore::complete_in(&mut self.tx, &self.lease, result).await?;
        }
        self.store.count(2);
        self.store.commit(self.tx, &self.lease).await
    }

    /// Rolls the transaction back: nothing it wrote stays, the key is free again and no attempt
    /// is spent.
    pub async fn rollback(self) {
        self.store.end(self.tx).await;
    }
}
