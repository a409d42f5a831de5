//! A Kafka consumer whose effect is a Postgres write: transaction mode. Each payment message
//! books one ledger row; the row, the claim and its completion commit in one transaction, so a
//! crash anywhere books it once or not at all, and a redelivery replays the stored result.
//!
//! ```text
//! DATABASE_URL=postgres://... KAFKA_BROKERS=127.0.0.1:9092 KAFKA_TOPIC=payments \
//!     INSTANCE=$(hostname) cargo run -p dedup --features kafka --example kafka_ledger
//! ```
//! Messages carry their idempotency key in the `idempotency-key` header and a JSON payload
//! `{"account": 7, "amount": 1250}`. Ctrl-C drains, commits and releases the identity.

use std::error::Error;
use std::future::Future;

use dedup::kafka::{Acquired, RunnerStats, TxHandler};
use dedup::sqlx::PgConnection;
use dedup::{Bytes, Engine, HandlerError};

/// The handler: one row per payment, on the batch's transaction.
#[derive(Debug)]
pub struct Ledger;

impl TxHandler for Ledger {
    type Error = String;
    type Output = Bytes;

    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        let payment: serde_json::Value = serde_json::from_slice(message.delivery().payload_bytes())
            .map_err(|e| HandlerError::Permanent(format!("not JSON: {e}")))?;
        let (Some(account), Some(amount)) =
            (payment["account"].as_i64(), payment["amount"].as_i64())
        else {
            return Err(HandlerError::Permanent("no account or amount".into()));
        };
        let key = String::from_utf8_lossy(message.lease().key.key_bytes()).into_owned();
        dedup::sqlx::query(
            "INSERT INTO ledger (key, account, amount, token) VALUES ($1, $2, $3, $4)",
        )
        .bind(&key)
        .bind(account)
        .bind(amount)
        .bind(message.token())
        .execute(tx)
        .await
        .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        Ok(Bytes::from(format!("booked {amount} on {account}")))
    }
}

/// Where the consumer runs.
#[derive(Debug)]
pub struct Settings {
    pub database_url: String,
    pub brokers: String,
    pub topic: String,
    pub instance: Option<String>,
    /// Further librdkafka properties.
    pub client: Vec<(String, String)>,
}

/// The whole set-up: the engine (migrations included), the ledger table, the consumer; runs until
/// `stop`, then shuts down cleanly.
pub async fn consume(
    settings: &Settings,
    stop: impl Future<Output = ()>,
) -> Result<RunnerStats, Box<dyn Error + Send + Sync>> {
    let mut engine = Engine::builder()
        .postgres_url(&settings.database_url)
        .scope("payments");
    if let Some(id) = &settings.instance {
        engine = engine.instance(id);
    }
    let engine = engine.build().await?;
    dedup::sqlx::query(
        "CREATE TABLE IF NOT EXISTS ledger (key text, account bigint, amount bigint, token bigint)",
    )
    .execute(engine.pool()?)
    .await?;
    let mut consumer = engine
        .consumer()
        .brokers(&settings.brokers)
        .group_id(format!("{}-ledger", settings.topic))
        .topics([&settings.topic])
        .set("auto.offset.reset", "earliest");
    for (k, v) in &settings.client {
        consumer = consumer.set(k, v);
    }
    let running = tokio::spawn(consumer.build(Ledger)?.run());
    stop.await;
    engine.shutdown().await;
    Ok(running.await??)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let settings = Settings {
        database_url: var("DATABASE_URL")?,
        brokers: var("KAFKA_BROKERS")?,
        topic: var("KAFKA_TOPIC")?,
        instance: std::env::var("INSTANCE").ok(),
        client: Vec::new(),
    };
    let stats = consume(&settings, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    eprintln!("stopped: {stats:?}");
    Ok(())
}
