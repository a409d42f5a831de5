//! The unhappy path of a batch transaction: calling the handler (a panic is a failure of the
//! call), and recording one message's failure inside the transaction.
//!
//! The second pass runs its parts in request order, each under a savepoint: each message that
//! failed before alone, the runs between them together; so a retry never lets a later message of
//! an ordering group overtake an earlier one. A result too large to store fails its own message.
//! A message held back in its group (`BatchAnswer::Deferred`) has a claim already taken given
//! back with `WITHDRAW_SQL`, so no attempt is spent.

use std::collections::{HashSet, VecDeque};
use std::panic::AssertUnwindSafe;

use dedup_core::{AfterHandlerError, HandlerError, Lease, State, StoreError, machine};
use futures_util::FutureExt;
use sqlx::postgres::PgConnection;

use super::pass::{Held, aborted};
use super::{BatchAnswer, BatchBody, BatchRetried, ItemResult};
use crate::PgStore;
use crate::classify::classify;
use crate::complete::finish;
use crate::outbox::OutboxBuffer;
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

/// A part of the acquired messages, run under one savepoint in the second pass.
pub(super) type Part = Vec<usize>;

/// `items` in order, cut so that each one `alone` says is a part by itself and the runs between
/// them are parts.
pub(super) fn segments(items: Part, alone: impl Fn(usize) -> bool) -> VecDeque<Part> {
    let mut parts = VecDeque::new();
    let mut run = Vec::new();
    for k in items {
        if alone(k) {
            if !run.is_empty() {
                parts.push_back(std::mem::take(&mut run));
            }
            parts.push_back(vec![k]);
        } else {
            run.push(k);
        }
    }
    if !run.is_empty() {
        parts.push_back(run);
    }
    parts
}

/// What the second pass runs in parts: the held groups, the leases, the messages that failed
/// in the first pass (indices into the requests), the map from a lease to its request, and the
/// outbox whose queues each call starts afresh.
pub(super) struct Parts<'a, 'h> {
    pub(super) held: &'a mut Held<'h>,
    pub(super) leases: &'a [Lease],
    pub(super) alone: &'a [usize],
    pub(super) req_of: &'a (dyn Fn(usize) -> usize + Sync),
    pub(super) outbox: Option<&'a OutboxBuffer>,
}

impl PgStore {
    /// The second pass's handler calls: each message that failed before on its own, the runs
    /// between them together, each part under a savepoint; a part that fails is cut again (by
    /// what the handler said failed, or in halves) until the message at fault is alone, and its
    /// group's later messages wait (left `None`).
    pub(super) async fn run_in_parts<E, H>(
        &self,
        tx: &mut PgConnection,
        handler: &mut H,
        parts_of: Parts<'_, '_>,
    ) -> Result<Vec<Option<ItemResult<E>>>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        let Parts {
            held,
            leases,
            alone,
            req_of,
            outbox,
        } = parts_of;
        // Parts in request order: each message that failed before on its own, the
        // runs between them together.
        let mut parts: VecDeque<Part> =
            segments((0..leases.len()).collect(), |k| alone.contains(&req_of(k)));
        let mut results: Vec<Option<ItemResult<E>>> = (0..leases.len()).map(|_| None).collect();
        while let Some(part) = parts.pop_front() {
            // A message whose group had a failure before it waits (left as None).
            let part: Part = part
                .into_iter()
                .filter(|&k| !held.waits(req_of(k)))
                .collect();
            if part.is_empty() {
                continue;
            }
            let sub: Vec<Lease> = part.iter().map(|&k| leases[k].clone()).collect();
            sqlx::query("SAVEPOINT dedup_part")
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, false))?;
            self.count(1);
            if let Some(outbox) = outbox {
                outbox.clear(&sub);
            }
            let mut out = call(handler, &mut *tx, &sub).await;
            let all_ok = matches!(&out, Ok(r) if r.iter().all(Result::is_ok));
            if all_ok {
                let released = sqlx::query("RELEASE SAVEPOINT dedup_part")
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| classify(e, false));
                self.count(1);
                match released {
                    Ok(_) => {
                        if let Ok(r) = out {
                            for (&k, r) in part.iter().zip(r) {
                                results[k] = Some(r);
                            }
                        }
                        continue;
                    }
                    // The handler said yes but left the transaction aborted (a
                    // statement of its failed): the part failed as a whole.
                    Err(e) if aborted(&e) => {
                        out = Err(HandlerError::Store(StoreError::backend(BatchRetried(
                            "the handler left the transaction aborted",
                        ))));
                    }
                    Err(e) => return Err(e),
                }
            }
            // Undone, and released too, so that failed parts do not nest.
            sqlx::query("ROLLBACK TO SAVEPOINT dedup_part")
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, false))?;
            sqlx::query("RELEASE SAVEPOINT dedup_part")
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, false))?;
            self.count(2);
            match out {
                // The message at fault, alone: its group's later messages wait.
                Ok(mut r) if part.len() == 1 => {
                    held.hold(req_of(part[0]));
                    results[part[0]] = r.pop();
                }
                Err(e) if part.len() == 1 => {
                    held.hold(req_of(part[0]));
                    results[part[0]] = Some(Err(e));
                }
                // The handler said which failed: those alone, the runs between
                // together, still in request order.
                Ok(r) => {
                    let bad: HashSet<usize> = part
                        .iter()
                        .zip(&r)
                        .filter(|(_, r)| r.is_err())
                        .map(|(&k, _)| k)
                        .collect();
                    for p in segments(part, |k| bad.contains(&k)).into_iter().rev() {
                        parts.push_front(p);
                    }
                }
                // Failed as a whole: halves, until the message at fault is alone.
                Err(_) => {
                    let mid = part.len() / 2;
                    parts.push_front(part[mid..].to_vec());
                    parts.push_front(part[..mid].to_vec());
                }
            }
        }
        Ok(results)
    }
}
