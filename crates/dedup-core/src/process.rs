//! The API a consumer calls: [`Dedup::process`], and [`Dedup::process_batch`] (in `batch.rs`).

mod batch;
mod heartbeat;
mod instance;

pub use batch::BatchItem;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::process;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use tokio::time::{Instant, sleep};
use tracing::{Instrument, debug, info_span, warn};

use crate::error::{InputError, StoreError};
use crate::key::{Fingerprint, IdempotencyKey};
use crate::record::{
    AfterFailure, ClaimOutcome, ClaimRequest, FencingToken, Lease, OwnerId, Policy, State,
    Timestamp,
};
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
    owner_prefix: Arc<str>,
    /// The stable identity, if configured (`with_instance`).
    instance: Option<crate::InstanceId>,
    claims: AtomicU64,
    /// The leases of this instance's running batches, extended together.
    beats: heartbeat::Heartbeats,
}

/// What [`Dedup::process`] did.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Processed {
    /// The handler ran, and its result is stored.
    Executed {
        /// The handler's result.
        result: Bytes,
        /// The token it ran under.
        token: FencingToken,
        /// Which attempt it was.
        attempts: u32,
    },
    /// The key was done before: the stored result, the handler did not run.
    Replayed {
        /// The stored result.
        result: Bytes,
    },
}

impl Processed {
    /// The result, fresh or replayed.
    pub fn result(&self) -> &Bytes {
        match self {
            Self::Executed { result, .. } | Self::Replayed { result } => result,
        }
    }

    /// Whether the handler ran in this call.
    pub fn executed(&self) -> bool {
        matches!(self, Self::Executed { .. })
    }
}

/// What a handler returns when it succeeds.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Completion {
    /// Store this result and mark the key COMPLETED (lease mode).
    Store(Bytes),
    /// The handler already completed the key with its lease inside its own database transaction,
    /// and that transaction committed (transactional mode). The result is what it stored.
    Committed(Bytes),
}

impl Completion {
    /// Lease mode: dedup stores `result` after the handler returns.
    pub fn store(result: impl Into<Bytes>) -> Self {
        Self::Store(result.into())
    }

    /// Transactional mode: the handler's transaction completed the key and committed.
    pub fn committed(result: impl Into<Bytes>) -> Self {
        Self::Committed(result.into())
    }
}

/// How a handler failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerError<E> {
    /// A passing failure: the key is released (attempts kept) for a later delivery, or marked
    /// FAILED once its attempts are used up.
    Retryable(E),
    /// This message can never succeed: the key is marked FAILED (poison).
    Permanent(E),
    /// Nothing the handler did needs keeping, and no attempt should be spent: the key is given
    /// back as [`Store::withdraw`] does (a first attempt's record goes, as if never claimed). For
    /// outcomes the caller chose not to store (the HTTP layer's unstored responses, say).
    Withdraw(E),
    /// The handler's own call to the store failed (transactional mode: completing inside its
    /// transaction, or the commit).
    Store(StoreError),
}

impl<E> HandlerError<E> {
    /// The same failure with the handler's error mapped by `f`.
    pub fn map_err<F>(self, f: impl FnOnce(E) -> F) -> HandlerError<F> {
        match self {
            Self::Retryable(e) => HandlerError::Retryable(f(e)),
            Self::Permanent(e) => HandlerError::Permanent(f(e)),
            Self::Withdraw(e) => HandlerError::Withdraw(f(e)),
            Self::Store(e) => HandlerError::Store(e),
        }
    }
}

