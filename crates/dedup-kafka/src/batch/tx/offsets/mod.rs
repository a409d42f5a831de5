//! Offsets in the transaction (`dedup_offsets`): the consumer's position stored in each batch's
//! own transaction ([`TxOffsets`], a `BatchWrites` of `dedup_pg`'s batch transaction), so a
//! batch's effects and its position commit together; positions that move without a batch (a
//! dead letter acknowledged) stored on their own ([`store_offsets`]); and the stored positions
//! read when partitions are assigned ([`OffsetReader`]). Positions only move forward.
//!
//! The rebalance callback runs inside `recv()` and cannot await, so the assignment's query runs
//! on a thread of its own (its own small runtime and connection, whatever runtime the runner is
//! on) and the callback waits for it up to a bound; past it, or on an error, the partitions
//! start from Kafka's committed offsets, which is safe: claims deduplicate what is read again.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{InputError, StoreError};
use dedup_pg::{BatchWrites, BatchWritesFuture, PgStore, classify};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Row};
use tracing::warn;

use crate::consumer::StartOffsets;

type Positions = HashMap<(String, i32), i64>;
type Reply = mpsc::Sender<Option<Positions>>;
type Request = (Vec<(String, i32)>, Reply);

/// Asks the reader thread for stored positions and waits up to a bound.
pub(crate) struct OffsetReader {
    requests: Mutex<mpsc::Sender<Request>>,
    wait: Duration,
}

impl OffsetReader {
    /// Starts the reader thread for `group` on a database of `options`. It ends when the reader
    /// is dropped.
    pub(crate) fn start(
        options: Arc<PgConnectOptions>,
        group: String,
        wait: Duration,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("dedup-offsets".to_owned())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                let mut conn: Option<PgConnection> = None;
                while let Ok((partitions, reply)) = rx.recv() {
                    let got = rt.block_on(async {
                        if conn.is_none() {
                            conn = options
                                .connect()
                                .await
                                .map_err(|e| warn!(error = %e, "offsets: connecting"))
                                .ok();
                        }
                        let c = conn.as_mut()?;
                        match stored_on(c, &group, &partitions).await {
                            Ok(found) => Some(found),
                            Err(e) => {
                                warn!(error = %e, "offsets: reading the stored positions");
                                conn = None;
                                None
                            }
                        }
                    });
                    let _ = reply.send(got);
                }
            })?;
        Ok(Self {
            requests: Mutex::new(tx),
            wait,
        })
    }
}

impl StartOffsets for OffsetReader {
    fn stored(&self, partitions: &[(String, i32)]) -> Option<Positions> {
        let (reply, answer) = mpsc::channel();
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send((partitions.to_vec(), reply))
            .ok()?;
        match answer.recv_timeout(self.wait) {
            Ok(found) => found,
            Err(_) => {
                warn!(wait = ?self.wait, "offsets: no stored positions in time; starting from Kafka's committed offsets");
                None
            }
        }
    }
}

/// Moves positions forward (never back). $1 group, $2 topics, $3 partitions, $4 next offsets.
const STORE_SQL: &str = concat!(
    "INSERT INTO dedup_offsets AS o (consumer_group, topic, partition, next_offset, updated_at)",
    " SELECT $1, q.topic, q.partition, q.next_offset, statement_timestamp()",
    " FROM unnest($2::text[], $3::int4[], $4::int8[]) AS q(topic, partition, next_offset)",
    " ORDER BY q.topic, q.partition",
    " ON CONFLICT (consumer_group, topic, partition) DO UPDATE",
    " SET next_offset = GREATEST(o.next_offset, EXCLUDED.next_offset), updated_at = EXCLUDED.updated_at",
    " WHERE EXCLUDED.next_offset > o.next_offset"
);

