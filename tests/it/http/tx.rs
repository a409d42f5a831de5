//! The transactional path of the layer (`Engine::begin`, `RequestTx::commit`): a request whose
//! transaction `begin` opened stores a response only through its commit; one that began and did
//! not commit gives its key back, whatever it answers. Under both layers: `http_layer` (the
//! claim committed first, `begin` opens a transaction of its own) and `http_tx_layer` (the key
//! claimed in the request's one transaction, which `begin` hands over: one commit).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use dedup::Engine;
use dedup::http::{CommitError, EngineLayer, IdempotencyConfig, IdempotencyContext, InFlight};
use dedup_core::Store;
use dedup_http::REPLAYED;
use sqlx::PgPool;

use super::{client, post_key, serve};
use crate::support::test_config;

async fn engine(pool: &PgPool) -> Engine {
    let engine = Engine::builder()
        .postgres(pool.clone())
        .tiers(test_config())
        .scope("orders")
        .build()
        .await
        .unwrap();
    sqlx::query("CREATE TABLE payments (note text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    engine
}

async fn payments(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Which layer a test's routes run under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `http_layer`: the claim commits first; `begin` opens a transaction of its own.
    Lease,
    /// `http_tx_layer`: the key is claimed in the request's one transaction.
    Tx,
}

fn layer(engine: &Engine, kind: Kind, config: IdempotencyConfig) -> EngineLayer {
    match kind {
        Kind::Lease => engine.http_layer(config),
        Kind::Tx => engine.http_tx_layer(config),
    }
    .unwrap()
}

/// A route counting its runs, given the engine and the request's context.
fn route<F, Fut>(engine: &Engine, runs: &Arc<AtomicU32>, f: F) -> axum::routing::MethodRouter
where
    F: Fn(Engine, IdempotencyContext) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response> + Send + 'static,
{
    let (engine, runs) = (engine.clone(), runs.clone());
    post(move |Extension(ctx): Extension<IdempotencyContext>| {
        runs.fetch_add(1, Ordering::SeqCst);
        f(engine.clone(), ctx)
    })
}

/// Under the default `StoreResponses::All`, a route that began its transaction and answered 503
/// without committing (and without `DoNotStore`) has nothing stored: the retry runs it again. So
/// does one that began and answered 422, and one that began and panicked.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_route_that_began_and_did_not_commit_runs_again_whatever_it_answered(pool: PgPool) {
    began_and_did_not_commit(pool, Kind::Lease).await;
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_route_that_began_and_did_not_commit_runs_again(pool: PgPool) {
    began_and_did_not_commit(pool, Kind::Tx).await;
}

async fn began_and_did_not_commit(pool: PgPool, kind: Kind) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route(
            "/unavailable",
            route(&engine, &runs, |engine, ctx| async move {
                let mut tx = engine.begin(&ctx).await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('rolled back')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                drop(tx);
                (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
            }),
        )
        .route(
            "/refused",
            route(&engine, &runs, |engine, ctx| async move {
                let _tx = engine.begin(&ctx).await.unwrap();
                (StatusCode::UNPROCESSABLE_ENTITY, "no such account").into_response()
            }),
        )
        .route(
            "/panics",
            route(&engine, &runs, |engine, ctx| async move {
                let _tx = engine.begin(&ctx).await.unwrap();
                panic!("the route failed mid-transaction")
            }),
        )
        .layer(layer(&engine, kind, IdempotencyConfig::new()));
    let base = serve(app).await;
    let c = client();
    for (path, status) in [
        ("/unavailable", StatusCode::SERVICE_UNAVAILABLE),
        ("/refused", StatusCode::UNPROCESSABLE_ENTITY),
        ("/panics", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        let url = format!("{base}{path}");
        runs.store(0, Ordering::SeqCst);
        for attempt in 1..=3 {
            let (s, h, b) = post_key(&c, &url, Some("p-1"), "{}").await;
            assert_eq!(s, status, "{path}, attempt {attempt}: {b}");
            assert!(
                !h.contains_key(REPLAYED),
                "{path}, attempt {attempt}: a response replayed although no commit stored it: {b}"
            );
            assert_eq!(runs.load(Ordering::SeqCst), attempt, "{path}");
        }
    }
    assert_eq!(payments(&pool).await, 0, "every transaction rolled back");
}

/// A route whose repository code opens a transaction of its own on the request's (sqlx's
/// `begin()` and `commit()`, as composable code does) gets a savepoint: its COMMIT does not
/// commit the request's transaction early. So a route that fails after that COMMIT leaves no
/// payment behind, its retry pays once, and the next is replayed: one payment in all.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_nested_commit_in_a_route_commits_nothing_before_the_request(pool: PgPool) {
    nested_commit(pool, Kind::Lease).await;
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_nested_commit_commits_nothing_before_the_request(pool: PgPool) {
    nested_commit(pool, Kind::Tx).await;
}

async fn nested_commit(pool: PgPool, kind: Kind) {
    use sqlx::Connection as _;
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/pay",
            route(&engine, &runs, move |engine, ctx| {
                let first = counted.load(Ordering::SeqCst) == 1;
                async move {
                    let mut tx = engine.begin(&ctx).await.unwrap();
                    let mut repository = (*tx).begin().await.unwrap();
                    sqlx::query("INSERT INTO payments VALUES ('paid')")
                        .execute(&mut *repository)
                        .await
                        .unwrap();
                    repository.commit().await.unwrap();
                    if first {
                        return (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "failed after the repository",
                        )
                            .into_response();
                    }
                    let created = axum::http::Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Bytes::from("paid"))
                        .unwrap();
                    tx.commit(created).await.unwrap().map(Into::into)
                }
            }),
        )
        .layer(layer(&engine, kind, IdempotencyConfig::new()));
    let base = serve(app).await;
    let c = client();
    let url = format!("{base}/pay");
    let (s, _, b) = post_key(&c, &url, Some("n-1"), "{}").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert_eq!(
        payments(&pool).await,
        0,
        "the repository's COMMIT committed nothing of the request's transaction"
    );
    let (s, h, b) = post_key(&c, &url, Some("n-1"), "{}").await;
    assert_eq!(
        (s, h.contains_key(REPLAYED)),
        (StatusCode::CREATED, false),
        "{b}"
    );
    let (s, h, b) = post_key(&c, &url, Some("n-1"), "{}").await;
    assert_eq!(
        (s, h.contains_key(REPLAYED)),
        (StatusCode::CREATED, true),
        "{b}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(payments(&pool).await, 1, "one payment in all");
}

/// A route that committed has its committed response replayed: also when it began another
/// transaction it dropped, and when it answered the first caller something else after the commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_route_that_committed_is_replayed(pool: PgPool) {
    committed_is_replayed(pool, Kind::Lease).await;
}

