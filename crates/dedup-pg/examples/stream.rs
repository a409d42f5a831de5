//! dedup's demo: push a stream with duplicates through concurrent workers on a real Postgres, and
//! show that every event's effect ran exactly once.
//!
//! The stream has hot keys duplicated many times, redeliveries, a few poison events (rejected
//! permanently), one key reused with a different payload, and transient failures that succeed when
//! redelivered. Each worker writes its ledger row and the fenced completion in one transaction.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run --release -p dedup-pg --example stream -- [--events N] [--workers W]
//! ```
//! `scripts/demo` starts Postgres and runs this. It creates (and recreates) the `dedup_demo`
//! database. Exits non-zero if the ledger does not hold exactly one row per processed key.

#![allow(clippy::print_stdout)]

use std::collections::HashSet;
use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dedup_core::{
    AfterHandlerError, Dedup, Fingerprint, HandlerError, IdempotencyKey, Policy, ProcessError,
    Processed, Scope,
};
use dedup_pg::PgStore;
use dedup_workload::{LedgerEvent, Workload};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use tokio::sync::Mutex;

#[derive(Clone, Debug)]
struct Event {
    id: u64,
    account: u64,
    amount: i64,
    /// The payload as the producer sent it; its fingerprint guards against key reuse.
    payload: String,
}

#[derive(Debug)]
struct Rejected(String);

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Rejected {}

fn event(id: u64) -> Event {
    // Every 500th event is poison: a negative amount the ledger refuses.
    let e = LedgerEvent::new(id, 500);
    Event {
        id,
        account: e.account,
        amount: e.amount,
        payload: e.payload(),
    }
}

/// `events` deliveries over 70% as many unique events (the shared workload generator): 30%
/// duplicates, a tenth of them on 8 hot keys, the rest redeliveries of random earlier events.
fn stream(events: u64) -> Vec<Event> {
    let mut out: Vec<Event> = Workload::new(events)
        .with_duplicates(0.3)
        .with_hot_keys(8)
        .with_recent(0.9, u64::MAX)
        .with_seed(42)
        .ids()
        .ids
        .into_iter()
        .map(event)
        .collect();
    // One producer bug: an event id reused with another payload.
    if let Some(e) = out.iter_mut().rev().find(|e| e.id == 1 && e.amount > 0) {
        e.amount += 1;
        e.payload = format!(
            r#"{{"id":1,"account":{},"amount":{}}}"#,
            e.account, e.amount
        );
    }
    // Workers pop deliveries from the end.
    out.reverse();
    out
}

#[derive(Default)]
struct Tally {
    executed: AtomicU64,
    replayed: AtomicU64,
    retried: AtomicU64,
    poison: AtomicU64,
    mismatched: AtomicU64,
    in_flight: AtomicU64,
}

