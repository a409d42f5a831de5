//! What operators and metrics read and do over parked keys (`dedup parked`, `unpark`, `drop`,
//! the gauges): statements over a group's rows, not fenced by an owner's epoch (the owner acts on
//! what they mark). `parked_summary`, `unpark` and `drop_parked` are each filtered by topic and
//! partition (`ParkedFilter`); `parked_gauges` feeds the metrics.

use std::time::Duration;

use dedup_core::StoreError;
use sqlx::Row;

use super::ParkedQueue;
use super::{ParkedGauges, ParkedKeySummary, attempts_of, key_of, sql, time_of};
use dedup_pg::classify;

/// Which of a group's partitions an operator's command looks at: every one by default, or one
/// topic, or one partition of it.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub struct ParkedFilter {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this partition (of [`topic`](Self::topic), or of every topic).
    pub partition: Option<i32>,
}

impl ParkedFilter {
    /// Every topic and partition.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only `topic`.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Only `partition`.
    #[must_use]
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }
}

impl ParkedQueue<'_> {
    /// `group`'s parked keys over the partitions `filter` names, oldest first (`dedup parked`).
    pub async fn parked_summary(
        &self,
        group: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedKeySummary>, StoreError> {
        let rows = sqlx::query(sql::SUMMARY_SQL)
            .bind(group)
            .bind(filter.topic.as_deref())
            .bind(filter.partition)
            .fetch_all(self.pool())
            .await
            .map_err(|e| classify(e, false))?;
        rows.iter()
            .map(|r| {
                let messages: i64 = r.try_get("messages")?;
                Ok(ParkedKeySummary {
                    topic: r.try_get("topic")?,
                    partition: r.try_get("partition")?,
                    ordering_key: key_of(r)?,
                    messages: u64::try_from(messages).unwrap_or(0),
                    oldest: time_of(r.try_get("oldest_us")?),
                    head_attempts: attempts_of(r, "head_attempts")?,
                    head_error: r.try_get("head_error")?,
                    head_due: time_of(r.try_get("due_us")?),
                    held: r.try_get("held")?,
                    dropped: r.try_get("dropped")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| classify(e, false))
    }

    /// Makes the head of `group`'s parked key `ordering_key` (`None`: the keyless queue) due
    /// now, and lifts a hold (`dedup unpark`), in the partitions `filter` names. Answers the
    /// messages it touched (0: nothing parked under that key there).
    pub async fn unpark(
        &self,
        group: &str,
        ordering_key: Option<&[u8]>,
        filter: &ParkedFilter,
    ) -> Result<u64, StoreError> {
        self.on_key(sql::UNPARK_SQL, group, ordering_key, filter)
            .await
    }

    /// Asks for `group`'s parked key `ordering_key` (`None`: the keyless queue) to be
    /// dead-lettered, every message of it, by the partition's owner (`dedup drop`), in the
    /// partitions `filter` names. Answers the messages marked.
    pub async fn drop_parked(
        &self,
        group: &str,
        ordering_key: Option<&[u8]>,
        filter: &ParkedFilter,
    ) -> Result<u64, StoreError> {
        self.on_key(sql::DROP_SQL, group, ordering_key, filter)
            .await
    }

    /// An operator's statement over one parked key's messages: the rows it changed.
    async fn on_key(
        &self,
        statement: &'static str,
        group: &str,
        ordering_key: Option<&[u8]>,
        filter: &ParkedFilter,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(statement)
            .bind(group)
            .bind(ordering_key.is_some())
            .bind(ordering_key.unwrap_or_default())
            .bind(filter.topic.as_deref())
            .bind(filter.partition)
            .execute(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        Ok(done.rows_affected())
    }

    /// Parked keys, messages and the oldest park's age over `partitions` of `group`.
    pub(crate) async fn parked_gauges(
        &self,
        group: &str,
        partitions: &[(String, i32)],
    ) -> Result<ParkedGauges, StoreError> {
        if partitions.is_empty() {
            return Ok(ParkedGauges::default());
        }
        let topics: Vec<&str> = partitions.iter().map(|p| p.0.as_str()).collect();
        let numbers: Vec<i32> = partitions.iter().map(|p| p.1).collect();
        let row = sqlx::query(sql::GAUGES_SQL)
            .bind(group)
            .bind(&topics)
            .bind(&numbers)
            .fetch_one(self.pool())
            .await
            .map_err(|e| classify(e, false))?;
        let get = || -> Result<ParkedGauges, sqlx::Error> {
            let keys: i64 = row.try_get("keys")?;
            let messages: i64 = row.try_get("messages")?;
            let oldest: f64 = row.try_get("oldest")?;
            Ok(ParkedGauges {
                keys: u64::try_from(keys).unwrap_or(0),
                messages: u64::try_from(messages).unwrap_or(0),
                oldest: Duration::try_from_secs_f64(oldest).unwrap_or_default(),
            })
        };
        get().map_err(|e| classify(e, false))
    }
}
