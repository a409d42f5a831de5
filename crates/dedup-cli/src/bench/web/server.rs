//! The HTTP contenders' server: an axum route on loopback, on a runtime of its own whose threads
//! are named [`THREAD`], so that its CPU time is told apart from the client's (`procs.rs`). The
//! route, its Postgres pool and, behind the layer, its engine are all made on that runtime, as a
//! service's would be.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Response, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use dedup::http::{IdempotencyConfig, IdempotencyContext};
use dedup::{Engine, MigrationMode, Scope, TieredConfig};
use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::connect::{CliError, connect_pg};

/// The name of the server runtime's threads (15 bytes: Linux keeps no more of a thread's name).
pub(super) const THREAD: &str = "dedup-bench-srv";

/// What the route does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// (hn): answers at once, touching no database.
    Floor,
    /// (h0): one autocommit `INSERT` of the request's ledger row, no idempotency.
    Plain,
    /// (h0x): `INSERT ... ON CONFLICT DO NOTHING` on the request's key; a duplicate is a 409.
    OnConflict,
    /// (h1), (h3): behind the layer in lease mode, the ledger row in a transaction of its own.
    Lease,
    /// (h2): behind the transactional layer (`Engine::http_tx_layer`): the claim, the ledger
    /// row and the stored response in one transaction (`Engine::begin`, `RequestTx::commit`).
    Tx,
    /// (h2l): the same route behind the lease-mode layer: the claim commits first, then
    /// `Engine::begin` opens a transaction of its own for the row and the stored response.
    TxUnderLease,
}

/// How the server is made.
#[derive(Clone, Debug)]
pub(super) struct Setup {
    pub(super) route: Route,
    pub(super) database_url: String,
    pub(super) pg_connections: u32,
    pub(super) redis_url: String,
    /// The run and the contender the ledger rows are written under.
    pub(super) run: String,
    pub(super) contender: &'static str,
    /// The layer's scope (the run's `bench-<tag>-<run>`, which the cleanup knows).
    pub(super) scope: String,
    /// Whether the engine keeps an L1 (false: one entry, so Redis answers).
    pub(super) l1: bool,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    engine: Option<Engine>,
    run: Arc<str>,
    contender: &'static str,
}

/// A server running on its own runtime.
pub(super) struct Server {
    pub(super) addr: SocketAddr,
    runtime: tokio::runtime::Runtime,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<()>>,
    engine: Option<Engine>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Starts the route `setup` says on a runtime of two worker threads.
    pub(super) async fn start(setup: Setup) -> Result<Self, CliError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(THREAD)
            .enable_all()
            .build()
            .map_err(|e| CliError::Failed(format!("the HTTP server's runtime: {e}")))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let built = runtime
            .spawn(async move {
                let pool = connect_pg(&setup.database_url, setup.pg_connections).await?;
                let mut engine = None;
                let layer = if matches!(setup.route, Route::Lease | Route::Tx | Route::TxUnderLease)
                {
                    let mut tiers = TieredConfig::default();
                    if !setup.l1 {
                        tiers = tiers.with_l1_capacity(1, 1 << 20);
                    }
                    let built = Engine::builder()
                        .postgres(pool.clone())
                        .redis_url(&setup.redis_url)
                        .scope(setup.scope.clone())
                        .tiers(tiers)
                        .migrations(MigrationMode::Verify)
                        .build()
                        .await
                        .map_err(|e| CliError::Failed(format!("the engine: {e}")))?;
                    let scope = Scope::new(setup.scope.clone())
                        .map_err(|e| CliError::Config(format!("scope: {e}")))?;
                    let config = IdempotencyConfig::new().with_scope(scope);
                    // (h2): the key claimed in the route's own transaction, one commit.
                    let layer = if setup.route == Route::Tx {
                        built.http_tx_layer(config)
                    } else {
                        built.http_layer(config)
                    }
                    .map_err(|e| CliError::Failed(format!("the layer: {e}")))?;
                    engine = Some(built);
                    Some(layer)
                } else {
                    None
                };
                let app = App {
                    pool,
                    engine: engine.clone(),
                    run: setup.run.into(),
                    contender: setup.contender,
                };
                let router = match setup.route {
                    Route::Floor => Router::new().route("/orders", post(floor)),
                    Route::Plain => Router::new().route("/orders", post(plain)),
                    Route::OnConflict => Router::new().route("/orders", post(on_conflict)),
                    Route::Lease => Router::new().route("/orders", post(lease)),
                    Route::Tx | Route::TxUnderLease => Router::new().route("/orders", post(in_tx)),
                };
                let router = match layer {
                    Some(layer) => router.route_layer(layer),
                    None => router,
                };
                let router = router.with_state(app);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .map_err(|e| CliError::Failed(format!("binding the HTTP server: {e}")))?;
                let addr = listener
                    .local_addr()
                    .map_err(|e| CliError::Failed(format!("the HTTP server's address: {e}")))?;
                let served = tokio::spawn(async move {
                    let serve = axum::serve(listener, router).with_graceful_shutdown(async {
                        let _ = stopped.await;
                    });
                    if let Err(e) = serve.await {
                        eprintln!("[bench] the HTTP server stopped: {e}");
                    }
                });
                Ok::<_, CliError>((addr, served, engine))
            })
            .await
            .map_err(|e| CliError::Failed(format!("starting the HTTP server: {e}")))?;
        let (addr, served, engine) = match built {
            Ok(b) => b,
            Err(e) => {
                runtime.shutdown_background();
                return Err(e);
            }
        };
        Ok(Self {
            addr,
            runtime,
            stop: Some(stop),
            served: Some(served),
            engine,
        })
    }

    /// The engine behind the layer, where there is one.
    pub(super) fn engine(&self) -> Option<&Engine> {
        self.engine.as_ref()
    }

    /// Stops taking connections, waits for the requests the layer started, shuts the engine down
    /// and the runtime with it.
    pub(super) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            let _ = served.await;
        }
        if let Some(engine) = self.engine.take() {
            let _ = self
                .runtime
                .spawn(async move { engine.shutdown().await })
                .await;
        }
        self.runtime.shutdown_background();
    }
}

