//! Completions and every other fenced end of a lease, one at a time or many in one statement.
//!
//! `COMPLETE_BATCH_SQL` completes many leases in one fenced `UPDATE ... FROM unnest`, inside the
//! function `dedup_complete_batch` (PL/pgSQL since migration `20261202000001`). Its plan is kept
//! per connection with sequential scans, plain index scans and hash and merge joins ruled out, so
//! its only plan probes the primary key once per key by a bitmap scan, whatever the table's
//! statistics said when it was made (docs/ARCHITECTURE.md, invariant 31).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{IdempotencyKey, Lease, State, StoreError, Timestamp, micros};
use sqlx::Row;
use sqlx::postgres::PgConnection;

use crate::PgStore;
use crate::classify::classify;
use crate::rows::*;
use crate::sql::*;

/// Runs [`COMPLETE_BATCH_SQL`] on `conn`, then completes each repeat of a key on its own. One
/// answer per item; the error that failed the whole statement, if one did (each item then holds
/// a copy of it); and how many statements were sent.
pub(crate) async fn complete_many(
    conn: &mut PgConnection,
    items: &[(Lease, Bytes)],
) -> (Vec<Result<(), StoreError>>, Option<StoreError>, u64) {
    let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
    let mut deferred = Vec::new();
    let (mut scopes, mut keys, mut tokens, mut results, mut rets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut index: HashMap<(&str, &[u8]), usize> = HashMap::with_capacity(items.len());
    for (i, (lease, result)) in items.iter().enumerate() {
        if let Err(e) = lease.policy.check_result(result) {
            out.push(Some(Err(e.into())));
            continue;
        }
        if index.contains_key(&(lease.key.scope().as_str(), lease.key.key_bytes())) {
            // A repeat of a key: completed after the batch, as if one after the other.
            deferred.push(i);
            out.push(None);
            continue;
        }
        index.insert((lease.key.scope().as_str(), lease.key.key_bytes()), i);
        scopes.push(lease.key.scope().as_str());
        keys.push(lease.key.key_bytes());
        tokens.push(token_i64(lease.token));
        results.push(result.as_ref());
        rets.push(micros(lease.policy.retention));
        out.push(None);
    }
    let mut failed = None;
    let mut statements = 0;
    if !scopes.is_empty() {
        statements += 1;
        let done = sqlx::query(COMPLETE_BATCH_SQL)
            .bind(&scopes)
            .bind(&keys)
            .bind(&tokens)
            .bind(&results)
            .bind(&rets)
            .fetch_all(&mut *conn)
            .await;
        match done {
            Ok(rows) => {
                for row in &rows {
                    let scope: Result<&str, _> = row.try_get("scope");
                    let key: Result<&[u8], _> = row.try_get("key");
                    if let (Ok(scope), Ok(key)) = (scope, key)
                        && let Some(&i) = index.get(&(scope, key))
                    {
                        out[i] = Some(Ok(()));
                    }
                }
            }
            Err(e) => {
                let e = classify(e, true);
                for &i in index.values() {
                    out[i] = Some(Err(echo(&e)));
                }
                for &i in &deferred {
                    out[i] = Some(Err(echo(&e)));
                }
                failed = Some(e);
            }
        }
    }
    if failed.is_none() {
        for i in deferred {
            let (lease, result) = &items[i];
            statements += 1;
            out[i] = Some(PgStore::complete_in(conn, lease, result).await);
        }
    }
    let out = out
        .into_iter()
        .zip(items)
        .map(|(answer, (lease, _))| {
            answer.unwrap_or_else(|| {
                Err(StoreError::LeaseLost {
                    key: lease.key.clone(),
                    token: lease.token,
                })
            })
        })
        .collect();
    (out, failed, statements)
}

/// Runs [`EXTEND_BATCH_SQL`] on `conn`: one answer per lease, in order (a lease the statement did
/// not extend was lost: taken over, or ended). A failed statement fails every lease alike.
pub(crate) async fn extend_many(
    conn: &mut PgConnection,
    leases: &[Lease],
) -> Result<Vec<Result<Timestamp, StoreError>>, StoreError> {
    let n = leases.len();
    let (mut scopes, mut keys, mut tokens, mut lease_us, mut rets) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for lease in leases {
        scopes.push(lease.key.scope().as_str());
        keys.push(lease.key.key_bytes());
        tokens.push(token_i64(lease.token));
        lease_us.push(micros(lease.policy.lease));
        rets.push(micros(lease.policy.retention));
    }
    let rows = sqlx::query(EXTEND_BATCH_SQL)
        .bind(&scopes)
        .bind(&keys)
        .bind(&tokens)
        .bind(&lease_us)
        .bind(&rets)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let mut until: HashMap<(String, Vec<u8>, i64), i64> = HashMap::with_capacity(rows.len());
    for row in rows {
        let scope: String = row.try_get("scope").map_err(|e| classify(e, false))?;
        let key: Vec<u8> = row.try_get("key").map_err(|e| classify(e, false))?;
        let token: i64 = row.try_get("token").map_err(|e| classify(e, false))?;
        let us: i64 = row.try_get("until_us").map_err(|e| classify(e, false))?;
        until.insert((scope, key, token), us);
    }
    Ok(leases
        .iter()
        .map(|lease| {
            let id = (
                lease.key.scope().as_str().to_owned(),
                lease.key.key_bytes().to_vec(),
                token_i64(lease.token),
            );
            until
                .get(&id)
                .map(|&us| Timestamp::from_micros(us))
                .ok_or_else(|| StoreError::LeaseLost {
                    key: lease.key.clone(),
                    token: lease.token,
                })
        })
        .collect())
}

/// A batch statement failed as a whole: each of its items is told so.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BatchFailed(pub(crate) String);

/// A copy of `e` of the same kind (retryable, unknown outcome or not), for each item of a batch
/// that `e` failed.
pub(crate) fn echo(e: &StoreError) -> StoreError {
    let msg = BatchFailed(format!("batch failed: {e}"));
    if e.is_outcome_unknown() {
        StoreError::outcome_unknown(msg)
    } else if e.is_retryable() {
        StoreError::unavailable(msg)
    } else {
        StoreError::backend(msg)
    }
}

pub(crate) fn unanswered(key: &IdempotencyKey) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: "the batch left this request unanswered".into(),
    }
}

pub(crate) async fn finish(
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
        .bind(failure.map(crate::text::safe_text))
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
