//! `dedup bench`: one workload, four ways of making its consumer idempotent, side by side.
//!
//! (a) the usual Postgres pattern (per message: BEGIN, SELECT ... FOR UPDATE, INSERT, UPDATE,
//! COMMIT); (b) the usual Redis pattern (per message: a Lua acquire and a Lua complete; not
//! durable); (c) dedup's tiered store, one call per message; (d) dedup's tiered store behind
//! `Batched` (group commit). The same events, the same concurrency, the same servers; each
//! contender in its own key space, with a cold L1. Every contender's effects are counted and must
//! equal the unique keys.

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use dedup_core::{
    BatchConfig, Batched, Completion, Dedup, HandlerError, IdempotencyKey, Scope, Store, TierStats,
    TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use dedup_redis::redis::{self, Script};
use sqlx::PgPool;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg, connect_redis};
use crate::workload::zipf_stream;

/// Compare dedup with the usual Postgres and Redis patterns on one workload.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pg: PgArgs,
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: String,
    /// Events in the stream.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// The share of events that repeat an earlier key.
    #[arg(long, default_value_t = 0.3)]
    duplicates: f64,
    /// The Zipf exponent of the duplicates' keys (higher: hotter hot keys).
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    /// Events processed at once, the same for every contender.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Postgres connections, the same pool for every contender that uses Postgres.
    #[arg(long, default_value_t = 64)]
    pg_connections: u32,
    /// Contenders to run, among a, b, c, d.
    #[arg(long, default_value = "a,b,c,d", value_delimiter = ',')]
    only: Vec<char>,
    /// (d): the most requests in one batch call.
    #[arg(long, default_value_t = 512)]
    batch_max: usize,
    /// (d): batch calls of one kind in flight at once.
    #[arg(long, default_value_t = 2)]
    batch_flushes: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// What one contender did.
#[derive(Debug)]
struct Outcome {
    name: &'static str,
    label: &'static str,
    durable: bool,
    elapsed: Duration,
    latencies_us: Vec<u64>,
    effects: u64,
    errors: u64,
    /// Postgres round trips, where Postgres is used.
    pg_trips: Option<u64>,
    /// Claims answered by L1, by L2, and by the authority.
    tiers: (u64, u64, u64),
    batches: Option<(u64, u64, u64, u64)>,
}

impl Outcome {
    fn rate(&self, events: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let n = events as f64;
        n / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let i = (((self.latencies_us.len() - 1) as f64) * p).round() as usize;
        #[allow(clippy::cast_precision_loss)]
        let ms = self.latencies_us[i] as f64 / 1000.0;
        ms
    }

    fn trips_per_unique(&self, unique: u64) -> Option<f64> {
        #[allow(clippy::cast_precision_loss)]
        self.pg_trips.map(|t| t as f64 / unique.max(1) as f64)
    }

    fn tier_shares(&self) -> (f64, f64, f64) {
        let (l1, l2, auth) = self.tiers;
        #[allow(clippy::cast_precision_loss)]
        let total = (l1 + l2 + auth).max(1) as f64;
        #[allow(clippy::cast_precision_loss)]
        let shares = (l1 as f64 / total, l2 as f64 / total, auth as f64 / total);
        shares
    }
}

