//! The state machine as pure functions: `(record, command, now) -> (record, answer)`.
//!
//! No I/O and no clock of its own: the store passes its own `now` and, for a claim, a way to draw
//! a fresh token. The in-memory store applies these functions under a lock; the Postgres store
//! runs the same rules in SQL and uses [`claim`] to classify the record it read, so both answer
//! alike (the conformance suite checks that they do). This is the one specification
//! (docs/ARCHITECTURE.md, invariant 2), unit-tested here transition by transition.
//!
//! ```text
//! (absent) --claim--> IN_PROGRESS(owner, token, lease_until, attempts=1, fingerprint)
//! IN_PROGRESS --complete(token, result)--> COMPLETED(result)
//! IN_PROGRESS --fail_retryable(token)--> RELEASED (attempts kept)   | FAILED when attempts >= max
//! IN_PROGRESS --fail_permanent(token)--> FAILED(reason)
//! IN_PROGRESS --extend(token)--> IN_PROGRESS (lease_until = now + lease)
//! IN_PROGRESS, lease expired | RELEASED --claim--> IN_PROGRESS(new token, attempts + 1)
//!                                                  | FAILED when attempts >= max
//! any record past expires_at --> treated as absent (and purged)
//! ```

use crate::error::StoreError;
use crate::key::Fingerprint;
use crate::record::{
    AfterFailure, ClaimOutcome, ClaimRequest, FencingToken, Lease, Record, State, Timestamp,
};

/// What a claim does to the record.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ClaimStep {
    /// Write `record` (a fresh claim or a takeover) and answer [`ClaimOutcome::Acquired`].
    Acquire {
        /// The record to write.
        record: Record,
        /// The lease granted.
        lease: Lease,
    },
    /// The key ran out of attempts: write `record` (FAILED) and answer
    /// [`ClaimOutcome::Failed`].
    Exhaust {
        /// The FAILED record to write.
        record: Record,
    },
    /// Write nothing; answer this.
    Answer(ClaimOutcome),
}

impl ClaimStep {
    /// The answer the caller gets once the step is applied.
    pub fn outcome(&self) -> ClaimOutcome {
        match self {
            Self::Acquire { lease, .. } => ClaimOutcome::Acquired(lease.clone()),
            Self::Exhaust { record } => failed_outcome(record),
            Self::Answer(outcome) => outcome.clone(),
        }
    }
}

/// Whether two fingerprints disagree. A missing one on either side never does.
pub fn mismatch(stored: Option<Fingerprint>, given: Option<Fingerprint>) -> bool {
    matches!((stored, given), (Some(a), Some(b)) if a != b)
}

/// Whether `record` may be dropped: it is past its `expires_at`.
pub fn purgeable(record: &Record, now: Timestamp) -> bool {
    record.expires_at <= now
}

/// The reason stored when a key runs out of attempts.
pub fn exhausted_reason(attempts: u32, max: u32, last_error: Option<&str>) -> String {
    format!(
        "out of attempts ({attempts} of {max}); last error: {}",
        last_error.unwrap_or("lease expired without completion")
    )
}