/// The same under the transactional layer, where a request has one transaction: a second
/// `begin` (after one dropped) answers `CommitError::Taken`, stores nothing, and the retry runs.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_route_that_committed_is_replayed(pool: PgPool) {
    committed_is_replayed(pool, Kind::Tx).await;
}

async fn committed_is_replayed(pool: PgPool, kind: Kind) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let created = || {
        axum::http::Response::builder()
            .status(StatusCode::CREATED)
            .body(Bytes::from("paid"))
            .unwrap()
    };
    let app = Router::new()
        .route(
            "/pay",
            route(&engine, &runs, move |engine, ctx| async move {
                let mut tx = engine.begin(&ctx).await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('paid')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit(created()).await.unwrap().map(Into::into)
            }),
        )
        .route(
            "/twice",
            route(&engine, &runs, move |engine, ctx| async move {
                let mut dropped = engine.begin(&ctx).await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('dropped')")
                    .execute(&mut *dropped)
                    .await
                    .unwrap();
                drop(dropped);
                let mut tx = match engine.begin(&ctx).await {
                    Ok(tx) => tx,
                    Err(e @ CommitError::Taken) => {
                        assert!(!e.is_retryable());
                        return (StatusCode::SERVICE_UNAVAILABLE, "begun twice").into_response();
                    }
                    Err(e) => panic!("{e}"),
                };
                sqlx::query("INSERT INTO payments VALUES ('twice')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit(created()).await.unwrap().map(Into::into)
            }),
        )
        .route(
            "/other",
            route(&engine, &runs, move |engine, ctx| async move {
                let mut tx = engine.begin(&ctx).await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('other')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let _ = tx.commit(created()).await.unwrap();
                (StatusCode::OK, "answered after the commit").into_response()
            }),
        )
        .layer(layer(&engine, kind, IdempotencyConfig::new()));
    let base = serve(app).await;
    let c = client();
    if kind == Kind::Tx {
        // The dropped transaction's write never commits, and nothing is stored.
        let url = format!("{base}/twice");
        for attempt in 1..=2 {
            let (s, h, b) = post_key(&c, &url, Some("t-1"), "{}").await;
            assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
            assert!(!h.contains_key(REPLAYED));
            assert_eq!(runs.load(Ordering::SeqCst), attempt);
        }
        assert_eq!(payments(&pool).await, 0);
        runs.store(0, Ordering::SeqCst);
    }
    let paths: &[&str] = match kind {
        Kind::Lease => &["/pay", "/twice", "/other"],
        Kind::Tx => &["/pay", "/other"],
    };
    for (n, &path) in paths.iter().enumerate() {
        let url = format!("{base}{path}");
        let (s, h, _) = post_key(&c, &url, Some("p-1"), "{}").await;
        assert!(s.is_success() && !h.contains_key(REPLAYED), "{path}: {s}");
        for _ in 0..2 {
            let (s, h, b) = post_key(&c, &url, Some("p-1"), "{}").await;
            assert_eq!(
                (s, b.as_str(), h.get(REPLAYED).map(|v| v.to_str().unwrap())),
                (StatusCode::CREATED, "paid", Some("true")),
                "{path}"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), n as u32 + 1, "{path}");
        assert_eq!(payments(&pool).await, n as i64 + 1, "{path}");
    }
}