pub(crate) async fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    if !(0.0..1.0).contains(&args.duplicates) || args.events == 0 || args.concurrency == 0 {
        return Err(CliError::Config(
            "--duplicates must be in [0, 1), --events and --concurrency above 0".into(),
        ));
    }
    if let Some(c) = args.only.iter().find(|c| !"abcd".contains(**c)) {
        return Err(CliError::Config(format!(
            "--only: unknown contender {c:?} (a, b, c or d)"
        )));
    }
    let pool = connect_pg(&args.pg.database_url, args.pg_connections.max(2)).await?;
    dedup_pg::migrate(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("migrations: {e}")))?;
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("reading synchronous_commit: {e}")))?;
    let (stream, unique) = zipf_stream(args.events, args.duplicates, args.zipf, 0xbe7c);
    let stream = Arc::new(stream);
    let run_id = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    let ctx = Ctx {
        batch: BatchConfig::default()
            .with_max_batch(args.batch_max)
            .with_max_flushes(args.batch_flushes),
        stream,
        concurrency: args.concurrency,
        run_id,
        quiet: args.json,
    };

    let mut outcomes = Vec::new();
    for c in ['a', 'b', 'c', 'd'] {
        if !args.only.contains(&c) {
            continue;
        }
        let outcome = match c {
            'a' => usual_postgres(&ctx, &pool).await?,
            'b' => usual_redis(&ctx, &args.redis_url).await?,
            'c' => tiered(&ctx, &pool, &args.redis_url, false).await?,
            _ => tiered(&ctx, &pool, &args.redis_url, true).await?,
        };
        outcomes.push(outcome);
    }
    // Rows are deleted only now: deleting between contenders would set autovacuum to work
    // while the next one is timed.
    ctx.note("deleting the bench's rows");
    cleanup(&pool, &ctx.run_id).await;
    let wrong: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.effects != unique || o.errors > 0)
        .collect();
    let report = Report {
        args: &args,
        unique,
        sync: &sync,
        outcomes: &outcomes,
    };
    if args.json {
        println!("{}", report.json());
    } else {
        report.table();
    }
    if wrong.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        for o in wrong {
            eprintln!(
                "dedup bench: {} ran {} effects for {unique} unique keys, with {} errors",
                o.name, o.effects, o.errors
            );
        }
        Ok(ExitCode::from(1))
    }
}

struct Ctx {
    batch: BatchConfig,
    stream: Arc<Vec<u64>>,
    concurrency: usize,
    run_id: String,
    quiet: bool,
}

impl Ctx {
    fn note(&self, what: &str) {
        if !self.quiet {
            eprintln!("[bench] {what}");
        }
    }
}

/// Runs `one` on every event of the stream from `concurrency` tasks; answers the time taken, each
/// event's latency (sorted, µs) and the number of errors.
async fn drive<F, Fut>(ctx: &Ctx, one: F) -> (Duration, Vec<u64>, u64)
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ctx.concurrency {
        let (stream, next, errors, one) = (
            Arc::clone(&ctx.stream),
            Arc::clone(&next),
            Arc::clone(&errors),
            one.clone(),
        );
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&id) = stream.get(i) else { break };
                let t = Instant::now();
                if let Err(e) = one(id).await
                    && errors.fetch_add(1, Ordering::Relaxed) < 5
                {
                    eprintln!("[bench] event {id}: {e}");
                }
                latencies.push(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            latencies
        });
    }
    let mut latencies = Vec::with_capacity(ctx.stream.len());
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(l) => latencies.extend(l),
            Err(_) => {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    (elapsed, latencies, errors.load(Ordering::Relaxed))
}

fn failed(what: &str) -> impl Fn(sqlx::Error) -> CliError + '_ {
    move |e| CliError::Failed(format!("{what}: {e}"))
}

