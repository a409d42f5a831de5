//! Consumer positions in Postgres (`dedup_offsets`): written in a batch's own transaction, so a
//! batch's effects and its consumer's position commit together, and read when a partition is
//! assigned. Positions only move forward.

use std::collections::HashMap;

use dedup_core::StoreError;
use sqlx::Row;
use sqlx::postgres::PgConnection;

use crate::PgStore;
use crate::classify::classify;
use crate::sql::{STORE_OFFSETS_SQL, STORED_OFFSETS_SQL};

/// The position of one partition to store in a batch's transaction
/// ([`BatchRequest::with_offsets`](crate::BatchRequest::with_offsets)): the offset before which every message is settled
/// once the batch commits.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TxOffsets {
    /// The consumer group.
    pub consumer_group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// Each request's offset, in the batch's order.
    pub offsets: Vec<i64>,
    /// The position if every request of the batch settles: the first offset outside the batch
    /// that is not settled yet, or the next offset to read.
    pub end: i64,
}

impl TxOffsets {
    /// The position of `topic`/`partition` for `consumer_group`.
    pub fn new(
        consumer_group: impl Into<String>,
        topic: impl Into<String>,
        partition: i32,
        offsets: Vec<i64>,
        end: i64,
    ) -> Self {
        Self {
            consumer_group: consumer_group.into(),
            topic: topic.into(),
            partition,
            offsets,
            end,
        }
    }

    /// The position after the batch: `end`, or the offset of its first request that did not
    /// settle (`settled[i]` for request `i`), whichever is lower.
    pub(crate) fn position(&self, settled: impl Fn(usize) -> bool) -> i64 {
        self.offsets
            .iter()
            .enumerate()
            .filter(|(i, _)| !settled(*i))
            .map(|(_, &o)| o)
            .fold(self.end, i64::min)
    }
}

/// Moves positions forward (never back) on `conn`: `(topic, partition, next offset)`.
pub(crate) async fn store_offsets_on(
    conn: &mut PgConnection,
    consumer_group: &str,
    positions: &[(&str, i32, i64)],
) -> Result<(), StoreError> {
    let topics: Vec<&str> = positions.iter().map(|p| p.0).collect();
    let partitions: Vec<i32> = positions.iter().map(|p| p.1).collect();
    let next: Vec<i64> = positions.iter().map(|p| p.2).collect();
    sqlx::query(STORE_OFFSETS_SQL)
        .bind(consumer_group)
        .bind(&topics)
        .bind(&partitions)
        .bind(&next)
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    Ok(())
}

/// A consumer group's stored positions of `partitions`, on `conn` (partitions without one are
/// left out).
///
/// # Errors
/// The query failed.
pub async fn stored_offsets_on(
    conn: &mut PgConnection,
    consumer_group: &str,
    partitions: &[(String, i32)],
) -> Result<HashMap<(String, i32), i64>, StoreError> {
    let topics: Vec<&str> = partitions.iter().map(|p| p.0.as_str()).collect();
    let parts: Vec<i32> = partitions.iter().map(|p| p.1).collect();
    let rows = sqlx::query(STORED_OFFSETS_SQL)
        .bind(consumer_group)
        .bind(&topics)
        .bind(&parts)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, false))?;
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let topic: String = row.try_get("topic").map_err(|e| classify(e, false))?;
        let partition: i32 = row.try_get("partition").map_err(|e| classify(e, false))?;
        let next: i64 = row.try_get("next_offset").map_err(|e| classify(e, false))?;
        out.insert((topic, partition), next);
    }
    Ok(out)
}

impl PgStore {
    /// Moves positions forward (never back), on their own: `(topic, partition, next offset)`.
    /// For positions that moved without a batch (dead letters acknowledged).
    ///
    /// # Errors
    /// The statement failed.
    pub async fn store_offsets(
        &self,
        consumer_group: &str,
        positions: &[(&str, i32, i64)],
    ) -> Result<(), StoreError> {
        if positions.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn().await?;
        self.count(1);
        let out = store_offsets_on(&mut conn, consumer_group, positions).await;
        if let Err(e) = &out {
            conn.saw(e);
        }
        out
    }

    /// A consumer group's stored positions of `partitions`.
    ///
    /// # Errors
    /// The query failed.
    pub async fn stored_offsets(
        &self,
        consumer_group: &str,
        partitions: &[(String, i32)],
    ) -> Result<HashMap<(String, i32), i64>, StoreError> {
        let mut conn = self.conn().await?;
        self.count(1);
        let out = stored_offsets_on(&mut conn, consumer_group, partitions).await;
        if let Err(e) = &out {
            conn.saw(e);
        }
        out
    }
}
