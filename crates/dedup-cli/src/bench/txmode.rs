//! (e) and (e'): dedup in transaction mode by the batch (`PgStore::transact_batch`): each batch of
//! the stream in one Postgres transaction, its effects (a counter for (e), a ledger row per key
//! for (e')) written by one batch handler, its completions in one statement, one commit.
//!
//! Beside them, the ceiling (500-row INSERTs into a copy of `dedup_records`, two clients) and the
//! claim statement alone on new keys, measured the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use dedup_core::outbox::OutboxMessage;
use dedup_core::{ClaimRequest, IdempotencyKey, Lease, OwnerId, Scope};
use dedup_pg::outbox::OutboxBuffer;
use dedup_pg::{BatchAnswer, BatchBody, BatchRequest, ItemResult, PgStore};
use sqlx::{PgConnection, PgPool};

use super::{Ctx, Latencies, Outcome, result_of, window};
use crate::connect::CliError;

/// (e) with `ledger` false: the effect is outside the database (counted once the batch commits,
/// as a consumer would act after its commit). (e') with `ledger` true: the effect is a row of
/// `dedup_bench_ledger`, written by the batch handler in the batch's transaction.
pub(super) async fn transaction_mode(
    ctx: &Ctx,
    pool: &PgPool,
    ledger: bool,
) -> Result<Outcome, CliError> {
    let (name, label, tag) = if ledger {
        ("(e')", "dedup: transaction mode, batched + ledger", "e2")
    } else {
        ("(e)", "dedup: transaction mode, batched", "e")
    };
    run_batches(
        ctx,
        pool,
        Batches {
            name,
            label,
            tag,
            ledger,
            outbox: None,
            pace: None,
            store: None,
        },
    )
    .await
}

/// How [`run_batches`] runs the stream: its names, its effect, and at what rate events come.
pub(super) struct Batches {
    pub(super) name: &'static str,
    pub(super) label: &'static str,
    pub(super) tag: &'static str,
    /// A ledger row per key in the batch's transaction.
    pub(super) ledger: bool,
    /// One message per executed key queued on the outbox to this topic.
    pub(super) outbox: Option<Arc<String>>,
    /// Events per second at which the stream comes (`None`: as fast as batches take them).
    pub(super) pace: Option<f64>,
    /// The store to run on (a relay on it is woken by its commits); a new one if `None`.
    pub(super) store: Option<PgStore>,
}