/// Decides a claim of `req.key`, whose current record is `current`, at `now`.
/// `next_token` is called only when a lease is granted.
pub fn claim(
    current: Option<&Record>,
    req: &ClaimRequest,
    now: Timestamp,
    next_token: impl FnOnce() -> FencingToken,
) -> ClaimStep {
    let policy = req.policy;
    let current = current.filter(|r| !purgeable(r, now));
    let Some(cur) = current else {
        let token = next_token();
        let lease_until = now.plus(policy.lease);
        let record = Record {
            key: req.key.clone(),
            state: State::InProgress,
            owner: Some(req.owner.clone()),
            token,
            lease_until: Some(lease_until),
            attempts: 1,
            fingerprint: req.fingerprint,
            result: None,
            failure: None,
            created_at: now,
            updated_at: now,
            expires_at: lease_until.plus(policy.retention),
        };
        return acquire(record, req);
    };
    if mismatch(cur.fingerprint, req.fingerprint) {
        return ClaimStep::Answer(ClaimOutcome::PayloadMismatch);
    }
    match cur.state {
        State::Completed => ClaimStep::Answer(ClaimOutcome::Completed {
            result: cur.result.clone().unwrap_or_default(),
            token: cur.token,
            fingerprint: cur.fingerprint,
        }),
        State::Failed => ClaimStep::Answer(failed_outcome(cur)),
        State::InProgress if cur.lease_until.is_some_and(|until| until > now) => {
            ClaimStep::Answer(ClaimOutcome::InFlight {
                owner: cur.owner.clone(),
                lease_until: cur.lease_until,
            })
        }
        State::InProgress | State::Released if cur.attempts >= policy.max_attempts => {
            ClaimStep::Exhaust {
                record: Record {
                    state: State::Failed,
                    lease_until: None,
                    failure: Some(exhausted_reason(
                        cur.attempts,
                        policy.max_attempts,
                        cur.failure.as_deref(),
                    )),
                    updated_at: now,
                    expires_at: now.plus(policy.failed_retention),
                    ..cur.clone()
                },
            }
        }
        State::InProgress | State::Released => {
            let lease_until = now.plus(policy.lease);
            let record = Record {
                state: State::InProgress,
                owner: Some(req.owner.clone()),
                token: next_token(),
                lease_until: Some(lease_until),
                attempts: cur.attempts.saturating_add(1),
                fingerprint: cur.fingerprint.or(req.fingerprint),
                updated_at: now,
                expires_at: lease_until.plus(policy.retention),
                ..cur.clone()
            };
            acquire(record, req)
        }
    }
}

fn acquire(record: Record, req: &ClaimRequest) -> ClaimStep {
    let lease = Lease::granted(&record, req);
    ClaimStep::Acquire { record, lease }
}

/// The answer a FAILED record gives a claim.
pub fn failed_outcome(record: &Record) -> ClaimOutcome {
    ClaimOutcome::Failed {
        reason: record.failure.clone().unwrap_or_default(),
        attempts: record.attempts,
    }
}

/// The fence: `current` must be IN_PROGRESS under `lease`'s token.
pub fn check_fence<'r>(
    current: Option<&'r Record>,
    lease: &Lease,
) -> Result<&'r Record, StoreError> {
    match current {
        Some(r) if r.state == State::InProgress && r.token == lease.token => Ok(r),
        _ => Err(StoreError::LeaseLost {
            key: lease.key.clone(),
            token: lease.token,
        }),
    }
}

/// `complete(token, result)`: IN_PROGRESS -> COMPLETED, kept for the policy's retention. A
/// completed record keeps no owner: the owner says who holds a lease, and nothing reads it once
/// the effect is recorded (a large window would carry it on every record).
pub fn complete(
    current: Option<&Record>,
    lease: &Lease,
    result: &[u8],
    now: Timestamp,
) -> Result<Record, StoreError> {
    lease.policy.check_result(result)?;
    let cur = check_fence(current, lease)?;
    Ok(Record {
        state: State::Completed,
        owner: None,
        lease_until: None,
        result: Some(bytes::Bytes::copy_from_slice(result)),
        failure: None,
        updated_at: now,
        expires_at: now.plus(lease.policy.retention),
        ..cur.clone()
    })
}

