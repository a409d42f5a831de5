//! The consumer's resident memory against the unique keys it has processed, with the default L1
//! (100,000 entries or 64 MiB): the engine as the demo runs it (the tiered store over Postgres and
//! Redis, behind `Batched`), 256 keys in flight, a trivial handler, keys generated on the fly.
//!
//! ```text
//! source scripts/services.sh && ensure_postgres && ensure_redis
//! cargo run --release -p dedup-benches --example memory            # 5,000,000 keys
//! KEYS=1000000 cargo run --release -p dedup-benches --example memory
//! ```
//! Prints VmRSS (and VmHWM, the peak) at each checkpoint.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dedup_core::{
    BatchConfig, Batched, Completion, Dedup, HandlerError, IdempotencyKey, Scope, TieredConfig,
    TieredStore,
};
use dedup_pg::PgStore;
use dedup_redis::RedisFastPath;

const IN_FLIGHT: usize = 256;

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let keys: u64 = std::env::var("KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&std::env::var("DATABASE_URL").expect("DATABASE_URL"))
            .await
            .unwrap();
        dedup_pg::migrate(&pool).await.unwrap();
        let fast = RedisFastPath::connect(&std::env::var("REDIS_URL").expect("REDIS_URL"))
            .await
            .unwrap()
            .with_prefix(format!("mem{}", std::process::id()));
        let tiered = TieredStore::new(PgStore::new(pool), fast, TieredConfig::default())
            .with_background_backfill();
        let dedup = Arc::new(Dedup::new(Batched::new(tiered, BatchConfig::default())));
        let scope = Scope::new(format!("mem-{}", std::process::id())).unwrap();
        let next = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicU64::new(0));
        println!("keys       seconds  keys/s   VmRSS MiB  VmHWM MiB  L1 entries");
        let started = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..IN_FLIGHT {
            let (dedup, scope, next, done) =
                (dedup.clone(), scope.clone(), next.clone(), done.clone());
            workers.push(tokio::spawn(async move {
                loop {
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    if id >= keys {
                        return;
                    }
                    let key = IdempotencyKey::new(scope.clone(), format!("evt-{id}")).unwrap();
                    let out = dedup
                        .process(&key, None, |_| async {
                            Ok::<_, HandlerError<std::io::Error>>(Completion::store("ok"))
                        })
                        .await
                        .unwrap();
                    assert!(out.executed());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        let mut checkpoint = 250_000u64.min(keys);
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let n = done.load(Ordering::Relaxed);
            if n >= checkpoint {
                let secs = started.elapsed().as_secs_f64();
                #[allow(clippy::cast_precision_loss)]
                let rate = n as f64 / secs;
                println!(
                    "{n:<10} {secs:>7.1}  {rate:>7.0}  {:>9.1}  {:>9.1}  {}",
                    status_kib("VmRSS:") as f64 / 1024.0,
                    status_kib("VmHWM:") as f64 / 1024.0,
                    dedup.store().inner().l1_entry_count(),
                );
                if checkpoint >= keys {
                    break;
                }
                checkpoint = (checkpoint
                    + if checkpoint < 1_000_000 {
                        250_000
                    } else {
                        1_000_000
                    })
                .min(keys);
            }
        }
        for w in workers {
            w.await.unwrap();
        }
    });
}
