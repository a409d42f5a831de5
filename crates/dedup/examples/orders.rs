//! An order service behind the Idempotency-Key layer: Postgres is the truth, Redis the fast path.
//!
//! ```text
//! DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379 \
//!     cargo run -p dedup --features http,redis --example orders
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: "order-1"' \
//!     -H 'content-type: application/json' -d '{"customer":"c-1","cents":1250}'
//! ```
//! Send the same request again: the same 201, with `Idempotent-Replayed: true`, and still one
//! order row.
//!
//! - `POST /orders` writes the order and completes the key **in one transaction**: a crash at any
//!   point leaves either both (a retry replays the response) or neither (a retry runs again).
//! - `POST /emails` stands for an effect outside the database (an email sent): lease mode. A
//!   crash after the email went and before the response was stored sends it again once the
//!   lease ends (`LEASE_MS`); that is the limit of any effect outside the transaction.
//! - `GET /orders/{id}` is not deduplicated (GET is idempotent).
//!
//! Settings (environment): `DATABASE_URL`; `REDIS_URL` (optional: without it Postgres answers
//! alone, behind the in-process L1); `BIND` (default `127.0.0.1:3000`, port 0 for any); `LEASE_MS`
//! (default 30000); `RETENTION_EVERY_MS` (default 60000: how often the instance that holds the
//! retention lock deletes expired records, the others standing by). To watch crashes mid-request: `ORDERS_DELAY_MS` (a slow payment provider,
//! inside the transaction), `ORDERS_AFTER_COMMIT_MS` (after the commit, before the answer),
//! `EMAILS_DELAY_MS` (after the email, before the answer).

use std::time::Duration;

use axum::extract::{MatchedPath, Path, State};
use axum::http::{HeaderValue, Response, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use dedup::Engine;
use dedup::http::{DoNotStore, IdempotencyConfig, IdempotencyContext};
use dedup::sqlx::PgPool;
use serde::Deserialize;

#[derive(Clone)]
struct App {
    engine: Engine,
    pool: PgPool,
    orders_delay: Duration,
    orders_after_commit: Duration,
    emails_delay: Duration,
}

#[derive(Deserialize)]
struct NewOrder {
    customer: String,
    cents: i64,
}

#[derive(Deserialize)]
struct NewEmail {
    to: String,
}

fn millis(name: &str, default: u64) -> Result<Duration, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map(Duration::from_millis)
            .map_err(|e| format!("{name}={v}: {e}")),
        Err(_) => Ok(Duration::from_millis(default)),
    }
}

fn problem(status: StatusCode, detail: &str) -> Response<axum::body::Body> {
    let body = serde_json::json!({"title": status.canonical_reason(), "status": status.as_u16(), "detail": detail});
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    r
}

/// The order row and the key's completion, in one transaction.
async fn create_order(
    State(app): State<App>,
    ctx: axum::Extension<IdempotencyContext>,
    body: Bytes,
) -> Response<axum::body::Body> {
    let Ok(order) = serde_json::from_slice::<NewOrder>(&body) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "expected {\"customer\": string, \"cents\": integer}",
        );
    };
    // Once `begin` is called, only a commit stores a response: whatever the route answers
    // without one (this 503, say) is not stored, and a retry runs again.
    let unavailable = |e: &dyn std::fmt::Display| {
        problem(StatusCode::SERVICE_UNAVAILABLE, &format!("try again: {e}"))
    };
    let mut tx = match app.engine.begin(&ctx).await {
        Ok(tx) => tx,
        Err(e) => return unavailable(&e),
    };
    let id: i64 = match dedup::sqlx::query_scalar(
        "INSERT INTO orders (idempotency_key, customer, cents) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(ctx.idempotency_key())
    .bind(&order.customer)
    .bind(order.cents)
    .fetch_one(&mut *tx)
    .await
    {
        Ok(id) => id,
        Err(e) => return unavailable(&e),
    };
    tokio::time::sleep(app.orders_delay).await;
    let json =
        serde_json::json!({"order_id": id, "customer": order.customer, "cents": order.cents});
    let response = Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/orders/{id}"))
        .body(Bytes::from(json.to_string()));
    let Ok(response) = response else {
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not build the response",
        );
    };
    // The order and the stored response commit together.
    let response = match tx.commit(response).await {
        Ok(response) => response,
        Err(e) => return unavailable(&e),
    };
    tokio::time::sleep(app.orders_after_commit).await;
    response.map(axum::body::Body::from)
}

