//! One pass of a batch transaction: BEGIN, the locks, the claims (fresh keys need none), the
//! handler (whole, or in parts after a failure), the completions, the caller's own writes, COMMIT.
//!
//! `run_once` runs the stages. The transaction's bounds (`idle_in_transaction_session_timeout`,
//! `lock_timeout`) are set with BEGIN, in its round trip, so they cover the whole transaction. A
//! single claim of the fallback runs under a savepoint, so a lock timeout it answers as InFlight
//! does not leave the transaction aborted. A handler that answered every message as done but left
//! the transaction aborted (it ignored a failed statement) shows at the first write after it
//! (25P02): the batch runs again in parts, so only the message at fault fails. A failed pass is
//! rolled back explicitly before the second one takes its locks; a commit whose reply is lost is
//! read back through a completed lease.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use dedup_core::{ClaimOutcome, ClaimRequest, Lease, State, Store, StoreError};
use sqlx::postgres::PgConnection;
use tracing::debug;

use super::fresh::{insert_claimed, insert_completed, read_fresh};
use super::parts::{Parts, call, handler_reason, record_failure, withdraw};

use super::{BatchAnswer, BatchBody, BatchRetried, BatchWrites, ItemResult, TxBatchConfig};
use crate::PgStore;
use crate::claim::{claim_counted, claim_many};
use crate::classify::classify;
use crate::complete::complete_many;
use crate::outbox::OutboxBuffer;
use crate::sql::TRY_LOCK_SQL;

/// Whether `e` says the transaction was aborted by an earlier failed statement (SQLSTATE 25P02).
pub(super) fn aborted(e: &StoreError) -> bool {
    crate::classify::sqlstate(e).as_deref() == Some("25P02")
}

/// Runs a savepoint statement (SAVEPOINT, RELEASE, ROLLBACK TO).
pub(super) async fn savepoint(
    conn: &mut PgConnection,
    sql: &'static str,
) -> Result<(), StoreError> {
    sqlx::query(sql)
        .execute(&mut *conn)
        .await
        .map(drop)
        .map_err(|e| classify(e, false))
}

/// What recording a pass's answers needs to know of it.
struct Recording<'a> {
    leases: &'a [Lease],
    /// Each lease's index into the distinct requests.
    positions: &'a [usize],
    /// Fresh keys: nothing written for them yet.
    unwritten: &'a HashSet<usize>,
    req_of: &'a (dyn Fn(usize) -> usize + Sync),
    /// A failure that shows the handler left the transaction aborted runs the batch again in
    /// parts (first pass only).
    retry_whole: bool,
}

/// Why recording stopped.
enum Stop {
    /// The handler left the transaction aborted: the batch runs again in parts.
    RetryWhole,
    Fail(StoreError),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Self::Fail(e)
    }
}

/// What a pass runs over: the requests, their ordering groups and the caller's own writes, if
/// any; `distinct` the first appearance of each key.
#[derive(Clone, Copy)]
pub(super) struct Plan<'a> {
    pub(super) reqs: &'a [ClaimRequest],
    pub(super) groups: Option<&'a [u64]>,
    pub(super) writes: Option<&'a dyn BatchWrites>,
    pub(super) outbox: Option<&'a OutboxBuffer>,
    pub(super) distinct: &'a [usize],
    pub(super) config: TxBatchConfig,
}