impl<E> From<StoreError> for HandlerError<E> {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// Why [`Dedup::process`] did not produce a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// Another holder runs the key and did not finish within the wait. Retry later.
    #[error("{key} is being processed by {} (lease until {lease_until:?})", owner.as_ref().map_or("another holder", |o| o.as_str()))]
    InFlight {
        /// The key.
        key: IdempotencyKey,
        /// The holder, where known.
        owner: Option<OwnerId>,
        /// The end of its lease, where known.
        lease_until: Option<Timestamp>,
    },
    /// The key is poison. Do not retry; dead-letter the message.
    #[error("{key} failed permanently after {attempts} attempt(s): {reason}")]
    Failed {
        /// The key.
        key: IdempotencyKey,
        /// Why.
        reason: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The key was used before with a different payload. Do not retry.
    #[error("{key} was used before with a different payload")]
    PayloadMismatch {
        /// The key.
        key: IdempotencyKey,
    },
    /// The handler failed; `after` says where that left the key.
    #[error("the handler failed on {key} ({after}): {source}")]
    Handler {
        /// The key.
        key: IdempotencyKey,
        /// The handler's error.
        #[source]
        source: E,
        /// Where the key stands now.
        after: AfterHandlerError,
    },
    /// The handler panicked. The panic was caught and counted as a retryable failure (its attempt
    /// counts); `after` says where that left the key.
    #[error("handler panicked: {message} (on {key}, {after})")]
    Panicked {
        /// The key.
        key: IdempotencyKey,
        /// The panic's message.
        message: String,
        /// Where the key stands now.
        after: AfterHandlerError,
    },
    /// The lease was taken over before the completion: another holder owns the key now, and this
    /// call's completion was refused. A redelivery will replay the other holder's result.
    #[error("lease lost on {key} (token {token})")]
    LeaseLost {
        /// The key.
        key: IdempotencyKey,
        /// The stale token.
        token: FencingToken,
    },
    /// The store failed.
    #[error(transparent)]
    Store(StoreError),
    /// The key is done, but its stored result does not decode into the type asked for
    /// ([`Dedup::process_typed`]): the type changed between deployments, or the codec cannot read
    /// it back. The handler does not run again. Do not retry; dead-letter the message.
    #[error("the stored result of {key} cannot be used: {source}")]
    Undecodable {
        /// The key.
        key: IdempotencyKey,
        /// Which check failed.
        #[source]
        source: crate::typed::CodecError,
    },
}

/// Where a handler's failure left its key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum AfterHandlerError {
    /// Released for a later delivery.
    Released {
        /// Attempts made so far.
        attempts: u32,
    },
    /// FAILED: permanent, or out of attempts.
    Failed {
        /// Attempts made.
        attempts: u32,
    },
    /// The store could not record the failure; the lease will expire and the key be taken over.
    Unrecorded,
}

impl fmt::Display for AfterHandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Released { attempts } => write!(f, "released after attempt {attempts}"),
            Self::Failed { attempts } => write!(f, "failed after {attempts} attempt(s)"),
            Self::Unrecorded => f.write_str("failure not recorded; the lease will expire"),
        }
    }
}

impl<E> ProcessError<E> {
    /// Whether delivering the same message again later can lead to a result.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InFlight { .. } | Self::LeaseLost { .. } => true,
            Self::Failed { .. } | Self::PayloadMismatch { .. } | Self::Undecodable { .. } => false,
            Self::Handler { after, .. } | Self::Panicked { after, .. } => {
                !matches!(after, AfterHandlerError::Failed { .. })
            }
            Self::Store(e) => e.is_retryable(),
        }
    }
}

/// What a handler gets: its lease, and whether the heartbeat has seen it taken over.
#[derive(Clone, Debug)]
pub struct LeaseContext {
    lease: Lease,
    lost: Arc<AtomicBool>,
}

