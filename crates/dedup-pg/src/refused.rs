//! Dead letters the dead-letter topic refused for good (`dedup_dead_letters`): a message larger
//! than the topic accepts, or a record it calls invalid, would stall its partition on the path
//! meant to unstall it. Where the store is Postgres the consumer keeps such a dead letter here,
//! whole, and moves on; operators list and remove them (`dedup dead-letters`). These rows block
//! nothing (unlike `dedup_parked`, whose rows hold their key). `keep_refused_dead_letter`,
//! `refused_dead_letters` and `remove_refused_dead_letter` are the three calls.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_core::StoreError;
use sqlx::Row;

use crate::PgStore;
use crate::classify::classify;
use crate::text::safe_text;

/// Keeps one (at most once per source offset). $1 group, $2 topic, $3 partition, $4 offset,
/// $5 message key, $6 payload, $7 header names (bytes), $8 header values, $9 timestamp,
/// $10 reason, $11 attempts, $12 dead-letter topic, $13 refusal.
const KEEP_SQL: &str = concat!(
    "INSERT INTO dedup_dead_letters (consumer_group, topic, partition, \"offset\", message_key,",
    " payload, header_names, header_values, timestamp_ms, reason, attempts, dead_letter_topic,",
    " refusal, stored_at)",
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, statement_timestamp())",
    " ON CONFLICT DO NOTHING",
);

/// A group's kept dead letters, oldest first. $1 group.
const LIST_SQL: &str = concat!(
    "SELECT topic, partition, \"offset\", message_key, payload, header_names, header_values,",
    " timestamp_ms, reason, attempts, dead_letter_topic, refusal,",
    " (EXTRACT(EPOCH FROM stored_at) * 1e6)::int8 AS stored_us",
    " FROM dedup_dead_letters WHERE consumer_group = $1 ORDER BY stored_at, topic, partition,",
    " \"offset\"",
);

/// Removes one. $1 group, $2 topic, $3 partition, $4 offset.
const REMOVE_SQL: &str = concat!(
    "DELETE FROM dedup_dead_letters WHERE consumer_group = $1 AND topic = $2",
    " AND partition = $3 AND \"offset\" = $4",
);

/// A dead letter the dead-letter topic refused, kept whole.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub struct RefusedDeadLetter {
    /// The consumer group that gave it up.
    pub group: String,
    /// Its source topic.
    pub topic: String,
    /// Its source partition.
    pub partition: i32,
    /// Its source offset.
    pub offset: i64,
    /// The Kafka message key.
    pub message_key: Option<Vec<u8>>,
    /// The payload.
    pub payload: Option<Vec<u8>>,
    /// The original headers, in order (names as bytes: kept exactly).
    pub headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// The message's timestamp (ms since the Unix epoch).
    pub timestamp_ms: Option<i64>,
    /// Why it was dead-lettered.
    pub reason: String,
    /// The attempts made.
    pub attempts: u32,
    /// The dead-letter topic that refused it.
    pub dead_letter_topic: String,
    /// What the dead-letter topic answered.
    pub refusal: String,
    /// When it was kept (read back only).
    pub stored_at: Option<SystemTime>,
}

impl RefusedDeadLetter {
    /// The dead letter of `group`'s message at `topic`/`partition`/`offset`.
    pub fn new(
        group: impl Into<String>,
        topic: impl Into<String>,
        partition: i32,
        offset: i64,
    ) -> Self {
        Self {
            group: group.into(),
            topic: topic.into(),
            partition,
            offset,
            ..Self::default()
        }
    }
}

impl PgStore {
    /// Keeps a dead letter the dead-letter topic refused (at most once per source offset: a
    /// replay after a crash writes nothing twice).
    pub async fn keep_refused_dead_letter(&self, d: &RefusedDeadLetter) -> Result<(), StoreError> {
        self.count(1);
        let names: Vec<&[u8]> = d.headers.iter().map(|h| h.0.as_slice()).collect();
        let values: Vec<Option<&[u8]>> = d.headers.iter().map(|h| h.1.as_deref()).collect();
        sqlx::query(KEEP_SQL)
            .bind(&d.group)
            .bind(&d.topic)
            .bind(d.partition)
            .bind(d.offset)
            .bind(d.message_key.as_deref())
            .bind(d.payload.as_deref())
            .bind(&names)
            .bind(&values)
            .bind(d.timestamp_ms)
            .bind(safe_text(&d.reason))
            .bind(i32::try_from(d.attempts).unwrap_or(i32::MAX))
            .bind(&d.dead_letter_topic)
            .bind(safe_text(&d.refusal))
            .execute(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        Ok(())
    }

    /// `group`'s kept dead letters, oldest first (`dedup dead-letters`).
    pub async fn refused_dead_letters(
        &self,
        group: &str,
    ) -> Result<Vec<RefusedDeadLetter>, StoreError> {
        let rows = sqlx::query(LIST_SQL)
            .bind(group)
            .fetch_all(self.pool())
            .await
            .map_err(|e| classify(e, false))?;
        rows.iter()
            .map(|r| {
                let names: Vec<Vec<u8>> = r.try_get("header_names")?;
                let values: Vec<Option<Vec<u8>>> = r.try_get("header_values")?;
                let attempts: i32 = r.try_get("attempts")?;
                let stored: i64 = r.try_get("stored_us")?;
                Ok(RefusedDeadLetter {
                    group: group.to_owned(),
                    topic: r.try_get("topic")?,
                    partition: r.try_get("partition")?,
                    offset: r.try_get("offset")?,
                    message_key: r.try_get("message_key")?,
                    payload: r.try_get("payload")?,
                    headers: names.into_iter().zip(values).collect(),
                    timestamp_ms: r.try_get("timestamp_ms")?,
                    reason: r.try_get("reason")?,
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    dead_letter_topic: r.try_get("dead_letter_topic")?,
                    refusal: r.try_get("refusal")?,
                    stored_at: Some(
                        UNIX_EPOCH + Duration::from_micros(u64::try_from(stored).unwrap_or(0)),
                    ),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| classify(e, false))
    }

    /// Removes a kept dead letter (once an operator has re-driven or dealt with it). Answers
    /// whether it was there.
    pub async fn remove_refused_dead_letter(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(REMOVE_SQL)
            .bind(group)
            .bind(topic)
            .bind(partition)
            .bind(offset)
            .execute(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        Ok(done.rows_affected() == 1)
    }
}
