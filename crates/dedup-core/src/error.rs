//! Typed errors. Each says whether a retry can help ([`StoreError::is_retryable`]) and whether
//! the outcome of the call is unknown ([`StoreError::is_outcome_unknown`]).
//!
//! `InputError` is the caller's fault (a setting is named in `InputError::Setting`); `StoreError`
//! is `Input`, `LeaseLost`, `Unavailable`, `OutcomeUnknown`, `Corrupt` or `Backend`. Both are
//! `#[non_exhaustive]` thiserror enums. A backend's own error is kept as an `Arc` (cheap to
//! share) and never appears in this crate's API: each backend classifies its errors into these.

use std::error::Error as StdError;
use std::sync::Arc;

use crate::key::IdempotencyKey;
use crate::record::FencingToken;

/// A backend's own error, shared cheaply (one error can be handed to many waiters).
pub type BoxError = Arc<dyn StdError + Send + Sync + 'static>;

/// The caller gave something dedup will not store. Retrying the same input cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
    /// An idempotency key with no bytes.
    #[error("the idempotency key is empty")]
    EmptyKey,
    /// An idempotency key longer than [`MAX_KEY_LEN`](crate::MAX_KEY_LEN).
    #[error(
        "the idempotency key is {len} bytes long; the limit is {max} (digest it with IdempotencyKey::digest)"
    )]
    KeyTooLong {
        /// The key's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An event time past what a time-ordered key holds (48 bits of milliseconds since the Unix
    /// epoch: [`IdempotencyKey::timed`](crate::IdempotencyKey::timed)).
    #[error(
        "the event time {ms} ms after the Unix epoch is past the year 10889 (48 bits of milliseconds)"
    )]
    EventTime {
        /// The time given, in milliseconds since the Unix epoch.
        ms: u64,
    },
    /// A scope with no characters.
    #[error("the scope is empty")]
    EmptyScope,
    /// A scope longer than [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN).
    #[error("the scope is {len} bytes long; the limit is {max}")]
    ScopeTooLong {
        /// The scope's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A scope holding control characters.
    #[error("the scope holds control characters")]
    ScopeNotPrintable,
    /// A result larger than the policy's `max_result_bytes`.
    #[error("the result is {len} bytes long; the limit is {max} (Policy::max_result_bytes)")]
    ResultTooLarge {
        /// The result's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A message queued on the outbox larger than its limit (key, payload and headers together),
    /// refused when it is queued rather than found at the relay.
    #[error(
        "the outbox message to {topic} is {len} bytes long; the limit is {max} (OutboxMessage::MAX_BYTES)"
    )]
    OutboxMessageTooLarge {
        /// The topic it was queued for.
        topic: String,
        /// Its size: key, payload, header names and values.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A topic Kafka cannot take: empty, longer than 249 characters, or with a character other
    /// than ASCII letters, digits, `.`, `_` and `-`.
    #[error("the outbox message's topic {0:?} is not a valid Kafka topic name")]
    OutboxTopic(String),
    /// A policy that cannot work (a zero lease, zero attempts, a duration the store cannot hold).
    #[error("invalid policy: {0}")]
    Policy(&'static str),
    /// A setting of [`Dedup`](crate::Dedup) that cannot work (a wait too long for the clock).
    #[error("invalid setting {setting}: {problem}")]
    Setting {
        /// The setting, as its `with_` method names it.
        setting: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// An error from a [`Store`](crate::Store).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller's input was refused; nothing was written.
    #[error(transparent)]
    Input(#[from] InputError),

    /// The fenced call's token no longer holds the key: its lease was taken over, or the key was
    /// completed, failed or purged. Nothing was written. The caller must stop and not retry: another
    /// holder owns the key now.
    #[error("lease lost on {key}: token {token} no longer holds it")]
    LeaseLost {
        /// The key.
        key: IdempotencyKey,
        /// The stale token the call carried.
        token: FencingToken,
    },

    /// The backend could not be reached or refused the call for a passing reason (pool exhausted,
    /// serialization failure, server shutting down). The call was **not** applied; retrying is safe.
    #[error("backend unavailable: {source}")]
    Unavailable {
        /// The backend's error.
        #[source]
        source: BoxError,
    },

    /// The call may or may not have been applied (the connection dropped after the statement or the
    /// COMMIT was sent). The caller must read the record back to learn the truth, never guess.
    #[error("outcome unknown: {source}")]
    OutcomeUnknown {
        /// The backend's error.
        #[source]
        source: BoxError,
    },

    /// A stored record could not be read as a dedup record (foreign or corrupted data).
    #[error("corrupt record for {key}: {detail}")]
    Corrupt {
        /// The key.
        key: IdempotencyKey,
        /// What was wrong.
        detail: String,
    },

    /// Any other backend error (a bug, a schema that was not migrated, a permission). Retrying the
    /// same call is not expected to help.
    #[error("backend error: {source}")]
    Backend {
        /// The backend's error.
        #[source]
        source: BoxError,
    },
}

impl StoreError {
    /// Wraps a passing backend error whose call was not applied.
    pub fn unavailable(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::Unavailable {
            source: Arc::new(source),
        }
    }

    /// Wraps a backend error whose call may have been applied.
    pub fn outcome_unknown(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::OutcomeUnknown {
            source: Arc::new(source),
        }
    }

    /// Wraps a backend error that a retry will not cure.
    pub fn backend(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::Backend {
            source: Arc::new(source),
        }
    }

    /// Whether the same call may succeed if tried again later.
    ///
    /// True for [`Unavailable`](Self::Unavailable) and
    /// [`OutcomeUnknown`](Self::OutcomeUnknown) (after reading the truth back).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::OutcomeUnknown { .. })
    }

    /// Whether the call may have been applied although it reported an error.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Self::OutcomeUnknown { .. })
    }

    /// Whether the call was refused because its token is stale.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Self::LeaseLost { .. })
    }
}
