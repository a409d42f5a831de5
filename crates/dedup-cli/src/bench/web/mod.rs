//! `dedup bench`'s HTTP contenders: an axum route on loopback TCP (`server.rs`), driven by an
//! in-process HTTP/1.1 keep-alive client at the bench's concurrency, each event a `POST /orders`
//! with the event's id as its `Idempotency-Key`, the same stream (ids and duplicates) as every
//! contender:
//! - (hn) the HTTP stack alone: a route that touches no database (the floor);
//! - (h0) the route alone: one autocommit `INSERT` of the request's ledger row, no idempotency;
//! - (h0x) the hand-rolled alternative: `INSERT ... ON CONFLICT DO NOTHING` on the request's
//!   id, a duplicate answered 409;
//! - (h1) the route behind dedup's layer in lease mode: the claim, the route's own `INSERT` in
//!   its own transaction, the completion (the engine's group commit and caches);
//! - (h2) the transactional path: `Engine::http_tx_layer` claims the key in the request's own
//!   transaction, and the route's `Engine::begin`, `INSERT` and `RequestTx::commit` complete it
//!   there: one commit;
//! - (h2l) the same route under the lease-mode layer (`Engine::http_layer`): the claim commits
//!   first (batched with other requests' claims), then `Engine::begin` opens a transaction of
//!   its own: what (h2) saves;
//! - (h3) retries only: every key completed first (not timed), then the stream again, every
//!   request a retry answered from L1; (h3r) the same on an engine whose L1 holds one entry,
//!   so that Redis answers.
//!
//! Each reports requests/s, p50/p99, the server's statements and writing commits per request
//! (`pg_stat_statements`, and the transaction ids the server assigned), CPU per 1,000 requests (the server's
//! threads, the client, Postgres and Redis apart: `procs.rs`), how each request was answered
//! (fresh, replayed, 409) and the effects: the ledger rows, one per request for (h0), one per
//! unique key for (h0x), (h1) and (h2), none for the retries of (h3).

mod procs;
mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sqlx::PgPool;

pub(super) use procs::PerRequests;
use server::{Route, Server, Setup};

use super::engine::tier_counts;
use super::{BenchArgs, Ctx, Outcome, cpu, drive, statements};
use crate::connect::CliError;

/// The HTTP contenders, in the order they run.
pub(super) const CONTENDERS: [&str; 7] = ["hn", "h0", "h0x", "h1", "h2", "h2l", "h3"];

/// What an HTTP contender adds to an [`Outcome`].
#[derive(Clone, Debug, Default)]
pub(super) struct HttpFigures {
    /// The effects it must have made: the ledger rows (or, for (hn), the answers).
    pub(super) expected_effects: u64,
    /// Requests answered by running the route.
    pub(super) fresh: u64,
    /// Requests answered with a stored response (`Idempotent-Replayed`).
    pub(super) replayed: u64,
    /// Requests answered 409: a duplicate of (h0x), or a key in flight behind the layer.
    pub(super) conflicts: u64,
    /// Transactions that wrote while it ran (transaction ids the server assigned: each a WAL
    /// flush at its commit).
    pub(super) commits: Option<u64>,
    /// CPU per 1,000 requests, by whom.
    pub(super) cpu: Option<PerRequests>,
    /// The paced pass (`--paced-share`), where one ran.
    pub(super) paced: Option<Paced>,
}

/// A pass paced at a share of the contender's rate: the rate asked, the rate reached, and the
/// latencies from each request's scheduled start.
#[derive(Clone, Debug)]
pub(super) struct Paced {
    pub(super) asked: f64,
    pub(super) reached: f64,
    pub(super) p50_ms: Option<f64>,
    pub(super) p99_ms: Option<f64>,
    pub(super) errors: u64,
}

/// How the requests were answered.
#[derive(Debug, Default)]
struct Answers {
    fresh: AtomicU64,
    replayed: AtomicU64,
    conflicts: AtomicU64,
}

/// The table the hand-rolled route (h0x) writes: one row per request id.
pub(super) async fn tables(pool: &PgPool) -> Result<(), CliError> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dedup_bench_ledger_unique \
         (run text NOT NULL, key text NOT NULL, amount int NOT NULL, PRIMARY KEY (run, key))",
    )
    .execute(pool)
    .await
    .map_err(|e| CliError::Failed(format!("creating the request table: {e}")))?;
    Ok(())
}

