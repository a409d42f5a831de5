//! What the layer does: which requests it takes, what it keeps, how it answers a retry.
//!
//! `IdempotencyConfig`: the header, scope, methods, whether the key is required, the body limit,
//! the stored-header allowlist (with a list never stored), `StoreResponses`, `InFlight`, route and
//! tenant extractors, and the policy.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::{InputError, MAX_WAIT, Policy, Scope};
use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};

/// Reads something from a request's head: a route template, a tenant.
pub type Extractor = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// Which responses are stored and replayed to retries.
#[derive(Clone)]
#[non_exhaustive]
pub enum StoreResponses {
    /// Every response, errors included (the default, as the IETF draft and Stripe do): once the
    /// handler answered, a retry gets that answer and never runs it again. A client that wants
    /// another try after an error uses a new key. A handler that opened a transaction
    /// ([`IdempotencyContext::transaction_opened`](crate::IdempotencyContext::transaction_opened))
    /// stores only what it committed, whatever this says.
    All,
    /// Only 2xx responses. Any other response is answered and not stored, and the key is given
    /// back without spending an attempt: a retry runs the handler again. Choose this only where
    /// a failed request is known to have had no effect.
    Successes,
    /// Those for which the function says yes.
    Custom(Arc<dyn Fn(StatusCode) -> bool + Send + Sync>),
}

impl StoreResponses {
    pub(crate) fn keeps(&self, status: StatusCode) -> bool {
        match self {
            Self::All => true,
            Self::Successes => status.is_success(),
            Self::Custom(f) => f(status),
        }
    }
}

impl fmt::Debug for StoreResponses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::All => f.write_str("All"),
            Self::Successes => f.write_str("Successes"),
            Self::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// What a retry gets while the first request with its key still runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum InFlight {
    /// 409 Conflict at once, with `Retry-After: 1` (the default, as the draft says).
    Conflict,
    /// Wait up to this long for the first request to finish and replay its response; 409 if it
    /// is still running then.
    Wait(Duration),
}

/// Headers never stored, whatever the allowlist says: cookies and hop-by-hop headers, and the
/// ones a replay computes afresh.
const NEVER_STORED: [&str; 14] = [
    "set-cookie",
    "set-cookie2",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
    "alt-svc",
];

/// The layer's settings. [`Default`] gives the values each setter names.
#[derive(Clone)]
pub struct IdempotencyConfig {
    pub(crate) header: HeaderName,
    pub(crate) scope: Scope,
    /// Whether [`with_scope`](IdempotencyConfig::with_scope) set it.
    scope_set: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) required: bool,
    pub(crate) max_request_bytes: usize,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) store: StoreResponses,
    pub(crate) in_flight: InFlight,
    pub(crate) route: Option<Extractor>,
    pub(crate) tenant: Option<Extractor>,
    pub(crate) policy: Policy,
}

impl fmt::Debug for IdempotencyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyConfig")
            .field("header", &self.header)
            .field("scope", &self.scope)
            .field("methods", &self.methods)
            .field("required", &self.required)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("stored_headers", &self.stored_headers)
            .field("store", &self.store)
            .field("in_flight", &self.in_flight)
            .field("route", &self.route.is_some())
            .field("tenant", &self.tenant.is_some())
            .field("policy", &self.policy)
            .finish()
    }
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            // A constant, valid by construction.
            scope: Scope::new("http").unwrap_or_else(|_| unreachable!()),
            scope_set: false,
            methods: vec![Method::POST, Method::PATCH],
            required: true,
            max_request_bytes: 1024 * 1024,
            stored_headers: [
                header::CONTENT_TYPE,
                header::CONTENT_LANGUAGE,
                header::CONTENT_ENCODING,
                header::CONTENT_DISPOSITION,
                header::LOCATION,
                header::ETAG,
                header::LAST_MODIFIED,
                header::CACHE_CONTROL,
                header::EXPIRES,
                header::VARY,
                header::LINK,
            ]
            .into(),
            store: StoreResponses::All,
            in_flight: InFlight::Conflict,
            route: None,
            tenant: None,
            policy: Policy::default(),
        }
    }
}