/// An effect outside the database: lease mode, the layer stores the response afterwards.
async fn send_email(State(app): State<App>, Json(email): Json<NewEmail>) -> impl IntoResponse {
    if let Err(e) = sqlx::query("INSERT INTO emails (recipient) VALUES ($1)")
        .bind(&email.to)
        .execute(&app.pool)
        .await
    {
        let mut r = problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string());
        r.extensions_mut().insert(DoNotStore);
        return r;
    }
    tokio::time::sleep(app.emails_delay).await;
    (StatusCode::ACCEPTED, format!("sent to {}", email.to)).into_response()
}

async fn get_order(State(app): State<App>, Path(id): Path<i64>) -> impl IntoResponse {
    let row: Result<Option<(String, i64)>, _> =
        sqlx::query_as("SELECT customer, cents FROM orders WHERE id = $1")
            .bind(id)
            .fetch_optional(&app.pool)
            .await;
    match row {
        Ok(Some((customer, cents))) => {
            Json(serde_json::json!({"order_id": id, "customer": customer, "cents": cents}))
                .into_response()
        }
        Ok(None) => problem(StatusCode::NOT_FOUND, "no such order"),
        Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    // Retention in the background: of all the instances, the one holding the retention lock
    // deletes expired records every round; the others stand by.
    let retention =
        dedup::RetentionConfig::default().with_every(millis("RETENTION_EVERY_MS", 60_000)?);
    let mut engine = Engine::builder()
        .postgres_url(url)
        .scope("orders")
        .retention(retention);
    if let Ok(redis) = std::env::var("REDIS_URL") {
        engine = engine.redis_url(redis);
    }
    let engine = engine.build().await?; // connects, applies dedup's migrations
    dedup::sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, idempotency_key text NOT NULL, customer text NOT NULL, cents bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS emails (id bigserial PRIMARY KEY, recipient text NOT NULL);",
    )
    .execute(engine.pool()?)
    .await?;
    // Keys are scoped by route template (`/orders`), not by the request's path.
    let config = IdempotencyConfig::new()
        .with_route(|p| {
            p.extensions
                .get::<MatchedPath>()
                .map(|m| m.as_str().to_owned())
        })
        .with_policy(dedup::Policy::default().with_lease(millis("LEASE_MS", 30_000)?))?;
    let app = App {
        engine: engine.clone(),
        pool: engine.pool()?.clone(),
        orders_delay: millis("ORDERS_DELAY_MS", 0)?,
        orders_after_commit: millis("ORDERS_AFTER_COMMIT_MS", 0)?,
        emails_delay: millis("EMAILS_DELAY_MS", 0)?,
    };
    // Orders are writes in Postgres: the key's claim, the order and the stored response commit
    // together (`http_tx_layer`, one commit). Emails leave the database: lease mode.
    let orders = Router::new()
        .route("/orders", post(create_order))
        .route_layer(engine.http_tx_layer(config.clone())?);
    let emails = Router::new()
        .route("/emails", post(send_email))
        .route_layer(engine.http_layer(config)?);
    let router = orders
        .merge(emails)
        .route("/orders/{id}", get(get_order))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(
        std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned()),
    )
    .await?;
    // One line on stdout, read by the tests: where it listens.
    #[allow(clippy::print_stdout)]
    {
        println!("listening on {}", listener.local_addr()?);
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Waits for requests still running (their clients may have gone; their handlers run to the
    // end), then lets go of the engine.
    if tokio::time::timeout(Duration::from_secs(30), engine.shutdown())
        .await
        .is_err()
    {
        eprintln!(
            "requests still running after 30 s; their keys are released when their leases end"
        );
    }
    Ok(())
}