/// Runs HTTP contender `c` ((h3) is two runs: (h3) and (h3r)).
pub(super) async fn run(
    c: &str,
    ctx: &Ctx,
    args: &BenchArgs,
    pool: &PgPool,
    counting: bool,
) -> Result<Vec<Outcome>, CliError> {
    let (route, name, label) = match c {
        "hn" => (Route::Floor, "(hn)", "HTTP alone: a route with no database"),
        "h0" => (
            Route::Plain,
            "(h0)",
            "the route alone: one INSERT, not idempotent",
        ),
        "h0x" => (
            Route::OnConflict,
            "(h0x)",
            "by hand: INSERT ON CONFLICT, 409 on a dup",
        ),
        "h1" => (Route::Lease, "(h1)", "dedup layer, lease mode"),
        "h2" => (
            Route::Tx,
            "(h2)",
            "dedup tx layer: claim, row, response, 1 commit",
        ),
        "h2l" => (
            Route::TxUnderLease,
            "(h2l)",
            "dedup lease layer + begin/commit: 2 commits",
        ),
        _ => (Route::Lease, "(h3)", "dedup layer, retries only (L1)"),
    };
    let tag = c;
    let setup = Setup {
        route,
        database_url: args.pg.database_url.clone(),
        pg_connections: args.pg_connections,
        redis_url: args.redis_url.clone(),
        run: ctx.run_id.clone(),
        contender: tag_of(c),
        scope: ctx.scope(tag),
        l1: true,
    };
    ctx.note(&format!("{name} {label}"));
    let server = Server::start(setup.clone()).await?;
    let events = u64::try_from(ctx.stream.len()).unwrap_or(u64::MAX);
    let mut out = Vec::new();
    if c == "h3" {
        // Every key completed first, untimed, then the stream again: every request a retry.
        let mut seen = std::collections::HashSet::new();
        let distinct: Vec<u64> = ctx
            .stream
            .iter()
            .copied()
            .filter(|id| seen.insert(*id))
            .collect();
        let warm = Ctx {
            stream: Arc::new(distinct),
            ..ctx.clone()
        };
        ctx.note("(h3) completing every key first (not timed)");
        let (_, _, errors) = drive(&warm, request(&server, ctx, &Arc::default())).await;
        if errors > 0 {
            server.stop().await;
            return Err(CliError::Failed(format!(
                "(h3): {errors} requests failed while completing the keys"
            )));
        }
        out.push(timed(ctx, pool, counting, &server, name, label, 0).await?);
        server.stop().await;
        ctx.note("(h3r) the same retries on an engine with no L1 to speak of (Redis answers)");
        let server = Server::start(Setup { l1: false, ..setup }).await?;
        let o = timed(
            ctx,
            pool,
            counting,
            &server,
            "(h3r)",
            "dedup layer, retries only (L1 off: Redis)",
            0,
        )
        .await?;
        out.push(o);
        server.stop().await;
        return Ok(out);
    }
    let expected = match route {
        Route::Floor | Route::Plain => events,
        _ => unique_of(ctx),
    };
    let o = timed(ctx, pool, counting, &server, name, label, expected).await;
    let o = match o {
        Ok(mut o) if args.paced_share > 0.0 => {
            let rate = o.rate(events) * args.paced_share;
            let paced = paced(ctx, &server, rate).await;
            if let Some(h) = o.http.as_mut() {
                h.paced = Some(paced);
            }
            Ok(o)
        }
        o => o,
    };
    server.stop().await;
    out.push(o?);
    Ok(out)
}

/// The stream again, on keys of its own (the same duplicates), one request started every
/// `1/rate` s whatever the others do (open loop), each latency taken from its scheduled start.
async fn paced(ctx: &Ctx, server: &Server, rate: f64) -> Paced {
    let keys = super::EventKeys::new(ctx.keys.shape, 0x9ace_d000, unique_of(ctx));
    let ctx = Ctx {
        keys,
        ..ctx.clone()
    };
    ctx.note(&format!("  paced at {rate:.0} requests/s"));
    let one = request(server, &ctx, &Arc::default());
    let period = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let started = Instant::now();
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, &id) in ctx.stream.iter().enumerate() {
        let at = started + period.mul_f64(i as f64);
        tokio::time::sleep_until(at.into()).await;
        let (one, errors) = (one.clone(), Arc::clone(&errors));
        tasks.spawn(async move {
            if one(id).await.is_err() {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX)
        });
    }
    let mut latencies = Vec::with_capacity(ctx.stream.len());
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(us) => latencies.push(us),
            Err(_) => {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    #[allow(clippy::cast_precision_loss)]
    let reached = ctx.stream.len() as f64 / elapsed.as_secs_f64().max(1e-9);
    Paced {
        asked: rate,
        reached,
        p50_ms: super::percentile_ms(&latencies, 0.5),
        p99_ms: super::percentile_ms(&latencies, 0.99),
        errors: errors.load(Ordering::Relaxed),
    }
}

/// The ledger's contender column for `c`.
fn tag_of(c: &str) -> &'static str {
    match c {
        "hn" => "hn",
        "h0" => "h0",
        "h0x" => "h0x",
        "h1" => "h1",
        "h2" => "h2",
        "h2l" => "h2l",
        _ => "h3",
    }
}