/// The context names the client's key (`idempotency_key`, as sent, unquoted) and dedup's key
/// (`dedup_key`: the layer's scope, tenant, method and route, and the client's key).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_context_gives_the_clients_key_and_dedups_key(pool: PgPool) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route(
            "/keys",
            route(&engine, &runs, |_, ctx| async move {
                let dedup_key = ctx.dedup_key();
                format!(
                    "{} {} {}",
                    ctx.idempotency_key(),
                    dedup_key.scope().as_str(),
                    String::from_utf8_lossy(dedup_key.key_bytes())
                )
                .into_response()
            }),
        )
        .layer(engine.http_layer(IdempotencyConfig::new()).unwrap());
    let url = format!("{}/keys", serve(app).await);
    let c = client();
    let (s, _, b) = post_key(&c, &url, Some("\"k-1\""), "").await;
    assert_eq!(
        (s, b.as_str()),
        (StatusCode::OK, "k-1 orders/http 0:|10:POST /keys|k-1")
    );
    let (_, _, b) = post_key(&c, &url, Some("Stripe_k:3"), "").await;
    assert_eq!(b, "Stripe_k:3 orders/http 0:|10:POST /keys|Stripe_k:3");
}

/// A commit whose outcome stays unknown (the connection dropped on COMMIT, and the read-back
/// failed too) is read back by the layer once the route answered: committed, the retry gets the
/// committed response; rolled back, the key is given back and the retry runs again.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_commit_of_unknown_outcome_is_read_back(pool: PgPool) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let unknown = || dedup::StoreError::outcome_unknown(std::io::Error::other("connection reset"));
    let app = Router::new()
        .route(
            "/committed",
            route(&engine, &runs, move |engine, ctx| async move {
                ctx.transaction_opened();
                let mut tx = engine.pool().unwrap().begin().await.unwrap();
                let paid = axum::http::Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Bytes::from("paid"))
                    .unwrap();
                let stored = ctx.stored_form(&paid).unwrap();
                dedup::PgStore::complete_in(&mut tx, ctx.lease().lease(), &stored)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                ctx.transaction_failed(&unknown());
                (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
            }),
        )
        .route(
            "/rolled-back",
            route(&engine, &runs, move |engine, ctx| async move {
                ctx.transaction_opened();
                let mut tx = engine.pool().unwrap().begin().await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('rolled back')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                drop(tx);
                ctx.transaction_failed(&unknown());
                (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
            }),
        )
        .layer(engine.http_layer(IdempotencyConfig::new()).unwrap());
    let base = serve(app).await;
    let c = client();
    let url = format!("{base}/committed");
    let (s, _, _) = post_key(&c, &url, Some("u-1"), "").await;
    assert_eq!(
        s,
        StatusCode::SERVICE_UNAVAILABLE,
        "the first caller gets the route's answer"
    );
    let (s, h, b) = post_key(&c, &url, Some("u-1"), "").await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::CREATED, "paid", true)
    );
    let url = format!("{base}/rolled-back");
    for attempt in 1..=3 {
        let (s, h, _) = post_key(&c, &url, Some("u-2"), "").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!h.contains_key(REPLAYED), "attempt {attempt}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(payments(&pool).await, 0);
}

