//! The usual patterns dedup is measured against: a Postgres transaction with
//! `SELECT ... FOR UPDATE` per message, and a Redis Lua acquire and complete per message; each
//! also with a ledger row per key ((a'), (b')).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dedup_redis::redis::{self, Script};
use sqlx::PgPool;

use super::txmode::ledger_rows;
use super::{Ctx, Outcome, drive, result_of};
use crate::connect::{CliError, connect_redis};

pub(super) fn failed(what: &str) -> impl Fn(sqlx::Error) -> CliError + '_ {
    move |e| CliError::Failed(format!("{what}: {e}"))
}

/// (a) Per message, one transaction: BEGIN, SELECT ... FOR UPDATE; a new key is INSERTed, its
/// effect run and its row UPDATEd to completed; COMMIT. A duplicate reads the row and commits.
pub(super) async fn usual_postgres(
    ctx: &Ctx,
    pool: &PgPool,
    ledger: bool,
) -> Result<Outcome, CliError> {
    let name = if ledger { "(a')" } else { "(a)" };
    ctx.note(&format!(
        "{name} postgres: a transaction with SELECT ... FOR UPDATE per message{}",
        if ledger { ", the ledger row in it" } else { "" }
    ));
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dedup_bench_usual \
         (key text PRIMARY KEY, state text NOT NULL, result bytea)",
    )
    .execute(pool)
    .await
    .map_err(failed("creating the bench table"))?;
    let prefix = Arc::new(format!("{}:{}", ctx.run_id, if ledger { "l:" } else { "" }));
    let run = Arc::new(ctx.run_id.clone());
    let effects = Arc::new(AtomicU64::new(0));
    let trips = Arc::new(AtomicU64::new(0));
    let keys = ctx.keys;
    let one = {
        let (pool, effects, trips, prefix, run) = (
            pool.clone(),
            Arc::clone(&effects),
            Arc::clone(&trips),
            Arc::clone(&prefix),
            Arc::clone(&run),
        );
        move |id: u64| {
            let (pool, effects, trips, prefix, run) = (
                pool.clone(),
                Arc::clone(&effects),
                Arc::clone(&trips),
                Arc::clone(&prefix),
                Arc::clone(&run),
            );
            async move {
                let key = format!("{prefix}{}", keys.of(id));
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
                if ledger {
                    sqlx::query(LEDGER_ROW)
                        .bind(run.as_str())
                        .bind(name)
                        .bind(&key)
                        .execute(&mut *tx)
                        .await
                        .map_err(e)?;
                    trips.fetch_add(1, Ordering::Relaxed);
                }
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
    let (elapsed, latencies, errors) = drive(ctx, one).await;
    let unique_calls = trips.load(Ordering::Relaxed);
    let effects = if ledger {
        ledger_rows(pool, &ctx.run_id, name).await?
    } else {
        effects.load(Ordering::Relaxed)
    };
    Ok(Outcome {
        name,
        label: if ledger {
            "postgres: SELECT FOR UPDATE + ledger row"
        } else {
            "postgres: SELECT FOR UPDATE per message"
        },
        durable: true,
        elapsed,
        latencies,
        effects,
        errors,
        pg_trips: Some(unique_calls),
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

/// One message's ledger row (the effect-in-the-database workload). $1 run, $2 contender, $3 key.
const LEDGER_ROW: &str =
    "INSERT INTO dedup_bench_ledger (run, contender, key, amount) VALUES ($1, $2, $3, 1)";

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
pub(super) async fn usual_redis(
    ctx: &Ctx,
    url: &str,
    ledger: Option<&PgPool>,
) -> Result<Outcome, CliError> {
    let name = if ledger.is_some() { "(b')" } else { "(b)" };
    ctx.note(&format!(
        "{name} redis: a Lua acquire and a Lua complete per message{}",
        if ledger.is_some() {
            ", the ledger row in a transaction of its own"
        } else {
            ""
        }
    ));
    let fast = connect_redis(url, "unused").await?;
    let conn = fast.connection().clone();
    let prefix = format!(
        "dedup-bench-usual{}-{}",
        if ledger.is_some() { "-l" } else { "" },
        ctx.run_id
    );
    let pool = ledger.cloned();
    let run = Arc::new(ctx.run_id.clone());
    let scripts = Arc::new((Script::new(ACQUIRE_LUA), Script::new(COMPLETE_LUA)));
    let effects = Arc::new(AtomicU64::new(0));
    let keys = ctx.keys;
    let one = {
        let effects = Arc::clone(&effects);
        move |id: u64| {
            let (mut conn, scripts, effects) =
                (conn.clone(), Arc::clone(&scripts), Arc::clone(&effects));
            let (pool, run) = (pool.clone(), Arc::clone(&run));
            let key = format!("{prefix}:{{{}}}", keys.of(id));
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
                if let Some(pool) = &pool {
                    sqlx::query(LEDGER_ROW)
                        .bind(run.as_str())
                        .bind(name)
                        .bind(&key)
                        .execute(pool)
                        .await
                        .map_err(|e| e.to_string())?;
                }
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
    let (elapsed, latencies, errors) = drive(ctx, one).await;
    let effects = match ledger {
        Some(pool) => ledger_rows(pool, &ctx.run_id, name).await?,
        None => effects.load(Ordering::Relaxed),
    };
    Ok(Outcome {
        name,
        label: if ledger.is_some() {
            "redis: Lua acquire + complete + ledger row"
        } else {
            "redis: Lua acquire + complete per message"
        },
        durable: false,
        elapsed,
        latencies,
        effects,
        errors,
        pg_trips: None,
        server_statements: None,
        cpu: None,
        wal: None,
        row_bytes: None,
        http: None,
        outbox: None,
        tiers: (0, ctx.stream.len() as u64, 0),
        batches: None,
    })
}
