//! One acquired key's run: the handler under a heartbeat, its failure recorded (or, when the
//! store cannot say, resolved by reading the truth back), and its completion.
//!
//! A handler that panics is caught (`ProcessError::Panicked`) and counts as a retryable failure.
//! After the handler ran, the heartbeat goes on while the completion is retried with backoff
//! until it lands, the lease is lost, or the last lease end the store granted has passed (counted
//! on this process's clock from when the granting request left, so never later than the store's);
//! `with_completion_deadline` may stop sooner. A handler's own store call that failed for a
//! passing reason gives its key back with `withdraw` (no attempt spent: nothing ran), and so does
//! `HandlerError::Withdraw` (an outcome the caller chose not to keep).

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use tokio::time::{Instant, sleep};
use tracing::{debug, warn};

use super::outcome::{
    AfterHandlerError, Completion, HandlerError, LeaseContext, ProcessError, Processed,
};
use super::{COMPLETE_BACKOFF_MAX, Dedup, Granted, RESOLVE_TRIES, panic_message};
use crate::error::StoreError;
use crate::record::{AfterFailure, Lease, State};
use crate::store::Store;

impl<S: Store> Dedup<S> {
    pub(super) async fn run<F, Fut, E>(
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
            Err(panic) => {
                return Err(Box::pin(self.panicked(&lease, panic_message(&*panic))).await);
            }
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
                        let _ = Box::pin(self.store.fail_permanent(&lease, &reason)).await;
                        Err(ProcessError::Store(StoreError::Input(e)))
                    }
                    Err(e) => Err(self.lease_error(&lease, e)),
                }
            }
            Ok(Completion::Committed(result)) => {
                self.store.committed(&lease, &result).await;
                Ok(executed(result))
            }
            // Boxed, as every rare path here: a store call's future can be as large as a
            // Postgres call's (~15 KB with sqlx), and an inline one makes every message's
            // future that much larger, allocated and copied per message whatever path it takes.
            Err(e) => Box::pin(self.recorded_failure(&lease, e)).await,
        }
    }

    /// Records a handler's failure on its key (released, FAILED, given back, or resolved from
    /// the store for the handler's own store call), and answers it.
    pub(super) async fn recorded_failure<E: fmt::Display>(
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
    pub(super) async fn handler_store_error<E>(
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

    pub(super) fn lease_error<E>(&self, lease: &Lease, e: StoreError) -> ProcessError<E> {
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

    pub(super) fn unrecorded<E>(&self, lease: &Lease, e: StoreError, source: E) -> ProcessError<E> {
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
    pub(super) async fn panicked<E>(&self, lease: &Lease, message: String) -> ProcessError<E> {
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
    pub(super) async fn complete_resolved(
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
                if let Ok(Some(r)) = Box::pin(self.store.get(&lease.key)).await {
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
    pub(super) async fn heartbeat(
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
            // Boxed: the heartbeat lives beside the completion, and an inline store call
            // would double the size of every message's future.
            match Box::pin(self.store.extend(lease)).await {
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
