//! [`Typed`]: a lease handler that returns a value instead of bytes.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use dedup_core::typed::{Codec, CodecError, ResultCodec, TypedError};
use dedup_core::{HandlerError, LeaseContext, Processed, TypedProcessed};
use dedup_kafka::{Ignore, OnResult};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{LeaseHandler, Message};

/// A [`LeaseHandler`] whose closure returns a `T`, stored with a [`ResultCodec`].
///
/// Every keyed message's result, fresh or replayed, is decoded before the message settles and
/// handed to [`on_result`](Self::on_result) (to send a reply, say). A stored result that no
/// longer decodes (the type or its tag changed between deployments) dead-letters the message
/// with the reason; the handler does not run again.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use dedup::{HandlerError, LeaseContext, ResultCodec, TypedProcessed};
/// # use dedup::kafka::{Message, Typed};
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Receipt { charged: i64 }
///
/// # fn f(engine: dedup::Engine) -> Result<(), Box<dyn std::error::Error>> {
/// let codec = ResultCodec::<Receipt, _>::bincode("receipt/v1")?;
/// let handler = Typed::new(codec, |_m: Arc<Message>, _lease: LeaseContext| async move {
///     // The effect, once per key.
///     Ok::<_, HandlerError<String>>(Receipt { charged: 100 })
/// })
/// .on_result(|_m: &Message, r: &TypedProcessed<Receipt>| {
///     // Every delivery, fresh or duplicate: reply with r.value().
/// });
/// let consumer = engine.consumer().brokers("kafka:9092").group_id("g").topics(["t"]).build(handler)?;
/// # Ok(()) }
/// ```
pub struct Typed<T, C, H, R = Ignore> {
    codec: ResultCodec<T, C>,
    handler: H,
    on_result: R,
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
            on_result: Ignore::default(),
        }
    }
}

impl<T, C, H, R> Typed<T, C, H, R> {
    /// Calls `f` with every keyed message's decoded result before the message settles.
    pub fn on_result<R2: OnResult<T>>(self, f: R2) -> Typed<T, C, H, R2> {
        Typed {
            codec: self.codec,
            handler: self.handler,
            on_result: f,
        }
    }
}

impl<T, C, H, R, Fut, E> LeaseHandler for Typed<T, C, H, R>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: Codec,
    H: Fn(Arc<Message>, LeaseContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    E: fmt::Display + Send + 'static,
    R: OnResult<T>,
{
    type Error = TypedError<E>;
    type Output = Bytes;

    fn handle(
        &self,
        message: Arc<Message>,
        lease: LeaseContext,
    ) -> impl Future<Output = Result<Bytes, HandlerError<TypedError<E>>>> + Send {
        let call = (self.handler)(message, lease);
        async move {
            let value = call.await.map_err(|e| e.map_err(TypedError::Handler))?;
            self.codec
                .encode_checked(&value)
                .map_err(|e| HandlerError::Permanent(TypedError::Encode(e)))
        }
    }

    fn check_result(&self, message: &Message, processed: &Processed) -> Result<(), CodecError> {
        let result = TypedProcessed::decode(&self.codec, processed)?;
        self.on_result.call(message, &result);
        Ok(())
    }
}