fn unique_of(ctx: &Ctx) -> u64 {
    let distinct: std::collections::HashSet<u64> = ctx.stream.iter().copied().collect();
    u64::try_from(distinct.len()).unwrap_or(u64::MAX)
}

/// One timed pass of the stream against `server`, with what it cost.
async fn timed(
    ctx: &Ctx,
    pool: &PgPool,
    counting: bool,
    server: &Server,
    name: &'static str,
    label: &'static str,
    expected_effects: u64,
) -> Result<Outcome, CliError> {
    let contender = tag_of(name.trim_matches(|c| c == '(' || c == ')'));
    let rows_before = rows(pool, &ctx.run_id, contender).await?;
    let commits_before = commits(pool).await;
    let statements_before = if counting {
        statements::count(pool).await
    } else {
        None
    };
    let (ticks, split) = (cpu::now(), procs::now());
    let answers = Arc::new(Answers::default());
    let (elapsed, latencies, errors) = drive(ctx, request(server, ctx, &answers)).await;
    let (ticks_after, split_after) = (cpu::now(), procs::now());
    let statements_after = if counting {
        statements::count(pool).await
    } else {
        None
    };
    let commits_after = commits(pool).await;
    let events = u64::try_from(ctx.stream.len()).unwrap_or(u64::MAX);
    let fresh = answers.fresh.load(Ordering::Relaxed);
    let effects = if name == "(hn)" {
        fresh
    } else {
        rows(pool, &ctx.run_id, contender)
            .await?
            .saturating_sub(rows_before)
    };
    let engine = server.engine();
    Ok(Outcome {
        name,
        label,
        durable: name != "(hn)",
        elapsed,
        latencies,
        effects,
        errors,
        pg_trips: None,
        server_statements: statements_before
            .zip(statements_after)
            .map(|(b, a)| a.since(b)),
        tiers: engine.map_or((0, 0, 0), |e| tier_counts(&e.tier_stats())),
        batches: engine.map(dedup::Engine::group_commit_stats),
        cpu: ticks.zip(ticks_after).map(|(b, a)| a.since(b)),
        wal: None,
        row_bytes: None,
        outbox: None,
        http: Some(HttpFigures {
            expected_effects,
            fresh,
            replayed: answers.replayed.load(Ordering::Relaxed),
            conflicts: answers.conflicts.load(Ordering::Relaxed),
            commits: commits_before
                .zip(commits_after)
                .map(|(b, a)| a.saturating_sub(b)),
            cpu: split.zip(split_after).map(|(b, a)| a.per_1k(b, events)),
            paced: None,
        }),
    })
}

/// One request per event: `POST /orders` with the event's key, counted by its answer.
fn request(
    server: &Server,
    ctx: &Ctx,
    answers: &Arc<Answers>,
) -> impl Fn(u64) -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(ctx.concurrency)
        .build(connector);
    let uri: Arc<str> = format!("http://{}/orders", server.addr).into();
    let (keys, answers) = (ctx.keys, Arc::clone(answers));
    move |id| {
        let (client, uri, answers) = (client.clone(), Arc::clone(&uri), Arc::clone(&answers));
        let key = keys.of(id);
        Box::pin(async move {
            let body = Bytes::from(format!(r#"{{"order":"{key}","amount":1}}"#));
            let req = http::Request::post(&*uri)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(Full::new(body))
                .map_err(|e| e.to_string())?;
            let resp = client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let counter = match status.as_u16() {
                409 => &answers.conflicts,
                200..=299 if replayed => &answers.replayed,
                200..=299 => &answers.fresh,
                _ => {
                    return Err(format!(
                        "{status}: {}",
                        String::from_utf8_lossy(&body[..body.len().min(200)])
                    ));
                }
            };
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
}

/// The rows the contender wrote in this run: the ledger's, or (h0x)'s table's.
async fn rows(pool: &PgPool, run: &str, contender: &str) -> Result<u64, CliError> {
    let n: i64 = if contender == "h0x" {
        sqlx::query_scalar("SELECT count(*) FROM dedup_bench_ledger_unique WHERE run = $1")
            .bind(run)
            .fetch_one(pool)
            .await
    } else {
        sqlx::query_scalar(
            "SELECT count(*) FROM dedup_bench_ledger WHERE run = $1 AND contender = $2",
        )
        .bind(run)
        .bind(contender)
        .fetch_one(pool)
        .await
    }
    .map_err(|e| CliError::Failed(format!("counting the rows of {contender}: {e}")))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The transaction ids the server assigned so far: one per transaction that wrote (and so
/// flushed the WAL at its commit), read without taking one. Read-only transactions take none.
/// (`pg_stat_database.xact_commit` would count every transaction, but a backend reports it up
/// to ten seconds late.)
async fn commits(pool: &PgPool) -> Option<u64> {
    let n: i64 = sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8")
        .fetch_one(pool)
        .await
        .ok()?;
    u64::try_from(n).ok()
}
