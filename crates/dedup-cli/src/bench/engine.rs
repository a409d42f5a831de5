//! dedup's own contenders: the tiered store one call per message, and behind `Batched`.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dedup_core::{
    Batched, Completion, Dedup, HandlerError, IdempotencyKey, Scope, Store, TierStats,
    TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use sqlx::PgPool;

use super::{Ctx, Outcome, drive, result_of};
use crate::connect::{CliError, connect_redis};

/// (c) and (d): `Dedup::process` on the tiered store (moka, Redis, Postgres), one call per
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
        server_statements: None,
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