/// The stream in batch transactions, `ctx.tx_workers` at a time.
pub(super) async fn run_batches(
    ctx: &Ctx,
    pool: &PgPool,
    how: Batches,
) -> Result<Outcome, CliError> {
    let Batches {
        name,
        label,
        tag,
        ledger,
        outbox,
        pace,
        store,
    } = how;
    let workers = ctx.tx_workers.max(1);
    let size = (ctx.concurrency / workers).max(1);
    ctx.note(&format!(
        "{name} dedup: transaction mode, {workers} batch transactions of up to {size} at once"
    ));
    let store = store.unwrap_or_else(|| PgStore::new(pool.clone()));
    let scope = Scope::new(ctx.scope(tag)).map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let contender = Arc::new(name.to_owned());
    let run = Arc::new(ctx.run_id.clone());
    let executed = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let (store, scope, stream, next) = (
            store.clone(),
            scope.clone(),
            Arc::clone(&ctx.stream),
            Arc::clone(&next),
        );
        let (executed, errors, contender, run) = (
            Arc::clone(&executed),
            Arc::clone(&errors),
            Arc::clone(&contender),
            Arc::clone(&run),
        );
        let keys = ctx.keys;
        let outbox = outbox.clone();
        tasks.spawn(async move {
            let mut latencies = Latencies::default();
            // Messages answered InFlight (a concurrent batch holds their key) come again.
            let mut again: Vec<u64> = Vec::new();
            // The drop's phase when an event that comes again was first tried.
            let mut first: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
            let mut n = 0u64;
            let mut failures = 0u32;
            loop {
                let take = size.saturating_sub(again.len());
                let from = next.fetch_add(take, Ordering::Relaxed);
                // Paced: the events of this batch have all come by now.
                if let Some(rate) = pace {
                    #[allow(clippy::cast_precision_loss)]
                    let due = started
                        + std::time::Duration::from_secs_f64(
                            (from + take).min(stream.len()) as f64 / rate,
                        );
                    tokio::time::sleep_until(due.into()).await;
                }
                let fresh = stream.get(from.min(stream.len())..(from + take).min(stream.len()));
                let mut ids: Vec<u64> = std::mem::take(&mut again);
                ids.extend(fresh.unwrap_or_default());
                if ids.is_empty() {
                    break;
                }
                let reqs: Vec<ClaimRequest> = ids
                    .iter()
                    .map(|id| {
                        n += 1;
                        let key = IdempotencyKey::new(scope.clone(), keys.of(*id))
                            .unwrap_or_else(|_| unreachable!("short keys are valid"));
                        ClaimRequest::new(key, OwnerId::new(format!("w{w}:{n}")))
                    })
                    .collect();
                let (t, phase) = (Instant::now(), window::drop_phase());
                // The drop's phase at the first try of each event answered now.
                let mut answered: Vec<u64> = Vec::with_capacity(ids.len());
                let queued = outbox
                    .as_ref()
                    .map(|topic| (Arc::clone(topic), Arc::new(OutboxBuffer::new())));
                let handler = handler(
                    ledger,
                    Arc::clone(&contender),
                    Arc::clone(&run),
                    queued.clone(),
                );
                let batch = match &queued {
                    Some((_, buffer)) => BatchRequest::new(&reqs).with_outbox(buffer),
                    None => BatchRequest::new(&reqs),
                };
                match store.transact_batch(batch, handler).await {
                    Ok(answers) => {
                        for (id, a) in ids.iter().zip(answers) {
                            if a.is_retryable() {
                                first.entry(*id).or_insert(phase);
                                again.push(*id);
                                continue;
                            }
                            answered.push(first.remove(id).unwrap_or(phase));
                            match a {
                                BatchAnswer::Executed { .. } => {
                                    executed.fetch_add(1, Ordering::Relaxed);
                                }
                                BatchAnswer::Replayed { .. } => {}
                                a => {
                                    if errors.fetch_add(1, Ordering::Relaxed) < 5 {
                                        eprintln!("[bench] {contender} event {id}: {a:?}");
                                    }
                                }
                            }
                        }
                    }
                    Err(e) if e.is_retryable() && failures < 100 => {
                        failures += 1;
                        for id in &ids {
                            first.entry(*id).or_insert(phase);
                        }
                        again = ids;
                    }
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("[bench] {contender}: {e}");
                        break;
                    }
                }
                let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                for p in answered {
                    latencies.record(us, 1, p);
                }
            }
            latencies
        });
    }
    let mut latencies = Latencies::default();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(l) => latencies.merge(l),
            Err(_) => {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let elapsed = started.elapsed();
    let latencies = latencies.sorted();
    let effects = if ledger {
        ledger_rows(pool, &ctx.run_id, name).await?
    } else {
        executed.load(Ordering::Relaxed)
    };
    Ok(Outcome {
        name,
        label,
        durable: true,
        elapsed,
        latencies,
        effects,
        errors: errors.load(Ordering::Relaxed),
        pg_trips: Some(store.statements()),
        server_statements: None,
        cpu: None,
        wal: None,
        row_bytes: None,
        http: None,
        outbox: None,
        tiers: (0, 0, ctx.stream.len() as u64),
        batches: None,
    })
}

/// The batch handler: every acquired message's ledger row in one statement ((e')), or nothing
/// to write ((e)); the result per message.
fn handler(
    ledger: bool,
    contender: Arc<String>,
    run: Arc<String>,
    outbox: Option<(Arc<String>, Arc<OutboxBuffer>)>,
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, std::io::Error> + Send {
    move |tx, leases| {
        let (contender, run) = (Arc::clone(&contender), Arc::clone(&run));
        // (g): one message per key, keyed by it, its result as the payload.
        if let Some((topic, buffer)) = &outbox {
            let now = super::unix_ms_now();
            for l in leases {
                let key = l.key.key_bytes().to_vec();
                let m = OutboxMessage::new(topic.as_str(), Bytes::from(key.clone())).with_key(key);
                let _ = buffer.publish(l, now, m);
            }
        }
        Box::pin(async move {
            let ids: Vec<String> = leases
                .iter()
                .map(|l| String::from_utf8_lossy(l.key.key_bytes()).into_owned())
                .collect();
            if ledger {
                sqlx::query(
                    "INSERT INTO dedup_bench_ledger (run, contender, key, amount) \
                     SELECT $1, $2, k, 1 FROM unnest($3::text[]) AS u(k)",
                )
                .bind(run.as_str())
                .bind(contender.as_str())
                .bind(&ids)
                .execute(&mut *tx)
                .await
                .map_err(|e| {
                    dedup_core::HandlerError::Retryable(std::io::Error::other(e.to_string()))
                })?;
            }
            Ok(ids
                .iter()
                .map(|k| -> ItemResult<std::io::Error> {
                    let id: u64 = k.trim_start_matches('e').parse().unwrap_or(0);
                    Ok(Bytes::from(result_of(id)))
                })
                .collect())
        })
    }
}

/// The ledger table of the effect-in-the-database workload: no unique constraint, so a doubled
/// effect shows as a second row.
pub(super) async fn ledger_table(pool: &PgPool) -> Result<(), CliError> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dedup_bench_ledger \
         (run text NOT NULL, contender text NOT NULL, key text NOT NULL, amount int NOT NULL)",
    )
    .execute(pool)
    .await
    .map_err(|e| CliError::Failed(format!("creating the ledger table: {e}")))?;
    Ok(())
}

