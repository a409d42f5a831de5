//! The API a consumer calls: [`Dedup::process`], and [`Dedup::process_batch`] (in `batch.rs`).
//!
//! `process` claims (waiting out a live lease up to a bound; `Dedup::try_process` does not wait
//! and answers `ProcessError::InFlight` at once, for a caller that waits its own way), runs the
//! handler beside a heartbeat, completes or records the failure, and resolves unknown outcomes.
//! Each call is a `dedup.process` span (key, token, outcome). Settings that could overflow the
//! clock are refused (`InputError::Setting`, `MAX_WAIT`).
//!
//! Here: `Dedup`, its settings and the claim. `outcome.rs` holds `Processed`, `Completion`,
//! `HandlerError`, `ProcessError` and `LeaseContext`; `run.rs` one acquired key's run;
//! `instance.rs` identities and adoption; `batch.rs` and `heartbeat.rs` lease mode by the batch.
//!
//! What lease mode cannot promise: an effect outside the database (an API call, an e-mail) that
//! ran, but whose completion could not be recorded before the lease ran out (the process was
//! paused past its lease, or the store stayed unreachable), runs again after the takeover. The
//! heartbeat makes this rare, the fence keeps the late completion out, and `LeaseContext::is_lost`
//! lets a handler check before its irreversible step; only transaction mode makes database
//! effects exactly-once.

mod batch;
mod heartbeat;
mod instance;
mod outcome;
mod run;

pub use batch::BatchItem;
pub use outcome::{
    AfterHandlerError, Completion, HandlerError, LeaseContext, ProcessError, Processed,
};

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, sleep};
use tracing::{Instrument, info_span, warn};

use crate::error::{InputError, StoreError};
use crate::key::{Fingerprint, IdempotencyKey};
use crate::record::{ClaimOutcome, ClaimRequest, Lease, OwnerId, OwnerIds, Policy, State};
use crate::store::Store;

/// How many times a call whose outcome is unknown, or whose backend is briefly unavailable, is
/// read back and tried again before the error is passed up.
const RESOLVE_TRIES: u32 = 5;

/// The longest wait a [`Dedup`] setting may hold (a week): beyond any sensible value, and far
/// inside what the clock can add without overflowing.
pub const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest pause between two tries to record a completion.
const COMPLETE_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Runs each key's effect once, and replays its result to every duplicate.
///
/// `process` claims the key, runs the handler while a heartbeat extends the lease, and completes
/// the key with the handler's result. Duplicates get the stored result without running the
/// handler. A duplicate that arrives while another holder runs the key waits (up to
/// [`with_in_flight_wait`](Self::with_in_flight_wait)) for that holder to finish.
#[derive(Debug)]
pub struct Dedup<S> {
    store: S,
    policy: Policy,
    in_flight_wait: Duration,
    completion_deadline: Option<Duration>,
    /// The stable identity, if configured (`with_instance`).
    instance: Option<crate::InstanceId>,
    /// The owner ids claims are made under.
    owners: OwnerIds,
    /// The leases of this instance's running batches, extended together.
    beats: heartbeat::Heartbeats,
}

impl<S: Store> Dedup<S> {
    /// Wraps a store, with the default [`Policy`] and a 5 s in-flight wait.
    pub fn new(store: S) -> Self {
        Self {
            store,
            policy: Policy::default(),
            in_flight_wait: Duration::from_secs(5),
            completion_deadline: None,
            instance: None,
            owners: OwnerIds::for_process(),
            beats: heartbeat::Heartbeats::default(),
        }
    }

    /// Sets the policy every claim uses.
    pub fn with_policy(mut self, policy: Policy) -> Result<Self, InputError> {
        policy.validate()?;
        self.policy = policy;
        Ok(self)
    }

    /// How long a duplicate waits for another holder's live lease before answering
    /// [`ProcessError::InFlight`]. Zero answers at once. Longer than [`MAX_WAIT`] is refused.
    pub fn with_in_flight_wait(mut self, wait: Duration) -> Result<Self, InputError> {
        if wait > MAX_WAIT {
            return Err(InputError::Setting {
                setting: "in_flight_wait",
                problem: "longer than a week (MAX_WAIT)",
            });
        }
        self.in_flight_wait = wait;
        Ok(self)
    }

