//! Claims: the single-key statement with its race re-runs and out-of-attempts marking, the batch
//! statement, and the re-grant of leases after a claim that waited.
//!
//! `CLAIM_BATCH_SQL` is the claim statement over `unnest` of parallel arrays. It inserts first
//! (`ON CONFLICT DO NOTHING`, in key order, so two batches never wait on each other in a cycle),
//! with no read before, so a batch of new keys costs about what inserting its rows costs; only
//! the keys the insert left out are read and, where claimable, taken over. Keys it leaves out (a
//! lost race, a key out of attempts) and a failed batch fall back to single claims, and a repeat
//! of a key in one batch is answered from the record its first claim left. A re-grant
//! (`REGRANT_SQL`) is one fenced statement; a key taken over in between is claimed again.

use std::collections::HashMap;
use std::time::Duration;

use dedup_core::machine::{self, ClaimStep};
use dedup_core::{ClaimOutcome, ClaimRequest, Lease, Record, State, StoreError, Timestamp, micros};
use sqlx::Row;
use sqlx::postgres::PgConnection;
use tracing::debug;

use crate::CLAIM_RACE_TRIES;
use crate::classify::classify;
use crate::rows::*;
use crate::sql::*;

/// A claim that kept losing races to concurrent writers.
#[derive(Debug, thiserror::Error)]
#[error("claim of {0} kept losing races to concurrent writers")]
pub(crate) struct Contention(pub(crate) String);

/// [`PgStore::claim_in`], also answering how many statements it sent.
pub(crate) async fn claim_counted(
    conn: &mut PgConnection,
    req: &ClaimRequest,
) -> (Result<ClaimOutcome, StoreError>, u64) {
    if let Err(e) = req.policy.validate() {
        return (Err(e.into()), 0);
    }
    let mut statements = 0;
    loop {
        statements += 1;
        match claim_once(conn, req).await {
            Ok(Some(outcome)) => return (Ok(outcome), statements),
            Err(e) => return (Err(e), statements),
            Ok(None) if statements >= u64::from(CLAIM_RACE_TRIES) => {
                let e = StoreError::unavailable(Contention(req.key.to_string()));
                return (Err(e), statements);
            }
            Ok(None) => debug!(key = %req.key, statements, "claim lost a race; re-reading"),
        }
    }
}

/// Each settled request's index, its answer, and the record as the statement left it (with the
/// statement's clock), from which a repeat of the key is answered.
pub(crate) type ClaimedMany = Vec<(
    usize,
    Result<ClaimOutcome, StoreError>,
    Option<(Record, Timestamp)>,
)>;

/// Runs [`CLAIM_BATCH_SQL`] for `reqs[i]`, `i` in `batch` (distinct keys); answers what it settled.
/// Keys it leaves out (lost races, keys out of attempts) go through the single-key claim.
pub(crate) async fn claim_many(
    conn: &mut PgConnection,
    reqs: &[ClaimRequest],
    batch: &[usize],
) -> Result<ClaimedMany, StoreError> {
    let n = batch.len();
    let (mut scopes, mut keys, mut owners, mut fps) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut leases, mut rets, mut maxes) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut index: HashMap<(&str, &[u8]), usize> = HashMap::with_capacity(n);
    for &i in batch {
        let req = &reqs[i];
        scopes.push(req.key.scope().as_str());
        keys.push(req.key.key_bytes());
        owners.push(req.owner.as_str());
        fps.push(req.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()));
        leases.push(micros(req.policy.lease));
        rets.push(micros(req.policy.retention));
        maxes.push(attempts_i32(req.policy.max_attempts));
        index.insert((req.key.scope().as_str(), req.key.key_bytes()), i);
    }
    let rows = sqlx::query(CLAIM_BATCH_SQL)
        .bind(&scopes)
        .bind(&keys)
        .bind(&owners)
        .bind(&fps)
        .bind(&leases)
        .bind(&rets)
        .bind(&maxes)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let mut answers = Vec::with_capacity(n);
    // The latest clock reading after the writes: when the claims took effect.
    let mut done = Timestamp::from_micros(i64::MIN);
    for row in &rows {
        let at: i64 = row.try_get("done_us").map_err(|e| classify(e, false))?;
        done = done.max(Timestamp::from_micros(at));
    }
    for row in &rows {
        let scope: &str = row.try_get("scope").map_err(|e| classify(e, false))?;
        let key: &[u8] = row.try_get("key").map_err(|e| classify(e, false))?;
        let Some(&i) = index.get(&(scope, key)) else {
            continue;
        };
        let req = &reqs[i];
        let src: &str = row.try_get("src").map_err(|e| classify(e, false))?;
        let now = Timestamp::from_micros(row.try_get("now_us").map_err(|e| classify(e, false))?);
        let record = match record_from_row(&req.key, row) {
            Ok(record) => record,
            Err(e) => {
                answers.push((i, Err(e), None));
                continue;
            }
        };
        let answer = match (src, record.state) {
            ("ins" | "upd", State::InProgress) => {
                ClaimOutcome::Acquired(Lease::granted(&record, req))
            }
            ("cur", _) => match machine::claim(Some(&record), req, now, || record.token) {
                ClaimStep::Answer(outcome) => outcome,
                // Out of attempts, or claimable when read but changed by a concurrent writer:
                // the single-key claim settles it.
                _ => continue,
            },
            _ => continue,
        };
        answers.push((i, Ok(answer), Some((record, now))));
    }
    // Leases granted from before a wait (the statement waited on a lock): re-grant them from now
    // in one statement. A key taken over in between is left out and claimed again on its own.
    let stale: Vec<usize> = answers
        .iter()
        .enumerate()
        .filter(|(_, (i, answer, seen))| {
            matches!(answer, Ok(ClaimOutcome::Acquired(_)))
                && seen
                    .as_ref()
                    .is_some_and(|(_, now)| waited(*now, done, reqs[*i].policy.lease))
        })
        .map(|(a, _)| a)
        .collect();
    if !stale.is_empty() {
        let leases: Vec<&Lease> = stale
            .iter()
            .filter_map(|&a| match &answers[a].1 {
                Ok(ClaimOutcome::Acquired(lease)) => Some(lease),
                _ => None,
            })
            .collect();
        // The claims may have committed already (autocommit): an error here leaves them
        // granted but short, which only a read-back (owner id) and an extension can settle.
        let ends = regrant(conn, &leases)
            .await
            .map_err(|e| StoreError::outcome_unknown(Regrant(e.to_string())))?;
        let mut lost = Vec::new();
        for (&a, end) in stale.iter().zip(ends) {
            match (end, &mut answers[a]) {
                (Some(until), (_, Ok(ClaimOutcome::Acquired(lease)), seen)) => {
                    lease.lease_until = until;
                    if let Some((record, _)) = seen {
                        record.lease_until = Some(until);
                    }
                }
                _ => lost.push(a),
            }
        }
        for a in lost.into_iter().rev() {
            let _lost = answers.remove(a);
        }
    }
    Ok(answers)
}

