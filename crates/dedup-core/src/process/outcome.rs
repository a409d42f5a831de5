//! What `process` answers and what a handler returns: the public result and error types.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::record::{FencingToken, Lease, OwnerId, Timestamp};

/// What [`Dedup::process`](crate::Dedup::process) did.
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

/// Lease mode: a handler's plain result is stored after it returns.
impl From<Bytes> for Completion {
    fn from(result: Bytes) -> Self {
        Self::Store(result)
    }
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
    /// back as [`Store::withdraw`](crate::Store::withdraw) does (a first attempt's record goes, as if never claimed). For
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

impl<E: fmt::Display> fmt::Display for HandlerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Retryable(e) => write!(f, "retryable: {e}"),
            Self::Permanent(e) => write!(f, "permanent: {e}"),
            Self::Withdraw(e) => write!(f, "withdrawn: {e}"),
            Self::Store(e) => write!(f, "store: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for HandlerError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Retryable(e) | Self::Permanent(e) | Self::Withdraw(e) => Some(e),
            Self::Store(e) => Some(e),
        }
    }
}

impl<E> From<StoreError> for HandlerError<E> {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// Why [`Dedup::process`](crate::Dedup::process) did not produce a result.
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
    /// ([`Dedup::process_typed`](crate::Dedup::process_typed)): the type changed between deployments, or the codec cannot read
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
    pub(super) lease: Lease,
    pub(super) lost: Arc<AtomicBool>,
}

impl LeaseContext {
    /// A lease that a transaction holds rather than a heartbeat (the key claimed inside the
    /// transaction that completes it): it is never seen lost, since it ends with that
    /// transaction.
    pub fn held(lease: Lease) -> Self {
        Self {
            lease,
            lost: Arc::default(),
        }
    }

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