/// Under the transactional layer the key's claim is in the route's transaction: while the route
/// runs no record is committed (the claim is not a commit of its own), a duplicate meanwhile is
/// answered 409 at once (it does not wait on the first's transaction), or under `InFlight::Wait`
/// gets the first's response once it committed; the effect ran once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_the_claim_commits_with_the_effect_and_a_duplicate_waits_on_nothing(
    pool: PgPool,
) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let slow = |engine: Engine, ctx: IdempotencyContext| async move {
        let mut tx = engine.begin(&ctx).await.unwrap();
        let pg = engine.postgres().unwrap();
        assert!(
            pg.get(ctx.dedup_key()).await.unwrap().is_none(),
            "no record is committed while the route runs"
        );
        sqlx::query("INSERT INTO payments VALUES ('paid')")
            .execute(&mut *tx)
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(700)).await;
        let paid = axum::http::Response::builder()
            .status(StatusCode::CREATED)
            .body(Bytes::from("paid"))
            .unwrap();
        tx.commit(paid).await.unwrap().map(Into::into)
    };
    let waiting = IdempotencyConfig::new()
        .with_in_flight(InFlight::Wait(std::time::Duration::from_secs(5)))
        .unwrap();
    let app = Router::new()
        .route("/pay", route(&engine, &runs, slow))
        .route_layer(layer(&engine, Kind::Tx, IdempotencyConfig::new()));
    let waits = Router::new()
        .route("/pay-waiting", route(&engine, &runs, slow))
        .route_layer(layer(&engine, Kind::Tx, waiting));
    let base = serve(app.merge(waits)).await;
    let c = client();

    let url = format!("{base}/pay");
    let first = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { post_key(&c, &url, Some("d-1"), "{}").await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let sent = std::time::Instant::now();
    let (s, h, b) = post_key(&c, &url, Some("d-1"), "{}").await;
    assert_eq!(s, StatusCode::CONFLICT, "{b}");
    assert!(h.contains_key("retry-after"));
    assert!(
        sent.elapsed() < std::time::Duration::from_millis(400),
        "answered at once, not after the first's transaction: {:?}",
        sent.elapsed()
    );
    let (s, _, b) = first.await.unwrap();
    assert_eq!((s, b.as_str()), (StatusCode::CREATED, "paid"));
    let (s, h, b) = post_key(&c, &url, Some("d-1"), "{}").await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::CREATED, "paid", true)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let url = format!("{base}/pay-waiting");
    let first = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { post_key(&c, &url, Some("d-2"), "{}").await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (s, h, b) = post_key(&c, &url, Some("d-2"), "{}").await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::CREATED, "paid", true),
        "the duplicate waited for the first's commit"
    );
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(payments(&pool).await, 2, "one effect per key");
    let record = engine
        .postgres()
        .unwrap()
        .get(
            &dedup::IdempotencyKey::new(
                dedup::Scope::new("orders/http").unwrap(),
                "0:|9:POST /pay|d-1",
            )
            .unwrap(),
        )
        .await
        .unwrap()
        .expect("the record committed with the effect");
    assert_eq!(record.state, dedup_core::State::Completed);
}

/// A route under the transactional layer that never begins has its response stored in the
/// layer's transaction (replayed to retries), unless it is not to be stored (`DoNotStore`): then
/// the key is given back and the retry runs.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_route_that_never_begins_is_stored_as_in_lease_mode(pool: PgPool) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route(
            "/plain",
            route(&engine, &runs, |_, _| async move {
                (StatusCode::ACCEPTED, "queued").into_response()
            }),
        )
        .route(
            "/declined",
            route(&engine, &runs, |_, _| async move {
                let mut r = (StatusCode::OK, "not stored").into_response();
                r.extensions_mut().insert(dedup::http::DoNotStore);
                r
            }),
        )
        .route_layer(layer(&engine, Kind::Tx, IdempotencyConfig::new()));
    let base = serve(app).await;
    let c = client();
    let url = format!("{base}/plain");
    let (s, h, _) = post_key(&c, &url, Some("n-1"), "").await;
    assert!(s == StatusCode::ACCEPTED && !h.contains_key(REPLAYED));
    let (s, h, b) = post_key(&c, &url, Some("n-1"), "").await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::ACCEPTED, "queued", true)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let url = format!("{base}/declined");
    for attempt in 2..=3 {
        let (s, h, _) = post_key(&c, &url, Some("n-2"), "").await;
        assert!(s == StatusCode::OK && !h.contains_key(REPLAYED));
        assert_eq!(runs.load(Ordering::SeqCst), attempt);
    }
}

