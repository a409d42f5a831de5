//! The demo's two ways to consume: transaction mode by the batch (`TxRunner`, the default), and
//! one message at a time through the full engine (`Runner` over moka, Redis and Postgres).
//!
//! By default each partition's batch and its ledger rows (one `INSERT ... SELECT FROM unnest`)
//! commit in one transaction. With `--mode per-message` the tiered store sits behind `Batched`,
//! and each ledger row and its completion commit in a transaction of their own.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    BatchConfig, Batched, Dedup, HandlerError, InstanceId, LeaseContext, Policy, TierStats,
    TieredConfig, TieredStore,
};
use dedup_kafka::{
    Acquired, BatchHandler, Batching, Delivery, Runner, RunnerConfig, StatsHandle, TxRunner,
};
use dedup_pg::{BatchBody, ItemResult, PgStore};
use dedup_redis::RedisFastPath;
use sqlx::PgConnection;

use crate::connect::CliError;

/// How the demo consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// Transaction mode by the batch: each partition's batch (up to 500 messages) in one Postgres
    /// transaction, its ledger rows in one statement; moka and Redis in front answer keys already
    /// settled, and learn each commit's completions after it.
    Tx,
    /// One message at a time through the full engine (moka, Redis, Postgres; claims grouped by
    /// `Batched`), each ledger row and its completion in a transaction of its own.
    PerMessage,
}

/// A consumer started: its counters, what the report prints about its engine, and how it ends.
pub(crate) struct Started {
    pub(crate) stats: StatsHandle,
    pub(crate) task: tokio::task::JoinHandle<Result<dedup_kafka::RunnerStats, CliError>>,
    pub(crate) engine: Engine,
}

/// What the report says about the engine after the run.
pub(crate) enum Engine {
    Tx(Arc<TieredStore<PgStore, RedisFastPath>>),
    PerMessage(Arc<Dedup<Batched<TieredStore<PgStore, RedisFastPath>>>>),
}

impl Engine {
    /// The report's engine lines.
    pub(crate) fn lines(&self, s: &dedup_kafka::RunnerStats) -> Vec<String> {
        match self {
            Self::Tx(caches) => {
                let tiers = caches.stats();
                #[allow(clippy::cast_precision_loss)]
                let per = tiers.authority_claims as f64 / s.batches.max(1) as f64;
                vec![
                    claims_line(&tiers),
                    format!(
                        "  batch transactions   {:>10}   ({per:.0} messages per transaction)",
                        s.batches
                    ),
                    copies_line(&tiers),
                    redis_line(&tiers),
                ]
            }
            Self::PerMessage(dedup) => {
                let tiers = dedup.store().inner().stats();
                let counts = dedup.store().batch_counts();
                let (claim_calls, claims) = (counts.claim_calls, counts.claims);
                vec![
                    claims_line(&tiers),
                    format!(
                        "  Postgres claim calls {claim_calls:>10}   (batches carrying {claims} claims)"
                    ),
                    copies_line(&tiers),
                    redis_line(&tiers),
                ]
            }
        }
    }
}

/// Every claim (one per delivery, and one more per retry) and the tier that answered it.
fn claims_line(t: &TierStats) -> String {
    let all = t.l1_hits + t.l2_hits + t.authority_claims;
    format!(
        "  claims               {all:>10}   answered by L1 {}, Redis {}, Postgres {} (every delivery's, retries included)",
        t.l1_hits, t.l2_hits, t.authority_claims
    )
}

/// The copies written to Redis after Postgres answered: a new result, or an earlier completed
/// outcome that Postgres answered a duplicate with (Postgres's claims less the failures). They
/// add up to every copy tried.
fn copies_line(t: &TierStats) -> String {
    let tried = t.backfills + t.backfills_refused + t.backfills_failed;
    format!(
        "  Redis copies         {tried:>10}   written {}, refused {} (a newer one held), not written {} (one per result Postgres gave: new, or answering a duplicate)",
        t.backfills, t.backfills_refused, t.backfills_failed
    )
}

/// Calls to Redis that failed or timed out (each falls through to Postgres: speed, never an
/// answer).
fn redis_line(t: &TierStats) -> String {
    format!(
        "  Redis calls failed   {:>10}   timed out {} (each fell through to Postgres)",
        t.l2_errors, t.l2_timeouts
    )
}

/// What the consumer runs on: Postgres, Redis, and the instance identity, if one was given.
pub(crate) struct Engines {
    pub(crate) pg: PgStore,
    pub(crate) fast: RedisFastPath,
    pub(crate) instance: Option<InstanceId>,
}