fn arg(args: &[String], name: &str, default: u64) -> Result<u64, Box<dyn Error>> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or(format!("{name} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let events = arg(&args, "--events", 20_000)?.max(100);
    let workers = arg(&args, "--workers", 16)?.clamp(1, 64);
    let url = std::env::var("DATABASE_URL").map_err(
        |_| "DATABASE_URL is not set: run scripts/demo, which starts Postgres and sets it",
    )?;
    let pool = demo_database(&url).await?;

    let store = PgStore::new(pool.clone());
    let dedup = Arc::new(
        Dedup::new(store.clone())
            .with_policy(
                Policy::default()
                    .with_lease(Duration::from_secs(10))
                    .with_max_attempts(3),
            )?
            .with_in_flight_wait(Duration::from_secs(30))?,
    );
    let scope = Scope::new("demo-payments")?;
    let deliveries = stream(events);
    let unique: HashSet<u64> = deliveries.iter().map(|e| e.id).collect();
    let poison: HashSet<u64> = unique
        .iter()
        .copied()
        .filter(|id| id % 500 == 499)
        .collect();

    println!(
        "dedup demo: {events} deliveries, {} unique events, {workers} concurrent workers",
        unique.len()
    );
    println!("  Postgres: {}", redact(&url));
    let queue = Arc::new(Mutex::new(deliveries));
    let tally = Arc::new(Tally::default());
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(
        usize::try_from(events).unwrap_or(0),
    )));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (queue, tally, latencies) = (
            Arc::clone(&queue),
            Arc::clone(&tally),
            Arc::clone(&latencies),
        );
        let (dedup, store, scope) = (Arc::clone(&dedup), store.clone(), scope.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let Some(ev) = queue.lock().await.pop() else { break };
                let key = IdempotencyKey::new(scope.clone(), format!("evt-{}", ev.id))?;
                let t = Instant::now();
                let out = dedup.process(&key, Some(Fingerprint::of(&ev.payload)), |ctx| {
                    let (store, ev) = (store.clone(), ev.clone());
                    async move {
                        if ev.amount < 0 {
                            return Err(HandlerError::Permanent(Rejected(format!("negative amount {}", ev.amount))));
                        }
                        // Every 97th event meets a transient failure on its first attempt.
                        if ev.id % 97 == 0 && ctx.lease().attempts == 1 {
                            return Err(HandlerError::Retryable(Rejected("ledger busy (simulated)".into())));
                        }
                        let token = i64::try_from(ctx.lease().token.get()).unwrap_or(i64::MAX);
                        store
                            .transact(&ctx, move |tx| {
                                Box::pin(async move {
                                    sqlx::query(
                                        "INSERT INTO ledger (event_id, account, amount, token) VALUES ($1, $2, $3, $4)",
                                    )
                                    .bind(i64::try_from(ev.id).unwrap_or(i64::MAX))
                                    .bind(i64::try_from(ev.account).unwrap_or(i64::MAX))
                                    .bind(ev.amount)
                                    .bind(token)
                                    .execute(&mut *tx)
                                    .await
                                    .map_err(|e| HandlerError::Retryable(Rejected(e.to_string())))?;
                                    Ok(Bytes::from(format!("booked {} on {}", ev.amount, ev.account)))
                                })
                            })
                            .await
                    }
                });
                let out = out.await;
                mine.push(t.elapsed());
                match out {
                    Ok(Processed::Executed { .. }) => tally.executed.fetch_add(1, Ordering::Relaxed),
                    Ok(_) => tally.replayed.fetch_add(1, Ordering::Relaxed),
                    Err(ProcessError::Handler { after: AfterHandlerError::Released { .. }, .. }) => {
                        // The broker would redeliver it: put it back at the end of the queue.
                        queue.lock().await.insert(0, ev);
                        tally.retried.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(ProcessError::Handler { .. } | ProcessError::Failed { .. }) => {
                        tally.poison.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(ProcessError::PayloadMismatch { .. }) => tally.mismatched.fetch_add(1, Ordering::Relaxed),
                    Err(ProcessError::InFlight { .. }) => tally.in_flight.fetch_add(1, Ordering::Relaxed),
                    Err(e) => return Err(Box::<dyn Error + Send + Sync>::from(e.to_string())),
                };
            }
            latencies.lock().await.extend(mine);
            Ok::<_, Box<dyn Error + Send + Sync>>(())
        }));
    }
    for t in tasks {
        t.await?.map_err(|e| e.to_string())?;
    }
    let elapsed = started.elapsed();

    let (rows, keys, doubled): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), \
         (SELECT count(*) FROM (SELECT event_id FROM ledger GROUP BY event_id HAVING count(*) > 1) d) FROM ledger",
    )
    .fetch_one(&pool)
    .await?;
    let expected = i64::try_from(unique.len() - poison.len())?;
    let mut lat = Arc::try_unwrap(latencies)
        .map_err(|_| "workers still hold latencies")?
        .into_inner();
    lat.sort_unstable();
    let pct = |p: usize| {
        lat.get((lat.len().saturating_sub(1)) * p / 100)
            .copied()
            .unwrap_or_default()
    };
    let t = &tally;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let line = |label: &str, value: String| println!("  {label:<30}{value}");
    println!();
    line("deliveries processed", format!("{:>8}", lat.len()));
    line("unique events", format!("{:>8}", unique.len()));
    line("effects executed", format!("{:>8}", n(&t.executed)));
    line("duplicates replayed", format!("{:>8}", n(&t.replayed)));
    line(
        "redelivered after a failure",
        format!("{:>8}  (transient, then succeeded)", n(&t.retried)),
    );
    line(
        "poison deliveries (FAILED)",
        format!("{:>8}  ({} poison events)", n(&t.poison), poison.len()),
    );
    line(
        "payload mismatches refused",
        format!("{:>8}", n(&t.mismatched)),
    );
    line(
        "gave up waiting (in flight)",
        format!("{:>8}", n(&t.in_flight)),
    );
    line(
        "ledger rows",
        format!("{rows:>8}  for {keys} events; expected {expected}; doubled: {doubled}"),
    );
    line(
        "throughput",
        format!(
            "{:>8.0}  deliveries/s over {:.2?}",
            lat.len() as f64 / elapsed.as_secs_f64(),
            elapsed
        ),
    );
    line(
        "latency per delivery",
        format!("p50 {:.2?}  p99 {:.2?}", pct(50), pct(99)),
    );
    if rows != expected
        || keys != expected
        || doubled != 0
        || u64::try_from(rows)? != n(&t.executed)
    {
        println!("\nFAIL: the ledger does not hold exactly one row per processed event");
        std::process::exit(1);
    }
    println!("\nOK: every event's effect ran exactly once; every duplicate got the stored result.");
    Ok(())
}

/// Recreates the `dedup_demo` database on the server of `url`, migrates it, adds the ledger.
async fn demo_database(url: &str) -> Result<PgPool, Box<dyn Error>> {
    let admin: PgConnectOptions = url.parse()?;
    let admin_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(admin.clone())
        .await
        .map_err(|e| {
            format!(
                "cannot reach Postgres at {}: {e} (is it running? scripts/demo starts one)",
                redact(url)
            )
        })?;
    sqlx::query("DROP DATABASE IF EXISTS dedup_demo WITH (FORCE)")
        .execute(&admin_pool)
        .await?;
    sqlx::query("CREATE DATABASE dedup_demo")
        .execute(&admin_pool)
        .await?;
    admin_pool.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(40)
        .connect_with(admin.database("dedup_demo").disable_statement_logging())
        .await?;
    dedup_pg::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE ledger (event_id bigint NOT NULL, account bigint NOT NULL, amount bigint NOT NULL \
         CHECK (amount > 0), token bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    Ok(pool)
}

/// The URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