    /// How long, at most, dedup keeps trying to record a completion after the handler returned.
    ///
    /// By default it keeps trying (with backoff, while the heartbeat keeps extending the lease)
    /// until the lease is really lost (taken over: fenced) or the last end the store granted has
    /// passed, since until then no one else can run the key. A shorter deadline gives up sooner,
    /// and the effect may then run again after the lease lapses. Longer than [`MAX_WAIT`] is
    /// refused.
    pub fn with_completion_deadline(mut self, deadline: Duration) -> Result<Self, InputError> {
        if deadline > MAX_WAIT {
            return Err(InputError::Setting {
                setting: "completion_deadline",
                problem: "longer than a week (MAX_WAIT)",
            });
        }
        self.completion_deadline = Some(deadline);
        Ok(self)
    }

    /// Names this instance in owner ids (a host or pod name helps an operator); the default is the
    /// process id.
    pub fn with_owner_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.owners = OwnerIds::with_prefix(prefix);
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The stable identity, if configured.
    pub fn instance(&self) -> Option<&crate::InstanceId> {
        self.instance.as_ref()
    }

    fn next_owner(&self) -> OwnerId {
        self.owners.next()
    }

    /// The claim request [`process`](Self::process) would make for `key`: this engine's policy
    /// and its next owner id. For a path that claims on its own (a key claimed inside the
    /// transaction that completes it) and records what becomes of it through [`store`](Self::store).
    pub fn claim_request(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
    ) -> ClaimRequest {
        ClaimRequest::new(key.clone(), self.next_owner())
            .with_fingerprint(fingerprint)
            .with_policy(self.policy)
    }

    /// How long a duplicate waits for another holder before answering InFlight
    /// ([`with_in_flight_wait`](Self::with_in_flight_wait)).
    pub fn in_flight_wait(&self) -> Duration {
        self.in_flight_wait
    }

    /// Runs `handler` for `key` once; replays the stored result to duplicates.
    ///
    /// `fingerprint` (usually [`Fingerprint::of`] the payload) makes a reuse of the key with a
    /// different payload answer [`ProcessError::PayloadMismatch`]; `None` skips that check.
    pub async fn process<F, Fut, E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed, ProcessError<E>>
    where
        F: FnOnce(LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        self.process_waiting(key, fingerprint, self.in_flight_wait, handler)
            .await
    }

    /// [`process`](Self::process) without waiting for another holder: a key whose live lease is
    /// someone else's answers [`ProcessError::InFlight`] at once, with the lease's end. For
    /// callers that wait their own way: a consumer that sets the message aside and lets other
    /// keys run meanwhile.
    pub async fn try_process<F, Fut, E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed, ProcessError<E>>
    where
        F: FnOnce(LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        self.process_waiting(key, fingerprint, Duration::ZERO, handler)
            .await
    }

