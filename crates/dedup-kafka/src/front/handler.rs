//! What a consumer calls: a [`TxHandler`] (the effect is a write in dedup's own Postgres, made in
//! the transaction that records it) or a [`LeaseHandler`] (the effect is outside, made under a
//! fenced lease). The handler's trait picks the mode.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use crate::{Acquired, BatchHandler, Delivery, Handler};
use bytes::Bytes;
use dedup_core::typed::CodecError;
use dedup_core::{Completion, HandlerError, LeaseContext, Processed};
use dedup_pg::{BatchBody, ItemResult};
use sqlx::postgres::PgConnection;

use super::{Call, Liveness};

/// A consumer whose effect is a write in the engine's Postgres: **transaction mode**. The
/// message's claim, the handler's writes, the completion (and, if asked, the consumer's position)
/// commit in one transaction, so a crash at any point leaves all of them or none: exactly once,
/// with no lease to outlive.
///
/// Messages are taken in batches (per partition, up to a size or a short wait) and a batch runs
/// in one transaction. [`handle`](Self::handle) is called for each message in turn; one that
/// fails is isolated from its batch neighbours (the batch runs again without it, and its writes
/// roll back alone). Implement [`handle_batch`](Self::handle_batch) as well to write a whole batch
/// in one statement.
///
/// A consumer takes a handler whose `Output` is `Bytes` (the result as stored); one whose
/// `Output` is a value of its own is wrapped in [`Typed`](super::Typed), which stores it
/// with a codec.
pub trait TxHandler: Send + Sync + 'static {
    /// The handler's own error.
    type Error: fmt::Display + Send + 'static;

    /// What it returns for each message: the result to store (`Bytes`), or a value for
    /// [`Typed`](super::Typed) to encode.
    type Output: Send;

    /// Writes one message's effect on `tx`, the batch's transaction, and returns the result to
    /// store (replayed to every duplicate). `Err(HandlerError::Retryable)` retries the message
    /// with backoff; `Permanent` fails its key and dead-letters it.
    fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> impl Future<Output = Result<Self::Output, HandlerError<Self::Error>>> + Send;

    /// Writes the effects of a whole batch on `tx`, one answer per message, in order. The
    /// default calls [`handle`](Self::handle) for each; at the first failure it fails the call,
    /// and the batch runs again in parts until the message at fault is alone. An override may be
    /// called again on parts of the batch after a failure, under savepoints.
    fn handle_batch(
        &self,
        tx: &mut PgConnection,
        batch: &[Acquired],
    ) -> impl Future<Output = Result<Vec<Answer<Self>>, HandlerError<Self::Error>>> + Send {
        async move {
            let mut out = Vec::with_capacity(batch.len());
            for message in batch {
                match self.handle(&mut *tx, message).await {
                    Ok(result) => out.push(Ok(result)),
                    Err(e) if batch.len() == 1 => out.push(Err(e)),
                    Err(e) => return Err(e),
                }
            }
            Ok(out)
        }
    }
}

/// One message's answer in [`TxHandler::handle_batch`]: its output, or its own failure.
pub type Answer<H> = Result<<H as TxHandler>::Output, HandlerError<<H as TxHandler>::Error>>;

