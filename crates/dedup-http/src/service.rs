//! The tower [`Layer`] and [`Service`].
//!
//! `IdempotencyLayer` / `Idempotency`. Methods the layer does not cover pass through untouched.
//! Otherwise: the key from the header, the body read once under a limit, the fingerprint; then the
//! claim, the inner service, the response's body and its completion run on a spawned task (a
//! client that goes away cancels nothing) through `Dedup::process`, with an `IdempotencyContext`
//! (the client's key, dedup's key, the lease, the marks of the handler's transaction) in the
//! request's extensions. The first caller always gets the handler's own response; a retry gets
//! the stored one. What is stored: a transaction's commit if the handler opened one (nothing,
//! the key given back, if none committed); else the response, unless marked `DoNotStore` or
//! refused by `StoreResponses`. `IdempotencyLayer::drain` waits for the
//! spawned requests at shutdown. `IdempotencyLayer::on` takes a `Dedup` (its store and owner
//! ids); the facade's `Engine::http_layer` builds it on the engine.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::typed::CodecError;
use dedup_core::{
    AfterHandlerError, Completion, Dedup, Fingerprint, HandlerError, IdempotencyKey, InputError,
    ProcessError, Processed, Store,
};
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tokio::sync::Notify;
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Instrument, warn};

use crate::config::{IdempotencyConfig, InFlight};
use crate::context::{Committed, DoNotStore, IdempotencyContext};
use crate::key::{KeyError, client_key, fingerprint, idempotency_key};
use crate::problem::{problem, retry_later};
use crate::stored;
use crate::tx::{TxClaimer, run_tx};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of the layer's responses: a buffered one (fresh, replayed or a problem), or the
/// inner service's own for requests the layer passes through.
pub type LayerBody<B> = Either<Full<Bytes>, B>;

/// A [`Layer`] that runs each request with an `Idempotency-Key` once and replays its response to
/// retries, on dedup's engine (any [`Store`]: Postgres behind the tiered caches in production).
pub struct IdempotencyLayer<S> {
    dedup: Arc<Dedup<S>>,
    config: Arc<IdempotencyConfig>,
    running: Arc<Running>,
    /// The transactional path's claimer, where the layer is transactional.
    claimer: Option<Arc<dyn TxClaimer>>,
}

/// The requests running on their own tasks.
#[derive(Default, Debug)]
struct Running {
    count: AtomicUsize,
    idle: Notify,
}

/// Counts one running request until it is dropped.
struct RunningGuard(Arc<Running>);