impl PgStore {
    /// One transaction over the distinct requests. `alone`: `None` on the happy path (no
    /// savepoint); in the second pass, the messages that failed in the first, each to be run
    /// alone. `groups`: the ordering group of each request, if the batch keeps an order.
    pub(super) async fn run_once<E, H>(
        &self,
        plan: &Plan<'_>,
        handler: &mut H,
        alone: Option<Vec<usize>>,
    ) -> Result<Pass<E>, StoreError>
    where
        E: std::fmt::Display + Send,
        H: for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, E> + Send,
    {
        let Plan {
            reqs,
            groups,
            writes,
            outbox,
            distinct,
            config,
        } = *plan;
        let mut conn = self.conn().await?;
        let out = async {
            // The bounds are set with BEGIN, in its round trip, so that a client stopped at any
            // point of the transaction (even before its first statement) holds its session no
            // longer than the idle bound.
            let begin = format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = '{}ms'; \
                 SET LOCAL lock_timeout = '{}ms'",
                config.idle_timeout.as_millis().max(1),
                config.lock_timeout.as_millis().max(1)
            );
            let mut tx = sqlx::Connection::begin_with(&mut **conn, sqlx::AssertSqlSafe(begin))
                .await
                .map_err(|e| classify(e, false))?;
            self.count(1);
            // Ordering groups with a message that did not settle: their later messages wait.
            let mut held = Held::new(groups);
            let mut answers: Vec<Option<BatchAnswer<E>>> = distinct.iter().map(|_| None).collect();
            let locked = self.try_lock(&mut tx, plan, &mut held, &mut answers).await?;
            let (leases, unwritten) = self
                .claim_and_sort(&mut tx, plan, &locked, &mut held, &mut answers)
                .await?;
            let (positions, leases): (Vec<usize>, Vec<Lease>) = leases.into_iter().unzip();
            let req_of = |k: usize| reqs_index(&positions, distinct, k);
            // The handler: the whole batch at once, or in parts under savepoints.
            let results: Vec<Option<ItemResult<E>>> = match &alone {
                _ if leases.is_empty() => Vec::new(),
                None => {
                    if let Some(outbox) = outbox {
                        outbox.clear(&leases);
                    }
                    let whole = call(handler, &mut tx, &leases).await;
                    match whole {
                        Ok(results) if results.iter().all(Result::is_ok) => {
                            results.into_iter().map(Some).collect()
                        }
                        Ok(results) => {
                            let failed = results
                                .iter()
                                .enumerate()
                                .filter(|(_, r)| r.is_err())
                                .map(|(k, _)| req_of(k))
                                .collect();
                            debug!("batch handler reported failures; running again in parts");
                            // Before the second pass takes its locks: let go of this one's.
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(failed));
                        }
                        Err(e) => {
                            debug!(error = %handler_reason(&e), "batch handler failed; running again in parts");
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(Vec::new()));
                        }
                    }
                }
                Some(alone) => {
                    let parts = Parts {
                        held: &mut held,
                        leases: &leases,
                        alone,
                        req_of: &req_of,
                        outbox,
                    };
                    self.run_in_parts(&mut tx, handler, parts).await?
                }
            };
            let retry_whole = alone.is_none();
            let rec = Recording {
                leases: &leases,
                positions: &positions,
                unwritten: &unwritten,
                req_of: &req_of,
                retry_whole,
            };
            let (done, written) = match self.record(&mut tx, &rec, results, &mut answers).await {
                Ok(recorded) => recorded,
                Err(Stop::RetryWhole) => {
                    tx.rollback().await.map_err(|e| classify(e, false))?;
                    return Ok(Pass::Retry(Vec::new()));
                }
                Err(Stop::Fail(e)) => return Err(e),
            };
            // What the messages that ran queued on the outbox, after their completions, in the
            // batch's order (not completions' before fresh keys').
            let mut published = false;
            if let Some(outbox) = outbox {
                let ran: HashSet<&dedup_core::IdempotencyKey> = done
                    .iter()
                    .chain(&written)
                    .map(|(lease, _)| &lease.key)
                    .collect();
                let ran = leases.iter().filter(|l| ran.contains(&l.key));
                match outbox.write(&mut tx, ran).await {
                    Ok(statements) => {
                        published = statements > 0;
                        self.count(statements);
                    }
                    Err(e) => {
                        self.count(1);
                        if retry_whole && aborted(&e) {
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(Vec::new()));
                        }
                        return Err(e);
                    }
                }
            }
            // The caller's own writes (the consumer's position), with the effects.
            if let Some(writes) = writes {
                let first: HashMap<&dedup_core::IdempotencyKey, usize> = distinct
                    .iter()
                    .enumerate()
                    .map(|(n, &i)| (&reqs[i].key, n))
                    .collect();
                let settled: Vec<bool> = (0..reqs.len())
                    .map(|i| settles(reqs, distinct, &first, &answers, i))
                    .collect();
                match writes.write(&mut tx, &settled).await {
                    Ok(statements) => self.count(statements),
                    Err(e) => {
                        // At least the statement that failed.
                        self.count(1);
                        if retry_whole && aborted(&e) {
                            tx.rollback().await.map_err(|e| classify(e, false))?;
                            return Ok(Pass::Retry(Vec::new()));
                        }
                        return Err(e);
                    }
                }
            }
            // A commit whose reply is lost is read back through one completed lease (a
            // transaction commits whole); whatever did not commit is a passing failure of the
            // whole batch, which a retry settles (every claim is read again).
            self.count(1);
            if let Err(e) = tx.commit().await {
                let err = classify(e, true);
                let landed = match (err.is_outcome_unknown(), done.first().or(written.first())) {
                    (true, Some((lease, _))) => matches!(
                        self.get(&lease.key).await,
                        Ok(Some(r)) if r.token == lease.token && r.state == State::Completed
                    ),
                    _ => false,
                };
                if !landed {
                    return Err(if err.is_outcome_unknown() && !(done.is_empty() && written.is_empty()) {
                        StoreError::unavailable(BatchRetried("the batch's commit did not land"))
                    } else {
                        err
                    });
                }
            }
            if published {
                self.wake_outbox();
            }
            Ok(Pass::Done(answers))
        }
        .await;
        if let Err(e) = &out {
            conn.saw(e);
            // A transaction dropped on an error only queues its ROLLBACK: send it now, so that
            // its advisory locks are gone before the caller retries the batch.
            if !crate::classify::must_discard(e) {
                let _ = sqlx::Connection::ping(&mut **conn).await;
            }
        }
        out
    }

    /// Locks what can be locked at once (each key's transaction-scoped lock, waiting up to the
    /// lock bound); the rest is InFlight, and a message whose group already waits is Deferred.
    /// Answers the requests locked.
    async fn try_lock<E>(
        &self,
        tx: &mut PgConnection,
        plan: &Plan<'_>,
        held: &mut Held<'_>,
        answers: &mut [Option<BatchAnswer<E>>],
    ) -> Result<Vec<usize>, StoreError> {
        let (reqs, distinct, config) = (plan.reqs, plan.distinct, plan.config);
        // Lock what can be locked at once; the rest is InFlight.
        let scopes: Vec<&str> = distinct
            .iter()
            .map(|&i| reqs[i].key.scope().as_str())
            .collect();
        let keys: Vec<&[u8]> = distinct.iter().map(|&i| reqs[i].key.key_bytes()).collect();
        let idle = format!("{}ms", config.idle_timeout.as_millis().max(1));
        let wait = format!("{}ms", config.lock_timeout.as_millis().max(1));
        let got: Vec<bool> = sqlx::query_scalar(TRY_LOCK_SQL)
            .bind(&scopes)
            .bind(&keys)
            .bind(&idle)
            .bind(&wait)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| classify(e, false))?;
        self.count(1);
        let mut locked = Vec::with_capacity(distinct.len());
        for (n, ok) in got.into_iter().enumerate() {
            let i = distinct[n];
            if held.waits(i) {
                answers[n] = Some(BatchAnswer::Deferred);
            } else if ok {
                locked.push(i);
            } else {
                held.hold(i);
                answers[n] = Some(BatchAnswer::InFlight);
            }
        }
        Ok(locked)
    }

    /// Claims the locked requests and files each answer in request order (so that a group's
    /// InFlight holds back only its later messages): the leases to run, in order with their
    /// index into the distinct requests, and the fresh keys among them.
    async fn claim_and_sort<E>(
        &self,
        tx: &mut PgConnection,
        plan: &Plan<'_>,
        locked: &[usize],
        held: &mut Held<'_>,
        answers: &mut [Option<BatchAnswer<E>>],
    ) -> Result<(Vec<(usize, Lease)>, HashSet<usize>), StoreError> {
        let (reqs, distinct) = (plan.reqs, plan.distinct);
        let index: HashMap<usize, usize> =
            distinct.iter().enumerate().map(|(n, &i)| (i, n)).collect();
        // Fresh keys (no row at all) are granted without a claim statement; the others are
        // claimed in one statement, and what it leaves out one by one.
        let (mut outcomes, unwritten) = self.claim_locked(&mut *tx, reqs, locked).await?;
        // In request order, so that a group's InFlight holds back only its later messages.
        let mut leases: Vec<(usize, Lease)> = Vec::new();
        for &i in locked {
            let n = index[&i];
            let Some(outcome) = outcomes.remove(&i) else {
                answers[n] = Some(BatchAnswer::InFlight);
                continue;
            };
            answers[n] = Some(match outcome {
                ClaimOutcome::Acquired(lease) if held.waits(i) => {
                    // A fresh key has nothing written to give back.
                    if !unwritten.contains(&i) {
                        withdraw(&mut *tx, &lease).await?;
                        self.count(1);
                    }
                    BatchAnswer::Deferred
                }
                ClaimOutcome::Acquired(lease) => {
                    leases.push((n, lease));
                    continue;
                }
                ClaimOutcome::Completed {
                    result,
                    token,
                    fingerprint,
                } => BatchAnswer::Replayed {
                    result,
                    token,
                    fingerprint,
                },
                ClaimOutcome::Failed { reason, attempts } => {
                    BatchAnswer::Failed { reason, attempts }
                }
                ClaimOutcome::PayloadMismatch => BatchAnswer::PayloadMismatch,
                _ => {
                    held.hold(i);
                    BatchAnswer::InFlight
                }
            });
        }
        Ok((leases, unwritten))
    }

    /// Records what the handler answered: fresh successes written COMPLETED in one statement, the
    /// other successes completed in one; each failure on its own (a fresh key's claim written
    /// first); a message that waited on its group given back. Answers the completions (the
    /// commit reads one back if its reply is lost).
    #[allow(clippy::type_complexity)]
    async fn record<E: std::fmt::Display + Send>(
        &self,
        tx: &mut PgConnection,
        rec: &Recording<'_>,
        results: Vec<Option<ItemResult<E>>>,
        answers: &mut [Option<BatchAnswer<E>>],
    ) -> Result<(Vec<(Lease, Bytes)>, Vec<(Lease, Bytes)>), Stop> {
        let Recording {
            leases,
            positions,
            unwritten,
            req_of,
            retry_whole,
        } = *rec;
        // Record: fresh successes written COMPLETED in one statement, the other successes
        // completed in one; each failure on its own (a fresh key's claim written first); a
        // message that waited on its group given back.
        let fresh_failed: Vec<&Lease> = results
            .iter()
            .enumerate()
            .filter(|(k, r)| matches!(r, Some(Err(_))) && unwritten.contains(&req_of(*k)))
            .map(|(k, _)| &leases[k])
            .collect();
        if !fresh_failed.is_empty() {
            self.count(1);
            insert_claimed(&mut *tx, &fresh_failed).await?;
        }
        let mut done = Vec::new();
        let mut done_at = Vec::new();
        let mut written = Vec::new();
        let mut written_at = Vec::new();
        for (k, r) in results.into_iter().enumerate() {
            let n = positions[k];
            let lease = &leases[k];
            let fresh = unwritten.contains(&req_of(k));
            match r {
                Some(Ok(result)) if fresh => {
                    written.push((lease.clone(), result));
                    written_at.push(k);
                }
                Some(Ok(result)) => {
                    done.push((lease.clone(), result));
                    done_at.push(k);
                }
                Some(Err(error)) => {
                    answers[n] = Some(record_failure(&mut *tx, lease, error).await?);
                    self.count(1);
                }
                None => {
                    if !fresh {
                        withdraw(&mut *tx, lease).await?;
                        self.count(1);
                    }
                    answers[n] = Some(BatchAnswer::Deferred);
                }
            }
        }
        // A handler that answered every message as done but left the transaction aborted (one
        // of its statements failed) shows here, at the first write after it: the batch runs
        // again in parts, so that the message at fault is found.
        if !written.is_empty() {
            self.count(1);
            if let Err(e) = insert_completed(&mut *tx, &written).await {
                if retry_whole && aborted(&e) {
                    return Err(Stop::RetryWhole);
                }
                return Err(Stop::Fail(e));
            }
            for (k, (lease, result)) in written_at.iter().zip(&written) {
                answers[positions[*k]] = Some(BatchAnswer::Executed {
                    result: result.clone(),
                    token: lease.token,
                    attempts: lease.attempts,
                });
            }
        }
        if !done.is_empty() {
            let (completed, failed, statements) = complete_many(&mut *tx, &done).await;
            self.count(statements);
            if let Some(e) = failed {
                if retry_whole && aborted(&e) {
                    return Err(Stop::RetryWhole);
                }
                return Err(Stop::Fail(e));
            }
            for ((k, r), (lease, result)) in done_at.iter().zip(completed).zip(&done) {
                // Our own uncommitted claims: only an oversized result can refuse here,
                // and that fails the whole batch before anything is recorded wrongly.
                r?;
                answers[positions[*k]] = Some(BatchAnswer::Executed {
                    result: result.clone(),
                    token: lease.token,
                    attempts: lease.attempts,
                });
            }
        }
        Ok((done, written))
    }

    /// The claims of the locked requests: fresh keys (no row at all) granted without a claim
    /// statement (answered in the second set: nothing written for them yet), the others claimed
    /// in one statement, and what it leaves out one by one under a savepoint.
    async fn claim_locked(
        &self,
        tx: &mut PgConnection,
        reqs: &[ClaimRequest],
        locked: &[usize],
    ) -> Result<(HashMap<usize, ClaimOutcome>, HashSet<usize>), StoreError> {
        let mut outcomes: HashMap<usize, ClaimOutcome> = HashMap::new();
        let mut unwritten: HashSet<usize> = HashSet::new();
        let mut existing = Vec::new();
        if !locked.is_empty() {
            self.count(1);
            for (&i, lease) in locked.iter().zip(read_fresh(&mut *tx, reqs, locked).await?) {
                match lease {
                    Some(lease) => {
                        unwritten.insert(i);
                        outcomes.insert(i, ClaimOutcome::Acquired(lease));
                    }
                    None => existing.push(i),
                }
            }
        }
        if !existing.is_empty() {
            self.count(1);
            for (i, answer, _) in claim_many(&mut *tx, reqs, &existing).await? {
                outcomes.insert(i, answer?);
            }
            // Left out: a lost race, or a key out of attempts (the single claim marks it).
            let left: Vec<usize> = existing
                .iter()
                .copied()
                .filter(|i| !outcomes.contains_key(i))
                .collect();
            // Each under a savepoint: a single claim that met a lock timeout answers InFlight
            // but leaves the transaction aborted, which rolling back to it undoes.
            for i in left {
                savepoint(&mut *tx, "SAVEPOINT dedup_claim").await?;
                let (answer, statements) = claim_counted(&mut *tx, &reqs[i]).await;
                let keep = matches!(&answer, Ok(o) if !matches!(o, ClaimOutcome::InFlight { .. }));
                if !keep {
                    savepoint(&mut *tx, "ROLLBACK TO SAVEPOINT dedup_claim").await?;
                }
                savepoint(&mut *tx, "RELEASE SAVEPOINT dedup_claim").await?;
                self.count(statements + if keep { 2 } else { 3 });
                outcomes.insert(i, answer?);
            }
        }
        Ok((outcomes, unwritten))
    }
}

