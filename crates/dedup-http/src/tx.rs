//! The transactional path: the key claimed inside the request's own transaction, held open
//! while the handler writes on it, and completed in it: one commit per request.
//!
//! A [`TxClaimer`] (the facade's `Engine::http_tx_layer` gives one on Postgres) answers a key
//! its caches or its record settle, or opens a transaction holding the key ([`OpenTx`]). The
//! layer puts it in the request's context; the handler takes it
//! ([`IdempotencyContext::take_transaction`]), writes, and commits its response's stored form
//! with it. What becomes of the transaction decides what is stored:
//! - committed by the handler: that stored form (the layer stores nothing more);
//! - taken and not committed (dropped, or the commit failed): nothing; it is rolled back and the
//!   key given back with no attempt spent, whatever the handler answered;
//! - never taken: the layer stores the response in it, as a lease-mode layer would (or rolls it
//!   back for a response it does not keep), and commits;
//! - the handler panicked or the service failed: rolled back, then the attempt is recorded in a
//!   transaction of its own that claims the key again without waiting (a key out of attempts
//!   fails for good), as a lease-mode layer records it.
//!
//! A key another request holds answers InFlight at once (409), or after waiting for it
//! (`InFlight::Wait`), trying again with a short backoff.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dedup_core::{
    AfterFailure, ClaimOutcome, ClaimRequest, Dedup, Lease, LeaseContext, Store, StoreError,
};
use futures_util::FutureExt as _;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;
use tracing::warn;

use crate::config::IdempotencyConfig;
use crate::context::{Committed, DoNotStore, IdempotencyContext};
use crate::problem::{problem, retry_later};
use crate::service::{Keyed, key_failed, store_unavailable};
use crate::stored;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed future, so that the traits here can be trait objects.
pub type TxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A transaction held open around a claimed key ([`TxClaimer::begin`]).
pub trait OpenTx: Send + fmt::Debug + 'static {
    /// The lease the key is held under.
    fn lease(&self) -> &Lease;

    /// Completes the key with `stored` (the response's stored form) in the transaction and
    /// commits it, with whatever was written on it; then copies the record to the caches.
    fn commit(self: Box<Self>, stored: Bytes) -> TxFuture<'static, Result<(), StoreError>>;

    /// Rolls the transaction back: the key is free again, no attempt spent.
    fn rollback(self: Box<Self>) -> TxFuture<'static, ()>;

    /// Records a failed attempt of the key in the transaction (which wrote nothing else) and
    /// commits: the key released for a later attempt, or failed for good where `permanent` or
    /// out of attempts.
    fn fail(
        self: Box<Self>,
        reason: String,
        permanent: bool,
    ) -> TxFuture<'static, Result<AfterFailure, StoreError>>;

    /// The transaction as `Any`, for its maker to take back its own type.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

/// What [`TxClaimer::begin`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum TxBegun {
    /// The key is held in this open transaction.
    Acquired(Box<dyn OpenTx>),
    /// The key is answered without running it (done, in flight, failed, reused).
    Answered(ClaimOutcome),
}

/// Claims keys inside transactions it holds open for the handler (the transactional layer's
/// store).
pub trait TxClaimer: Send + Sync + fmt::Debug + 'static {
    /// Answers `req` from the caches or the record where they settle it; otherwise begins a
    /// transaction and claims the key in it. A key another transaction holds answers
    /// [`ClaimOutcome::InFlight`] at once.
    fn begin<'a>(&'a self, req: &'a ClaimRequest) -> TxFuture<'a, Result<TxBegun, StoreError>>;
}

type Answer<E> = Result<Response<Bytes>, E>;

/// The longest pause between two tries of a key in flight, under `InFlight::Wait`.
const WAIT_STEP_MAX: Duration = Duration::from_millis(100);