/// A consumer whose effect is outside the engine's Postgres (an HTTP call, a payment provider,
/// another database): **lease mode**. The message runs under a fenced lease, kept alive while the
/// handler runs; its result is recorded after it returns. A crash between the effect and the
/// record runs the effect again once the lease ends (the limit of any effect outside the
/// transaction): pass [`LeaseContext::lease`]'s fencing token to a downstream that can refuse a
/// stale one.
///
/// Any `Fn(Arc<Delivery>, LeaseContext) -> impl Future<Output = Result<Bytes, HandlerError<E>>>`
/// closure is a lease handler.
///
/// A handler that writes its effect in a Postgres transaction of its own and completes the key
/// inside it (`engine.postgres()?.transact(&lease, ..)`) returns that `Completion` instead of
/// `Bytes`: then nothing is left to record after it. One whose `Output` is a value of its own is
/// wrapped in [`Typed`](super::Typed).
pub trait LeaseHandler: Send + Sync + 'static {
    /// The handler's own error.
    type Error: fmt::Display + Send + 'static;

    /// What it returns: the result to store (`Bytes`), a `Completion`, or a value for
    /// [`Typed`](super::Typed) to encode.
    type Output: Send;

    /// Makes one message's effect and returns the result to store (replayed to every duplicate).
    fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> impl Future<Output = Result<Self::Output, HandlerError<Self::Error>>> + Send;

    /// Whether [`handle_keyless`](Self::handle_keyless) is implemented: the builder accepts
    /// `missing_key(MissingKey::ProcessWithoutDedup)` only for a handler that says so.
    const RUNS_KEYLESS: bool = false;

    /// Runs a message that has no idempotency key, under
    /// `missing_key(MissingKey::ProcessWithoutDedup)`: no claim and no stored result, so at least
    /// once (a redelivery runs it again). Only called where `RUNS_KEYLESS` is true.
    fn handle_keyless(
        &self,
        message: Arc<Delivery>,
    ) -> impl Future<Output = Result<(), HandlerError<Self::Error>>> + Send {
        let _ = message;
        async { Ok(()) }
    }

    /// Looks at a keyed message's result, fresh or replayed, before the message settles; an
    /// error dead-letters the message with the reason. The default accepts every result;
    /// [`Typed`](super::Typed) decodes it.
    ///
    /// # Errors
    /// The result cannot be used.
    fn check_result(&self, message: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        let _ = (message, processed);
        Ok(())
    }
}

impl<F, Fut, T, E> LeaseHandler for F
where
    F: Fn(Arc<Delivery>, LeaseContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Send,
    E: fmt::Display + Send + 'static,
{
    type Error = E;
    type Output = T;

    fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> impl Future<Output = Result<T, HandlerError<E>>> + Send {
        self(message, lease)
    }
}

/// A [`TxHandler`] as the transaction-mode loop calls it.
#[derive(Debug)]
pub(crate) struct Transactional<H>(pub(crate) H, pub(crate) Arc<dyn Liveness>);

impl<H: TxHandler<Output: Into<Bytes>>> BatchHandler for Transactional<H> {
    type Error = H::Error;

    fn handle<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [Acquired],
    ) -> BatchBody<'c, Self::Error> {
        Box::pin(async move {
            let _call = Call::new(&*self.1);
            let answers = self.0.handle_batch(tx, batch).await?;
            Ok(answers
                .into_iter()
                .map(|a| a.map(Into::into))
                .collect::<Vec<ItemResult<H::Error>>>())
        })
    }
}

/// A [`LeaseHandler`] as the lease-mode loops call it.
#[derive(Debug)]
pub(crate) struct Leased<H>(pub(crate) H, pub(crate) Arc<dyn Liveness>);

impl<H: LeaseHandler<Output: Into<Completion>>> Handler for Leased<H> {
    type Error = H::Error;

    async fn handle(
        &self,
        delivery: Arc<Delivery>,
        lease: Option<LeaseContext>,
    ) -> Result<Completion, HandlerError<H::Error>> {
        let _call = Call::new(&*self.1);
        match lease {
            Some(lease) => self.0.handle(delivery, lease).await.map(Into::into),
            // Keyless, under `ProcessWithoutDedup` (which the builder allows only where
            // `RUNS_KEYLESS` says `handle_keyless` is implemented): nothing is stored.
            None => self
                .0
                .handle_keyless(delivery)
                .await
                .map(|()| Completion::store(Bytes::new())),
        }
    }

    fn check_result(&self, delivery: &Delivery, processed: &Processed) -> Result<(), CodecError> {
        self.0.check_result(delivery, processed)
    }
}