/// A contender's ledger rows in this run.
pub(super) async fn ledger_rows(
    pool: &PgPool,
    run: &str,
    contender: &str,
) -> Result<u64, CliError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_bench_ledger WHERE run = $1 AND contender = $2",
    )
    .bind(run)
    .bind(contender)
    .fetch_one(pool)
    .await
    .map_err(|e| CliError::Failed(format!("counting ledger rows: {e}")))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Runs `chunk(from, to)` over `0..rows` in 500-row chunks from two clients at once; answers
/// rows per second. The ceiling and the claim measurement share it, so that they compare.
async fn two_clients<F, Fut>(rows: u64, what: &str, chunk: F) -> Result<f64, CliError>
where
    F: Fn(u64, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (next, chunk) = (Arc::clone(&next), chunk.clone());
        tasks.spawn(async move {
            loop {
                let from = next.fetch_add(500, Ordering::Relaxed);
                if from >= rows {
                    return Ok::<(), String>(());
                }
                chunk(from, (from + 500).min(rows)).await?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|j| CliError::Failed(format!("{what}: {j}")))?
            .map_err(|e| CliError::Failed(format!("{what}: {e}")))?;
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = rows as f64 / started.elapsed().as_secs_f64().max(1e-9);
    Ok(rate)
}

/// dedup's claim statement on new keys, measured as the ceiling is: the stream's unique keys
/// claimed in 500-key `claim_batch` statements (each its own transaction) from two clients.
/// Answers claims per second; the ceiling's rate over it is what a claim costs beside a plain
/// INSERT of the same rows.
pub(super) async fn claims(ctx: &Ctx, pool: &PgPool, rows: u64) -> Result<f64, CliError> {
    use dedup_core::{ClaimOutcome, Store};
    ctx.note("claims: 500-key claim statements on new keys, two clients");
    let scope =
        Scope::new(ctx.scope("claim")).map_err(|e| CliError::Failed(format!("claims: {e}")))?;
    let store = PgStore::new(pool.clone());
    let keys = ctx.keys;
    two_clients(rows, "claims", move |from, to| {
        let (store, scope) = (store.clone(), scope.clone());
        async move {
            let reqs: Vec<ClaimRequest> = (from..to)
                .map(|i| {
                    let key = IdempotencyKey::new(scope.clone(), keys.of(i))
                        .map_err(|e| e.to_string())?;
                    Ok(ClaimRequest::new(key, OwnerId::new("bench")))
                })
                .collect::<Result<_, String>>()?;
            for answer in store.claim_batch(&reqs).await {
                match answer {
                    Ok(ClaimOutcome::Acquired(_)) => {}
                    other => return Err(format!("a new key was not acquired: {other:?}")),
                }
            }
            Ok(())
        }
    })
    .await
}

/// The ceiling: the same Postgres taking `rows` completed rows as 500-row
/// `INSERT ... ON CONFLICT DO NOTHING` statements into a scratch table with `dedup_records`'
/// columns and indexes, from two clients. Answers rows per second.
pub(super) async fn ceiling(ctx: &Ctx, pool: &PgPool, rows: u64) -> Result<f64, CliError> {
    ctx.note("ceiling: 500-row INSERTs into a copy of dedup_records, two clients");
    let e = |e: sqlx::Error| CliError::Failed(format!("ceiling: {e}"));
    sqlx::query("DROP TABLE IF EXISTS dedup_bench_ceiling")
        .execute(pool)
        .await
        .map_err(e)?;
    sqlx::query("CREATE TABLE dedup_bench_ceiling (LIKE dedup_records INCLUDING ALL)")
        .execute(pool)
        .await
        .map_err(e)?;
    let insert_pool = pool.clone();
    let shape = ctx.keys;
    let rate = two_clients(rows, "ceiling", move |from, to| {
        let pool = insert_pool.clone();
        async move {
            let keys: Vec<Vec<u8>> = (from..to).map(|i| shape.of(i).into_bytes()).collect();
            let results: Vec<Vec<u8>> = (from..to).map(|i| result_of(i).into_bytes()).collect();
            sqlx::query(
                "INSERT INTO dedup_bench_ceiling (scope, key, state, token, attempts, result, \
                 created_at, updated_at, expires_at) \
                 SELECT 'ceiling', k, 'completed', nextval('dedup_token_seq'), 1, r, \
                 statement_timestamp(), statement_timestamp(), \
                 statement_timestamp() + interval '7 days' \
                 FROM unnest($1::bytea[], $2::bytea[]) AS u(k, r) ON CONFLICT DO NOTHING",
            )
            .bind(&keys)
            .bind(&results)
            .execute(&pool)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
        }
    })
    .await?;
    sqlx::query("DROP TABLE dedup_bench_ceiling")
        .execute(pool)
        .await
        .map_err(e)?;
    Ok(rate)
}
