//! The Idempotency-Key layer with a real server on loopback (axum over the tiered store: L1,
//! a Redis of the test's own, Postgres) and a real HTTP client; and the example service as
//! processes, one of them killed with SIGKILL mid-request.
//!
//! Replays, problem details, limits, concurrent retries (wait and 409), a client that disconnects,
//! `StoreResponses::Successes`, two instances sharing Redis and Postgres; and the example service
//! (`crates/dedup/examples/orders.rs`) SIGKILLed mid-request in three states (committed,
//! transaction open, effect outside the database). It runs `target/debug/examples/orders`, which
//! `cargo test --workspace` builds.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use dedup::Engine;
use dedup::http::EngineLayer;
use dedup_http::{BODY_NOT_STORED, IdempotencyConfig, InFlight, REPLAYED, StoreResponses};
use reqwest::Client;
use sqlx::PgPool;
use tokio::time::{Instant, sleep};

use crate::support::{RedisServer, test_config, until, url_of};

mod tx;

/// Serves `router` on a free loopback port; the base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

fn client() -> Client {
    Client::builder().build().unwrap()
}

/// An order route whose handler counts its runs, takes `hold` to answer, sets a cookie (which
/// must never be stored) and a Location.
fn orders(runs: Arc<AtomicU32>, hold: Duration) -> Router {
    Router::new()
        .route(
            "/orders",
            post(move |body: String| {
                let runs = runs.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    sleep(hold).await;
                    (
                        StatusCode::CREATED,
                        [
                            (header::LOCATION, format!("/orders/{n}")),
                            (header::SET_COOKIE, "session=secret".to_owned()),
                            (header::CONTENT_TYPE, "application/json".to_owned()),
                        ],
                        format!(r#"{{"order":{n},"body":{body:?}}}"#),
                    )
                }
            }),
        )
        .route("/orders", get(|| async { "listed" }))
}

/// A layer built from an engine of its own (L1, the test's Redis, Postgres), as a service
/// builds it; two calls are two instances sharing Redis and Postgres.
async fn layer(pool: &PgPool, redis: &RedisServer, config: IdempotencyConfig) -> EngineLayer {
    let engine = Engine::builder()
        .postgres(pool.clone())
        .redis_url(redis.url())
        .tiers(test_config())
        .scope("orders")
        .build()
        .await
        .unwrap();
    engine.http_layer(config).unwrap()
}

