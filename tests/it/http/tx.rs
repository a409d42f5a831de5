//! The transactional path of the layer (`Engine::begin`, `RequestTx::commit`): a request whose
//! transaction `begin` opened stores a response only through its commit; one that began and did
//! not commit gives its key back, whatever it answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use dedup::Engine;
use dedup::http::{IdempotencyConfig, IdempotencyContext};
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
        .layer(engine.http_layer(IdempotencyConfig::new()).unwrap());
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

/// A route that committed has its committed response replayed: also when it began another
/// transaction it dropped, and when it answered the first caller something else after the commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_route_that_committed_is_replayed(pool: PgPool) {
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
                let dropped = engine.begin(&ctx).await.unwrap();
                drop(dropped);
                let mut tx = engine.begin(&ctx).await.unwrap();
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
        .layer(engine.http_layer(IdempotencyConfig::new()).unwrap());
    let base = serve(app).await;
    let c = client();
    for (n, path) in ["/pay", "/twice", "/other"].into_iter().enumerate() {
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