/// Whether request `i` settles with this pass's answers (`answers[n]` for `distinct[n]`):
/// executed or replayed, or a repeat of a key that does (with a compatible payload). A failure
/// or mismatch is not settled here: its dead letter is not written yet.
fn settles<E>(
    reqs: &[ClaimRequest],
    distinct: &[usize],
    first: &HashMap<&dedup_core::IdempotencyKey, usize>,
    answers: &[Option<BatchAnswer<E>>],
    i: usize,
) -> bool {
    let Some(&n) = first.get(&reqs[i].key) else {
        return false;
    };
    let first = &reqs[distinct[n]];
    let compatible = reqs[i].fingerprint.is_none()
        || first.fingerprint.is_none()
        || reqs[i].fingerprint == first.fingerprint;
    compatible
        && matches!(
            answers[n],
            Some(BatchAnswer::Executed { .. } | BatchAnswer::Replayed { .. })
        )
}

/// The ordering groups of a batch in which a message did not settle: the group's later messages
/// wait. Without groups, nothing waits.
pub(super) struct Held<'g> {
    groups: Option<&'g [u64]>,
    held: HashSet<u64>,
}

impl<'g> Held<'g> {
    fn new(groups: Option<&'g [u64]>) -> Self {
        Self {
            groups,
            held: HashSet::new(),
        }
    }

    /// Request `i` did not settle: its group's later messages wait.
    pub(super) fn hold(&mut self, i: usize) {
        if let Some(g) = self.groups {
            self.held.insert(g[i]);
        }
    }

    /// Whether request `i` waits for an earlier message of its group.
    pub(super) fn waits(&self, i: usize) -> bool {
        self.groups.is_some_and(|g| self.held.contains(&g[i]))
    }
}

/// The outcome of one transaction over the batch.
pub(super) enum Pass<E> {
    Done(Vec<Option<BatchAnswer<E>>>),
    /// Rolled back after a handler failure; these requests (indices into `reqs`) failed alone.
    Retry(Vec<usize>),
}

fn reqs_index(positions: &[usize], distinct: &[usize], k: usize) -> usize {
    distinct[positions[k]]
}
