//! What every runner calls: the per-message [`Handler`] and how its answers are read (a
//! withdrawal counted as a retry, the attempts an error says were made, a panic's message).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use dedup_core::typed::CodecError;
use dedup_core::{
    AfterHandlerError, Completion, HandlerError, LeaseContext, ProcessError, Processed,
};

use crate::delivery::Delivery;

/// What the runner calls for each message.
///
/// `lease` is the dedup lease the message runs under (pass it to a transactional completion such
/// as `PgStore::transact`); it is `None` only for a keyless message under
/// [`MissingKey::ProcessWithoutDedup`](crate::MissingKey::ProcessWithoutDedup). Any `Fn(Arc<Delivery>, Option<LeaseContext>) -> Future`
/// closure is a handler.
pub(crate) trait Handler: Send + Sync + 'static {
    /// The handler's own error.
    type Error: fmt::Display + Send + 'static;

    /// Handles one message.
    fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> impl Future<Output = Result<Completion, HandlerError<Self::Error>>> + Send;

    /// Looks at a keyed message's result, fresh or replayed, before the message settles. An error
    /// dead-letters the message with [`ProcessError::Undecodable`]'s text as the reason (a typed
    /// result that no longer decodes: see the facade's `dedup::kafka::Typed`). The default accepts every
    /// result.
    ///
    /// # Errors
    /// The result cannot be used.
    fn check_result(&self, delivery: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        let _ = (delivery, processed);
        Ok(())
    }
}

impl<F, Fut, E> Handler for F
where
    F: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Completion, HandlerError<E>>> + Send,
    E: fmt::Display + Send + 'static,
{
    type Error = E;

    fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> impl Future<Output = Result<Completion, HandlerError<E>>> + Send {
        self(delivery, lease)
    }
}

/// Whether `lease` is its key's last attempt under its policy: a retryable failure now fails the
/// key.
pub(crate) fn last_attempt(lease: &dedup_core::LeaseContext) -> bool {
    let l = lease.lease();
    l.attempts >= l.policy.max_attempts
}

/// A message is retried until it settles, so a handler's `Withdraw` (give the key back, spend no
/// attempt) would retry it without end: the runner counts it as a retryable failure.
pub(crate) fn no_withdraw<T, E>(r: Result<T, HandlerError<E>>) -> Result<T, HandlerError<E>> {
    r.map_err(retry_withdrawn)
}

/// [`no_withdraw`] for the error alone.
pub(crate) fn retry_withdrawn<E>(e: HandlerError<E>) -> HandlerError<E> {
    match e {
        HandlerError::Withdraw(e) => HandlerError::Retryable(e),
        other => other,
    }
}

/// The attempts an error says were made, or `otherwise`.
pub(crate) fn attempts_of<E>(err: &ProcessError<E>, otherwise: u32) -> u32 {
    match err {
        ProcessError::Failed { attempts, .. } => *attempts,
        ProcessError::Handler {
            after: AfterHandlerError::Failed { attempts },
            ..
        }
        | ProcessError::Panicked {
            after: AfterHandlerError::Failed { attempts },
            ..
        } => *attempts,
        _ => otherwise,
    }
}

/// A panic's message, where it has one.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}
