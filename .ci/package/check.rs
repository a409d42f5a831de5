//! Drives the README's quickstart (`src/main.rs`, taken from the packaged `dedup`): makes the
//! `payments` topic, sends three payments (two keys, one of them twice, one without a key), and
//! waits for the ledger to hold each key's row once. `scripts/package-check` runs it.

use std::time::Duration;

use dedup::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use dedup::rdkafka::consumer::{BaseConsumer, Consumer};
use dedup::rdkafka::message::{Header, OwnedHeaders};
use dedup::rdkafka::producer::{FutureProducer, FutureRecord};
use dedup::rdkafka::{ClientConfig, Offset, TopicPartitionList};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let brokers = std::env::var("KAFKA_BROKERS")?;
    let pool = dedup::sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    match std::env::args().nth(1).as_deref() {
        Some("topic") => {
            let admin: AdminClient<_> = config.create()?;
            let topics = [
                NewTopic::new("payments", 2, TopicReplication::Fixed(1)),
                NewTopic::new("payments.dlq", 1, TopicReplication::Fixed(1)),
            ];
            for made in admin.create_topics(&topics, &AdminOptions::new()).await? {
                made.map_err(|(t, e)| format!("{t}: {e}"))?;
            }
        }
        Some("send") => {
            let producer: FutureProducer = config.create()?;
            for (key, payment) in [("p-1", "10"), ("p-2", "20"), ("p-1", "10")] {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "idempotency-key",
                    value: Some(key),
                });
                let record = FutureRecord::to("payments")
                    .key(key)
                    .payload(payment)
                    .headers(headers);
                producer
                    .send(record, Duration::from_secs(10))
                    .await
                    .map_err(|(e, _)| e)?;
            }
            // No key: dead-lettered to payments.dlq, never booked.
            let record = FutureRecord::<(), _>::to("payments").payload("30");
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)?;
        }
        Some("wait") => {
            for _ in 0..600 {
                let rows: Vec<(Vec<u8>, i64)> = dedup::sqlx::query_as(
                    "SELECT key, count(*) FROM ledger GROUP BY key ORDER BY key",
                )
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                if rows.len() == 2 {
                    assert!(
                        rows.iter().all(|(_, n)| *n == 1),
                        "a payment booked twice: {rows:?}"
                    );
                    println!("ledger: one row for each of 2 keys");
                    break;
                }
                if rows.len() > 2 {
                    return Err(format!("more rows than payments: {rows:?}").into());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let booked: i64 = dedup::sqlx::query_scalar("SELECT count(DISTINCT key) FROM ledger")
                .fetch_one(&pool)
                .await?;
            if booked != 2 {
                return Err(
                    format!("the ledger did not get its 2 rows within 60 s: {booked}").into(),
                );
            }
            // Every message settled (the duplicate replayed, the keyless one dead-lettered): the
            // group's offsets are committed to the end of both partitions.
            let group: BaseConsumer = config.clone().set("group.id", "ledger").create()?;
            let mut partitions = TopicPartitionList::new();
            partitions.add_partition("payments", 0);
            partitions.add_partition("payments", 1);
            let mut seen = Vec::new();
            for _ in 0..600 {
                let committed =
                    group.committed_offsets(partitions.clone(), Duration::from_secs(5))?;
                seen.clear();
                for p in committed.elements() {
                    let (_, high) = group.fetch_watermarks(
                        "payments",
                        p.partition(),
                        Duration::from_secs(5),
                    )?;
                    seen.push((p.partition(), p.offset(), high));
                }
                // A partition no message went to has nothing to commit: the keyless payment's
                // partition is the producer's pick, so either may be empty.
                if seen.iter().all(|(_, at, high)| {
                    *at == Offset::Offset(*high) || (*high == 0 && *at == Offset::Invalid)
                }) {
                    println!("offsets: committed to the end");
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return Err(format!("offsets not at the end within 60 s: {seen:?}").into());
        }
        _ => return Err("usage: check topic|send|wait".into()),
    }
    Ok(())
}
