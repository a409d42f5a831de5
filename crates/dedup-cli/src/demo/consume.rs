//! The demo's two ways to consume, both built from one `dedup::Engine` (L1, Redis, Postgres):
//! transaction mode by the batch (a `TxHandler`, the default), and one message at a time in lease
//! mode (a `LeaseHandler`).
//!
//! By default each partition's batch and its ledger rows (one `INSERT ... SELECT FROM unnest`)
//! commit in one transaction, the caches answering keys already settled. With `--mode
//! per-message` each message is claimed through the caches and group commit, and its ledger row
//! and its completion commit in a transaction of their own.

use std::sync::Arc;

use bytes::Bytes;
use dedup::kafka::{
    Acquired, Answer, Batching, ConsumerBuilder, Delivery, LeaseHandler, RunnerStats, StatsHandle,
    TxHandler,
};
use dedup::{Completion, Engine, HandlerError, LeaseContext, PgStore, TierStats};
use sqlx::PgConnection;

use crate::connect::CliError;

/// How the demo consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// Transaction mode by the batch: each partition's batch (up to 500 messages) in one Postgres
    /// transaction, its ledger rows in one statement; L1 and Redis in front answer keys already
    /// settled, and learn each commit's completions after it.
    Tx,
    /// One message at a time through the full engine (L1, Redis, Postgres; claims grouped by
    /// group commit), each ledger row and its completion in a transaction of their own.
    PerMessage,
}

/// A consumer started: its counters and how it ends.
pub(crate) struct Started {
    pub(crate) stats: StatsHandle,
    pub(crate) task: tokio::task::JoinHandle<Result<RunnerStats, CliError>>,
}

/// Builds the consumer for `mode` from `consumer` (the engine's, set up by the caller) and runs it
/// until the engine shuts down.
pub(crate) fn start(
    mode: Mode,
    consumer: ConsumerBuilder,
    engine: &Engine,
    run: String,
) -> Result<Started, CliError> {
    let built = match mode {
        Mode::Tx => consumer.batching(Batching::default()).build(Ledger { run }),
        Mode::PerMessage => consumer.build(Booking {
            pg: engine
                .postgres()
                .map_err(|e| CliError::Config(e.to_string()))?
                .clone(),
            run,
        }),
    }
    .map_err(|e| CliError::Config(e.to_string()))?;
    let stats = built.stats();
    let task = tokio::spawn(async move {
        built
            .run()
            .await
            .map_err(|e| CliError::Failed(format!("consumer: {e}")))
    });
    Ok(Started { stats, task })
}

/// The report's engine lines.
pub(crate) fn lines(mode: Mode, engine: &Engine, s: &RunnerStats) -> Vec<String> {
    let tiers = engine.tier_stats();
    let second = match mode {
        Mode::Tx => {
            #[allow(clippy::cast_precision_loss)]
            let per = tiers.authority_claims as f64 / s.batches.max(1) as f64;
            format!(
                "  batch transactions   {:>10}   ({per:.0} messages per transaction)",
                s.batches
            )
        }
        Mode::PerMessage => {
            let counts = engine.group_commit_stats();
            format!(
                "  Postgres claim calls {:>10}   (batches carrying {} claims)",
                counts.claim_calls, counts.claims
            )
        }
    };
    vec![
        claims_line(&tiers),
        second,
        copies_line(&tiers),
        redis_line(&tiers),
    ]
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

impl TxHandler for Ledger {
    type Error = String;
    type Output = Bytes;

    /// One event: the batch path on a batch of one.
    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        let mut answers = self.handle_batch(tx, std::slice::from_ref(message)).await?;
        answers
            .pop()
            .unwrap_or_else(|| Err(HandlerError::Retryable("no answer".to_owned())))
    }

    async fn handle_batch(
        &self,
        tx: &mut PgConnection,
        batch: &[Acquired],
    ) -> Result<Vec<Answer<Self>>, HandlerError<String>> {
        {
            let n = batch.len();
            let (mut keys, mut accounts, mut amounts, mut tokens) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            let mut answers: Vec<Answer<Self>> = Vec::with_capacity(n);
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
        }
    }
}

/// The per-message handler: one ledger row and the fenced completion in one transaction.
#[derive(Debug)]
struct Booking {
    pg: PgStore,
    run: String,
}

impl LeaseHandler for Booking {
    type Error = String;
    type Output = Completion;

    async fn handle(
        &self,
        d: Arc<Delivery>,
        lease: LeaseContext,
    ) -> Result<Completion, HandlerError<String>> {
        book(&self.pg, &self.run, &d, lease).await
    }
}

async fn book(
    pg: &PgStore,
    run: &str,
    d: &Delivery,
    lease: LeaseContext,
) -> Result<Completion, HandlerError<String>> {
    let (key, account, amount) = entry(d).map_err(HandlerError::Permanent)?;
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