/// A route under the transactional layer that keeps panicking spends an attempt each time (its
/// transaction rolled back, the attempt recorded apart), and past the policy's attempts the key
/// fails for good, as under a lease-mode layer; its writes never commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_route_that_keeps_panicking_fails_for_good(pool: PgPool) {
    let engine = engine(&pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let config = IdempotencyConfig::new()
        .with_policy(dedup::Policy::default().with_max_attempts(2))
        .unwrap();
    let app = Router::new()
        .route(
            "/panics",
            route(&engine, &runs, |engine, ctx| async move {
                let mut tx = engine.begin(&ctx).await.unwrap();
                sqlx::query("INSERT INTO payments VALUES ('never')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                panic!("the route failed mid-transaction")
            }),
        )
        .route_layer(layer(&engine, Kind::Tx, config));
    let url = format!("{}/panics", serve(app).await);
    let c = client();
    let (s, _, b) = post_key(&c, &url, Some("x-1"), "").await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(b.contains("handler-panicked"), "{b}");
    // The second attempt is the last: it runs, and the key fails with it.
    for attempt in 2..=3 {
        let (s, _, b) = post_key(&c, &url, Some("x-1"), "").await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(b.contains("key-failed"), "attempt {attempt}: {b}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a failed key runs no more");
    assert_eq!(payments(&pool).await, 0);
}

/// What a route queues on the outbox (`RequestTx::publish`) is written only by the request's
/// commit, with its effect and stored response: a run that began, queued and did not commit
/// leaves no message; the run that commits leaves its own two, with derived keys by ordinal; a
/// replay publishes nothing more. Under both layers.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_route_publishes_only_what_its_committed_request_queued(pool: PgPool) {
    publishes_on_commit(pool, Kind::Lease).await;
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn under_the_tx_layer_a_route_publishes_only_what_its_committed_request_queued(pool: PgPool) {
    publishes_on_commit(pool, Kind::Tx).await;
}

async fn publishes_on_commit(pool: PgPool, kind: Kind) {
    use dedup::outbox::OutboxMessage;
    let engine = engine(&pool).await;
    let relay = dedup::outbox::RelayStore::new(engine.postgres().unwrap().clone());
    let start = relay.position().await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/pay",
            route(&engine, &runs, move |engine, ctx| {
                let run = counted.load(Ordering::SeqCst);
                async move {
                    let mut tx = engine.begin(&ctx).await.unwrap();
                    sqlx::query("INSERT INTO payments VALUES ('paid')")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    for n in 0..2 {
                        let m = OutboxMessage::new("payments.made", format!("run {run} #{n}"));
                        tx.publish(m).unwrap();
                    }
                    assert!(tx.publish(OutboxMessage::new("no topic", "x")).is_err());
                    if run == 1 {
                        return (StatusCode::SERVICE_UNAVAILABLE, "failed before the commit")
                            .into_response();
                    }
                    let created = axum::http::Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Bytes::from("paid"))
                        .unwrap();
                    tx.commit(created).await.unwrap().map(Into::into)
                }
            }),
        )
        .layer(layer(&engine, kind, IdempotencyConfig::new()));
    let base = serve(app).await;
    let c = client();
    let url = format!("{base}/pay");
    let (s, _, _) = post_key(&c, &url, Some("o-1"), "{}").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let (s, _, _) = post_key(&c, &url, Some("o-1"), "{}").await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, h, _) = post_key(&c, &url, Some("o-1"), "{}").await;
    assert_eq!((s, h.contains_key(REPLAYED)), (StatusCode::CREATED, true));
    let cur = relay.snapshot().await.unwrap();
    let rows = relay.read(&start, &cur, None, 100).await.unwrap();
    let got: Vec<_> = rows
        .iter()
        .map(|r| String::from_utf8(r.payload.clone().unwrap().to_vec()).unwrap())
        .collect();
    assert_eq!(
        got,
        ["run 2 #0", "run 2 #1"],
        "only the committed run's, in order"
    );
    assert_ne!(rows[0].idem_key, rows[1].idem_key);
    assert_eq!(rows[0].cause_key, rows[1].cause_key);
    assert_eq!(rows[0].cause_scope, "orders/http");
    assert_eq!(payments(&pool).await, 1);
}
