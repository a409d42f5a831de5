//! A Kafka consumer whose effect is a call to another service (a payment provider): lease mode.
//! Each message runs under a fenced lease kept alive while the call runs; its answer is stored
//! and replayed to every duplicate. The call carries the idempotency key and the fencing token,
//! so a provider that keeps them can refuse a stale holder; a crash after the call and before the
//! record runs it again once the lease ends (the limit of any effect outside the transaction).
//!
//! ```text
//! DATABASE_URL=postgres://... REDIS_URL=redis://... KAFKA_BROKERS=127.0.0.1:9092 \
//!     KAFKA_TOPIC=charges PROVIDER_URL=http://127.0.0.1:8080 \
//!     cargo run -p dedup --features kafka,redis --example kafka_calls
//! ```

use std::error::Error;
use std::future::Future;
use std::sync::Arc;

use dedup::kafka::{Batching, Delivery, LeaseHandler, Ordering, RunnerStats};
use dedup::{Bytes, Engine, HandlerError, LeaseContext};

/// The handler: one charge per message, at the provider.
#[derive(Debug)]
pub struct Charge {
    client: reqwest::Client,
    provider: String,
}

impl LeaseHandler for Charge {
    type Error = String;
    type Output = Bytes;

    async fn handle(
        &self,
        message: Arc<Delivery>,
        lease: LeaseContext,
    ) -> Result<Bytes, HandlerError<String>> {
        let lease = lease.lease();
        let answer = self
            .client
            .post(format!("{}/charges", self.provider))
            .header("idempotency-key", lease.key.key_bytes())
            .header("fencing-token", lease.token.get().to_string())
            .body(message.payload_bytes().to_vec())
            .send()
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
        match answer.status().as_u16() {
            200..=299 => answer
                .bytes()
                .await
                .map_err(|e| HandlerError::Retryable(e.to_string())),
            400..=499 => Err(HandlerError::Permanent(format!(
                "refused: {}",
                answer.status()
            ))),
            _ => Err(HandlerError::Retryable(format!(
                "provider: {}",
                answer.status()
            ))),
        }
    }
}

/// Where the consumer runs.
#[derive(Debug)]
pub struct Settings {
    pub database_url: String,
    pub redis_url: Option<String>,
    pub brokers: String,
    pub topic: String,
    pub provider: String,
    /// Further librdkafka properties.
    pub client: Vec<(String, String)>,
}

/// The whole set-up: the engine with Redis in front of Postgres, the consumer by the batch; runs
/// until `stop`, then shuts down cleanly.
pub async fn consume(
    settings: &Settings,
    stop: impl Future<Output = ()>,
) -> Result<RunnerStats, Box<dyn Error + Send + Sync>> {
    let mut engine = Engine::builder()
        .postgres_url(&settings.database_url)
        .scope("charges");
    if let Some(url) = &settings.redis_url {
        engine = engine.redis_url(url);
    }
    let engine = engine.build().await?; // connects and applies dedup's migrations
    let mut consumer = engine
        .consumer()
        .brokers(&settings.brokers)
        .group_id(format!("{}-charges", settings.topic))
        .topics([&settings.topic])
        .ordering(Ordering::PerKey) // distinct keys run concurrently
        .batching(Batching::default()) // claims and completions by the batch
        .set("auto.offset.reset", "earliest");
    for (k, v) in &settings.client {
        consumer = consumer.set(k, v);
    }
    let handler = Charge {
        client: reqwest::Client::new(),
        provider: settings.provider.clone(),
    };
    let running = tokio::spawn(consumer.build(handler)?.run());
    stop.await;
    engine.shutdown().await;
    Ok(running.await??)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let settings = Settings {
        database_url: var("DATABASE_URL")?,
        redis_url: std::env::var("REDIS_URL").ok(),
        brokers: var("KAFKA_BROKERS")?,
        topic: var("KAFKA_TOPIC")?,
        provider: var("PROVIDER_URL")?,
        client: Vec::new(),
    };
    let stats = consume(&settings, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    eprintln!("stopped: {stats:?}");
    Ok(())
}