/// `fail_retryable(token, error)`: releases the key, keeping the attempts; FAILED once the
/// attempts reach the policy's limit.
pub fn fail_retryable(
    current: Option<&Record>,
    lease: &Lease,
    error: &str,
    now: Timestamp,
) -> Result<(Record, AfterFailure), StoreError> {
    let cur = check_fence(current, lease)?;
    let max = lease.policy.max_attempts;
    let (record, after) = if cur.attempts >= max {
        let record = Record {
            state: State::Failed,
            failure: Some(exhausted_reason(cur.attempts, max, Some(error))),
            expires_at: now.plus(lease.policy.failed_retention),
            ..cur.clone()
        };
        (
            record,
            AfterFailure::Failed {
                attempts: cur.attempts,
            },
        )
    } else {
        let record = Record {
            state: State::Released,
            failure: Some(error.to_owned()),
            expires_at: now.plus(lease.policy.retention),
            ..cur.clone()
        };
        (
            record,
            AfterFailure::Released {
                attempts: cur.attempts,
            },
        )
    };
    Ok((
        Record {
            lease_until: None,
            updated_at: now,
            ..record
        },
        after,
    ))
}

/// `fail_permanent(token, reason)`: IN_PROGRESS -> FAILED.
pub fn fail_permanent(
    current: Option<&Record>,
    lease: &Lease,
    reason: &str,
    now: Timestamp,
) -> Result<Record, StoreError> {
    let cur = check_fence(current, lease)?;
    Ok(Record {
        state: State::Failed,
        lease_until: None,
        failure: Some(reason.to_owned()),
        updated_at: now,
        expires_at: now.plus(lease.policy.failed_retention),
        ..cur.clone()
    })
}

/// `withdraw(token)`: a lease granted but never used, given back with the attempt its claim
/// counted. A first attempt leaves no record at all (`None`: the key stands as if it had never
/// been claimed, fingerprint included); a later one leaves the key released with one attempt
/// fewer.
pub fn withdraw(
    current: Option<&Record>,
    lease: &Lease,
    now: Timestamp,
) -> Result<Option<Record>, StoreError> {
    let cur = check_fence(current, lease)?;
    if cur.attempts <= 1 {
        return Ok(None);
    }
    Ok(Some(Record {
        state: State::Released,
        lease_until: None,
        attempts: cur.attempts - 1,
        updated_at: now,
        ..cur.clone()
    }))
}

