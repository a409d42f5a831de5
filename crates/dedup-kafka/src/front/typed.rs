//! [`Typed`]: any handler, returning a value instead of bytes.

use std::fmt;
use std::sync::Arc;

use crate::{Acquired, Delivery};
use bytes::Bytes;
use dedup_core::typed::{Codec, CodecError, ResultCodec, TypedError};
use dedup_core::{HandlerError, LeaseContext, Processed, TypedProcessed};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;

use super::{LeaseHandler, TxHandler};

/// Wraps a handler whose `Output` is a value `T` (any [`TxHandler`] or [`LeaseHandler`], a
/// closure included), and stores that value with a [`ResultCodec`] (a tag naming the type and
/// its version, serde underneath). The wrapped handler is a handler of the same mode.
///
/// In lease mode every keyed message's result, fresh or replayed, is decoded before the message
/// settles and handed to [`on_result`](Self::on_result) (to send a reply, say). A stored result
/// that no longer decodes (the type or its tag changed between deployments) dead-letters the
/// message with the reason; the handler does not run again. The wrapped handler's own
/// `check_result` runs first. A value the codec cannot write fails its key permanently (in lease
/// mode its effect ran and is not run again; in transaction mode the message's writes roll back
/// with it).
///
/// ```
/// # use std::sync::Arc;
/// # use dedup_core::typed::{ResultCodec, TypedProcessed};
/// # use dedup_core::{HandlerError, LeaseContext};
/// # use dedup_kafka::{Delivery, Typed};
/// # fn f() -> Result<(), Box<dyn std::error::Error>> {
/// // The amount charged, stored with the key and given back to every duplicate.
/// let codec = ResultCodec::<u64, _>::bincode("charged/v1")?;
/// let handler = Typed::new(codec, |_m: Arc<Delivery>, _lease: LeaseContext| async move {
///     // The effect, once per key.
///     Ok::<_, HandlerError<String>>(100_u64)
/// })
/// .on_result(|_m: &Delivery, r: &TypedProcessed<u64>| {
///     // Every delivery, fresh or duplicate: reply with r.value().
/// });
/// // engine.consumer().brokers("kafka:9092").group_id("g").topics(["t"]).build(handler)?
/// # let _ = handler;
/// # Ok(()) }
/// # f().unwrap();
/// ```
pub struct Typed<T, C, H, R = Ignore> {
    codec: ResultCodec<T, C>,
    handler: H,
    on_result: R,
}

/// The default [`Typed::on_result`]: does nothing with the value.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct Ignore;

/// What [`Typed`] calls with each decoded result (lease mode). Any
/// `Fn(&Delivery, &TypedProcessed<T>)` is one.
pub trait OnResult<T>: Send + Sync + 'static {
    /// Called once per settled keyed message, fresh or replayed.
    fn call(&self, message: &Delivery, result: &TypedProcessed<T>);
}

impl<T> OnResult<T> for Ignore {
    fn call(&self, _: &Delivery, _: &TypedProcessed<T>) {}
}

impl<T, F> OnResult<T> for F
where
    F: Fn(&Delivery, &TypedProcessed<T>) + Send + Sync + 'static,
{
    fn call(&self, message: &Delivery, result: &TypedProcessed<T>) {
        self(message, result);
    }
}

impl<T, C: fmt::Debug, H, R> fmt::Debug for Typed<T, C, H, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Typed")
            .field("codec", &self.codec)
            .finish_non_exhaustive()
    }
}

impl<T, C, H> Typed<T, C, H, Ignore> {
    /// Stores what `handler` returns with `codec`.
    pub fn new(codec: ResultCodec<T, C>, handler: H) -> Self {
        Self {
            codec,
            handler,
            on_result: Ignore,
        }
    }
}

impl<T, C, H, R> Typed<T, C, H, R> {
    /// Calls `f` with every keyed message's decoded result before the message settles (lease
    /// mode: a transaction-mode consumer hands no result back, so a `Typed` with `on_result` is
    /// not a [`TxHandler`]).
    pub fn on_result<R2: OnResult<T>>(self, f: R2) -> Typed<T, C, H, R2> {
        Typed {
            codec: self.codec,
            handler: self.handler,
            on_result: f,
        }
    }
}

impl<T: Serialize + DeserializeOwned, C: Codec, H, R> Typed<T, C, H, R> {
    fn encode<E>(&self, value: &T) -> Result<Bytes, HandlerError<TypedError<E>>> {
        self.codec
            .encode_checked(value)
            .map_err(|e| HandlerError::Permanent(TypedError::Encode(e)))
    }
}

impl<T, C, H, R> LeaseHandler for Typed<T, C, H, R>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: Codec,
    H: LeaseHandler<Output = T>,
    R: OnResult<T>,
{
    type Error = TypedError<H::Error>;
    type Output = Bytes;

    async fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> Result<Bytes, HandlerError<Self::Error>> {
        let value = self
            .handler
            .handle(message, lease)
            .await
            .map_err(|e| e.map_err(TypedError::Handler))?;
        self.encode(&value)
    }

    const RUNS_KEYLESS: bool = H::RUNS_KEYLESS;

    async fn handle_keyless(
        &self,
        message: Arc<Delivery>,
    ) -> Result<(), HandlerError<Self::Error>> {
        self.handler
            .handle_keyless(message)
            .await
            .map_err(|e| e.map_err(TypedError::Handler))
    }

    fn check_result(&self, message: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        self.handler.check_result(message, processed)?;
        let result = TypedProcessed::decode(&self.codec, processed)?;
        self.on_result.call(message, &result);
        Ok(())
    }
}

impl<T, C, H> TxHandler for Typed<T, C, H, Ignore>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: Codec,
    H: TxHandler<Output = T>,
{
    type Error = TypedError<H::Error>;
    type Output = Bytes;

    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<Self::Error>> {
        let value = self
            .handler
            .handle(tx, message)
            .await
            .map_err(|e| e.map_err(TypedError::Handler))?;
        self.encode(&value)
    }

    async fn handle_batch(
        &self,
        tx: &mut PgConnection,
        batch: &[Acquired],
    ) -> Result<Vec<Result<Bytes, HandlerError<Self::Error>>>, HandlerError<Self::Error>> {
        let values = self
            .handler
            .handle_batch(tx, batch)
            .await
            .map_err(|e| e.map_err(TypedError::Handler))?;
        Ok(values
            .into_iter()
            .map(|v| match v {
                Ok(value) => self.encode(&value),
                Err(e) => Err(e.map_err(TypedError::Handler)),
            })
            .collect())
    }
}