/// Whether a claim statement that started at `now` and finished its writes at `done` waited
/// long enough (a tenth of the lease) that its leases must be re-granted from now.
pub(crate) fn waited(now: Timestamp, done: Timestamp, lease: Duration) -> bool {
    done.as_micros().saturating_sub(now.as_micros()) > micros(lease) / 10
}

/// Re-grants `leases` from now ([`REGRANT_SQL`]): each one's new end, or `None` where its token no
/// longer holds the key (taken over in between).
pub(crate) async fn regrant(
    conn: &mut PgConnection,
    leases: &[&Lease],
) -> Result<Vec<Option<Timestamp>>, StoreError> {
    let scopes: Vec<&str> = leases.iter().map(|l| l.key.scope().as_str()).collect();
    let keys: Vec<&[u8]> = leases.iter().map(|l| l.key.key_bytes()).collect();
    let tokens: Vec<i64> = leases.iter().map(|l| token_i64(l.token)).collect();
    let lease_us: Vec<i64> = leases.iter().map(|l| micros(l.policy.lease)).collect();
    let ret_us: Vec<i64> = leases.iter().map(|l| micros(l.policy.retention)).collect();
    let rows = sqlx::query(REGRANT_SQL)
        .bind(&scopes)
        .bind(&keys)
        .bind(&tokens)
        .bind(&lease_us)
        .bind(&ret_us)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let mut ends: HashMap<(String, Vec<u8>), Timestamp> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let scope: String = row.try_get("scope").map_err(|e| classify(e, false))?;
        let key: Vec<u8> = row.try_get("key").map_err(|e| classify(e, false))?;
        let until: i64 = row
            .try_get("lease_until_us")
            .map_err(|e| classify(e, false))?;
        ends.insert((scope, key), Timestamp::from_micros(until));
    }
    debug!(
        n = leases.len(),
        held = ends.len(),
        "re-granted leases after a waiting claim"
    );
    Ok(leases
        .iter()
        .map(|l| {
            ends.get(&(
                l.key.scope().as_str().to_owned(),
                l.key.key_bytes().to_vec(),
            ))
            .copied()
        })
        .collect())
}

/// One run of the claim statement; `None` when it lost a race and must run again.
pub(crate) async fn claim_once(
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
    let done = Timestamp::from_micros(row.try_get("done_us").map_err(|e| classify(e, false))?);
    let record = record_from_row(&req.key, &row)?;
    Ok(match (src.as_str(), record.state) {
        ("ins" | "upd", State::InProgress) => {
            let mut lease = Lease::granted(&record, req);
            if waited(now, done, p.lease) {
                // Granted from before a wait: the lease must run from now. Re-granted under its
                // token; if someone took the key over in between, this claim is simply re-run.
                let ends = regrant(conn, &[&lease])
                    .await
                    .map_err(|e| StoreError::outcome_unknown(Regrant(e.to_string())))?;
                match ends.into_iter().next().flatten() {
                    Some(until) => lease.lease_until = until,
                    None => return Ok(None),
                }
            }
            Some(ClaimOutcome::Acquired(lease))
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
pub(crate) async fn exhaust(
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
        .bind(failed.failure.as_deref().map(crate::text::safe_text))
        .bind(micros(req.policy.failed_retention))
        .bind(attempts_i32(req.policy.max_attempts))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    Ok((done.rows_affected() == 1).then(|| machine::failed_outcome(failed)))
}

/// A re-grant after a waiting claim failed: the claim itself may have committed.
#[derive(Debug, thiserror::Error)]
#[error("re-granting leases after a waiting claim failed: {0}")]
pub(crate) struct Regrant(pub(crate) String);