/// `extend(token)`: the heartbeat; the lease runs `policy.lease` from `now`.
pub fn extend(
    current: Option<&Record>,
    lease: &Lease,
    now: Timestamp,
) -> Result<Record, StoreError> {
    let cur = check_fence(current, lease)?;
    let lease_until = now.plus(lease.policy.lease);
    Ok(Record {
        lease_until: Some(lease_until),
        updated_at: now,
        expires_at: cur.expires_at.max(lease_until.plus(lease.policy.retention)),
        ..cur.clone()
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::{IdempotencyKey, Scope};
    use crate::record::{OwnerId, Policy};

    const T0: Timestamp = Timestamp::from_micros(1_000_000_000);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn req(owner: &str) -> ClaimRequest {
        let key = IdempotencyKey::new(Scope::new("s").expect("scope"), b"k").expect("key");
        ClaimRequest::new(key, OwnerId::new(owner))
            .with_fingerprint(Some(Fingerprint::of(b"payload")))
            .with_policy(
                Policy::default()
                    .with_lease(secs(10))
                    .with_max_attempts(3)
                    .with_retention(secs(100))
                    .with_failed_retention(secs(1000)),
            )
    }

    fn tok(n: u64) -> impl FnOnce() -> FencingToken {
        move || FencingToken::new(n)
    }

    fn acquired(step: ClaimStep) -> (Record, Lease) {
        match step {
            ClaimStep::Acquire { record, lease } => (record, lease),
            other => panic!("expected Acquire, got {other:?}"),
        }
    }

    #[test]
    fn a_new_key_is_acquired_with_a_lease_on_the_store_clock() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(7)));
        assert_eq!(rec.state, State::InProgress);
        assert_eq!(rec.token, FencingToken::new(7));
        assert_eq!(rec.attempts, 1);
        assert_eq!(rec.lease_until, Some(T0.plus(secs(10))));
        assert_eq!(rec.expires_at, T0.plus(secs(110)));
        assert_eq!(rec.owner, Some(OwnerId::new("a")));
        assert_eq!(lease.token, rec.token);
        assert_eq!(lease.lease_until, T0.plus(secs(10)));
    }

    #[test]
    fn a_live_lease_answers_in_flight_and_draws_no_token() {
        let (rec, _) = acquired(claim(None, &req("a"), T0, tok(1)));
        let step = claim(Some(&rec), &req("b"), T0.plus(secs(9)), || {
            panic!("no token may be drawn for an answer")
        });
        assert_eq!(
            step,
            ClaimStep::Answer(ClaimOutcome::InFlight {
                owner: Some(OwnerId::new("a")),
                lease_until: Some(T0.plus(secs(10)))
            })
        );
    }

    #[test]
    fn an_expired_lease_is_taken_over_with_a_new_token_and_one_more_attempt() {
        let (rec, _) = acquired(claim(None, &req("a"), T0, tok(1)));
        let (rec2, lease2) = acquired(claim(Some(&rec), &req("b"), T0.plus(secs(10)), tok(2)));
        assert_eq!(rec2.token, FencingToken::new(2));
        assert_eq!(rec2.attempts, 2);
        assert_eq!(rec2.owner, Some(OwnerId::new("b")));
        assert_eq!(rec2.created_at, T0);
        assert_eq!(lease2.attempts, 2);
    }

    #[test]
    fn complete_then_duplicates_replay_the_result() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        let done = complete(Some(&rec), &lease, b"ok", T0.plus(secs(1))).expect("complete");
        assert_eq!(done.state, State::Completed);
        assert_eq!(done.lease_until, None);
        assert_eq!(done.expires_at, T0.plus(secs(101)));
        assert_eq!(
            claim(Some(&done), &req("b"), T0.plus(secs(50)), tok(9)).outcome(),
            ClaimOutcome::Completed {
                result: bytes::Bytes::from_static(b"ok"),
                token: FencingToken::new(1),
                fingerprint: Some(Fingerprint::of(b"payload")),
            }
        );
    }

    #[test]
    fn stale_tokens_are_fenced_out_of_every_call() {
        let (rec, stale) = acquired(claim(None, &req("a"), T0, tok(1)));
        let (rec2, _) = acquired(claim(Some(&rec), &req("b"), T0.plus(secs(11)), tok(2)));
        let now = T0.plus(secs(12));
        assert!(complete(Some(&rec2), &stale, b"late", now).is_err_and(|e| e.is_lease_lost()));
        assert!(fail_retryable(Some(&rec2), &stale, "x", now).is_err_and(|e| e.is_lease_lost()));
        assert!(fail_permanent(Some(&rec2), &stale, "x", now).is_err_and(|e| e.is_lease_lost()));
        assert!(extend(Some(&rec2), &stale, now).is_err_and(|e| e.is_lease_lost()));
        assert!(extend(None, &stale, now).is_err_and(|e| e.is_lease_lost()));
    }

    #[test]
    fn a_completed_key_cannot_be_completed_again() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        let done = complete(Some(&rec), &lease, b"ok", T0).expect("complete");
        assert!(complete(Some(&done), &lease, b"again", T0).is_err_and(|e| e.is_lease_lost()));
    }

    #[test]
    fn retryable_failures_release_then_exhaust_into_failed() {
        let mut rec = None;
        for attempt in 1..=3u32 {
            let (r, lease) = acquired(claim(rec.as_ref(), &req("a"), T0, tok(u64::from(attempt))));
            assert_eq!(r.attempts, attempt);
            let (after_rec, after) = fail_retryable(Some(&r), &lease, "timeout", T0).expect("fail");
            if attempt < 3 {
                assert_eq!(after, AfterFailure::Released { attempts: attempt });
                assert_eq!(after_rec.state, State::Released);
                assert_eq!(after_rec.failure.as_deref(), Some("timeout"));
            } else {
                assert_eq!(after, AfterFailure::Failed { attempts: 3 });
                assert_eq!(after_rec.state, State::Failed);
                assert_eq!(after_rec.expires_at, T0.plus(secs(1000)));
            }
            rec = Some(after_rec);
        }
        match claim(rec.as_ref(), &req("b"), T0, tok(99)).outcome() {
            ClaimOutcome::Failed { reason, attempts } => {
                assert_eq!(attempts, 3);
                assert!(reason.contains("timeout"), "{reason}");
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[test]
    fn a_lease_that_keeps_expiring_exhausts_the_attempts() {
        let mut rec = None;
        let mut now = T0;
        for n in 1..=3u64 {
            let (r, _) = acquired(claim(rec.as_ref(), &req("a"), now, tok(n)));
            rec = Some(r);
            now = now.plus(secs(11));
        }
        let step = claim(rec.as_ref(), &req("b"), now, || panic!("no token"));
        let ClaimStep::Exhaust { record } = &step else {
            panic!("expected Exhaust, got {step:?}");
        };
        assert_eq!(record.state, State::Failed);
        assert!(
            record
                .failure
                .as_deref()
                .is_some_and(|f| f.contains("lease expired"))
        );
        assert!(matches!(
            step.outcome(),
            ClaimOutcome::Failed { attempts: 3, .. }
        ));
    }

    #[test]
    fn fail_permanent_makes_the_key_poison() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        let failed = fail_permanent(Some(&rec), &lease, "bad amount", T0).expect("fail");
        assert_eq!(failed.state, State::Failed);
        assert_eq!(
            claim(Some(&failed), &req("b"), T0, tok(2)).outcome(),
            ClaimOutcome::Failed {
                reason: "bad amount".into(),
                attempts: 1
            }
        );
    }

    #[test]
    fn extend_moves_the_lease_from_now() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        let later = T0.plus(secs(8));
        let ext = extend(Some(&rec), &lease, later).expect("extend");
        assert_eq!(ext.lease_until, Some(later.plus(secs(10))));
        assert!(ext.expires_at >= later.plus(secs(110)));
        assert!(matches!(
            claim(Some(&ext), &req("b"), T0.plus(secs(15)), tok(2)).outcome(),
            ClaimOutcome::InFlight { .. }
        ));
    }

    #[test]
    fn a_different_payload_is_a_mismatch_in_every_state() {
        let other = req("b").with_fingerprint(Some(Fingerprint::of(b"other")));
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        assert_eq!(
            claim(Some(&rec), &other, T0, tok(2)).outcome(),
            ClaimOutcome::PayloadMismatch
        );
        let done = complete(Some(&rec), &lease, b"ok", T0).expect("complete");
        assert_eq!(
            claim(Some(&done), &other, T0, tok(2)).outcome(),
            ClaimOutcome::PayloadMismatch
        );
        let unchecked = req("c").with_fingerprint(None);
        assert!(matches!(
            claim(Some(&done), &unchecked, T0, tok(2)).outcome(),
            ClaimOutcome::Completed { .. }
        ));
    }

    #[test]
    fn a_record_past_retention_is_absent() {
        let (rec, lease) = acquired(claim(None, &req("a"), T0, tok(1)));
        let done = complete(Some(&rec), &lease, b"ok", T0).expect("complete");
        let after = T0.plus(secs(100));
        assert!(purgeable(&done, after));
        let (fresh, _) = acquired(claim(Some(&done), &req("b"), after, tok(5)));
        assert_eq!(fresh.attempts, 1);
        assert_eq!(fresh.created_at, after);
        assert_eq!(fresh.result, None);
    }

    #[test]
    fn an_oversized_result_is_refused_before_the_fence() {
        let policy = req("a").policy.with_max_result_bytes(4);
        let (rec, lease) = acquired(claim(None, &req("a").with_policy(policy), T0, tok(1)));
        let err = complete(Some(&rec), &lease, b"12345", T0).expect_err("too large");
        assert!(matches!(
            err,
            StoreError::Input(crate::InputError::ResultTooLarge { len: 5, max: 4 })
        ));
        assert!(!err.is_retryable());
    }
}