/// (a) Per message, one transaction: BEGIN, SELECT ... FOR UPDATE; a new key is INSERTed, its
/// effect run and its row UPDATEd to completed; COMMIT. A duplicate reads the row and commits.
async fn usual_postgres(ctx: &Ctx, pool: &PgPool) -> Result<Outcome, CliError> {
    ctx.note("(a) postgres: a transaction with SELECT ... FOR UPDATE per message");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dedup_bench_usual \
         (key text PRIMARY KEY, state text NOT NULL, result bytea)",
    )
    .execute(pool)
    .await
    .map_err(failed("creating the bench table"))?;
    let prefix = Arc::new(format!("{}:", ctx.run_id));
    let effects = Arc::new(AtomicU64::new(0));
    let trips = Arc::new(AtomicU64::new(0));
    let one = {
        let (pool, effects, trips, prefix) = (
            pool.clone(),
            Arc::clone(&effects),
            Arc::clone(&trips),
            Arc::clone(&prefix),
        );
        move |id: u64| {
            let (pool, effects, trips, prefix) = (
                pool.clone(),
                Arc::clone(&effects),
                Arc::clone(&trips),
                Arc::clone(&prefix),
            );
            async move {
                let key = format!("{prefix}e{id}");
                let e = |e: sqlx::Error| e.to_string();
                let mut tx = pool.begin().await.map_err(e)?;
                let row: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(
                    "SELECT state, result FROM dedup_bench_usual WHERE key = $1 FOR UPDATE",
                )
                .bind(&key)
                .fetch_optional(&mut *tx)
                .await
                .map_err(e)?;
                if row.is_some() {
                    tx.commit().await.map_err(e)?;
                    trips.fetch_add(3, Ordering::Relaxed);
                    return Ok(());
                }
                let inserted = sqlx::query(
                    "INSERT INTO dedup_bench_usual (key, state) VALUES ($1, 'in_progress') \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&key)
                .execute(&mut *tx)
                .await
                .map_err(e)?;
                if inserted.rows_affected() == 0 {
                    // A concurrent duplicate inserted and committed it first.
                    tx.rollback().await.map_err(e)?;
                    trips.fetch_add(4, Ordering::Relaxed);
                    return Ok(());
                }
                effects.fetch_add(1, Ordering::Relaxed);
                sqlx::query(
                    "UPDATE dedup_bench_usual SET state = 'completed', result = $2 WHERE key = $1",
                )
                .bind(&key)
                .bind(result_of(id).as_bytes())
                .execute(&mut *tx)
                .await
                .map_err(e)?;
                tx.commit().await.map_err(e)?;
                trips.fetch_add(5, Ordering::Relaxed);
                Ok(())
            }
        }
    };
    let (elapsed, latencies_us, errors) = drive(ctx, one).await;
    let unique_calls = trips.load(Ordering::Relaxed);
    Ok(Outcome {
        name: "(a)",
        label: "postgres: SELECT FOR UPDATE per message",
        durable: true,
        elapsed,
        latencies_us,
        effects: effects.load(Ordering::Relaxed),
        errors,
        pg_trips: Some(unique_calls),
        tiers: (0, 0, ctx.stream.len() as u64),
        batches: None,
    })
}

/// The usual Redis acquire: the key's state if it has one, else take it for the lease.
const ACQUIRE_LUA: &str = r"
local v = redis.call('HGET', KEYS[1], 's')
if v then return v end
redis.call('HSET', KEYS[1], 's', 'in_progress')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return false
";

/// The usual Redis complete: store the result if the key is still in progress.
const COMPLETE_LUA: &str = r"
if redis.call('HGET', KEYS[1], 's') ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 's', 'completed', 'r', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// (b) Per message, a Lua acquire and a Lua complete. Not durable: a Redis restart or failover
/// forgets keys, and their effects run again. A key found in progress counts as a duplicate.
async fn usual_redis(ctx: &Ctx, url: &str) -> Result<Outcome, CliError> {
    ctx.note("(b) redis: a Lua acquire and a Lua complete per message");
    let fast = connect_redis(url, "unused").await?;
    let conn = fast.connection().clone();
    let prefix = format!("dedup-bench-usual-{}", ctx.run_id);
    let scripts = Arc::new((Script::new(ACQUIRE_LUA), Script::new(COMPLETE_LUA)));
    let effects = Arc::new(AtomicU64::new(0));
    let one = {
        let effects = Arc::clone(&effects);
        move |id: u64| {
            let (mut conn, scripts, effects) =
                (conn.clone(), Arc::clone(&scripts), Arc::clone(&effects));
            let key = format!("{prefix}:{{e{id}}}");
            async move {
                let e = |e: redis::RedisError| e.to_string();
                let state: Option<String> = scripts
                    .0
                    .key(&key)
                    .arg(30_000)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(e)?;
                if state.is_some() {
                    return Ok(());
                }
                effects.fetch_add(1, Ordering::Relaxed);
                let _: i64 = scripts
                    .1
                    .key(&key)
                    .arg(result_of(id))
                    .arg(600_000)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(e)?;
                Ok(())
            }
        }
    };
    let (elapsed, latencies_us, errors) = drive(ctx, one).await;
    Ok(Outcome {
        name: "(b)",
        label: "redis: Lua acquire + complete per message",
        durable: false,
        elapsed,
        latencies_us,
        effects: effects.load(Ordering::Relaxed),
        errors,
        pg_trips: None,
        tiers: (0, ctx.stream.len() as u64, 0),
        batches: None,
    })
}

