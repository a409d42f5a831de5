//! The HTTP Idempotency-Key layer built from an [`Engine`]: the engine's store, caches and
//! owner ids; the layer's own policy, header and scope ([`IdempotencyConfig`]). A handler whose
//! effect is a write in the engine's Postgres runs it in a [`RequestTx`]: the writes and the
//! stored response commit in one transaction. Under [`Engine::http_tx_layer`] the key's claim is
//! in that transaction too (one commit per request); under [`Engine::http_layer`] the claim
//! commits first, on its own (lease mode), and [`Engine::begin`] opens the transaction.

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytes::Bytes;
use dedup_core::outbox::OutboxMessage;
use dedup_core::typed::CodecError;
use dedup_core::{BatchCache, ClaimRequest, InputError, Lease, Store, StoreError};
use dedup_http::{
    IdempotencyConfig, IdempotencyContext, IdempotencyLayer, OpenTx, TxBegun, TxClaimer, TxFuture,
};
use dedup_pg::outbox::OutboxWriter;
use dedup_pg::{ClaimedTx, PgStore, TxBatchConfig, TxClaim};
use http::Response;
use sqlx::postgres::{PgConnection, Postgres};

use crate::engine::{BuildError, Engine, EngineStore};

/// The layer [`Engine::http_layer`] and [`Engine::http_tx_layer`] build.
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

    /// The layer for routes whose effect is a write in the engine's Postgres: each request's key
    /// is claimed inside a transaction the layer holds open while the route runs, and the route
    /// writes on it ([`Engine::begin`] hands it over) and commits its response with it. The
    /// claim, the effect and the stored response are one commit, where [`http_layer`]
    /// (lease mode) commits the claim first on its own.
    ///
    /// Everything else is as [`http_layer`](Self::http_layer) answers it (replays from the
    /// caches, 409 or a wait for a key in flight, 422 for a key reused); what is stored is what
    /// the route's commit stored: nothing, with the key given back and no attempt spent, if it
    /// began and did not commit. A route under it that never calls [`Engine::begin`] has its
    /// response stored in the layer's transaction, as `http_layer` would store it. Each request
    /// holds a Postgres connection from its claim to its commit, and a server stopped mid-request
    /// holds its key until Postgres ends the idle session (the policy's lease).
    ///
    /// # Errors
    /// A policy or in-flight wait that cannot work; an in-memory engine (no Postgres).
    ///
    /// [`http_layer`]: Self::http_layer
    pub fn http_tx_layer(&self, mut config: IdempotencyConfig) -> Result<EngineLayer, BuildError> {
        if config.scope().is_none() {
            config = config.with_scope(self.http_scope().clone());
        }
        let pg = self
            .postgres()
            .map_err(|e| BuildError::setting("http_tx_layer", e))?
            .clone();
        let member = self.member(None);
        let dedup = self.member_dedup(self.policy(), member.owner_prefix)?;
        // A request ends within the lease, or Postgres ends its session (nothing of it commits).
        let lease = config.policy().lease;
        let claimer = Arc::new(PgClaimer {
            pg,
            caches: self.caches(),
            store: self.store().clone(),
            config: TxBatchConfig::default().with_idle_timeout(lease),
        });
        let layer = IdempotencyLayer::transactional(dedup, config, claimer)
            .map_err(|e| BuildError::setting("http_tx_layer", e))?;
        self.keep_layer(layer.clone());
        Ok(layer)
    }

    /// Begins the transaction of a request whose effect is a write in the engine's Postgres:
    /// write on it (it derefs to a `PgConnection`, on which sqlx's `begin()` opens a
    /// savepoint), then [`RequestTx::commit`] the response.
    /// `ctx` is the request's, from its extensions (axum: `Extension<IdempotencyContext>`).
    ///
    /// Under [`http_tx_layer`](Self::http_tx_layer) it hands over the transaction the layer
    /// claimed the key in, so the claim, the writes and the stored response are one commit; a
    /// request has that one transaction, and a second `begin` answers [`CommitError::Taken`].
    /// Under [`http_layer`](Self::http_layer) it begins a transaction of its own (the claim
    /// committed before the route ran).
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
        // Under `http_tx_layer`, the transaction the key was claimed in, and no other.
        if ctx.is_transactional() {
            let Some(open) = ctx.take_transaction() else {
                return Err(CommitError::Taken);
            };
            return match open.into_any().downcast::<PgOpenTx>() {
                Ok(open) => Ok(RequestTx {
                    held: Some(Held::Claimed(open)),
                    ctx: ctx.clone(),
                    pg: store,
                    outbox: None,
                }),
                Err(_) => Err(CommitError::Store(StoreError::unavailable(ForeignTx))),
            };
        }
        let tx = store
            .pool()
            .begin()
            .await
            .map_err(|e| dedup_pg::classify(e, false))?;
        Ok(RequestTx {
            held: Some(Held::Own {
                tx,
                store: store.clone(),
            }),
            ctx: ctx.clone(),
            pg: store,
            outbox: None,
        })
    }
}