impl LeaseContext {
    /// The lease: pass it to a transactional completion (`complete_in`).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Whether the heartbeat found the lease taken over. A handler about to do something
    /// irreversible outside the database checks this first; its completion will be refused anyway.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

impl<S: Store> Dedup<S> {
    /// Wraps a store, with the default [`Policy`] and a 5 s in-flight wait.
    pub fn new(store: S) -> Self {
        Self {
            store,
            policy: Policy::default(),
            in_flight_wait: Duration::from_secs(5),
            completion_deadline: None,
            owner_prefix: format!("pid{}-{:x}", process::id(), Timestamp::now().as_micros()).into(),
            instance: None,
            claims: AtomicU64::new(0),
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
        self.owner_prefix = prefix.into();
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
        let n = self.claims.fetch_add(1, Ordering::Relaxed);
        OwnerId::new(format!("{}#{n}", self.owner_prefix))
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
            match self.store.get(&req.key).await {
                Ok(Some(r))
                    if r.state == State::InProgress && r.owner.as_ref() == Some(&req.owner) =>
                {
                    // Ours. Its lease may have been granted a while ago (the lost reply, a wait on
                    // a lock), so it is extended from now before it is used: the fence says
                    // whether it is still ours at all.
                    let mut lease = Lease::granted(&r, req);
                    match self.store.extend(&lease).await {
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

    async fn run<F, Fut, E>(
        &self,
        lease: Lease,
        sent: Instant,
        handler: F,
    ) -> Result<Processed, ProcessError<E>>
    where
        F: FnOnce(LeaseContext) -> Fut,
        Fut: Future<Output = Result<Completion, HandlerError<E>>>,
        E: fmt::Display,
    {
        let ctx = LeaseContext {
            lease: lease.clone(),
            lost: Arc::new(AtomicBool::new(false)),
        };
        let lost = Arc::clone(&ctx.lost);
        let granted = Granted(Mutex::new(sent + lease.policy.lease));
        let beat = self.heartbeat(&lease, &lost, &granted);
        tokio::pin!(beat);
        let outcome = {
            // A panicking handler must not leave its key held, nor stop its caller's loop.
            let work = AssertUnwindSafe(async move { handler(ctx).await }).catch_unwind();
            tokio::pin!(work);
            tokio::select! {
                biased;
                out = &mut work => out,
                never = &mut beat => match never {},
            }
        };
        let executed = |result: Bytes| Processed::Executed {
            result,
            token: lease.token,
            attempts: lease.attempts,
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(panic) => return Err(self.panicked(&lease, panic_message(&*panic)).await),
        };
        match outcome {
            Ok(Completion::Store(result)) => {
                // The effect ran: keep the lease alive while the completion is recorded.
                let done = {
                    let done = self.complete_resolved(&lease, &result, &lost, &granted);
                    tokio::pin!(done);
                    tokio::select! {
                        biased;
                        done = &mut done => done,
                        never = &mut beat => match never {},
                    }
                };
                match done {
                    Ok(()) => Ok(executed(result)),
                    Err(StoreError::Input(e)) => {
                        // The effect ran, but its result cannot be stored. Releasing the key
                        // would run the effect again; FAILED keeps it at one and says why.
                        let reason = format!("the effect ran but its result was refused: {e}");
                        let _ = self.store.fail_permanent(&lease, &reason).await;
                        Err(ProcessError::Store(StoreError::Input(e)))
                    }
                    Err(e) => Err(self.lease_error(&lease, e)),
                }
            }
            Ok(Completion::Committed(result)) => {
                self.store.committed(&lease, &result).await;
                Ok(executed(result))
            }
            Err(e) => self.recorded_failure(&lease, e).await,
        }
    }

    /// Records a handler's failure on its key (released, FAILED, given back, or resolved from
    /// the store for the handler's own store call), and answers it.
    async fn recorded_failure<E: fmt::Display>(
        &self,
        lease: &Lease,
        error: HandlerError<E>,
    ) -> Result<Processed, ProcessError<E>> {
        match error {
            HandlerError::Retryable(source) => {
                let after = match self.store.fail_retryable(lease, &source.to_string()).await {
                    Ok(AfterFailure::Released { attempts }) => {
                        AfterHandlerError::Released { attempts }
                    }
                    Ok(AfterFailure::Failed { attempts }) => AfterHandlerError::Failed { attempts },
                    Err(e) => return Err(self.unrecorded(lease, e, source)),
                };
                Err(ProcessError::Handler {
                    key: lease.key.clone(),
                    source,
                    after,
                })
            }
            HandlerError::Permanent(source) => {
                match self.store.fail_permanent(lease, &source.to_string()).await {
                    Ok(()) => Err(ProcessError::Handler {
                        key: lease.key.clone(),
                        source,
                        after: AfterHandlerError::Failed {
                            attempts: lease.attempts,
                        },
                    }),
                    Err(e) => Err(self.unrecorded(lease, e, source)),
                }
            }
            HandlerError::Withdraw(source) => {
                let after = match self.store.withdraw(lease).await {
                    Ok(()) => AfterHandlerError::Released {
                        attempts: lease.attempts.saturating_sub(1),
                    },
                    Err(e) => return Err(self.unrecorded(lease, e, source)),
                };
                Err(ProcessError::Handler {
                    key: lease.key.clone(),
                    source,
                    after,
                })
            }
            HandlerError::Store(e) => self.handler_store_error(lease, e).await,
        }
    }

    /// The handler's own store call failed (transactional mode).
    async fn handler_store_error<E>(
        &self,
        lease: &Lease,
        e: StoreError,
    ) -> Result<Processed, ProcessError<E>> {
        if e.is_outcome_unknown() {
            // Did its transaction commit the completion? The record says.
            for _ in 0..RESOLVE_TRIES {
                match self.store.get(&lease.key).await {
                    Ok(Some(r)) if r.token == lease.token && r.state == State::Completed => {
                        let result = r.result.unwrap_or_default();
                        self.store.committed(lease, &result).await;
                        return Ok(Processed::Executed {
                            result,
                            token: lease.token,
                            attempts: lease.attempts,
                        });
                    }
                    Ok(_) => break,
                    Err(_) => sleep(Duration::from_millis(50)).await,
                }
            }
        }
        match &e {
            StoreError::LeaseLost { .. } => {}
            StoreError::Input(_) => {
                // Its transaction rolled back, and a retry would fail the same way.
                let _ = self.store.fail_permanent(lease, &e.to_string()).await;
            }
            _ if e.is_retryable() => {
                // A passing error (a failover, a statement timeout) rolled its transaction back:
                // nothing ran. Give the key back without spending an attempt, so that passing
                // errors alone can never exhaust a healthy message into the dead-letter topic.
                let _ = self.store.withdraw(lease).await;
            }
            _ => {
                // Its transaction rolled back: nothing ran. Release the key for a later delivery.
                let _ = self.store.fail_retryable(lease, &e.to_string()).await;
            }
        }
        Err(self.lease_error(lease, e))
    }

    fn lease_error<E>(&self, lease: &Lease, e: StoreError) -> ProcessError<E> {
        if e.is_lease_lost() {
            warn!(key = %lease.key, token = lease.token.get(), "lease lost: another holder owns the key");
            ProcessError::LeaseLost {
                key: lease.key.clone(),
                token: lease.token,
            }
        } else {
            ProcessError::Store(e)
        }
    }

    fn unrecorded<E>(&self, lease: &Lease, e: StoreError, source: E) -> ProcessError<E> {
        if e.is_lease_lost() {
            return self.lease_error(lease, e);
        }
        warn!(key = %lease.key, error = %e, "could not record the handler's failure");
        ProcessError::Handler {
            key: lease.key.clone(),
            source,
            after: AfterHandlerError::Unrecorded,
        }
    }

    /// Records a caught panic as a retryable failure of the handler.
    async fn panicked<E>(&self, lease: &Lease, message: String) -> ProcessError<E> {
        warn!(key = %lease.key, token = lease.token.get(), message, "handler panicked");
        let after = match self
            .store
            .fail_retryable(lease, &format!("handler panicked: {message}"))
            .await
        {
            Ok(AfterFailure::Released { attempts }) => AfterHandlerError::Released { attempts },
            Ok(AfterFailure::Failed { attempts }) => AfterHandlerError::Failed { attempts },
            Err(e) if e.is_lease_lost() => return self.lease_error(lease, e),
            Err(e) => {
                warn!(key = %lease.key, error = %e, "could not record the handler's panic");
                AfterHandlerError::Unrecorded
            }
        };
        ProcessError::Panicked {
            key: lease.key.clone(),
            message,
            after,
        }
    }

    /// Completes, after the handler ran. A passing error is retried with backoff (the heartbeat
    /// keeps the lease alive meanwhile) until the completion lands, the lease is lost (fenced),
    /// the last end the store granted has passed, or the caller's completion deadline has: until
    /// then no one else can run the key, so giving up sooner would risk a second effect for
    /// nothing. An unknown outcome is read back: COMPLETED under our token means it landed.
    async fn complete_resolved(
        &self,
        lease: &Lease,
        result: &[u8],
        lost: &AtomicBool,
        granted: &Granted,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut tries = 0u32;
        loop {
            tries += 1;
            let err = match self.store.complete(lease, result).await {
                Ok(()) => return Ok(()),
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => e,
            };
            if err.is_outcome_unknown() {
                warn!(key = %lease.key, error = %err, "completion outcome unknown; reading it back");
                if let Ok(Some(r)) = self.store.get(&lease.key).await {
                    if r.token == lease.token && r.state == State::Completed {
                        return Ok(());
                    }
                    if r.token != lease.token || r.state != State::InProgress {
                        return Err(StoreError::LeaseLost {
                            key: lease.key.clone(),
                            token: lease.token,
                        });
                    }
                }
            }
            if lost.load(Ordering::Acquire) {
                return Err(StoreError::LeaseLost {
                    key: lease.key.clone(),
                    token: lease.token,
                });
            }
            let mut give_up = granted.until();
            if let Some(d) = self.completion_deadline {
                give_up = give_up.min(started + d);
            }
            let now = Instant::now();
            if now >= give_up {
                warn!(key = %lease.key, error = %err, tries, "completion not recorded before the lease ran out; giving up");
                return Err(err);
            }
            warn!(key = %lease.key, error = %err, tries, "completion failed; retrying");
            sleep(backoff.min(give_up - now)).await;
            backoff = (backoff * 2).min(COMPLETE_BACKOFF_MAX);
        }
    }

    /// Extends the lease every third of its length until it is lost; never returns. A failed
    /// extension is tried again sooner, every twelfth of the lease.
    async fn heartbeat(
        &self,
        lease: &Lease,
        lost: &AtomicBool,
        granted: &Granted,
    ) -> std::convert::Infallible {
        let every = (lease.policy.lease / 3).max(Duration::from_millis(1));
        let mut wait = every;
        loop {
            sleep(wait).await;
            let sent = Instant::now();
            match self.store.extend(lease).await {
                Ok(until) => {
                    granted.extended(sent + lease.policy.lease);
                    wait = every;
                    debug!(key = %lease.key, until = until.as_micros(), "lease extended");
                }
                Err(e) if e.is_lease_lost() => {
                    warn!(key = %lease.key, token = lease.token.get(), "heartbeat found the lease taken over");
                    lost.store(true, Ordering::Release);
                    return std::future::pending().await;
                }
                Err(e) => {
                    wait = (every / 4).max(Duration::from_millis(1));
                    warn!(key = %lease.key, error = %e, "heartbeat failed; retrying");
                }
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