fn result_of(id: u64) -> String {
    format!("done:{id}")
}

/// (c) and (d): `Dedup::process` on the tiered store (moka, Redis, Postgres), one call per
/// message; (d) puts `Batched` between the consumer and the tiers.
async fn tiered(ctx: &Ctx, pool: &PgPool, url: &str, batched: bool) -> Result<Outcome, CliError> {
    let which = if batched { "d" } else { "c" };
    ctx.note(&format!(
        "({which}) dedup: tiered store{}",
        if batched {
            ", batched"
        } else {
            ", one call per message"
        }
    ));
    let pg = PgStore::new(pool.clone());
    let fast = connect_redis(url, &format!("dedup-bench-{which}-{}", ctx.run_id)).await?;
    let store = TieredStore::new(pg.clone(), fast, TieredConfig::default());
    // (d) writes its batches' backfills in the background: the batch answers once Postgres has.
    let store = if batched {
        store.with_background_backfill()
    } else {
        store
    };
    let scope = Scope::new(format!("bench-{which}-{}", ctx.run_id))
        .map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let effects = Arc::new(AtomicU64::new(0));
    let (elapsed, latencies_us, errors, stats, batches) = if batched {
        let dedup = Arc::new(Dedup::new(Batched::new(store, ctx.batch)));
        let (elapsed, latencies, errors) = drive(ctx, process_one(&dedup, &scope, &effects)).await;
        let stats = dedup.store().inner().stats();
        let batches = dedup.store().batch_counts();
        (elapsed, latencies, errors, stats, Some(batches))
    } else {
        let dedup = Arc::new(Dedup::new(store));
        let (elapsed, latencies, errors) = drive(ctx, process_one(&dedup, &scope, &effects)).await;
        (elapsed, latencies, errors, dedup.store().stats(), None)
    };
    let trips = pg.statements();
    Ok(Outcome {
        name: if batched { "(d)" } else { "(c)" },
        label: if batched {
            "dedup: tiered, batched (group commit)"
        } else {
            "dedup: tiered, one call per message"
        },
        durable: true,
        elapsed,
        latencies_us,
        effects: effects.load(Ordering::Relaxed),
        errors,
        pg_trips: Some(trips),
        tiers: tier_counts(&stats),
        batches,
    })
}

fn tier_counts(s: &TierStats) -> (u64, u64, u64) {
    (s.l1_hits, s.l2_hits, s.authority_claims)
}

fn process_one<S: Store + 'static>(
    dedup: &Arc<Dedup<S>>,
    scope: &Scope,
    effects: &Arc<AtomicU64>,
) -> impl Fn(u64) -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    let (dedup, scope, effects) = (Arc::clone(dedup), scope.clone(), Arc::clone(effects));
    move |id: u64| {
        let (dedup, scope, effects) = (Arc::clone(&dedup), scope.clone(), Arc::clone(&effects));
        Box::pin(async move {
            let key = IdempotencyKey::new(scope, format!("e{id}")).map_err(|e| e.to_string())?;
            dedup
                .process(&key, None, |_lease| async {
                    effects.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, HandlerError<std::io::Error>>(Completion::store(result_of(id)))
                })
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
    }
}

/// Deletes a run's rows (records under its scopes, rows of (a)) in bounded batches.
async fn cleanup(pool: &PgPool, run_id: &str) {
    for (sql, pattern) in [
        (
            "DELETE FROM dedup_records WHERE ctid IN (SELECT ctid FROM dedup_records \
             WHERE scope IN ('bench-c-' || $1, 'bench-d-' || $1) LIMIT 10000)",
            run_id.to_owned(),
        ),
        (
            "DELETE FROM dedup_bench_usual WHERE ctid IN (SELECT ctid FROM dedup_bench_usual \
             WHERE starts_with(key, $1) LIMIT 10000)",
            format!("{run_id}:"),
        ),
    ] {
        loop {
            match sqlx::query(sql).bind(&pattern).execute(pool).await {
                Ok(d) if d.rows_affected() > 0 => {}
                _ => break,
            }
        }
    }
}

struct Report<'a> {
    args: &'a BenchArgs,
    unique: u64,
    sync: &'a str,
    outcomes: &'a [Outcome],
}

