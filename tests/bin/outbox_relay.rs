//! An outbox relay process for the chain's kill test: publishes the outbox of the database given
//! to the brokers given, with a 1 s lease and a 50 ms poll, until it is killed (or SIGTERM).
//!
//! Usage: `dedup-outbox-relay <brokers> <database-url> [k=v ...]` (`k=v`: extra librdkafka
//! properties).

use std::time::Duration;

use dedup::outbox::{OutboxRelay, RelayConfig};
use dedup_pg::PgStore;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, brokers, db, extra @ ..] = args.as_slice() else {
        return Err("usage: dedup-outbox-relay <brokers> <database-url> [k=v ...]".into());
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(db)?;
    let mut client = rdkafka::ClientConfig::new();
    client.set("bootstrap.servers", brokers);
    for kv in extra {
        let (k, v) = kv.split_once('=').ok_or("extra properties are k=v")?;
        client.set(k, v);
    }
    let config = RelayConfig::default()
        .with_lease(Duration::from_secs(1))
        .with_poll(Duration::from_millis(50))
        .with_rotate_every(Duration::from_secs(2));
    let relay = OutboxRelay::new(&PgStore::new(pool), client, config)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    relay
        .run(async move {
            term.recv().await;
        })
        .await?;
    Ok(())
}
