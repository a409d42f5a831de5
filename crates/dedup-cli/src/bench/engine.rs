//! dedup's own contenders: the tiered store one call per message (c), behind `Batched` (d), and
//! in lease mode by the batch, `Dedup::process_batch` (f).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dedup_core::{
    BatchItem, Batched, Completion, Dedup, HandlerError, IdempotencyKey, Scope, Store, TierStats,
    TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use sqlx::PgPool;

use super::{Ctx, EventKeys, Latencies, Outcome, drive, result_of, window};
use crate::connect::{CliError, connect_redis};

/// (c) and (d): `Dedup::process` on the tiered store (L1, Redis, Postgres), one call per
/// message; (d) puts `Batched` between the consumer and the tiers.
pub(super) async fn tiered(
    ctx: &Ctx,
    pool: &PgPool,
    url: &str,
    batched: bool,
) -> Result<Outcome, CliError> {
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
    let scope =
        Scope::new(ctx.scope(which)).map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let effects = Arc::new(AtomicU64::new(0));
    let (elapsed, latencies, errors, stats, batches) = if batched {
        let dedup = Arc::new(Dedup::new(Batched::new(store, ctx.batch)));
        let (elapsed, latencies, errors) =
            drive(ctx, process_one(&dedup, &scope, &effects, ctx.keys)).await;
        let stats = dedup.store().inner().stats();
        let batches = dedup.store().batch_counts();
        (elapsed, latencies, errors, stats, Some(batches))
    } else {
        let dedup = Arc::new(Dedup::new(store));
        let (elapsed, latencies, errors) =
            drive(ctx, process_one(&dedup, &scope, &effects, ctx.keys)).await;
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
        latencies,
        effects: effects.load(Ordering::Relaxed),
        errors,
        pg_trips: Some(trips),
        server_statements: None,
        cpu: None,
        wal: None,
        row_bytes: None,
        http: None,
        outbox: None,
        tiers: tier_counts(&stats),
        batches,
    })
}

pub(super) fn tier_counts(s: &TierStats) -> (u64, u64, u64) {
    (s.l1_hits, s.l2_hits, s.authority_claims)
}

fn process_one<S: Store + 'static>(
    dedup: &Arc<Dedup<S>>,
    scope: &Scope,
    effects: &Arc<AtomicU64>,
    keys: EventKeys,
) -> impl Fn(u64) -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    let (dedup, scope, effects) = (Arc::clone(dedup), scope.clone(), Arc::clone(effects));
    move |id: u64| {
        let (dedup, scope, effects) = (Arc::clone(&dedup), scope.clone(), Arc::clone(&effects));
        Box::pin(async move {
            let key = IdempotencyKey::new(scope, keys.of(id)).map_err(|e| e.to_string())?;
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

/// (f): lease mode by the batch, `Dedup::process_batch` on the tiered store: each batch of the
/// stream claimed in one call, its handlers run concurrently (the effect: a counter, outside the
/// database), one heartbeat statement for its leases, its completions in one call. Messages that
/// another batch holds come again in the worker's next batch.
pub(super) async fn lease_batches(
    ctx: &Ctx,
    pool: &PgPool,
    url: &str,
) -> Result<Outcome, CliError> {
    let workers = ctx.tx_workers.max(1);
    let size = (ctx.concurrency / workers).max(1);
    ctx.note(&format!(
        "(f) dedup: lease mode by the batch, {workers} batches of up to {size} at once"
    ));
    let pg = PgStore::new(pool.clone());
    let fast = connect_redis(url, &format!("dedup-bench-f-{}", ctx.run_id)).await?;
    let store =
        TieredStore::new(pg.clone(), fast, TieredConfig::default()).with_background_backfill();
    let scope = Scope::new(ctx.scope("f")).map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let dedup = Arc::new(Dedup::new(store));
    let effects = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (dedup, scope, stream, next) = (
            Arc::clone(&dedup),
            scope.clone(),
            Arc::clone(&ctx.stream),
            Arc::clone(&next),
        );
        let (effects, errors) = (Arc::clone(&effects), Arc::clone(&errors));
        let keys = ctx.keys;
        tasks.spawn(async move {
            let mut latencies = Latencies::default();
            let mut again: Vec<u64> = Vec::new();
            // The drop's phase when an event that comes again was first tried.
            let mut first: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
            let mut failures = 0u32;
            loop {
                let take = size.saturating_sub(again.len());
                let from = next.fetch_add(take, Ordering::Relaxed);
                let fresh = stream.get(from.min(stream.len())..(from + take).min(stream.len()));
                let mut ids: Vec<u64> = std::mem::take(&mut again);
                ids.extend(fresh.unwrap_or_default());
                if ids.is_empty() {
                    break;
                }
                let items: Vec<BatchItem> = ids
                    .iter()
                    .filter_map(|id| {
                        IdempotencyKey::new(scope.clone(), keys.of(*id))
                            .ok()
                            .map(|k| BatchItem::new(k, None))
                    })
                    .collect();
                let (t, phase) = (std::time::Instant::now(), window::drop_phase());
                let answers = dedup
                    .process_batch(&items, |i, _lease| {
                        let (effects, id) = (&effects, ids[i]);
                        async move {
                            effects.fetch_add(1, Ordering::Relaxed);
                            Ok::<_, HandlerError<std::io::Error>>(Completion::store(result_of(id)))
                        }
                    })
                    .await;
                let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                for (id, a) in ids.iter().zip(answers) {
                    match a {
                        Ok(_) => latencies.record(us, 1, first.remove(id).unwrap_or(phase)),
                        Err(e) if e.is_retryable() && failures < 10_000 => {
                            failures += 1;
                            first.entry(*id).or_insert(phase);
                            again.push(*id);
                        }
                        Err(e) => {
                            if errors.fetch_add(1, Ordering::Relaxed) < 5 {
                                eprintln!("[bench] (f) event {id}: {e}");
                            }
                        }
                    }
                }
                if !again.is_empty() {
                    // Held by the other worker's batch: let it finish first.
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
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
    Ok(Outcome {
        name: "(f)",
        label: "dedup: lease mode by the batch",
        durable: true,
        elapsed,
        latencies: latencies.sorted(),
        effects: effects.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        pg_trips: Some(pg.statements()),
        server_statements: None,
        cpu: None,
        wal: None,
        row_bytes: None,
        http: None,
        outbox: None,
        tiers: tier_counts(&dedup.store().stats()),
        batches: None,
    })
}
