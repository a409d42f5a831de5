//! Measures the tiered store on a real Postgres and Redis: 100,000 events (by default) with 30%
//! duplicates (half of them on 1,000 hot keys, half redeliveries of recent events), 16 concurrent
//! workers, lease mode. Prints the Postgres round trips per unique key and the hit ratio per tier.
//! A measurement, not a timed test: `scripts/measure` starts the servers and runs it.
//!
//! `DATABASE_URL=… REDIS_URL=… cargo run --release -p dedup-redis --example measure -- [--events N]`

#![allow(clippy::print_stdout)]

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use dedup_core::{
    Completion, Dedup, HandlerError, IdempotencyKey, Scope, TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use dedup_redis::RedisFastPath;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

fn stream(events: usize, rng: &mut Lcg) -> (Vec<u64>, usize) {
    let unique = events * 7 / 10;
    let mut out: Vec<u64> = (0..unique as u64).collect();
    for i in 0..events - unique {
        let k = if i % 2 == 0 {
            rng.next() % 1000
        } else {
            rng.next() % unique as u64
        };
        out.push(k);
    }
    // Shuffle, then pull each redelivery close behind an earlier copy of its key.
    for i in (1..out.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        out.swap(i, j);
    }
    (out, unique)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let events: usize = match args.iter().position(|a| a == "--events") {
        Some(i) => args.get(i + 1).ok_or("--events needs a value")?.parse()?,
        None => 100_000,
    };
    let db_url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set (scripts/measure sets it)")?;
    let redis_url =
        std::env::var("REDIS_URL").map_err(|_| "REDIS_URL is not set (scripts/measure sets it)")?;

    let admin: PgConnectOptions = db_url.parse()?;
    let admin_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(admin.clone())
        .await?;
    sqlx::query("DROP DATABASE IF EXISTS dedup_measure WITH (FORCE)")
        .execute(&admin_pool)
        .await?;
    sqlx::query("CREATE DATABASE dedup_measure")
        .execute(&admin_pool)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(32)
        .connect_with(admin.database("dedup_measure"))
        .await?;
    dedup_pg::migrate(&pool).await?;
    let prefix = format!("measure-{}", std::process::id());
    let fast = RedisFastPath::connect(&redis_url)
        .await?
        .with_prefix(prefix);
    let store = Arc::new(TieredStore::new(
        PgStore::new(pool.clone()),
        fast.clone(),
        TieredConfig::default(),
    ));
    let dedup = Arc::new(Dedup::new(Arc::clone(&store)));

    let (keys, unique) = stream(events, &mut Lcg(11));
    let keys = Arc::new(keys);
    let next = Arc::new(AtomicUsize::new(0));
    let scope = Scope::new("measure")?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (dedup, keys, next, scope) = (
            Arc::clone(&dedup),
            Arc::clone(&keys),
            Arc::clone(&next),
            scope.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(k) = keys.get(i) else { break };
                let key = IdempotencyKey::new(scope.clone(), format!("evt-{k}"))
                    .map_err(|e| e.to_string())?;
                dedup
                    .process(&key, None, |_| async {
                        Ok::<_, HandlerError<std::io::Error>>(Completion::store("ok"))
                    })
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    let st = store.stats();
    let claims = events as f64;
    let pct = |n: u64| n as f64 * 100.0 / claims;
    println!(
        "{events} events, {unique} unique keys ({:.0}% duplicates), 16 workers, lease mode",
        (events - unique) as f64 * 100.0 / claims
    );
    println!(
        "  answered by L1             {:>7}  {:>5.1}%",
        st.l1_hits,
        pct(st.l1_hits)
    );
    println!(
        "  answered by L2 (Redis)     {:>7}  {:>5.1}%",
        st.l2_hits,
        pct(st.l2_hits)
    );
    println!(
        "  decided by Postgres        {:>7}  {:>5.1}%",
        st.authority_claims,
        pct(st.authority_claims)
    );
    println!(
        "  Postgres claims per unique key        {:.3}",
        st.authority_claims as f64 / unique as f64
    );
    println!(
        "  Postgres round trips per unique key   {:.3}  (claims, completions, heartbeats)",
        st.authority_calls as f64 / unique as f64
    );
    println!(
        "  Redis errors / timeouts    {} / {}",
        st.l2_errors, st.l2_timeouts
    );
    println!(
        "  elapsed {:.2?} ({:.0} events/s)",
        elapsed,
        claims / elapsed.as_secs_f64()
    );

    // A rebalance: another instance (its own, empty L1) replays the last 20,000 events.
    let other = TieredStore::new(PgStore::new(pool), fast, TieredConfig::default());
    let other = Dedup::new(&other);
    let replay = &keys[keys.len().saturating_sub(20_000)..];
    for k in replay {
        let key = IdempotencyKey::new(scope.clone(), format!("evt-{k}"))?;
        other
            .process(&key, None, |_| async {
                Ok::<_, HandlerError<std::io::Error>>(Completion::store("x"))
            })
            .await?;
    }
    let st = other.store().stats();
    let n = replay.len() as f64;
    println!(
        "\nanother instance (empty L1) replays the last {} events after a rebalance",
        replay.len()
    );
    println!(
        "  answered by L1             {:>7}  {:>5.1}%",
        st.l1_hits,
        st.l1_hits as f64 * 100.0 / n
    );
    println!(
        "  answered by L2 (Redis)     {:>7}  {:>5.1}%",
        st.l2_hits,
        st.l2_hits as f64 * 100.0 / n
    );
    println!(
        "  decided by Postgres        {:>7}  {:>5.1}%",
        st.authority_claims,
        st.authority_claims as f64 * 100.0 / n
    );
    Ok(())
}