impl IdempotencyConfig {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The request header that carries the key (default `Idempotency-Key`).
    pub fn with_header(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// The scope every key of this layer lives in: two layers with different scopes never share
    /// keys. Default: built from an engine (`dedup::Engine::http_layer`), `<engine scope>/http`;
    /// otherwise `http`.
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.scope_set = true;
        self.scope = scope;
        self
    }

    /// The scope [`with_scope`](Self::with_scope) set, if it was set.
    pub fn scope(&self) -> Option<&Scope> {
        self.scope_set.then_some(&self.scope)
    }

    /// The methods the layer applies to (default POST and PATCH, the draft's non-idempotent
    /// methods). Other requests pass through untouched, their bodies unread.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Whether a request without the header is refused with 400 (the default) or passes through
    /// without deduplication.
    pub fn with_key_required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// The largest request body read (default 1 MiB); a larger one is refused with 413 before
    /// anything runs.
    pub fn with_max_request_bytes(mut self, max: usize) -> Self {
        self.max_request_bytes = max;
        self
    }

    /// Adds a response header to those stored and replayed (default: Content-Type,
    /// Content-Language, Content-Encoding, Content-Disposition, Location, ETag, Last-Modified,
    /// Cache-Control, Expires, Vary, Link).
    ///
    /// # Errors
    /// `Set-Cookie`, hop-by-hop headers, `Content-Length`, `Date` and `Alt-Svc` are never stored.
    pub fn with_stored_header(mut self, name: HeaderName) -> Result<Self, InputError> {
        if NEVER_STORED.contains(&name.as_str()) {
            return Err(InputError::Setting {
                setting: "stored_header",
                problem: "cookies, hop-by-hop headers, Content-Length, Date and Alt-Svc are never stored",
            });
        }
        if !self.stored_headers.contains(&name) {
            self.stored_headers.push(name);
        }
        Ok(self)
    }

    /// Which responses are stored (default [`StoreResponses::All`]).
    pub fn with_store(mut self, store: StoreResponses) -> Self {
        self.store = store;
        self
    }

    /// What a retry gets while the first request runs (default [`InFlight::Conflict`]).
    ///
    /// # Errors
    /// A wait over [`MAX_WAIT`].
    pub fn with_in_flight(mut self, in_flight: InFlight) -> Result<Self, InputError> {
        if let InFlight::Wait(d) = in_flight
            && d > MAX_WAIT
        {
            return Err(InputError::Setting {
                setting: "in_flight",
                problem: "the wait must be at most a week",
            });
        }
        self.in_flight = in_flight;
        Ok(self)
    }

    /// How a request's route is named in its key (default: the request's path, so
    /// `/orders/1` and `/orders/2` are different routes; under axum's `nest` that path has the
    /// nest's prefix taken off, so set a route there). With axum, name the route template:
    /// `|p| p.extensions.get::<axum::extract::MatchedPath>().map(|m| m.as_str().to_owned())`
    /// (add the layer with `route_layer` so the template is known). The method is always part
    /// of the key.
    pub fn with_route(
        mut self,
        route: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.route = Some(Arc::new(route));
        self
    }

    /// The tenant a request belongs to (an account id from a verified token, say): the same key
    /// sent by two tenants is two keys. Once set, a request for which it returns `None` is
    /// refused (400 `tenant-unknown`) rather than sharing a key space with every other such
    /// request. Default: none (keys are shared by every caller of a route).
    pub fn with_tenant(
        mut self,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.tenant = Some(Arc::new(tenant));
        self
    }

    /// The policy the layer's claims use (a running request's lease, how long responses are
    /// kept, the largest stored response).
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The dedup policy: the lease a running request holds (default 30 s: past it, a retry runs
    /// the request again), how long responses are kept (7 days), and the largest stored
    /// response (64 KiB: a larger one is answered and stored without its body).
    ///
    /// # Errors
    /// A policy no store can honour.
    pub fn with_policy(mut self, policy: Policy) -> Result<Self, InputError> {
        policy.validate()?;
        self.policy = policy;
        Ok(self)
    }

    pub(crate) fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub(crate) fn stores_header(&self, name: &HeaderName) -> bool {
        self.stored_headers.contains(name) && !NEVER_STORED.contains(&name.as_str())
    }
}