impl Report<'_> {
    fn rate_of(&self, name: &str) -> Option<f64> {
        self.outcomes
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.rate(self.args.events))
    }

    fn ratio(&self, a: &str, b: &str) -> Option<f64> {
        Some(self.rate_of(a)? / self.rate_of(b)?)
    }

    fn table(&self) {
        let a = self.args;
        println!(
            "dedup bench: {} events, {} unique keys ({:.0}% duplicates, Zipf s={}), \
             concurrency {} and {} Postgres connections for every contender",
            a.events,
            self.unique,
            a.duplicates * 100.0,
            a.zipf,
            a.concurrency,
            a.pg_connections
        );
        println!(
            "Postgres synchronous_commit={} (durable commits: {}); Redis and Postgres on this host",
            self.sync,
            if self.sync == "off" { "NO" } else { "yes" }
        );
        println!();
        println!(
            "{:<4} {:<42} {:>10} {:>8} {:>8} {:>11} {:>6} {:>6} {:>6} {:>8} {:>7}",
            "",
            "contender",
            "events/s",
            "p50 ms",
            "p99 ms",
            "PG trips/u",
            "L1",
            "L2",
            "PG",
            "effects",
            "durable"
        );
        for o in self.outcomes {
            let (l1, l2, auth) = o.tier_shares();
            println!(
                "{:<4} {:<42} {:>10.0} {:>8.2} {:>8.2} {:>11} {:>5.1}% {:>5.1}% {:>5.1}% {:>8} {:>7}",
                o.name,
                o.label,
                o.rate(a.events),
                o.percentile_ms(0.5),
                o.percentile_ms(0.99),
                o.trips_per_unique(self.unique)
                    .map_or("-".to_owned(), |t| format!("{t:.3}")),
                l1 * 100.0,
                l2 * 100.0,
                auth * 100.0,
                o.effects,
                if o.durable { "yes" } else { "no" },
            );
        }
        println!();
        println!(
            "PG trips/u: Postgres round trips per unique key. L1/L2/PG: the share of claims each \
             tier answered."
        );
        for o in self.outcomes {
            if let Some((calls, claims, ccalls, completions)) = o.batches {
                println!(
                    "{}: {claims} claims in {calls} batch calls, {completions} completions in \
                     {ccalls} batch calls (L1 hits bypass the batches)",
                    o.name
                );
            }
        }
        for (x, y) in [("(d)", "(a)"), ("(d)", "(b)"), ("(c)", "(a)")] {
            if let Some(r) = self.ratio(x, y) {
                println!("{x}/{y} = {r:.2}x");
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        let a = self.args;
        let contenders: Vec<serde_json::Value> = self
            .outcomes
            .iter()
            .map(|o| {
                let (l1, l2, auth) = o.tier_shares();
                serde_json::json!({
                    "name": o.name,
                    "label": o.label,
                    "durable": o.durable,
                    "events_per_s": o.rate(a.events),
                    "p50_ms": o.percentile_ms(0.5),
                    "p99_ms": o.percentile_ms(0.99),
                    "pg_round_trips_per_unique_key": o.trips_per_unique(self.unique),
                    "hit_ratio": {"l1": l1, "l2": l2, "postgres": auth},
                    "effects": o.effects,
                    "errors": o.errors,
                    "elapsed_s": o.elapsed.as_secs_f64(),
                    "batches": o.batches.map(|(calls, claims, ccalls, completions)| serde_json::json!({
                        "claim_calls": calls, "claims": claims,
                        "completion_calls": ccalls, "completions": completions,
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "events": a.events,
            "unique_keys": self.unique,
            "duplicates": a.duplicates,
            "zipf": a.zipf,
            "concurrency": a.concurrency,
            "pg_connections": a.pg_connections,
            "synchronous_commit": self.sync,
            "contenders": contenders,
            "ratios": {
                "d_over_a": self.ratio("(d)", "(a)"),
                "d_over_b": self.ratio("(d)", "(b)"),
            },
        })
    }
}