fn answer(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r
}

fn failed(e: &dyn std::fmt::Display) -> Response<Body> {
    let mut r = Response::new(Body::from(format!("failed: {e}")));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    r
}

fn key_of(headers: &HeaderMap) -> &str {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

const INSERT_LEDGER: &str =
    "INSERT INTO dedup_bench_ledger (run, contender, key, amount) VALUES ($1, $2, $3, 1)";

async fn floor(_body: Bytes) -> Response<Body> {
    answer(StatusCode::CREATED, "created")
}

async fn plain(State(app): State<App>, headers: HeaderMap, _body: Bytes) -> Response<Body> {
    match sqlx::query(INSERT_LEDGER)
        .bind(&*app.run)
        .bind(app.contender)
        .bind(key_of(&headers))
        .execute(&app.pool)
        .await
    {
        Ok(_) => answer(StatusCode::CREATED, "created"),
        Err(e) => failed(&e),
    }
}

async fn on_conflict(State(app): State<App>, headers: HeaderMap, _body: Bytes) -> Response<Body> {
    match sqlx::query(
        "INSERT INTO dedup_bench_ledger_unique (run, key, amount) VALUES ($1, $2, 1) \
         ON CONFLICT DO NOTHING",
    )
    .bind(&*app.run)
    .bind(key_of(&headers))
    .execute(&app.pool)
    .await
    {
        Ok(done) if done.rows_affected() == 1 => answer(StatusCode::CREATED, "created"),
        Ok(_) => answer(
            StatusCode::CONFLICT,
            "a request with this id was made before",
        ),
        Err(e) => failed(&e),
    }
}

async fn lease(
    State(app): State<App>,
    ctx: axum::Extension<IdempotencyContext>,
    _body: Bytes,
) -> Response<Body> {
    match sqlx::query(INSERT_LEDGER)
        .bind(&*app.run)
        .bind(app.contender)
        .bind(ctx.idempotency_key())
        .execute(&app.pool)
        .await
    {
        Ok(_) => answer(StatusCode::CREATED, "created"),
        Err(e) => failed(&e),
    }
}

async fn in_tx(
    State(app): State<App>,
    ctx: axum::Extension<IdempotencyContext>,
    _body: Bytes,
) -> Response<Body> {
    let Some(engine) = app.engine.as_ref() else {
        return failed(&"no engine");
    };
    let mut tx = match engine.begin(&ctx).await {
        Ok(tx) => tx,
        Err(e) => return failed(&e),
    };
    if let Err(e) = sqlx::query(INSERT_LEDGER)
        .bind(&*app.run)
        .bind(app.contender)
        .bind(ctx.idempotency_key())
        .execute(&mut *tx)
        .await
    {
        return failed(&e);
    }
    let mut response = Response::new(Bytes::from_static(b"created"));
    *response.status_mut() = StatusCode::CREATED;
    match tx.commit(response).await {
        Ok(r) => r.map(Body::from),
        Err(e) => failed(&e),
    }
}
