//! The dead-letter topic: where poison messages, permanent failures and keyless messages go,
//! with the reason, the attempts and the original coordinates in headers.

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::delivery::Delivery;

/// Dead-letter header: why the message was dead-lettered.
pub const DLQ_REASON: &str = "dedup-reason";
/// Dead-letter header: the attempts made.
pub const DLQ_ATTEMPTS: &str = "dedup-attempts";
/// Dead-letter header: the original topic.
pub const DLQ_TOPIC: &str = "dedup-original-topic";
/// Dead-letter header: the original partition.
pub const DLQ_PARTITION: &str = "dedup-original-partition";
/// Dead-letter header: the original offset.
pub const DLQ_OFFSET: &str = "dedup-original-offset";

/// Writes dead letters.
pub(crate) struct DeadLetters {
    pub(crate) producer: FutureProducer,
    pub(crate) topic: String,
}

impl DeadLetters {
    /// One attempt to write `d` to the dead-letter topic; returns once the broker acknowledged
    /// it (`acks=all`), so the offset may then move past the message.
    pub(crate) async fn write(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
    ) -> Result<(), KafkaError> {
        let attempts = attempts.to_string();
        let partition = d.partition.to_string();
        let offset = d.offset.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(d.headers.len() + 5);
        for (k, v) in &d.headers {
            headers = headers.insert(Header {
                key: k,
                value: v.as_deref(),
            });
        }
        for (k, v) in [
            (DLQ_REASON, reason),
            (DLQ_ATTEMPTS, &attempts),
            (DLQ_TOPIC, &d.topic),
            (DLQ_PARTITION, &partition),
            (DLQ_OFFSET, &offset),
        ] {
            headers = headers.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).headers(headers);
        if let Some(k) = &d.key {
            record = record.key(&k[..]);
        }
        if let Some(p) = &d.payload {
            record = record.payload(&p[..]);
        }
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map(|_| ())
            .map_err(|(e, _)| e)
    }
}
