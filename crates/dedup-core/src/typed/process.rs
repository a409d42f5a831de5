//! [`Dedup::process_typed`]: the consumer API with typed results.
//!
//! A replay whose stored result does not decode is `ProcessError::Undecodable`, never a second
//! run.

use std::fmt;
use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Codec, CodecError, ResultCodec};
use crate::key::{Fingerprint, IdempotencyKey};
use crate::process::{Completion, Dedup, HandlerError, LeaseContext, ProcessError, Processed};
use crate::record::FencingToken;
use crate::store::Store;

/// What [`Dedup::process_typed`] did, with the value.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum TypedProcessed<T> {
    /// The handler ran; its value is stored.
    Executed {
        /// The handler's value (the one it returned, not a decoded copy).
        value: T,
        /// The token it ran under.
        token: FencingToken,
        /// Which attempt it was.
        attempts: u32,
    },
    /// The key was done before: the stored value, decoded. The handler did not run.
    Replayed {
        /// The stored value.
        value: T,
    },
}

impl<T> TypedProcessed<T> {
    /// The value, fresh or replayed.
    pub fn value(&self) -> &T {
        match self {
            Self::Executed { value, .. } | Self::Replayed { value } => value,
        }
    }

    /// The value, fresh or replayed.
    pub fn into_value(self) -> T {
        match self {
            Self::Executed { value, .. } | Self::Replayed { value } => value,
        }
    }

    /// Whether the handler ran in this call.
    pub fn executed(&self) -> bool {
        matches!(self, Self::Executed { .. })
    }

    /// `processed`'s stored result decoded with `codec` (a fresh one too: a type the codec cannot
    /// read back is found on its first run, not on its first duplicate).
    ///
    /// # Errors
    /// The result does not decode as a `T` under the codec's tag.
    pub fn decode<C: Codec>(
        codec: &ResultCodec<T, C>,
        processed: &Processed,
    ) -> Result<Self, CodecError>
    where
        T: Serialize + DeserializeOwned,
    {
        let value = codec.decode(processed.result())?;
        Ok(match processed {
            Processed::Executed {
                token, attempts, ..
            } => Self::Executed {
                value,
                token: *token,
                attempts: *attempts,
            },
            _ => Self::Replayed { value },
        })
    }
}

/// A typed handler's failure, as [`ProcessError::Handler`] carries it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TypedError<E> {
    /// The handler's own error.
    #[error("{0}")]
    Handler(E),
    /// The handler's value cannot be encoded, or would not decode back. Its effect ran, so the
    /// key is marked FAILED (permanent) rather than run again.
    #[error(transparent)]
    Encode(CodecError),
}

impl<S: Store> Dedup<S> {
    /// [`process`](Self::process) with typed results: the handler returns a `T`, which `codec`
    /// stores; every duplicate gets it back decoded.
    ///
    /// Lease mode: dedup stores the value after the handler returns. (A transactional handler
    /// encodes with [`ResultCodec::encode`], completes with those bytes inside its transaction, and
    /// uses [`process`](Self::process) and [`ResultCodec::decode`].)
    ///
    /// # Errors
    /// As [`process`](Self::process), and:
    /// - [`ProcessError::Undecodable`]: the stored result was written by another codec or under
    ///   another tag, or does not decode whole. Not retryable; the handler does not run again.
    /// - [`ProcessError::Handler`] with [`TypedError::Encode`]: the handler's value cannot be
    ///   encoded, or does not decode back (checked before it is stored); the key is FAILED.
    pub async fn process_typed<T, C, F, Fut, E>(
        &self,
        codec: &ResultCodec<T, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<TypedProcessed<T>, ProcessError<TypedError<E>>>
    where
        T: Serialize + DeserializeOwned,
        C: Codec,
        F: FnOnce(LeaseContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
        E: fmt::Display,
    {
        let mut fresh: Option<T> = None;
        let slot = &mut fresh;
        let processed = self
            .process(key, fingerprint, move |lease| async move {
                let value = handler(lease)
                    .await
                    .map_err(|e| e.map_err(TypedError::Handler))?;
                let bytes = codec
                    .encode_checked(&value)
                    .map_err(|e| HandlerError::Permanent(TypedError::Encode(e)))?;
                *slot = Some(value);
                Ok(Completion::Store(bytes))
            })
            .await?;
        let undecodable = |source| ProcessError::Undecodable {
            key: key.clone(),
            source,
        };
        match processed {
            Processed::Executed {
                result,
                token,
                attempts,
            } => {
                let value = match fresh {
                    Some(value) => value,
                    // Unreachable: an executed call ran the closure to its end.
                    None => codec.decode(&result).map_err(undecodable)?,
                };
                Ok(TypedProcessed::Executed {
                    value,
                    token,
                    attempts,
                })
            }
            Processed::Replayed { result } => Ok(TypedProcessed::Replayed {
                value: codec.decode(&result).map_err(undecodable)?,
            }),
        }
    }
}