impl RunningGuard {
    fn new(running: &Arc<Running>) -> Self {
        running.count.fetch_add(1, AtomicOrdering::AcqRel);
        Self(running.clone())
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, AtomicOrdering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl<S> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        Self {
            dedup: self.dedup.clone(),
            config: self.config.clone(),
            running: self.running.clone(),
            claimer: self.claimer.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("dedup", &self.dedup)
            .field("config", &self.config)
            .field("transactional", &self.claimer.is_some())
            .finish()
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// A layer on `dedup` (its store and owner ids; the policy and the in-flight wait are
    /// `config`'s).
    ///
    /// # Errors
    /// A policy or wait the engine refuses.
    pub fn on(dedup: Dedup<S>, config: IdempotencyConfig) -> Result<Self, InputError> {
        let wait = match config.in_flight {
            InFlight::Conflict => Duration::ZERO,
            InFlight::Wait(d) => d,
        };
        let dedup = dedup
            .with_policy(config.policy)?
            .with_in_flight_wait(wait)?;
        Ok(Self {
            dedup: Arc::new(dedup),
            config: Arc::new(config),
            running: Arc::default(),
            claimer: None,
        })
    }

    /// A transactional layer on `dedup`: each request's key is claimed inside a transaction
    /// `claimer` opens and holds while the handler runs; the handler writes on it
    /// ([`IdempotencyContext::take_transaction`]) and commits its response with it, so that the
    /// claim, the effect and the stored response are one commit (see `tx.rs`). `dedup` is the
    /// store failed attempts are recorded in, and its owner ids; `claimer` the transactions.
    ///
    /// # Errors
    /// A policy or wait the engine refuses.
    pub fn transactional(
        dedup: Dedup<S>,
        config: IdempotencyConfig,
        claimer: Arc<dyn TxClaimer>,
    ) -> Result<Self, InputError> {
        let mut layer = Self::on(dedup, config)?;
        layer.claimer = Some(claimer);
        Ok(layer)
    }

    /// Waits until every request the layer started has finished (handlers run on their own
    /// tasks, so that a client going away cancels nothing). Call it after the server stopped
    /// taking connections and before the runtime ends, bounded by your own timeout: a handler
    /// cut off by the runtime's end leaves its key held until its lease ends.
    pub async fn drain(&self) {
        loop {
            let idle = self.running.idle.notified();
            if self.running.count.load(AtomicOrdering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// The engine, for its store and counters.
    pub fn dedup(&self) -> &Arc<Dedup<S>> {
        &self.dedup
    }
}

impl<S, I> Layer<I> for IdempotencyLayer<S> {
    type Service = Idempotency<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        Idempotency {
            inner,
            dedup: self.dedup.clone(),
            config: self.config.clone(),
            running: self.running.clone(),
            claimer: self.claimer.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an inner one.
pub struct Idempotency<S, I> {
    inner: I,
    dedup: Arc<Dedup<S>>,
    config: Arc<IdempotencyConfig>,
    running: Arc<Running>,
    claimer: Option<Arc<dyn TxClaimer>>,
}

impl<S, I: Clone> Clone for Idempotency<S, I> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            dedup: self.dedup.clone(),
            config: self.config.clone(),
            running: self.running.clone(),
            claimer: self.claimer.clone(),
        }
    }
}

impl<S, I: fmt::Debug> fmt::Debug for Idempotency<S, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Why a response was not stored (the handler error [`Dedup::process`] records).
#[derive(Debug)]
enum NotStored {
    Service,
    Declined(StatusCode),
    Uncommitted(StatusCode),
    Encode(CodecError),
}

impl fmt::Display for NotStored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Service => f.write_str("the service failed"),
            Self::Declined(s) => write!(f, "a {s} response is not stored"),
            Self::Uncommitted(s) => write!(
                f,
                "the handler opened a transaction and none committed (it answered {s})"
            ),
            Self::Encode(e) => write!(f, "{e}"),
        }
    }
}

type Answer<E> = Result<Response<Bytes>, E>;

impl<S, I, B, RB> Service<Request<B>> for Idempotency<S, I>
where
    S: Store + Send + Sync + 'static,
    I: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<LayerBody<RB>>;
    type Error = I::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, I::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), I::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone that was polled ready is the one called.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.applies_to(req.method()) {
            return Box::pin(async move { Ok(inner.call(req).await?.map(Either::Right)) });
        }
        let (dedup, config, running, claimer) = (
            self.dedup.clone(),
            self.config.clone(),
            self.running.clone(),
            self.claimer.clone(),
        );
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bad = |kind, title, detail: String| {
                Ok(buffered(problem(
                    StatusCode::BAD_REQUEST,
                    kind,
                    title,
                    &detail,
                )))
            };
            let client_key = match client_key(&parts.headers, &config.header) {
                Ok(Some(k)) => k,
                Ok(None) if !config.required => {
                    let req = Request::from_parts(parts, body);
                    return Ok(inner.call(req).await?.map(Either::Right));
                }
                Ok(None) => {
                    return bad(
                        "key-missing",
                        "Idempotency-Key is required",
                        format!("this request needs an {} header", config.header),
                    );
                }
                Err(e) => {
                    return bad(
                        "key-malformed",
                        "Idempotency-Key is malformed",
                        format!("{}: {e}", config.header),
                    );
                }
            };
            let key = match idempotency_key(&config, &parts, &client_key) {
                Ok(key) => key,
                Err(KeyError::NoTenant) => {
                    return bad(
                        "tenant-unknown",
                        "The request's tenant is unknown",
                        "requests with an idempotency key must name their tenant".to_owned(),
                    );
                }
                Err(KeyError::Input(e)) => {
                    return bad(
                        "key-malformed",
                        "Idempotency-Key is malformed",
                        e.to_string(),
                    );
                }
            };
            let body = match Limited::new(body, config.max_request_bytes).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                    return Ok(buffered(problem(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "body-too-large",
                        "Request body too large",
                        &format!(
                            "the body is over {} bytes, the limit for requests with an idempotency key",
                            config.max_request_bytes
                        ),
                    )));
                }
                Err(e) => {
                    return bad("body-unreadable", "Request body unreadable", e.to_string());
                }
            };
            let fingerprint = fingerprint(&parts, &body);
            let request = Request::from_parts(parts, B::from(body));
            // The effect runs on its own task: a client that goes away mid-request drops this
            // future, not the handler, which runs to its end and stores its response for the
            // retry (or gives the key back).
            let guard = RunningGuard::new(&running);
            let task = tokio::spawn(
                async move {
                    let request = Keyed {
                        client_key: client_key.into(),
                        key,
                        fingerprint,
                        request,
                    };
                    let answer = match claimer {
                        Some(claimer) => run_tx(dedup, config, claimer, inner, request).await,
                        None => run(dedup, config, inner, request).await,
                    };
                    drop(guard);
                    answer
                }
                .in_current_span(),
            );
            match task.await {
                Ok(answer) => Ok(buffered(answer?)),
                Err(e) => {
                    warn!(error = %e, "the idempotent request's task failed");
                    Ok(buffered(problem(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "internal",
                        "Internal error",
                        "the request's task failed",
                    )))
                }
            }
        })
    }
}