/// A transaction from another layer than the engine's.
#[derive(Debug, thiserror::Error)]
#[error("the request's transaction was not opened by this engine's layer")]
struct ForeignTx;

/// The transactional layer's claimer: the engine's caches, then a claim inside a transaction on
/// its Postgres ([`PgStore::begin_claim`]).
#[derive(Debug)]
struct PgClaimer {
    pg: PgStore,
    caches: Arc<dyn BatchCache>,
    store: EngineStore,
    config: TxBatchConfig,
}

impl TxClaimer for PgClaimer {
    fn begin<'a>(&'a self, req: &'a ClaimRequest) -> TxFuture<'a, Result<TxBegun, StoreError>> {
        Box::pin(async move {
            // A key the caches hold settled is answered without a transaction.
            if let Some(Some(settled)) = self
                .caches
                .settled_many(std::slice::from_ref(req))
                .await
                .pop()
            {
                return Ok(TxBegun::Answered(settled));
            }
            match self.pg.begin_claim(req, self.config).await? {
                TxClaim::Acquired(tx) => Ok(TxBegun::Acquired(Box::new(PgOpenTx {
                    tx,
                    store: self.store.clone(),
                }))),
                TxClaim::Answered(outcome) => Ok(TxBegun::Answered(outcome)),
                _ => Err(StoreError::unavailable(ForeignTx)),
            }
        })
    }
}

/// A key claimed in an open transaction, with the store its commit is copied to.
#[derive(Debug)]
struct PgOpenTx {
    tx: ClaimedTx,
    store: EngineStore,
}

impl OpenTx for PgOpenTx {
    fn lease(&self) -> &Lease {
        self.tx.lease()
    }

    fn commit(self: Box<Self>, stored: Bytes) -> TxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            let Self { tx, store } = *self;
            let lease = tx.lease().clone();
            tx.commit(&stored).await?;
            // Only now, after the commit: the caches' copy.
            store.committed(&lease, &stored).await;
            Ok(())
        })
    }

    fn rollback(self: Box<Self>) -> TxFuture<'static, ()> {
        Box::pin(async move { self.tx.rollback().await })
    }

    fn fail(
        self: Box<Self>,
        reason: String,
        permanent: bool,
    ) -> TxFuture<'static, Result<dedup_core::AfterFailure, StoreError>> {
        Box::pin(async move { self.tx.fail(&reason, permanent).await })
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// A request's transaction ([`Engine::begin`]): the effect's writes, then the key's completion
/// with the stored response, committed together. Dropped without [`commit`](Self::commit), it
/// rolls back, and the request's response is not stored (the key is given back).
#[derive(Debug)]
pub struct RequestTx {
    /// `None` only once committed.
    held: Option<Held>,
    ctx: IdempotencyContext,
    /// The engine's store (its outbox relay is woken after a commit that published).
    pg: PgStore,
    /// What the route queued on the outbox, written just before the completion.
    outbox: Option<OutboxWriter>,
}