/// A consumer group's stored positions for some partitions. $1 group, $2 topics, $3 partitions.
const STORED_SQL: &str = concat!(
    "SELECT o.topic, o.partition, o.next_offset FROM dedup_offsets o",
    " JOIN unnest($2::text[], $3::int4[]) AS q(topic, partition)",
    " ON o.topic = q.topic AND o.partition = q.partition WHERE o.consumer_group = $1"
);

/// The position of one partition to store in a batch's transaction: the offset before which
/// every message is settled once the batch commits.
#[derive(Clone, Debug)]
pub(crate) struct TxOffsets {
    consumer_group: String,
    topic: String,
    partition: i32,
    /// Each request's offset, in the batch's order.
    offsets: Vec<i64>,
    /// The position if every request of the batch settles: the first offset outside the batch
    /// that is not settled yet, or the next offset to read.
    end: i64,
}

impl TxOffsets {
    /// The position of `topic`/`partition` for `consumer_group` after a batch of messages at
    /// `offsets` (in the batch's order) that ends at `end`.
    pub(crate) fn new(
        consumer_group: String,
        topic: String,
        partition: i32,
        offsets: Vec<i64>,
        end: i64,
    ) -> Self {
        Self {
            consumer_group,
            topic,
            partition,
            offsets,
            end,
        }
    }

    /// The position after the batch: `end`, or the offset of its first request that does not
    /// settle (`settled[i]` for request `i`; a request it says nothing of does not), whichever
    /// is lower. A message to be dead-lettered holds it until its dead letter is acknowledged
    /// ([`store_offsets`]).
    fn position(&self, settled: &[bool]) -> i64 {
        self.offsets
            .iter()
            .enumerate()
            .filter(|(i, _)| !settled.get(*i).copied().unwrap_or(false))
            .map(|(_, &o)| o)
            .fold(self.end, i64::min)
    }
}

impl BatchWrites for TxOffsets {
    fn write<'c>(&'c self, tx: &'c mut PgConnection, settled: &'c [bool]) -> BatchWritesFuture<'c> {
        Box::pin(async move {
            // One offset per request, or a position past an unsettled message could be stored.
            if settled.len() != self.offsets.len() {
                return Err(StoreError::Input(InputError::Setting {
                    setting: "offsets",
                    problem: "needs one offset per request of the batch",
                }));
            }
            let position = self.position(settled);
            store_on(
                tx,
                &self.consumer_group,
                &[(&self.topic, self.partition, position)],
            )
            .await?;
            Ok(1)
        })
    }
}

/// Moves positions forward (never back) on `conn`: `(topic, partition, next offset)`.
async fn store_on(
    conn: &mut PgConnection,
    consumer_group: &str,
    positions: &[(&str, i32, i64)],
) -> Result<(), StoreError> {
    let topics: Vec<&str> = positions.iter().map(|p| p.0).collect();
    let partitions: Vec<i32> = positions.iter().map(|p| p.1).collect();
    let next: Vec<i64> = positions.iter().map(|p| p.2).collect();
    sqlx::query(STORE_SQL)
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
async fn stored_on(
    conn: &mut PgConnection,
    consumer_group: &str,
    partitions: &[(String, i32)],
) -> Result<Positions, StoreError> {
    let topics: Vec<&str> = partitions.iter().map(|p| p.0.as_str()).collect();
    let parts: Vec<i32> = partitions.iter().map(|p| p.1).collect();
    let rows = sqlx::query(STORED_SQL)
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

/// Moves positions forward (never back), on their own: `(topic, partition, next offset)`. For
/// positions that moved without a batch (dead letters acknowledged).
pub(crate) async fn store_offsets(
    store: &PgStore,
    consumer_group: &str,
    positions: &[(&str, i32, i64)],
) -> Result<(), StoreError> {
    if positions.is_empty() {
        return Ok(());
    }
    let mut conn = store.conn().await?;
    store.count(1);
    let out = store_on(&mut conn, consumer_group, positions).await;
    conn.checked(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
