//! An `Idempotency-Key` layer for HTTP services (tower: axum, hyper), on dedup's engine.
//!
//! Build it from the engine: `dedup::Engine::http_layer` (the `dedup` crate, feature `http`;
//! its `examples/orders.rs` is an axum service with a route of each kind). This crate is the
//! layer itself: [`IdempotencyLayer::on`] puts it on any `Dedup`, as the example below does on
//! the in-memory store.
//!
//! Per the IETF draft (draft-ietf-httpapi-idempotency-key-header-07) and what Stripe does: the
//! first request with a key runs; its response (status, an allowlist of headers, the body) is
//! stored and replayed to every retry, marked `Idempotent-Replayed: true`.
//!
//! | request | answer |
//! |---|---|
//! | POST/PATCH without the header (where required) | 400, problem+json |
//! | a malformed key (not a Structured Field string nor a bare token, > 255 bytes) | 400 |
//! | a body over the limit (default 1 MiB) | 413, nothing runs |
//! | the first with its key | the handler's response, stored |
//! | a retry after it completed | the stored response, `Idempotent-Replayed: true` |
//! | a retry while it runs | 409 with `Retry-After: 1` ([`InFlight::Conflict`]), or a wait ([`InFlight::Wait`]) |
//! | the key again with another method, path, query or body | 422 |
//! | the store down | 503 with `Retry-After: 1` |
//!
//! - **The key** is the header's value (a Structured Field string, `"..."`, or a bare token as
//!   Stripe's clients send it), scoped by the layer's [`Scope`](dedup_core::Scope), a tenant
//!   ([`IdempotencyConfig::with_tenant`]) and the method and route
//!   ([`IdempotencyConfig::with_route`]).
//! - **The fingerprint** is SHA-256 over the method, path, query and body bytes; nothing is
//!   canonicalised.
//! - **What is stored** is every response by default ([`StoreResponses::All`]): once the
//!   handler answered, a retry never runs it again, whatever the answer was (a panic, an error
//!   from the inner service or a crash leaves no answer: then the key is released). [`StoreResponses::Successes`] stores
//!   only 2xx; a handler can also mark one response [`DoNotStore`]. A handler that opened a
//!   transaction ([`IdempotencyContext::transaction_opened`]; `dedup::Engine::begin` marks it)
//!   stores only what that transaction committed: if none committed, nothing is stored and the
//!   key is given back, whatever the handler answered.
//! - **In the handler**, the request's extensions hold an [`IdempotencyContext`]: the client's
//!   key ([`IdempotencyContext::idempotency_key`]), dedup's key
//!   ([`IdempotencyContext::dedup_key`]) and the lease.
//! - **Sizes.** The request body is read once (up to the limit) and handed on. A response whose
//!   stored form exceeds `Policy::max_result_bytes` (64 KiB) is answered whole to the first
//!   caller and stored without its body: a retry gets the status and headers, an empty body and
//!   `Idempotent-Replayed-Body-Omitted: <length>`.
//! - **A client that goes away** does not cancel the handler: it runs on its own task to its
//!   end, and its response is stored for the retry. [`IdempotencyLayer::drain`] waits for such
//!   requests at shutdown.
//! - **A server killed mid-request** leaves the key held until its lease ends (30 s by default);
//!   then a retry runs the handler again, unless its effect committed with its stored response
//!   in one transaction ([`IdempotencyContext::stored_form`],
//!   [`IdempotencyContext::transaction_committed`]), in which case the retry gets the response
//!   and the effect stays single.
//!
//! # With axum
//! ```no_run
//! use axum::{Router, routing::post};
//! use dedup_core::{Dedup, MemoryStore};
//! use dedup_http::{IdempotencyConfig, IdempotencyLayer};
//!
//! # fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let config = IdempotencyConfig::new().with_route(|p| {
//!     p.extensions
//!         .get::<axum::extract::MatchedPath>()
//!         .map(|m| m.as_str().to_owned())
//! });
//! let app: Router = Router::new()
//!     .route("/orders", post(|body: String| async move { format!("created {body}") }))
//!     .route_layer(IdempotencyLayer::on(Dedup::new(MemoryStore::new()), config)?);
//! # Ok(()) }
//! ```
//! With hyper alone, map the request body into one that is `From<Bytes>` (`Full<Bytes>`, say)
//! before the layer.

mod config;
mod context;
mod key;
mod problem;
mod service;
mod stored;
mod tx;

pub use config::{Extractor, IdempotencyConfig, InFlight, StoreResponses};
pub use context::{Committed, DoNotStore, IdempotencyContext};
pub use key::{KeyHeaderError, MAX_CLIENT_KEY_LEN};
pub use problem::PROBLEM_TYPE_PREFIX;
pub use service::{Idempotency, IdempotencyLayer, LayerBody};
pub use stored::{BODY_NOT_STORED, REPLAYED};
pub use tx::{OpenTx, TxBegun, TxClaimer, TxFuture};
