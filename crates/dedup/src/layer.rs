//! The HTTP Idempotency-Key layer built from an [`Engine`]: the engine's store, caches and
//! owner ids; the layer's own policy, header and scope ([`IdempotencyConfig`]). A handler whose
//! effect is a write in the engine's Postgres runs it in a [`RequestTx`]: the writes and the
//! stored response commit in one transaction.

use std::ops::{Deref, DerefMut};

use bytes::Bytes;
use dedup_core::StoreError;
use dedup_core::typed::CodecError;
use dedup_http::{IdempotencyConfig, IdempotencyContext, IdempotencyLayer};
use dedup_pg::PgStore;
use http::Response;
use sqlx::postgres::{PgConnection, Postgres};

use crate::engine::{BuildError, Engine, EngineStore};

/// The layer [`Engine::http_layer`] builds.
pub type EngineLayer = IdempotencyLayer<EngineStore>;

impl Engine {
    /// A tower layer that runs each request carrying an `Idempotency-Key` once and replays its
    /// response to retries, on this engine. `config` holds the layer's own settings, its policy
    /// included (a running request's lease, how long responses are kept). [`Engine::shutdown`]
    /// waits for the requests it started.
    ///
    /// Its keys live in `<engine scope>/http` unless `config` sets a scope: apart from other
    /// services' (each engine has its own scope) and from the consumers' event keys (a client's
    /// key never meets an event's). (So an engine scoped `a/http` would share the keys of the HTTP
    /// layer of an engine scoped `a`: do not end a scope with `/http`.)
    ///
    /// # Errors
    /// A policy or in-flight wait that cannot work.
    pub fn http_layer(&self, mut config: IdempotencyConfig) -> Result<EngineLayer, BuildError> {
        if config.scope().is_none() {
            config = config.with_scope(self.http_scope().clone());
        }
        let member = self.member(None);
        let dedup = self.member_dedup(self.policy(), member.owner_prefix)?;
        let layer = IdempotencyLayer::on(dedup, config)
            .map_err(|e| BuildError::setting("http_layer", e))?;
        self.keep_layer(layer.clone());
        Ok(layer)
    }

    /// Begins the transaction of a request whose effect is a write in the engine's Postgres:
    /// write on it (it derefs to a `PgConnection`), then [`RequestTx::commit`] the response.
    /// `ctx` is the request's, from its extensions (axum: `Extension<IdempotencyContext>`).
    ///
    /// Once `begin` is called, the request stores only what a commit stores: if no
    /// [`RequestTx::commit`] succeeded (the begin failed, the transaction was dropped, the
    /// commit failed), the layer stores nothing and gives the key back without spending an
    /// attempt, whatever the route answers (a 503, a 422), and a retry runs the route again. A
    /// commit whose outcome stays unknown is read back: committed, its response is replayed.
    ///
    /// ```no_run
    /// # use dedup::http::{IdempotencyContext, RequestTx};
    /// # async fn create(engine: dedup::Engine, ctx: IdempotencyContext)
    /// #     -> Result<http::Response<bytes::Bytes>, Box<dyn std::error::Error>> {
    /// let mut tx = engine.begin(&ctx).await?;
    /// dedup::sqlx::query("INSERT INTO orders (customer) VALUES ('c-1')")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let response = http::Response::builder().status(201).body(bytes::Bytes::from("created"))?;
    /// Ok(tx.commit(response).await?) // the order and its stored response, in one commit
    /// # }
    /// ```
    ///
    /// # Errors
    /// Postgres is unavailable (answer 503: nothing ran, nothing is stored, a retry runs);
    /// [`NoPostgres`](crate::NoPostgres) from an in-memory engine.
    pub async fn begin(&self, ctx: &IdempotencyContext) -> Result<RequestTx, CommitError> {
        // From here on the request stores only what a commit stores: a begin that fails, a
        // transaction dropped, a commit that failed leave nothing stored, whatever the route
        // answers, and a retry runs again.
        ctx.transaction_opened();
        let store = self.postgres()?.clone();
        let tx = store
            .pool()
            .begin()
            .await
            .map_err(|e| dedup_pg::classify(e, false))?;
        Ok(RequestTx {
            tx,
            ctx: ctx.clone(),
            store,
        })
    }
}

/// A request's transaction ([`Engine::begin`]): the effect's writes, then the key's completion
/// with the stored response, committed together. Dropped without [`commit`](Self::commit), it
/// rolls back, and the request's response is not stored (the key is given back).
#[derive(Debug)]
pub struct RequestTx {
    tx: sqlx::Transaction<'static, Postgres>,
    ctx: IdempotencyContext,
    store: PgStore,
}

impl Deref for RequestTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for RequestTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

/// Why a [`RequestTx`] did not begin or commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// The response cannot be stored (too large for the policy, or not encodable). Nothing
    /// committed.
    #[error("the response cannot be stored: {0}")]
    Response(#[from] CodecError),
    /// The completion or the commit failed: the lease was taken over (`LeaseLost`), or Postgres
    /// failed. Nothing committed (an outcome still unknown is read back after the route
    /// answered): answer 503; nothing is stored, and a retry runs again.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The engine is in memory: it has no Postgres to begin a transaction on.
    #[error(transparent)]
    NoPostgres(#[from] crate::NoPostgres),
}

impl CommitError {
    /// Whether sending the request again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Response(_) | Self::NoPostgres(_) => false,
            Self::Store(e) => e.is_retryable(),
        }
    }
}

impl RequestTx {
    /// Completes the key with `response`'s stored form inside the transaction and commits (an
    /// unknown commit outcome is resolved by reading the record back). Returns the response
    /// marked [`Committed`](dedup_http::Committed): that stored form is what every retry gets,
    /// whatever the route answers the first caller.
    ///
    /// # Errors
    /// See [`CommitError`]; either way, nothing committed and nothing is stored.
    pub async fn commit(
        mut self,
        mut response: Response<Bytes>,
    ) -> Result<Response<Bytes>, CommitError> {
        let stored = self.ctx.stored_form(&response)?;
        let lease = self.ctx.lease().lease();
        PgStore::complete_in(&mut self.tx, lease, &stored).await?;
        if let Err(e) = self.store.commit(self.tx, lease).await {
            // An outcome still unknown is read back by the layer once the route answered.
            self.ctx.transaction_failed(&e);
            return Err(e.into());
        }
        let committed = self.ctx.transaction_committed(stored);
        response.extensions_mut().insert(committed);
        Ok(response)
    }
}
