//! A consumer that charges each order once and tells the world through the outbox: the charge
//! row, dedup's record of the order message and the `orders.charged` message commit in one
//! transaction, and the engine's relay publishes the message once that commits, with an
//! idempotency key derived from the order's (docs/OUTBOX.md).
//!
//! ```text
//! DATABASE_URL=postgres://... KAFKA_BROKERS=127.0.0.1:9092 KAFKA_TOPIC=orders \
//!     cargo run -p dedup --features kafka --example outbox
//! ```
//! Messages carry their idempotency key in the `idempotency-key` header and a JSON payload
//! `{"order": "o-1", "cents": 1250}`; each charge goes out to `<KAFKA_TOPIC>.charged`, keyed by
//! the order. Ctrl-C drains, commits and stops the relay.

use std::error::Error;
use std::future::Future;

use dedup::kafka::{Acquired, RunnerStats, TxHandler};
use dedup::outbox::{OutboxMessage, RelayConfig};
use dedup::sqlx::PgConnection;
use dedup::{Bytes, Engine, HandlerError};

/// Charges each order once, and queues its `charged` message in the same transaction.
#[derive(Debug)]
pub struct Charge {
    /// Where the charges go.
    pub charged: String,
}

impl TxHandler for Charge {
    type Error = String;
    type Output = Bytes;

    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        let order: serde_json::Value =
            serde_json::from_slice(message.delivery().payload_bytes())
                .map_err(|e| HandlerError::Permanent(format!("not JSON: {e}")))?;
        let (Some(id), Some(cents)) = (order["order"].as_str(), order["cents"].as_i64()) else {
            return Err(HandlerError::Permanent("no order or cents".into()));
        };
        dedup::sqlx::query("INSERT INTO charges (order_id, cents) VALUES ($1, $2)")
            .bind(id)
            .bind(cents)
            .execute(&mut *tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        // Written with the charge; published by the relay once this batch commits.
        let charged = serde_json::json!({ "order": id, "cents": cents }).to_string();
        message
            .publish(OutboxMessage::new(&self.charged, charged).with_key(id.to_owned()))
            .map_err(|e| HandlerError::Permanent(e.to_string()))?;
        Ok(Bytes::from(format!("charged {cents} for {id}")))
    }
}

/// Where the consumer runs.
#[derive(Debug)]
pub struct Settings {
    pub database_url: String,
    pub brokers: String,
    pub topic: String,
    /// Further librdkafka properties (the consumer's and the relay's).
    pub client: Vec<(String, String)>,
}

/// The engine with its relay, the charges table, the consumer; runs until `stop`, then shuts
/// down (the consumer drains and commits, then the relay stops).
pub async fn run(
    settings: &Settings,
    stop: impl Future<Output = ()>,
) -> Result<RunnerStats, Box<dyn Error + Send + Sync>> {
    let mut kafka = dedup::rdkafka::ClientConfig::new();
    kafka.set("bootstrap.servers", &settings.brokers);
    for (k, v) in &settings.client {
        kafka.set(k, v);
    }
    let engine = Engine::builder()
        .postgres_url(&settings.database_url)
        .scope("orders")
        .outbox(kafka, RelayConfig::default())
        .build()
        .await?;
    dedup::sqlx::query("CREATE TABLE IF NOT EXISTS charges (order_id text, cents bigint)")
        .execute(engine.pool()?)
        .await?;
    let mut consumer = engine
        .consumer()
        .brokers(&settings.brokers)
        .group_id(format!("{}-charges", settings.topic))
        .topics([&settings.topic])
        .set("auto.offset.reset", "earliest");
    for (k, v) in &settings.client {
        consumer = consumer.set(k, v);
    }
    let charge = Charge {
        charged: format!("{}.charged", settings.topic),
    };
    let running = tokio::spawn(consumer.build(charge)?.run());
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
        client: Vec::new(),
    };
    let stats = run(&settings, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    eprintln!("stopped: {stats:?}");
    Ok(())
}