async fn post_key(
    c: &Client,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> (StatusCode, HeaderMap, String) {
    let mut req = c.post(url).body(body.to_owned());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let r = req.send().await.unwrap();
    let (status, headers) = (r.status(), r.headers().clone());
    (status, headers, r.text().await.unwrap())
}

fn is_problem(h: &HeaderMap) -> bool {
    h[header::CONTENT_TYPE] == "application/problem+json"
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_retry_replays_the_stored_response_and_misuse_gets_problem_details(pool: PgPool) {
    let redis = RedisServer::start();
    let runs = Arc::new(AtomicU32::new(0));
    let app = orders(runs.clone(), Duration::ZERO)
        .route(
            "/big",
            post(|| async { (StatusCode::OK, "x".repeat(100_000)) }),
        )
        .layer(
            layer(
                &pool,
                &redis,
                IdempotencyConfig::new().with_max_request_bytes(1000),
            )
            .await,
        );
    let base = serve(app).await;
    let url = format!("{base}/orders");
    let c = client();

    let (s1, h1, b1) = post_key(&c, &url, Some("\"order-1\""), r#"{"n":1}"#).await;
    assert_eq!(s1, StatusCode::CREATED);
    assert!(!h1.contains_key(REPLAYED));
    assert!(
        h1.contains_key(header::SET_COOKIE),
        "the first caller gets the handler's response whole"
    );
    // A bare token (as Stripe's clients send it) is the same key as the quoted string.
    let (s2, h2, b2) = post_key(&c, &url, Some("order-1"), r#"{"n":1}"#).await;
    assert_eq!((s2, &b2), (StatusCode::CREATED, &b1));
    assert_eq!(h2[REPLAYED], "true");
    assert_eq!(h2[header::LOCATION], "/orders/1");
    assert_eq!(h2[header::CONTENT_TYPE], "application/json");
    assert!(
        !h2.contains_key(header::SET_COOKIE),
        "cookies are never stored"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The key again with another body: 422.
    let (s, h, b) = post_key(&c, &url, Some("order-1"), r#"{"n":2}"#).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert!(is_problem(&h));
    let problem: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(problem["status"], 422);
    assert_eq!(problem["type"], "urn:dedup:idempotency:key-reused");
    // No key, or a malformed one: 400, and nothing runs.
    for key in [None, Some("two words"), Some("\"unterminated")] {
        let (s, h, b) = post_key(&c, &url, key, "{}").await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{key:?}: {b}");
        assert!(is_problem(&h));
    }
    let (s, _, b) = post_key(&c, &url, Some(&"k".repeat(256)), "{}").await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    // A body over the limit: 413 before anything runs.
    let (s, h, _) = post_key(&c, &url, Some("big-body"), &"x".repeat(1001)).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(is_problem(&h));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // GET is not deduplicated: no key needed.
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.text().await.unwrap(), "listed");

    // A response too large to store: the first caller gets it whole, a retry gets the status,
    // an empty body and the length it had.
    let big = format!("{base}/big");
    let (s, h, b) = post_key(&c, &big, Some("big-1"), "").await;
    assert_eq!((s, b.len()), (StatusCode::OK, 100_000));
    assert!(!h.contains_key(REPLAYED));
    let (s, h, b) = post_key(&c, &big, Some("big-1"), "").await;
    assert_eq!((s, b.len()), (StatusCode::OK, 0));
    assert_eq!(h[REPLAYED], "true");
    assert_eq!(h[BODY_NOT_STORED], "100000");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn concurrent_retries_run_the_handler_once(pool: PgPool) {
    let redis = RedisServer::start();
    let c = client();
    // Retries wait for the first request and get its response.
    let runs = Arc::new(AtomicU32::new(0));
    let config = IdempotencyConfig::new()
        .with_in_flight(InFlight::Wait(Duration::from_secs(20)))
        .unwrap();
    let base = serve(
        orders(runs.clone(), Duration::from_millis(300)).layer(layer(&pool, &redis, config).await),
    )
    .await;
    let url = format!("{base}/orders");
    let calls = (0..16).map(|_| post_key(&c, &url, Some("same"), "{}"));
    let answers = futures_util::future::join_all(calls).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let body = &answers[0].2;
    let mut replayed = 0;
    for (s, h, b) in &answers {
        assert_eq!((*s, b), (StatusCode::CREATED, body));
        replayed += usize::from(h.contains_key(REPLAYED));
    }
    assert_eq!(replayed, 15);

    // The default: a retry while the first runs gets 409 at once, with Retry-After.
    let runs = Arc::new(AtomicU32::new(0));
    let base = serve(
        orders(runs.clone(), Duration::from_millis(1500))
            .layer(layer(&pool, &redis, IdempotencyConfig::new()).await),
    )
    .await;
    let url = format!("{base}/orders");
    let first = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { post_key(&c, &url, Some("slow"), "{}").await }
    });
    until("the first request runs", || {
        std::future::ready(runs.load(Ordering::SeqCst) == 1)
    })
    .await;
    let started = Instant::now();
    let (s, h, _) = post_key(&c, &url, Some("slow"), "{}").await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(
        started.elapsed() < Duration::from_millis(1000),
        "409 at once, not after the first"
    );
    assert_eq!(h[header::RETRY_AFTER], "1");
    assert!(is_problem(&h));
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    let (s, h, _) = post_key(&c, &url, Some("slow"), "{}").await;
    assert_eq!(
        (s, &h[REPLAYED]),
        (StatusCode::CREATED, &"true".parse().unwrap())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A client that gives up mid-request does not cancel the handler: it runs to its end, and the
/// retry gets its stored response.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_client_that_disconnects_does_not_cancel_the_effect(pool: PgPool) {
    let redis = RedisServer::start();
    let effects = Arc::new(AtomicU32::new(0));
    let layer = layer(&pool, &redis, IdempotencyConfig::new()).await;
    let app = Router::new()
        .route(
            "/pay",
            post({
                let effects = effects.clone();
                move || {
                    let effects = effects.clone();
                    async move {
                        sleep(Duration::from_millis(800)).await;
                        let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
                        (StatusCode::CREATED, format!("payment {n}"))
                    }
                }
            }),
        )
        .layer(layer.clone());
    let url = format!("{}/pay", serve(app).await);
    let impatient = Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let err = impatient
        .post(&url)
        .header("idempotency-key", "pay-1")
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    // The handler still runs: drain waits for it (as a server does on shutdown).
    tokio::time::timeout(Duration::from_secs(10), layer.drain())
        .await
        .expect("the handler finishes");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    // The response is stored right after the effect.
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (s, h, b) = loop {
        let answer = post_key(&c, &url, Some("pay-1"), "").await;
        if answer.0 != StatusCode::CONFLICT || Instant::now() > deadline {
            break answer;
        }
        sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((s, b.as_str()), (StatusCode::CREATED, "payment 1"));
    assert_eq!(h[REPLAYED], "true");
    sleep(Duration::from_millis(200)).await;
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

/// `StoreResponses::Successes`: an error response is answered, not stored, and costs no attempt;
/// the retry runs again and its success is stored.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn only_successes_are_stored_when_asked(pool: PgPool) {
    let redis = RedisServer::start();
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route(
            "/flaky",
            post({
                let runs = runs.clone();
                move || {
                    let runs = runs.clone();
                    async move {
                        match runs.fetch_add(1, Ordering::SeqCst) {
                            0..=5 => (StatusCode::BAD_GATEWAY, "upstream down").into_response(),
                            _ => (StatusCode::OK, "done").into_response(),
                        }
                    }
                }
            }),
        )
        .layer(
            layer(
                &pool,
                &redis,
                IdempotencyConfig::new().with_store(StoreResponses::Successes),
            )
            .await,
        );
    let url = format!("{}/flaky", serve(app).await);
    let c = client();
    // More failures than the policy's 5 attempts: none of them is spent.
    for _ in 0..6 {
        let (s, h, _) = post_key(&c, &url, Some("f-1"), "").await;
        assert_eq!(s, StatusCode::BAD_GATEWAY);
        assert!(!h.contains_key(REPLAYED));
    }
    let (s, _, b) = post_key(&c, &url, Some("f-1"), "").await;
    assert_eq!((s, b.as_str()), (StatusCode::OK, "done"));
    let (s, h, b) = post_key(&c, &url, Some("f-1"), "").await;
    assert_eq!(
        (s, b.as_str(), &h[REPLAYED]),
        (StatusCode::OK, "done", &"true".parse().unwrap())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 7);
}

/// Two server instances over one Redis and one Postgres: a retry that reaches the other
/// instance is replayed, and concurrent requests split across both run once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn two_instances_share_their_keys(pool: PgPool) {
    let redis = RedisServer::start();
    let runs = Arc::new(AtomicU32::new(0));
    let config = || {
        IdempotencyConfig::new()
            .with_in_flight(InFlight::Wait(Duration::from_secs(20)))
            .unwrap()
    };
    let a = serve(
        orders(runs.clone(), Duration::from_millis(200))
            .layer(layer(&pool, &redis, config()).await),
    )
    .await;
    let b = serve(
        orders(runs.clone(), Duration::from_millis(200))
            .layer(layer(&pool, &redis, config()).await),
    )
    .await;
    let c = client();
    let (s, _, first) = post_key(&c, &format!("{a}/orders"), Some("x-1"), "{}").await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, h, again) = post_key(&c, &format!("{b}/orders"), Some("x-1"), "{}").await;
    assert_eq!(
        (s, &again, &h[REPLAYED]),
        (StatusCode::CREATED, &first, &"true".parse().unwrap())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    for i in 0..5 {
        let key = format!("both-{i}");
        let calls = (0..8).map(|n| {
            let base = if n % 2 == 0 { &a } else { &b };
            let (c, url, key) = (c.clone(), format!("{base}/orders"), key.clone());
            async move { post_key(&c, &url, Some(&key), "{}").await }
        });
        let answers = futures_util::future::join_all(calls).await;
        assert!(
            answers
                .iter()
                .all(|(s, _, body)| *s == StatusCode::CREATED && *body == answers[0].2)
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}

/// The example service (`crates/dedup/examples/orders.rs`), started as processes.
struct Service {
    child: tokio::process::Child,
    base: String,
}

impl Service {
    async fn start(pool: &PgPool, redis: &RedisServer, env: &[(&str, &str)]) -> Self {
        use tokio::io::AsyncBufReadExt;
        let exe = std::env::current_exe().unwrap();
        let bin = exe
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples/orders");
        assert!(
            bin.exists(),
            "{} is missing: `cargo test --workspace` builds it (or `cargo build -p dedup --features http,redis --example orders`)",
            bin.display()
        );
        let mut child = tokio::process::Command::new(bin)
            .env("DATABASE_URL", url_of(pool))
            .env("REDIS_URL", redis.url())
            .env("BIND", "127.0.0.1:0")
            .env("LEASE_MS", "2000")
            // A killed instance's lock goes to the next one within a round.
            .env("RETENTION_EVERY_MS", "100")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the service starts within 30 s")
            .unwrap()
            .expect("the service prints where it listens");
        let addr = line.strip_prefix("listening on ").expect(&line).to_owned();
        // The example runs retention in the background: one of its processes holds the lock.
        crate::support::until("an orders process holds the retention lock", || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND classid = x'64656472'::int8::oid AND objsubid = 2 \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(pool)
            .await
            .unwrap()
                == 1
        })
        .await;
        Self {
            child,
            base: format!("http://{addr}"),
        }
    }

    fn kill(&mut self) {
        let pid = self.child.id().unwrap();
        let ok = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The first instance is killed with SIGKILL after its effect began and before it answered;
/// the retry goes to the second instance:
/// - an order committed with its stored response (one transaction): the retry gets the
///   response, no second order;
/// - an order whose transaction was still open: it rolled back with the process; the retry is
///   refused (409) while the dead instance's lease lasts, then runs once: one order;
/// - an email (an effect outside the database, lease mode) sent before the kill: the retry runs
///   it again once the lease ends. Two emails: the stated limit of effects outside the
///   transaction.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_server_killed_mid_request_leaves_one_effect_where_it_committed_with_the_response(
    pool: PgPool,
) {
    let redis = RedisServer::start();
    let b = Service::start(&pool, &redis, &[]).await;
    let mut a = Service::start(
        &pool,
        &redis,
        &[
            ("ORDERS_AFTER_COMMIT_MS", "60000"),
            ("EMAILS_DELAY_MS", "60000"),
        ],
    )
    .await;
    let c = client();
    let order = r#"{"customer":"c-1","cents":1250}"#;
    let send = |base: &str, path: &str, key: &str, body: &str| {
        let (c, url, key, body) = (
            c.clone(),
            format!("{base}{path}"),
            key.to_owned(),
            body.to_owned(),
        );
        tokio::spawn(async move {
            c.post(url)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
        })
    };
    let pending_order = send(&a.base, "/orders", "o-committed", order);
    let pending_email = send(&a.base, "/emails", "e-1", r#"{"to":"x@example.com"}"#);
    until_rows(&pool, "SELECT count(*) FROM orders", 1).await;
    until_rows(&pool, "SELECT count(*) FROM emails", 1).await;
    a.kill();
    assert!(
        pending_order.await.unwrap().is_err(),
        "the client saw the connection die"
    );
    assert!(pending_email.await.unwrap().is_err());

    // The committed order: replayed from the second instance (after at most the lease, while
    // Redis still holds the dead instance's in-progress marker).
    let (s, h, body) =
        retry_past_409(&c, &format!("{}/orders", b.base), "o-committed", order).await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    assert_eq!(h[REPLAYED], "true");
    assert_eq!(h[header::LOCATION], "/orders/1");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);

    // An order whose transaction is open at the kill.
    let mut a = Service::start(&pool, &redis, &[("ORDERS_DELAY_MS", "60000")]).await;
    let pending = send(&a.base, "/orders", "o-open", order);
    until_rows(&pool, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE 'INSERT INTO orders%'", 1).await;
    a.kill();
    assert!(pending.await.unwrap().is_err());
    // Its key was claimed in that transaction (`http_tx_layer`): rolled back with the dead
    // connection, the key is free as soon as Postgres ends the session, with no lease to wait
    // out (a retry sent before that is answered 409).
    let freed = std::time::Instant::now();
    let (s, h, body) = retry_past_409(&c, &format!("{}/orders", b.base), "o-open", order).await;
    assert!(
        freed.elapsed() < std::time::Duration::from_millis(1500),
        "the key waited {:?}, as if for the lease (2 s)",
        freed.elapsed()
    );
    assert_eq!(s, StatusCode::CREATED, "{body}");
    assert!(!h.contains_key(REPLAYED), "it ran on the second instance");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        2,
        "one per key"
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT idempotency_key) FROM orders").await,
        2
    );

    // The email: sent again after the lease.
    let (s, h, _) = retry_past_409(
        &c,
        &format!("{}/emails", b.base),
        "e-1",
        r#"{"to":"x@example.com"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert!(!h.contains_key(REPLAYED));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM emails").await,
        2,
        "lease mode: sent again"
    );
    // And from now on it is replayed.
    let (s, h, _) = post_key_json(
        &c,
        &format!("{}/emails", b.base),
        "e-1",
        r#"{"to":"x@example.com"}"#,
    )
    .await;
    assert_eq!(
        (s, &h[REPLAYED]),
        (StatusCode::ACCEPTED, &"true".parse().unwrap())
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM emails").await, 2);
}

async fn post_key_json(
    c: &Client,
    url: &str,
    key: &str,
    body: &str,
) -> (StatusCode, HeaderMap, String) {
    let r = c
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status(), r.headers().clone());
    (status, headers, r.text().await.unwrap())
}

/// Retries while the answer is 409 (the key still held), for up to 20 s.
async fn retry_past_409(
    c: &Client,
    url: &str,
    key: &str,
    body: &str,
) -> (StatusCode, HeaderMap, String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = post_key_json(c, url, key, body).await;
        if answer.0 != StatusCode::CONFLICT || Instant::now() > deadline {
            return answer;
        }
        sleep(Duration::from_millis(200)).await;
    }
}

async fn until_rows(pool: &PgPool, sql: &'static str, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // The example creates its tables at start; before that the count fails.
        let got: Option<i64> = sqlx::query_scalar(sql).fetch_one(pool).await.ok();
        if got == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{sql} never reached {n} (last {got:?})"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// With axum's `route_layer`, keys are scoped by route template (`MatchedPath`) and tenant: the
/// same key on `/accounts/1/refunds` and `/accounts/2/refunds` is one key of the template (another
/// payload: 422), the same key from two tenants is two keys, and a request without a tenant is
/// refused.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn keys_are_scoped_by_route_template_and_tenant(pool: PgPool) {
    use axum::extract::{MatchedPath, Path};
    let redis = RedisServer::start();
    let runs = Arc::new(AtomicU32::new(0));
    let config = IdempotencyConfig::new()
        .with_route(|p| {
            p.extensions
                .get::<MatchedPath>()
                .map(|m| m.as_str().to_owned())
        })
        .with_tenant(|p| {
            p.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let app = Router::new()
        .route(
            "/accounts/{id}/refunds",
            post({
                let runs = runs.clone();
                move |Path(id): Path<u32>| {
                    let runs = runs.clone();
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        (StatusCode::CREATED, format!("refund {n} on {id}"))
                    }
                }
            }),
        )
        .route_layer(layer(&pool, &redis, config).await);
    let base = serve(app).await;
    let c = client();
    let send = |path: &'static str, tenant: Option<&'static str>| {
        let (c, url) = (c.clone(), format!("{base}{path}"));
        async move {
            let mut req = c.post(url).header("idempotency-key", "r-1");
            if let Some(t) = tenant {
                req = req.header("x-tenant", t);
            }
            let r = req.send().await.unwrap();
            let (s, h) = (r.status(), r.headers().clone());
            (s, h, r.text().await.unwrap())
        }
    };
    let (s, _, b) = send("/accounts/1/refunds", Some("acme")).await;
    assert_eq!((s, b.as_str()), (StatusCode::CREATED, "refund 1 on 1"));
    let (s, h, b) = send("/accounts/1/refunds", Some("acme")).await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::CREATED, "refund 1 on 1", true)
    );
    // Same template, another path: the same key with another payload.
    let (s, h, _) = send("/accounts/2/refunds", Some("acme")).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&h));
    // Another tenant: another key, its own run.
    let (s, h, b) = send("/accounts/1/refunds", Some("globex")).await;
    assert_eq!(
        (s, b.as_str(), h.contains_key(REPLAYED)),
        (StatusCode::CREATED, "refund 2 on 1", false)
    );
    // No tenant: refused, nothing runs.
    let (s, h, b) = send("/accounts/1/refunds", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b.contains("tenant-unknown"), "{b}");
    assert!(is_problem(&h));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Built from an engine of scope `orders`, the layer's keys live in `orders/http`: apart from
    // other services' and from the engine's consumers' event keys.
    let scopes: Vec<String> = sqlx::query_scalar("SELECT DISTINCT scope FROM dedup_records")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(scopes, vec!["orders/http".to_owned()]);
}
