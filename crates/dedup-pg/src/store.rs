//! [`Store`] on [`PgStore`], and the pooled connection that is closed after an error that says it
//! must not be reused.

use std::collections::HashMap;

use bytes::Bytes;
use dedup_core::machine::{self, ClaimStep};
use dedup_core::{
    Adoption, AfterFailure, ClaimOutcome, ClaimRequest, IdempotencyKey, InstanceId, Lease, Record,
    State, Store, StoreError, Timestamp, micros,
};
use sqlx::Postgres;
use tracing::{debug, warn};

use crate::PgStore;
use crate::claim::*;
use crate::classify::{classify, must_discard};
use crate::complete::*;
use crate::rows::*;
use crate::sql::*;

impl Store for PgStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.conn().await?;
        let (outcome, statements) = claim_counted(&mut conn, req).await;
        self.count(statements);
        conn.checked(outcome)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        self.count(1);
        let done = Self::complete_in(&mut conn, lease, result).await;
        conn.checked(done)
    }

    /// One statement for the batch's distinct keys; a key that lost a race to a concurrent writer
    /// (rare) and each repeat of a key are then claimed one by one, in order.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Vec<Result<ClaimOutcome, StoreError>> {
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(e) => return reqs.iter().map(|_| Err(echo(&e))).collect(),
        };
        let mut out: Vec<Option<Result<ClaimOutcome, StoreError>>> = Vec::with_capacity(reqs.len());
        let mut first: HashMap<&IdempotencyKey, usize> = HashMap::with_capacity(reqs.len());
        let mut batch = Vec::with_capacity(reqs.len());
        let mut after: HashMap<&IdempotencyKey, (Record, Timestamp)> = HashMap::new();
        for (i, req) in reqs.iter().enumerate() {
            match req.policy.validate() {
                Err(e) => out.push(Some(Err(e.into()))),
                Ok(()) => {
                    if first.insert(&req.key, i).is_none() {
                        batch.push(i);
                    }
                    out.push(None);
                }
            }
        }
        if batch.len() > 1 {
            self.count(1);
            match claim_many(&mut conn, reqs, &batch).await {
                Ok(answers) => {
                    for (i, answer, seen) in answers {
                        out[i] = Some(answer);
                        if let Some(seen) = seen {
                            after.insert(&reqs[i].key, seen);
                        }
                    }
                }
                // Not applied (deadlock, overload...): every key is claimed one by one below.
                Err(e) if !e.is_outcome_unknown() => {
                    conn.saw(&e);
                    if must_discard(&e) {
                        // This connection cannot claim: the fallback takes a fresh one.
                        match self.conn().await {
                            Ok(fresh) => conn = fresh,
                            Err(e) => return reqs.iter().map(|_| Err(echo(&e))).collect(),
                        }
                    }
                    debug!(error = %e, "batch claim failed; claiming one by one");
                }
                // It may have applied: claim one by one too, each claim re-reading the row. A
                // lease the lost answer granted is held by our owner id and expires unused.
                Err(e) => warn!(error = %e, "batch claim outcome unknown; claiming one by one"),
            }
        }
        for (i, req) in reqs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            // A repeat of a key is answered from the record its first claim left, when that
            // answer needs no write (it is InFlight after a grant, or a replay).
            if let Some((record, now)) = after.get(&req.key)
                && let ClaimStep::Answer(answer) =
                    machine::claim(Some(record), req, *now, || record.token)
            {
                out[i] = Some(Ok(answer));
            } else {
                let (answer, statements) = claim_counted(&mut conn, req).await;
                self.count(statements);
                if let Ok(ClaimOutcome::Acquired(_) | ClaimOutcome::Failed { .. }) = &answer {
                    // The record changed: a later repeat must not be answered from before.
                    after.remove(&req.key);
                }
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .zip(reqs)
            .map(|(answer, req)| conn.checked(answer.unwrap_or_else(|| Err(unanswered(&req.key)))))
            .collect()
    }

    /// One statement; an outcome that is unknown (a dropped connection) is read back.
    async fn complete_batch(&self, items: &[(Lease, Bytes)]) -> Vec<Result<(), StoreError>> {
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(e) => return items.iter().map(|_| Err(echo(&e))).collect(),
        };
        let (mut out, failed, statements) = complete_many(&mut conn, items).await;
        self.count(statements);
        let Some(err) = failed else {
            return out;
        };
        conn.saw(&err);
        drop(conn);
        if !err.is_outcome_unknown() {
            return out;
        }
        warn!(error = %err, n = items.len(), "batch completion outcome unknown; reading it back");
        self.count(1);
        let records = match self.get_many(items.iter().map(|(l, _)| &l.key)).await {
            Ok(records) => records,
            Err(_) => return out,
        };
        for ((lease, _), answer) in items.iter().zip(out.iter_mut()) {
            if answer.as_ref().is_err_and(StoreError::is_outcome_unknown) {
                *answer = match records.get(&lease.key) {
                    Some(r) if r.token == lease.token && r.state == State::Completed => Ok(()),
                    Some(r) if r.token == lease.token && r.state == State::InProgress => {
                        Err(StoreError::unavailable(BatchFailed(
                            "the batch completion did not apply; retry".into(),
                        )))
                    }
                    _ => Err(StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    }),
                };
            }
        }
        out
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        // The token pins the attempt count: it changes only with a takeover, which changes the
        // token too. So the lease's count is the record's.
        let p = lease.policy;
        let (state, failure, retention, after) = if lease.attempts >= p.max_attempts {
            let reason = machine::exhausted_reason(lease.attempts, p.max_attempts, Some(error));
            let after = AfterFailure::Failed {
                attempts: lease.attempts,
            };
            (State::Failed, reason, p.failed_retention, after)
        } else {
            let after = AfterFailure::Released {
                attempts: lease.attempts,
            };
            (State::Released, error.to_owned(), p.retention, after)
        };
        let done = finish(&mut conn, lease, state, None, Some(&failure), retention).await;
        conn.checked(done).map(|()| after)
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let retention = lease.policy.failed_retention;
        let done = finish(
            &mut conn,
            lease,
            State::Failed,
            None,
            Some(reason),
            retention,
        )
        .await;
        conn.checked(done)
    }

    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let done = sqlx::query_scalar::<_, i64>(WITHDRAW_SQL)
            .bind(lease.key.scope().as_str())
            .bind(lease.key.key_bytes())
            .bind(token_i64(lease.token))
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, true))
            .and_then(|changed| {
                if changed == 1 {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    })
                }
            });
        conn.checked(done)
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let until = sqlx::query_scalar::<_, i64>(EXTEND_SQL)
            .bind(lease.key.scope().as_str())
            .bind(lease.key.key_bytes())
            .bind(token_i64(lease.token))
            .bind(micros(lease.policy.lease))
            .bind(micros(lease.policy.retention))
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, true))
            .and_then(|until| {
                until
                    .map(Timestamp::from_micros)
                    .ok_or_else(|| StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    })
            });
        conn.checked(until)
    }

    async fn extend_batch(&self, leases: &[Lease]) -> Vec<Result<Timestamp, StoreError>> {
        if leases.is_empty() {
            return Vec::new();
        }
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(e) => return leases.iter().map(|_| Err(echo(&e))).collect(),
        };
        self.count(1);
        match extend_many(&mut conn, leases).await {
            Ok(out) => out,
            Err(e) => {
                conn.saw(&e);
                leases.iter().map(|_| Err(echo(&e))).collect()
            }
        }
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let row = sqlx::query(GET_SQL)
            .bind(key.scope().as_str())
            .bind(key.key_bytes())
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        conn.checked(row)?
            .map(|row| record_from_row(key, &row))
            .transpose()
    }

    /// Takes the identity's session lock on a connection of its own (kept for the life of the
    /// store, so the server releases it only when this process or its session dies), waiting a
    /// few seconds for a dead predecessor's session to end; then ends the live leases of the
    /// identity's other incarnations in one statement.
    async fn adopt(&self, instance: &InstanceId, mine: &str) -> Result<Adoption, StoreError> {
        self.adopt_leases(instance, mine).await
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        // Every record past its retention but those in the ranges of days of the partitioned
        // table, which go whole (`maintain_ranges`, run by the retention) and have no index to
        // walk in the order of expiry (a BRIN: each statement would read every expired row).
        let ranged = crate::layout::ranged_days(&mut conn).await;
        let ranged = conn.checked(ranged)?.unwrap_or((0, 0));
        let done = sqlx::query(PURGE_SQL)
            .bind(i64::from(limit))
            .bind(ranged.0)
            .bind(ranged.1)
            .execute(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        conn.checked(done).map(|d| d.rows_affected())
    }
}

/// A pooled connection ([`PgStore::conn`](crate::PgStore::conn)) that is closed, instead of
/// returned to the pool, once an error says it must not be reused: 25006 (it reaches a server
/// that cannot write, such as a primary demoted in a failover), or a session the server ended.
/// See [`classify`](crate::classify()).
#[derive(Debug)]
pub struct PgConn(pub(crate) sqlx::pool::PoolConnection<Postgres>);

impl PgConn {
    /// Marks the connection for closing if `e` says it must not be reused.
    pub fn saw(&mut self, e: &StoreError) {
        if must_discard(e) {
            warn!(error = %e, "closing a Postgres connection that must not be reused");
            self.0.close_on_drop();
        }
    }

    /// `r`, after [`saw`](Self::saw) its error.
    pub fn checked<T>(&mut self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &r {
            self.saw(e);
        }
        r
    }
}

impl std::ops::Deref for PgConn {
    type Target = sqlx::pool::PoolConnection<Postgres>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for PgConn {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}