/// The key failed for good (the handler panicked past the policy's attempts, say).
pub(crate) fn key_failed() -> Response<Bytes> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "key-failed",
        "The request with this key failed for good",
        "its effect may have run: check before sending the request again with a new key",
    )
}

fn buffered<RB>(r: Response<Bytes>) -> Response<LayerBody<RB>> {
    r.map(|b| Either::Left(Full::new(b)))
}

/// The store is down: 503, a retry may succeed.
pub(crate) fn store_unavailable(
    key: &IdempotencyKey,
    e: &dedup_core::StoreError,
) -> Response<Bytes> {
    warn!(key = %key, error = %e, "the idempotency store is unavailable");
    retry_later(problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "The idempotency store is unavailable",
        "retry later with the same key",
    ))
}

/// A request with its keys and fingerprint, ready to run.
pub(crate) struct Keyed<B> {
    pub(crate) client_key: Arc<str>,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) request: Request<B>,
}

/// Claims the key, runs the inner service once, stores its response; or answers from the
/// stored one, or with the problem that stands in the way.
async fn run<S, I, B, RB>(
    dedup: Arc<Dedup<S>>,
    config: Arc<IdempotencyConfig>,
    mut inner: I,
    keyed: Keyed<B>,
) -> Answer<I::Error>
where
    S: Store,
    I: Service<Request<B>, Response = Response<RB>>,
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    let mut fresh: Option<Answer<I::Error>> = None;
    let slot = &mut fresh;
    let handler_config = config.clone();
    let Keyed {
        client_key,
        key,
        fingerprint,
        request,
    } = keyed;
    let out = dedup
        .process(&key, Some(fingerprint), |lease| async move {
            let config = handler_config;
            let mut request = request;
            let ctx = IdempotencyContext::new(client_key, lease, config.clone());
            request.extensions_mut().insert(ctx.clone());
            let response = match inner.call(request).await {
                Ok(r) => r,
                Err(e) => {
                    // The service (or a layer inside it, a timeout say) failed, maybe after the
                    // effect began: the key is released and the attempt counts.
                    *slot = Some(Err(e));
                    return Err(HandlerError::Retryable(NotStored::Service));
                }
            };
            let (parts, body) = response.into_parts();
            let (parts, body) = match body.collect().await {
                Ok(body) => (parts, body.to_bytes()),
                Err(e) => {
                    // The handler ran and its answer broke off: answered, and stored or not
                    // like any other 500.
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
            };
            // A transaction the handler opened decides: what it committed is stored, and if
            // none committed nothing is, whatever the handler answered.
            let marks = ctx.take_marks();
            let committed = marks
                .committed
                .or_else(|| parts.extensions.get::<Committed>().map(|c| c.0.clone()));
            let declined = marks.opened
                || parts.extensions.get::<DoNotStore>().is_some()
                || !config.store.keeps(parts.status);
            let stored = match (&committed, declined) {
                (None, false) => Some(stored::encode(
                    &config,
                    parts.status,
                    &parts.headers,
                    &body,
                    config.policy.max_result_bytes,
                )),
                _ => None,
            };
            let status = parts.status;
            *slot = Some(Ok(stored::fresh(parts, body)));
            match (committed, stored) {
                (Some(c), _) => Ok(Completion::Committed(c)),
                (None, Some(Ok(bytes))) => Ok(Completion::Store(bytes)),
                (None, Some(Err(e))) => Err(HandlerError::Permanent(NotStored::Encode(e))),
                // A commit of unknown outcome: the record says whether it committed (then it
                // is replayed), else the key is given back.
                (None, None) if marks.opened => match marks.unknown {
                    Some(e) => Err(HandlerError::Store(e)),
                    None => Err(HandlerError::Withdraw(NotStored::Uncommitted(status))),
                },
                (None, None) => Err(HandlerError::Withdraw(NotStored::Declined(status))),
            }
        })
        .await;
    // The first caller gets the handler's own response, whatever became of storing it.
    if let Some(answer) = fresh {
        if let Err(e) = &out
            && !matches!(e, ProcessError::Handler { .. })
        {
            warn!(key = %key, error = %e, "the response was answered but not stored");
        }
        return answer;
    }
    Ok(match out {
        Ok(Processed::Replayed { result }) => match stored::replay(&result) {
            Ok(r) => r,
            Err(e) => {
                warn!(key = %key, error = %e, "a stored response cannot be read");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "stored-response-unreadable",
                    "The stored response cannot be read",
                    "the response stored for this key cannot be replayed",
                )
            }
        },
        Err(ProcessError::InFlight { .. }) => retry_later(problem(
            StatusCode::CONFLICT,
            "in-flight",
            "A request with this key is in progress",
            "the first request with this idempotency key has not finished; retry later",
        )),
        Err(ProcessError::PayloadMismatch { .. }) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "key-reused",
            "Idempotency-Key reused with another request",
            "this idempotency key was used with a different method, path, query or body",
        ),
        Err(ProcessError::Failed { reason, .. }) => {
            warn!(key = %key, reason, "a request with a failed key");
            key_failed()
        }
        Err(ProcessError::Panicked {
            after: AfterHandlerError::Failed { .. },
            ..
        }) => key_failed(),
        Err(ProcessError::Panicked { .. }) => retry_later(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler-panicked",
            "The handler failed",
            "the handler failed; the request may be sent again with the same key",
        )),
        Err(ProcessError::Store(e)) if e.is_retryable() => store_unavailable(&key, &e),
        Ok(_) | Err(_) => {
            match out {
                Err(e) => warn!(key = %key, error = %e, "an idempotent request failed"),
                Ok(_) => warn!(key = %key, "executed without a response"),
            }
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "the request could not be completed",
            )
        }
    })
}