    async fn process_waiting<F, Fut, E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        wait: Duration,
        handler: F,
    ) -> Result<Processed, ProcessError<E>>
    where
        F: FnOnce(LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        let span = info_span!("dedup.process", key = %key, outcome = tracing::field::Empty, token = tracing::field::Empty);
        async move {
            let (lease, sent) = match self.claim_waiting(key, fingerprint, wait).await? {
                Claimed::Lease(lease, sent) => (lease, sent),
                Claimed::Replay(result) => {
                    tracing::Span::current().record("outcome", "replayed");
                    return Ok(Processed::Replayed { result });
                }
            };
            tracing::Span::current().record("token", lease.token.get());
            let out = self.run(lease, sent, handler).await;
            tracing::Span::current().record(
                "outcome",
                match &out {
                    Ok(_) => "executed",
                    Err(ProcessError::LeaseLost { .. }) => "lease_lost",
                    Err(ProcessError::Handler { .. }) => "handler_error",
                    Err(ProcessError::Panicked { .. }) => "handler_panicked",
                    Err(_) => "error",
                },
            );
            out
        }
        .instrument(span)
        .await
    }

    async fn claim_waiting<E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        wait: Duration,
    ) -> Result<Claimed, ProcessError<E>> {
        let deadline = Instant::now() + wait;
        let mut backoff = Duration::from_millis(5);
        loop {
            let req = ClaimRequest::new(key.clone(), self.next_owner())
                .with_fingerprint(fingerprint)
                .with_policy(self.policy);
            // The lease cannot have started before the request left: its end, counted from here
            // on this process's clock, is never later than the store's.
            let sent = Instant::now();
            match self
                .claim_resolved(&req)
                .await
                .map_err(ProcessError::Store)?
            {
                ClaimOutcome::Acquired(lease) => return Ok(Claimed::Lease(lease, sent)),
                ClaimOutcome::Completed { result, .. } => return Ok(Claimed::Replay(result)),
                ClaimOutcome::Failed { reason, attempts } => {
                    return Err(ProcessError::Failed {
                        key: key.clone(),
                        reason,
                        attempts,
                    });
                }
                ClaimOutcome::PayloadMismatch => {
                    return Err(ProcessError::PayloadMismatch { key: key.clone() });
                }
                ClaimOutcome::InFlight { owner, lease_until } => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(ProcessError::InFlight {
                            key: key.clone(),
                            owner,
                            lease_until,
                        });
                    }
                    sleep(backoff.min(deadline - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
            }
        }
    }

    /// Claims; a claim whose outcome is unknown is read back: if the record holds our owner id
    /// (one per claim attempt) the claim landed and its lease is ours, otherwise the claim is made
    /// again. A retried claim that finds our own owner id in flight adopts that lease too, rather
    /// than waiting it out.
    async fn claim_resolved(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_resolved_as(req, false).await
    }

    /// [`claim_resolved`](Self::claim_resolved), told whether an earlier claim of `req` may
    /// have landed without its answer (then our own owner id in flight is adopted at once).
    async fn claim_resolved_as(
        &self,
        req: &ClaimRequest,
        unknown: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        let mut tries = 0;
        let mut unknown = unknown;
        loop {
            tries += 1;
            let outcome = match self.store.claim(req).await {
                Err(e) if e.is_outcome_unknown() && tries < RESOLVE_TRIES => {
                    warn!(key = %req.key, error = %e, "claim outcome unknown; reading it back");
                    unknown = true;
                    None
                }
                Ok(ClaimOutcome::InFlight { owner: Some(o), .. }) if unknown && o == req.owner => {
                    None
                }
                other => Some(other),
            };
            if let Some(outcome) = outcome {
                return outcome;
            }
            // Boxed (a rare path): an inline store call would enlarge every message's future.
            match Box::pin(self.store.get(&req.key)).await {
                Ok(Some(r))
                    if r.state == State::InProgress && r.owner.as_ref() == Some(&req.owner) =>
                {
                    // Ours. Its lease may have been granted a while ago (the lost reply, a wait on
                    // a lock), so it is extended from now before it is used: the fence says
                    // whether it is still ours at all.
                    let mut lease = Lease::granted(&r, req);
                    match Box::pin(self.store.extend(&lease)).await {
                        Ok(until) => {
                            lease.lease_until = until;
                            return Ok(ClaimOutcome::Acquired(lease));
                        }
                        // Taken over meanwhile: claim again, which answers from the new holder.
                        Err(e) if e.is_lease_lost() => unknown = false,
                        Err(e) if e.is_retryable() && tries < RESOLVE_TRIES => {
                            sleep(Duration::from_millis(20 * u64::from(tries))).await;
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(_) => {}
                Err(e) if e.is_retryable() && tries < RESOLVE_TRIES => {
                    sleep(Duration::from_millis(20 * u64::from(tries))).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

enum Claimed {
    /// A lease, and when the claim that granted it was sent.
    Lease(Lease, Instant),
    Replay(Bytes),
}

/// The latest end of a lease that the store is known to have granted, on this process's clock
/// (counted from when the granting request was sent, so never later than the store's end).
struct Granted(Mutex<Instant>);

impl Granted {
    fn new(until: Instant) -> Self {
        Self(Mutex::new(until))
    }

    fn until(&self) -> Instant {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn extended(&self, until: Instant) {
        let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        *g = (*g).max(until);
    }
}

/// A panic's message, where it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[test]
    fn waits_too_long_for_the_clock_are_refused_by_name() {
        let too_long = MAX_WAIT + Duration::from_secs(1);
        for (setting, result) in [
            (
                "in_flight_wait",
                Dedup::new(MemoryStore::new()).with_in_flight_wait(too_long),
            ),
            (
                "in_flight_wait",
                Dedup::new(MemoryStore::new()).with_in_flight_wait(Duration::MAX),
            ),
            (
                "completion_deadline",
                Dedup::new(MemoryStore::new()).with_completion_deadline(Duration::MAX),
            ),
        ] {
            match result {
                Err(InputError::Setting { setting: named, .. }) => assert_eq!(named, setting),
                other => panic!("{setting}: expected a Setting error, got {other:?}"),
            }
        }
        assert!(
            Dedup::new(MemoryStore::new())
                .with_in_flight_wait(MAX_WAIT)
                .is_ok()
        );
    }
}