/// Claims the key in a transaction, runs the inner service with it, and stores what the
/// transaction committed; or answers from the stored response, or with the problem that stands
/// in the way.
pub(crate) async fn run_tx<S, I, B, RB>(
    dedup: Arc<Dedup<S>>,
    config: Arc<IdempotencyConfig>,
    claimer: Arc<dyn TxClaimer>,
    mut inner: I,
    keyed: Keyed<B>,
) -> Answer<I::Error>
where
    S: Store + Send + Sync + 'static,
    I: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    B: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let Keyed {
        client_key,
        key,
        fingerprint,
        mut request,
    } = keyed;
    let req = dedup.claim_request(&key, Some(fingerprint));
    let deadline = Instant::now() + dedup.in_flight_wait();
    let mut step = Duration::from_millis(5);
    let open = loop {
        match claimer.begin(&req).await {
            Ok(TxBegun::Acquired(open)) => break open,
            Ok(TxBegun::Answered(ClaimOutcome::InFlight { .. })) if Instant::now() < deadline => {
                tokio::time::sleep(step.min(deadline.saturating_duration_since(Instant::now())))
                    .await;
                step = (step * 2).min(WAIT_STEP_MAX);
            }
            Ok(TxBegun::Answered(outcome)) => return Ok(answered(&key, outcome)),
            Err(e) if e.is_retryable() => return Ok(store_unavailable(&key, &e)),
            Err(e) => {
                warn!(key = %key, error = %e, "an idempotent request failed");
                return Ok(internal());
            }
        }
    };
    let lease = open.lease().clone();
    let ctx = IdempotencyContext::new(
        client_key,
        LeaseContext::held(lease.clone()),
        config.clone(),
    )
    .holding(open);
    request.extensions_mut().insert(ctx.clone());
    // A panic of the service or its body is caught here, and the transaction rolled back at
    // once (a route's `RequestTx` gives it back as it unwinds). (The request already runs on a
    // task of its own, so no second one is spawned for this.)
    let routed = AssertUnwindSafe(async move {
        let response = inner.call(request).await?;
        let (parts, body) = response.into_parts();
        Ok(match body.collect().await {
            Ok(body) => (parts, body.to_bytes()),
            Err(e) => {
                let e: BoxError = e.into();
                warn!(error = %e, "the handler's response body failed");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "response-failed",
                    "The response failed",
                    "the handler's response broke off",
                )
                .into_parts()
            }
        })
    })
    .catch_unwind()
    .await;
    let (parts, body) = match routed {
        Ok(Ok(answered)) => answered,
        Ok(Err(e)) => {
            // The service failed, maybe after its effect began: nothing commits, and the
            // attempt counts.
            if let Some(open) = ctx.take_open() {
                open.rollback().await;
            }
            record_attempt(&*claimer, &req, "the service failed", false).await;
            return Err(e);
        }
        Err(_) => {
            if let Some(open) = ctx.take_open() {
                open.rollback().await;
            }
            return Ok(
                match record_attempt(&*claimer, &req, "the handler panicked", false).await {
                    Some(AfterFailure::Failed { .. }) => key_failed(),
                    _ => retry_later(problem(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "handler-panicked",
                        "The handler failed",
                        "the handler failed; the request may be sent again with the same key",
                    )),
                },
            );
        }
    };
    let marks = ctx.take_marks();
    let left = ctx.take_open();
    let committed = marks.committed.is_some() || parts.extensions.get::<Committed>().is_some();
    match left {
        // Taken by the handler and not committed, or the handler committed elsewhere: nothing
        // of this transaction is kept.
        Some(open) if marks.opened || committed => open.rollback().await,
        // Never taken: the response is stored in it, as a lease-mode layer stores it.
        Some(open) => {
            let keep =
                parts.extensions.get::<DoNotStore>().is_none() && config.store.keeps(parts.status);
            let encoded = keep.then(|| {
                stored::encode(
                    &config,
                    parts.status,
                    &parts.headers,
                    &body,
                    config.policy.max_result_bytes,
                )
            });
            match encoded {
                Some(Ok(bytes)) => {
                    if let Err(e) = open.commit(bytes).await {
                        warn!(key = %key, error = %e, "the response was answered but not stored");
                    }
                }
                Some(Err(e)) => {
                    open.rollback().await;
                    warn!(key = %key, error = %e, "the response cannot be stored");
                    record_attempt(&*claimer, &req, &e.to_string(), true).await;
                }
                None => open.rollback().await,
            }
        }
        // Committed by the handler, or its commit failed. One whose outcome stayed unknown
        // is read back: committed, the caches get their copy.
        None => {
            if let Some(e) = marks.unknown {
                read_back(&dedup, &lease, &e).await;
            }
        }
    }
    Ok(stored::fresh(parts, body))
}

/// The answer to a key its record settles.
fn answered(key: &dedup_core::IdempotencyKey, outcome: ClaimOutcome) -> Response<Bytes> {
    match outcome {
        ClaimOutcome::Completed { result, .. } => stored::replay(&result).unwrap_or_else(|e| {
            warn!(key = %key, error = %e, "a stored response cannot be read");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored-response-unreadable",
                "The stored response cannot be read",
                "the response stored for this key cannot be replayed",
            )
        }),
        ClaimOutcome::InFlight { .. } => retry_later(problem(
            StatusCode::CONFLICT,
            "in-flight",
            "A request with this key is in progress",
            "the first request with this idempotency key has not finished; retry later",
        )),
        ClaimOutcome::PayloadMismatch => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "Idempotency-Key reused with another request",
            "this idempotency key was used with a different method, path, query or body",
        ),
        ClaimOutcome::Failed { reason, .. } => {
            warn!(key = %key, reason, "a request with a failed key");
            key_failed()
        }
        ClaimOutcome::Acquired(_) | _ => internal(),
    }
}

fn internal() -> Response<Bytes> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        "the request could not be completed",
    )
}

/// Records a failed attempt of `req`'s key once its transaction rolled back, in a transaction of
/// its own that claims the key again (`permanent`: failed for good), so that a key that keeps
/// failing fails for good, as a lease-mode layer records it. It never waits: where another
/// request holds the key by then, or the store is down, nothing is recorded (the attempt is
/// lost, not the key).
async fn record_attempt(
    claimer: &dyn TxClaimer,
    req: &ClaimRequest,
    reason: &str,
    permanent: bool,
) -> Option<AfterFailure> {
    match claimer.begin(req).await {
        Ok(TxBegun::Acquired(open)) => match open.fail(reason.to_owned(), permanent).await {
            Ok(after) => Some(after),
            Err(e) => {
                warn!(key = %req.key, error = %e, "a failed attempt was not recorded");
                None
            }
        },
        Ok(_) => None,
        Err(e) => {
            warn!(key = %req.key, error = %e, "a failed attempt was not recorded");
            None
        }
    }
}

/// After a commit of unknown outcome: reads the record back, and copies it to the caches if the
/// commit landed.
async fn read_back<S: Store>(dedup: &Dedup<S>, lease: &Lease, error: &StoreError) {
    match dedup.store().get(&lease.key).await {
        Ok(Some(r)) if r.token == lease.token && r.state == dedup_core::State::Completed => {
            if let Some(result) = &r.result {
                dedup.store().committed(lease, result).await;
            }
        }
        Ok(_) => {}
        Err(e) => {
            warn!(key = %lease.key, error = %e, first = %error, "a commit of unknown outcome could not be read back");
        }
    }
}