/// Starts the consumer in `mode`; it runs until `stop` fires.
pub(crate) fn start(
    mode: Mode,
    config: RunnerConfig,
    engines: Engines,
    run: String,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<Started, CliError> {
    let Engines { pg, fast, instance } = engines;
    let policy = Policy::default().with_lease(Duration::from_secs(10));
    let until = async {
        let _ = stop.await;
    };
    match mode {
        Mode::Tx => {
            // The caches: keys they hold settled are answered without a transaction; each
            // commit's completions are copied to them (in the background) after it.
            let caches = Arc::new(
                TieredStore::new(pg.clone(), fast, TieredConfig::default())
                    .with_background_backfill(),
            );
            let runner = TxRunner::new(config, Batching::default(), pg, Ledger { run })
                .map_err(|e| CliError::Config(e.to_string()))?
                .with_policy(policy)
                .map_err(|e| CliError::Config(e.to_string()))?
                .with_caches(caches.clone());
            let stats = runner.stats();
            let task = tokio::spawn(async move {
                runner
                    .run(until)
                    .await
                    .map_err(|e| CliError::Failed(format!("runner: {e}")))
            });
            Ok(Started {
                stats,
                task,
                engine: Engine::Tx(caches),
            })
        }
        Mode::PerMessage => {
            let store = TieredStore::new(pg.clone(), fast, TieredConfig::default())
                .with_background_backfill();
            // Group commit: the claims of every message in flight go to Postgres as batches.
            let store = Batched::new(store, BatchConfig::default());
            let mut dedup = Dedup::new(store);
            if let Some(id) = instance {
                // Owner ids under the identity; the runner adopts at start.
                dedup = dedup.with_instance(id);
            }
            let dedup = Arc::new(
                dedup
                    .with_policy(policy)
                    .map_err(|e| CliError::Config(e.to_string()))?
                    .with_in_flight_wait(Duration::from_millis(200))
                    .map_err(|e| CliError::Config(e.to_string()))?,
            );
            let handler = move |d: Arc<Delivery>, lease: Option<LeaseContext>| {
                let (pg, run) = (pg.clone(), run.clone());
                async move { book(&pg, &run, &d, lease).await }
            };
            let runner = Runner::new(config, dedup.clone(), handler)
                .map_err(|e| CliError::Config(e.to_string()))?;
            let stats = runner.stats();
            let task = tokio::spawn(async move {
                runner
                    .run(until)
                    .await
                    .map_err(|e| CliError::Failed(format!("runner: {e}")))
            });
            Ok(Started {
                stats,
                task,
                engine: Engine::PerMessage(dedup),
            })
        }
    }
}

/// A ledger entry read from an event's payload; a bad one is the event's permanent failure.
fn entry(d: &Delivery) -> Result<(String, i64, i64), String> {
    let json: serde_json::Value = serde_json::from_slice(d.payload_bytes())
        .map_err(|e| format!("payload is not JSON: {e}"))?;
    let field = |name: &str| {
        json.get(name)
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(|| format!("payload has no integer {name:?}"))
    };
    let (account, amount) = (field("account")?, field("amount")?);
    if amount <= 0 {
        return Err(format!("amount {amount} is not positive"));
    }
    let key = String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default()).into_owned();
    Ok((key, account, amount))
}

/// The demo's batch handler: every acquired event's ledger row in one statement, on the batch's
/// transaction (the claims and completions commit with it).
#[derive(Debug)]
struct Ledger {
    run: String,
}

impl BatchHandler for Ledger {
    type Error = String;

    fn handle<'c>(
        &'c self,
        tx: &'c mut PgConnection,
        batch: &'c [Acquired],
    ) -> BatchBody<'c, String> {
        Box::pin(async move {
            let n = batch.len();
            let (mut keys, mut accounts, mut amounts, mut tokens) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            let mut answers: Vec<ItemResult<String>> = Vec::with_capacity(n);
            for a in batch {
                match entry(a.delivery()) {
                    Ok((key, account, amount)) => {
                        answers.push(Ok(Bytes::from(format!(
                            "booked {key}: {amount} to {account}"
                        ))));
                        keys.push(key);
                        accounts.push(account);
                        amounts.push(amount);
                        tokens.push(a.token());
                    }
                    Err(e) => answers.push(Err(HandlerError::Permanent(e))),
                }
            }
            sqlx::query(
                "INSERT INTO dedup_demo_ledger (run, key, account, amount, token) \
                 SELECT $1, k, a, m, t FROM unnest($2::text[], $3::int8[], $4::int8[], $5::int8[]) AS u(k, a, m, t)",
            )
            .bind(&self.run)
            .bind(&keys)
            .bind(&accounts)
            .bind(&amounts)
            .bind(&tokens)
            .execute(&mut *tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            Ok(answers)
        })
    }
}

/// The per-message handler: one ledger row and the fenced completion in one transaction.
async fn book(
    pg: &PgStore,
    run: &str,
    d: &Delivery,
    lease: Option<LeaseContext>,
) -> Result<dedup_core::Completion, HandlerError<String>> {
    let (key, account, amount) = entry(d).map_err(HandlerError::Permanent)?;
    let lease = lease.ok_or_else(|| HandlerError::Permanent("no idempotency key".to_owned()))?;
    let token = i64::try_from(lease.lease().token.get()).unwrap_or(i64::MAX);
    let run = run.to_owned();
    pg.transact(&lease, move |tx| {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO dedup_demo_ledger (run, key, account, amount, token) VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&run)
            .bind(&key)
            .bind(account)
            .bind(amount)
            .bind(token)
            .execute(tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            Ok(Bytes::from(format!("booked {key}: {amount} to {account}")))
        })
    })
    .await
}