/// The transaction a [`RequestTx`] writes on.
#[derive(Debug)]
enum Held {
    /// Begun by [`Engine::begin`] under a lease-mode layer.
    Own {
        tx: sqlx::Transaction<'static, Postgres>,
        store: PgStore,
    },
    /// The transactional layer's, the key claimed in it.
    Claimed(Box<PgOpenTx>),
}

impl Deref for RequestTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.held {
            Some(Held::Own { tx, .. }) => tx,
            Some(Held::Claimed(open)) => &open.tx,
            None => unreachable!("a RequestTx is consumed by its commit"),
        }
    }
}

impl DerefMut for RequestTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.held {
            Some(Held::Own { tx, .. }) => tx,
            Some(Held::Claimed(open)) => &mut open.tx,
            None => unreachable!("a RequestTx is consumed by its commit"),
        }
    }
}

impl Drop for RequestTx {
    fn drop(&mut self) {
        // Not committed: the layer's transaction goes back to the layer, which rolls it back as
        // soon as the route answered (rather than when its connection is next used).
        if let Some(Held::Claimed(open)) = self.held.take() {
            self.ctx.return_transaction(open);
        }
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
    /// Under [`Engine::http_tx_layer`], the request's one transaction (the one its key is
    /// claimed in) was begun before: a request begins once. Nothing is stored; a retry runs the
    /// route again.
    #[error(
        "the request's transaction was begun before: under http_tx_layer a request begins once"
    )]
    Taken,
}

impl CommitError {
    /// Whether sending the request again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Response(_) | Self::NoPostgres(_) | Self::Taken => false,
            Self::Store(e) => e.is_retryable(),
        }
    }
}

impl RequestTx {
    /// Queues `message` on the outbox (docs/OUTBOX.md): written in this transaction when it
    /// commits, with the route's writes and the stored response, and published by the relay
    /// once that commits; never if the request's transaction rolls back. Its derived key counts
    /// this request's messages per topic, from the request's idempotency key, so a request run
    /// again after a rollback derives the same keys.
    ///
    /// # Errors
    /// A message the relay could never publish: an invalid topic name, or one over
    /// [`OutboxMessage::MAX_BYTES`].
    pub fn publish(&mut self, message: OutboxMessage) -> Result<(), InputError> {
        let writer = match &mut self.outbox {
            Some(w) => w,
            None => {
                let key = self.ctx.lease().lease().key.clone();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                let event_ms = dedup_core::outbox::event_ms(&key, now);
                self.outbox.insert(OutboxWriter::new(key, event_ms))
            }
        };
        writer.publish(message)
    }

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
        // A response that cannot be stored leaves the transaction to its drop (rolled back).
        let stored = self.ctx.stored_form(&response)?;
        // What the route queued, in one statement before the completion; a failure leaves the
        // transaction to its drop (rolled back).
        let published = match self.outbox.take() {
            Some(mut w) if w.pending() > 0 => {
                let conn: &mut PgConnection = &mut self;
                w.write(conn).await?;
                true
            }
            _ => false,
        };
        let committed = match self.held.take() {
            Some(Held::Own { mut tx, store }) => {
                let lease = self.ctx.lease().lease();
                PgStore::complete_in(&mut tx, lease, &stored).await?;
                store.commit(tx, lease).await
            }
            Some(Held::Claimed(open)) => open.commit(stored.clone()).await,
            None => unreachable!("a RequestTx is consumed by its commit"),
        };
        if let Err(e) = committed {
            // An outcome still unknown is read back by the layer once the route answered.
            self.ctx.transaction_failed(&e);
            return Err(e.into());
        }
        if published {
            self.pg.wake_outbox();
        }
        let committed = self.ctx.transaction_committed(stored);
        response.extensions_mut().insert(committed);
        Ok(response)
    }
}
