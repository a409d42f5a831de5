//! [`Typed`]: a handler that returns a value instead of bytes.
//!
//! It encodes the closure's value, and through `Handler::check_result` (called for every settled
//! keyed message, fresh or replayed) decodes each result for `on_result`. A result that does not
//! decode dead-letters its message with `ProcessError::Undecodable`'s text.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use dedup_core::typed::{Codec, CodecError, ResultCodec, TypedError};
use dedup_core::{Completion, HandlerError, LeaseContext, Processed, TypedProcessed};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::delivery::Delivery;
use crate::handler::Handler;

/// A [`Handler`] whose closure returns a `T`, stored with a [`ResultCodec`].
///
/// Every keyed message's result, fresh or replayed, is decoded before the message settles and
/// handed to [`on_result`](Self::on_result) (to send a reply, say). A stored result that no
/// longer decodes (the type or its tag changed between deployments) dead-letters the message
/// with the reason; the handler does not run again.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use dedup_core::{HandlerError, LeaseContext, ResultCodec, TypedProcessed};
/// # use dedup_kafka::{Delivery, Typed};
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Receipt { charged: i64 }
///
/// # fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let codec = ResultCodec::<Receipt, _>::bincode("receipt/v1")?;
/// let handler = Typed::new(codec, |_d: Arc<Delivery>, _lease: Option<LeaseContext>| async move {
///     // The effect, once per key.
///     Ok::<_, HandlerError<String>>(Receipt { charged: 100 })
/// })
/// .on_result(|_d: &Delivery, r: &TypedProcessed<Receipt>| {
///     // Every delivery, fresh or duplicate: reply with r.value().
/// });
/// // Runner::new(config, dedup, handler)
/// # Ok(()) }
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

/// What [`Typed`] calls with each decoded result.
pub trait OnResult<T>: Send + Sync + 'static {
    /// Called once per settled keyed message, fresh or replayed.
    fn call(&self, delivery: &Delivery, result: &TypedProcessed<T>);
}

impl<T> OnResult<T> for Ignore {
    fn call(&self, _delivery: &Delivery, _result: &TypedProcessed<T>) {}
}

impl<T, F> OnResult<T> for F
where
    F: Fn(&Delivery, &TypedProcessed<T>) + Send + Sync + 'static,
{
    fn call(&self, delivery: &Delivery, result: &TypedProcessed<T>) {
        self(delivery, result);
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
    /// Calls `f` with every keyed message's decoded result before the message settles.
    pub fn on_result<R2: OnResult<T>>(self, f: R2) -> Typed<T, C, H, R2> {
        Typed {
            codec: self.codec,
            handler: self.handler,
            on_result: f,
        }
    }
}

impl<T, C, H, R, Fut, E> Handler for Typed<T, C, H, R>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: Codec,
    H: Fn(Arc<Delivery>, Option<LeaseContext>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    E: fmt::Display + Send + 'static,
    R: OnResult<T>,
{
    type Error = TypedError<E>;

    fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> impl Future<Output = Result<Completion, HandlerError<TypedError<E>>>> + Send {
        let call = (self.handler)(delivery, lease);
        async move {
            let value = call.await.map_err(|e| e.map_err(TypedError::Handler))?;
            let bytes = self
                .codec
                .encode_checked(&value)
                .map_err(|e| HandlerError::Permanent(TypedError::Encode(e)))?;
            Ok(Completion::Store(bytes))
        }
    }

    fn check_result(&self, delivery: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        let result = TypedProcessed::decode(&self.codec, processed)?;
        self.on_result.call(delivery, &result);
        Ok(())
    }
}
