//! The unhappy path of a batch transaction: calling the handler (a panic is a failure of the
//! call), and recording one message's failure inside the transaction.

use std::panic::AssertUnwindSafe;

use dedup_core::{AfterHandlerError, HandlerError, Lease, State, StoreError, machine};
use futures_util::FutureExt;
use sqlx::postgres::PgConnection;

use super::{BatchAnswer, BatchBody, BatchRetried, ItemResult};
use crate::classify::classify;
use crate::complete::finish;
use crate::rows::token_i64;

/// Calls the handler, catching a panic as a failure of the whole call.
pub(super) async fn call<E, H>(
    handler: &mut H,
    conn: &mut PgConnection,
    leases: &[Lease],
) -> Result<Vec<ItemResult<E>>, HandlerError<E>>
where
    H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
{
    // The call itself is inside the catch too: a handler may panic before its first await.
    match AssertUnwindSafe(async { handler(conn, leases).await })
        .catch_unwind()
        .await
    {
        // A result too large to store fails its message (its writes are then undone under its
        // savepoint, and the key FAILED), not the batch.
        Ok(Ok(results)) if results.len() == leases.len() => Ok(results
            .into_iter()
            .zip(leases)
            .map(|(r, lease)| match r {
                Ok(result) => match lease.policy.check_result(&result) {
                    Ok(()) => Ok(result),
                    Err(e) => Err(HandlerError::Store(StoreError::Input(e))),
                },
                err => err,
            })
            .collect()),
        Ok(Ok(results)) => Err(HandlerError::Store(StoreError::backend(BatchRetried(
            if results.len() < leases.len() {
                "the batch handler answered fewer messages than it was given"
            } else {
                "the batch handler answered more messages than it was given"
            },
        )))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(HandlerError::Store(StoreError::backend(BatchRetried(
            "the batch handler panicked",
        )))),
    }
}

/// Records a message's failure inside the batch's transaction: released (attempts kept) or
/// FAILED, fenced like every change; a passing store error gives the key back unspent.
pub(super) async fn record_failure<E: std::fmt::Display>(
    conn: &mut PgConnection,
    lease: &Lease,
    error: HandlerError<E>,
) -> Result<BatchAnswer<E>, StoreError> {
    let p = lease.policy;
    let reason = handler_reason(&error);
    let (state, failure, retention, after) = match &error {
        // Permanent, or a result that can never be stored: FAILED, with the reason.
        HandlerError::Permanent(_) | HandlerError::Store(StoreError::Input(_)) => (
            State::Failed,
            reason,
            p.failed_retention,
            AfterHandlerError::Failed {
                attempts: lease.attempts,
            },
        ),
        // A passing store error (nothing ran), or an outcome the handler chose not to keep.
        HandlerError::Store(_) | HandlerError::Withdraw(_)
            if matches!(&error, HandlerError::Withdraw(_))
                || matches!(&error, HandlerError::Store(e) if e.is_retryable()) =>
        {
            sqlx::query(crate::sql::WITHDRAW_SQL)
                .bind(lease.key.scope().as_str())
                .bind(lease.key.key_bytes())
                .bind(token_i64(lease.token))
                .execute(&mut *conn)
                .await
                .map_err(|e| classify(e, true))?;
            return Ok(BatchAnswer::Handler {
                error,
                after: AfterHandlerError::Released {
                    attempts: lease.attempts.saturating_sub(1),
                },
            });
        }
        _ if lease.attempts >= p.max_attempts => (
            State::Failed,
            machine::exhausted_reason(lease.attempts, p.max_attempts, Some(&reason)),
            p.failed_retention,
            AfterHandlerError::Failed {
                attempts: lease.attempts,
            },
        ),
        _ => (
            State::Released,
            reason,
            p.retention,
            AfterHandlerError::Released {
                attempts: lease.attempts,
            },
        ),
    };
    finish(conn, lease, state, None, Some(&failure), retention).await?;
    Ok(BatchAnswer::Handler { error, after })
}

pub(super) fn handler_reason<E: std::fmt::Display>(e: &HandlerError<E>) -> String {
    match e {
        HandlerError::Retryable(e) => e.to_string(),
        HandlerError::Permanent(e) => e.to_string(),
        HandlerError::Withdraw(e) => format!("withdrawn: {e}"),
        HandlerError::Store(e) => format!("the handler's store call failed: {e}"),
        _ => "the handler failed".to_owned(),
    }
}

/// Gives back a key claimed in this transaction without running it (an earlier message of its
/// ordering group did not settle): a fresh claim row is deleted, an older one released with its
/// attempt returned.
pub(super) async fn withdraw(conn: &mut PgConnection, lease: &Lease) -> Result<(), StoreError> {
    sqlx::query(crate::sql::WITHDRAW_SQL)
        .bind(lease.key.scope().as_str())
        .bind(lease.key.key_bytes())
        .bind(token_i64(lease.token))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    Ok(())
}
