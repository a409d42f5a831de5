//! Parked messages: per-key ordered retries kept in Postgres (`dedup_parked`).
//!
//! A consumer parks a message that keeps failing (and every later message of its ordering key)
//! here before it moves its offset past it; the partition's owner re-runs each key's head through
//! the same claim, then the next, and the key is free when its queue is empty. Ownership is an
//! epoch per partition ([`ParkedQueue::acquire_parked`]), bumped by each new owner: every write of an
//! owner names its epoch and changes nothing once another owner took the partition. The count of
//! a key's messages is its row count, so nothing can drift, and an assignment's sync barrier is
//! one query. docs/PARKING.md has the semantics.
//!
//! `acquire_parked` bumps a partition's epoch in `dedup_parked_owners` and loads its parked keys
//! with their counts: the barrier (`acquire_parked_while` bumps only if the caller still owns the
//! partition once it has a connection). `park`, `take_head`, `settle_head` and `defer_head` are
//! fenced by the epoch, each locking the owner row `FOR SHARE` in its one statement; `due_heads`
//! answers each key's lowest offset where it is due, not held and not taken by the current
//! epoch's run. A park pins the dedup record its message names (`expires_at = 'infinity'`, the
//! span it had kept in `pinned_ttl`), a deferral pins the record its head's run made, and the
//! settle that removes the last row naming a record gives it its span back from then. A park may
//! write a held marker (a message dead-lettered in place under the hold policy). Ordering keys
//! are compared and indexed by their digest (`ordering_digest`, a generated column), so a key of
//! any length parks. The statements are in `sql.rs`; what operators and metrics use in `ops.rs`.

mod ops;
mod sql;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

pub use ops::ParkedFilter;

/// The parked messages (`dedup_parked`) in a [`PgStore`]'s database: what operators call (the
/// summary, unpark, drop) and, inside this crate, what a consumer that parks calls (the
/// partition's epoch, park, the heads) and the metrics (the gauges).
#[derive(Clone, Copy, Debug)]
pub struct ParkedQueue<'a>(&'a PgStore);

impl<'a> ParkedQueue<'a> {
    /// The parked messages of `store`'s database.
    #[must_use]
    pub fn new(store: &'a PgStore) -> Self {
        Self(store)
    }
}

impl ParkedQueue<'_> {
    async fn conn(&self) -> Result<PgConn, StoreError> {
        self.0.conn().await
    }

    fn count(&self, statements: u64) {
        self.0.count(statements);
    }

    fn pool(&self) -> &sqlx::PgPool {
        self.0.pool()
    }
}

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_core::StoreError;
use sqlx::Row;
use sqlx::postgres::PgRow;

use dedup_pg::{PgConn, PgStore, classify, safe_text};

/// One partition of one consumer group: where parked messages belong, whoever owns it.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
#[non_exhaustive]
pub(crate) struct ParkedPartition {
    /// The consumer group (parked queues are scoped by it).
    pub(crate) group: String,
    /// The topic.
    pub(crate) topic: String,
    /// The partition.
    pub(crate) partition: i32,
}

impl ParkedPartition {
    /// `topic`/`partition` of `group`.
    pub(crate) fn new(group: impl Into<String>, topic: impl Into<String>, partition: i32) -> Self {
        Self {
            group: group.into(),
            topic: topic.into(),
            partition,
        }
    }
}

/// An owner's epoch of a partition: every write it makes names it, and fails once a later owner
/// bumped it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(crate) struct ParkEpoch(pub(crate) i64);

/// An ordering key as parked: `None` for a partition's messages without one (they share a
/// queue).
pub type ParkedKey = Option<Vec<u8>>;

/// A message to park, or a parked head to re-run: what the consumer needs to run it again.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub(crate) struct ParkedMessage {
    /// Its offset in its partition.
    pub(crate) offset: i64,
    /// Its ordering key (see [`ParkedKey`]).
    pub(crate) ordering_key: ParkedKey,
    /// The Kafka message key.
    pub(crate) message_key: Option<Vec<u8>>,
    /// The payload.
    pub(crate) payload: Option<Vec<u8>>,
    /// The headers, in order.
    pub(crate) headers: Vec<(String, Option<Vec<u8>>)>,
    /// The message's timestamp (ms since the Unix epoch).
    pub(crate) timestamp_ms: Option<i64>,
    /// The last failure.
    pub(crate) error: String,
    /// Attempts made so far, in place and parked.
    pub(crate) attempts: u32,
    /// Its dedup record's scope and key, if it had a usable one: the record is pinned while the
    /// message is parked (no claim takes it over as expired, no purge deletes it).
    pub(crate) dedup_key: Option<(String, Vec<u8>)>,
    /// A held marker: the message was dead-lettered already (in place, under the hold policy);
    /// its row only keeps its key's later messages back until an operator releases the key,
    /// and is then removed without running.
    pub(crate) held_marker: bool,
}

impl ParkedMessage {
    /// A message at `offset` with `ordering_key`, failed with `error` after `attempts`.
    pub(crate) fn new(
        offset: i64,
        ordering_key: ParkedKey,
        error: impl Into<String>,
        attempts: u32,
    ) -> Self {
        Self {
            offset,
            ordering_key,
            error: error.into(),
            attempts,
            ..Self::default()
        }
    }

    /// With its dedup record's scope and key.
    #[must_use]
    pub(crate) fn with_dedup_key(
        mut self,
        scope: impl Into<String>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.dedup_key = Some((scope.into(), key.into()));
        self
    }

    /// As a held marker (see [`held_marker`](Self::held_marker)).
    #[must_use]
    pub(crate) fn into_held_marker(mut self) -> Self {
        self.held_marker = true;
        self
    }

    /// With the message's key, payload, headers and timestamp.
    #[must_use]
    pub(crate) fn with_message(
        mut self,
        message_key: Option<Vec<u8>>,
        payload: Option<Vec<u8>>,
        headers: Vec<(String, Option<Vec<u8>>)>,
        timestamp_ms: Option<i64>,
    ) -> Self {
        self.message_key = message_key;
        self.payload = payload;
        self.headers = headers;
        self.timestamp_ms = timestamp_ms;
        self
    }
}

/// What a park did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub(crate) enum ParkOutcome {
    /// Written now.
    Parked,
    /// The offset was parked before (a replay after a crash): nothing written.
    AlreadyParked,
    /// Another owner took the partition: nothing written; this consumer must let it go.
    Fenced,
}

/// A head to run now, from [`ParkedQueue::due_heads`].
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub(crate) struct ParkedHead {
    /// Its topic.
    pub(crate) topic: String,
    /// Its partition.
    pub(crate) partition: i32,
    /// The message.
    pub(crate) message: ParkedMessage,
    /// An operator asked for the key's queue to be dead-lettered.
    pub(crate) dropped: bool,
    /// It was dead-lettered already under the hold policy and an operator released or dropped
    /// its key: it is to be removed without running.
    pub(crate) gave_up: bool,
}

/// What taking a head did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub(crate) enum HeadTaken {
    /// Taken: run it.
    Taken,
    /// It had gone (settled meanwhile).
    Gone,
    /// Another owner took the partition: nothing changed.
    Fenced,
}

/// What settling a head did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub(crate) enum HeadSettled {
    /// Its row went.
    Removed,
    /// Under the hold policy: its row stays as the key's held marker, and the key's other
    /// messages are held.
    Held,
    /// It had gone already (settled before a crash, say).
    Gone,
    /// Another owner took the partition: nothing changed.
    Fenced,
}

/// One parked key of a group, for operators (`dedup parked`).
#[derive(Clone, PartialEq, Debug)]
#[non_exhaustive]
pub struct ParkedKeySummary {
    /// Its topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// The ordering key.
    pub ordering_key: ParkedKey,
    /// Messages parked under it.
    pub messages: u64,
    /// When its oldest message was parked.
    pub oldest: SystemTime,
    /// The head's attempts.
    pub head_attempts: u32,
    /// The head's last failure.
    pub head_error: String,
    /// When the head runs next.
    pub head_due: SystemTime,
    /// An operator must release it (`dedup unpark`).
    pub held: bool,
    /// An operator asked for it to be dead-lettered.
    pub dropped: bool,
}

/// Parked keys, messages and the age of the oldest park, over some partitions (the metrics).
#[derive(Clone, Copy, PartialEq, Debug, Default)]
#[non_exhaustive]
pub(crate) struct ParkedGauges {
    /// Keys with something parked.
    pub(crate) keys: u64,
    /// Messages parked.
    pub(crate) messages: u64,
    /// How long the oldest has been parked.
    pub(crate) oldest: Duration,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

pub(super) fn time_of(micros_since_epoch: i64) -> SystemTime {
    let micros = u64::try_from(micros_since_epoch).unwrap_or(0);
    UNIX_EPOCH + Duration::from_micros(micros)
}

fn key_parts(key: &ParkedKey) -> (bool, &[u8]) {
    match key {
        Some(k) => (true, k.as_slice()),
        None => (false, &[]),
    }
}

pub(super) fn key_of(row: &PgRow) -> Result<ParkedKey, sqlx::Error> {
    let has: bool = row.try_get("has_key")?;
    let key: Vec<u8> = row.try_get("ordering_key")?;
    Ok(has.then_some(key))
}

pub(super) fn attempts_of(row: &PgRow, column: &str) -> Result<u32, sqlx::Error> {
    let n: i32 = row.try_get(column)?;
    Ok(u32::try_from(n).unwrap_or(0))
}

fn head_of(row: &PgRow) -> Result<ParkedHead, sqlx::Error> {
    let names: Vec<String> = row.try_get("header_names")?;
    let values: Vec<Option<Vec<u8>>> = row.try_get("header_values")?;
    Ok(ParkedHead {
        topic: row.try_get("topic")?,
        partition: row.try_get("partition")?,
        message: ParkedMessage {
            offset: row.try_get("offset")?,
            ordering_key: key_of(row)?,
            message_key: row.try_get("message_key")?,
            payload: row.try_get("payload")?,
            headers: names.into_iter().zip(values).collect(),
            timestamp_ms: row.try_get("timestamp_ms")?,
            error: row.try_get("error")?,
            attempts: attempts_of(row, "attempts")?,
            dedup_key: {
                let scope: Option<String> = row.try_get("dedup_scope")?;
                let key: Option<Vec<u8>> = row.try_get("dedup_key")?;
                scope.zip(key)
            },
            held_marker: false,
        },
        dropped: row.try_get("dropped")?,
        gave_up: row.try_get("gave_up")?,
    })
}

impl ParkedQueue<'_> {
    /// Takes `partition`'s parked keys over for `owner` (when the partition is assigned): bumps
    /// its epoch, so the previous owner's writes are refused from now on, then reads its parked
    /// keys and how many messages each has, in a snapshot taken after the bump (it saw every park
    /// the bump waited for). The caller keeps the counts true for as long as it owns the
    /// partition: it parks and settles through this store with the epoch.
    #[cfg(test)]
    pub(crate) async fn acquire_parked(
        &self,
        partition: &ParkedPartition,
        owner: &str,
    ) -> Result<(ParkEpoch, HashMap<ParkedKey, u64>), StoreError> {
        self.acquire_parked_while(partition, owner, &|| true)
            .await?
            .ok_or_else(|| StoreError::unavailable(std::io::Error::other("not owned")))
    }

    /// [`acquire_parked`](Self::acquire_parked), bumping only if `owned` still answers true once
    /// a connection is in hand, right before the statement (`None` otherwise). A consumer passes
    /// its own view of the assignment: an acquire that waited for a connection past a revocation
    /// must not bump after the next owner did, or it would fence that owner out.
    pub(crate) async fn acquire_parked_while(
        &self,
        partition: &ParkedPartition,
        owner: &str,
        owned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Option<(ParkEpoch, HashMap<ParkedKey, u64>)>, StoreError> {
        let mut conn = self.conn().await?;
        if !owned() {
            return Ok(None);
        }
        self.count(2);
        let epoch = sqlx::query_scalar(sql::ACQUIRE_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(owner)
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        let epoch: i64 = conn.checked(epoch)?;
        let rows = sqlx::query(sql::KEYS_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .fetch_all(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        let rows = conn.checked(rows)?;
        let mut keys = HashMap::with_capacity(rows.len());
        for row in &rows {
            let n: i64 = row.try_get("n").map_err(|e| classify(e, false))?;
            keys.insert(
                key_of(row).map_err(|e| classify(e, false))?,
                u64::try_from(n).unwrap_or(0),
            );
        }
        Ok(Some((ParkEpoch(epoch), keys)))
    }

    /// Parks `message` in `partition` under `epoch`, due in `due_in` (zero for a message parked
    /// behind its key's head: it runs when it becomes the head). At most once per offset.
    pub(crate) async fn park(
        &self,
        partition: &ParkedPartition,
        epoch: ParkEpoch,
        message: &ParkedMessage,
        due_in: Duration,
    ) -> Result<ParkOutcome, StoreError> {
        self.count(1);
        let (has_key, key) = key_parts(&message.ordering_key);
        let names: Vec<&str> = message.headers.iter().map(|h| h.0.as_str()).collect();
        let values: Vec<Option<&[u8]>> = message.headers.iter().map(|h| h.1.as_deref()).collect();
        let mut conn = self.conn().await?;
        let wrote = sqlx::query(sql::PARK_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(epoch.0)
            .bind(message.offset)
            .bind(has_key)
            .bind(key)
            .bind(message.message_key.as_deref())
            .bind(message.payload.as_deref())
            .bind(&names)
            .bind(&values)
            .bind(message.timestamp_ms)
            .bind(safe_text(&message.error))
            .bind(i32::try_from(message.attempts).unwrap_or(i32::MAX))
            .bind(secs(due_in))
            .bind(message.dedup_key.as_ref().map(|k| k.0.as_str()))
            .bind(message.dedup_key.as_ref().map(|k| k.1.as_slice()))
            .bind(message.held_marker)
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        if conn.checked(wrote)?.is_some() {
            return Ok(ParkOutcome::Parked);
        }
        self.count(1);
        let row = sqlx::query(sql::PARK_CHECK_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(epoch.0)
            .bind(message.offset)
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        let row = conn.checked(row)?;
        let parked: bool = row.try_get("parked").map_err(|e| classify(e, false))?;
        let owned: bool = row.try_get("owned").map_err(|e| classify(e, false))?;
        Ok(match (parked, owned) {
            (true, _) => ParkOutcome::AlreadyParked,
            (false, false) => ParkOutcome::Fenced,
            // Neither written nor there while we own it: a concurrent writer of the same offset
            // is the only way, and it committed nothing we can see yet. Passing.
            (false, true) => {
                return Err(StoreError::unavailable(std::io::Error::other(
                    "a park of the same offset raced ours; try again",
                )));
            }
        })
    }

    /// The heads to run now over `partitions` of `group` (topic, partition): each parked key's
    /// lowest offset where it is due and not held, or its key was dropped by an operator; at most
    /// `limit`, in partition and offset order.
    pub(crate) async fn due_heads(
        &self,
        group: &str,
        partitions: &[(String, i32)],
        limit: u32,
    ) -> Result<Vec<ParkedHead>, StoreError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        self.count(1);
        let topics: Vec<&str> = partitions.iter().map(|p| p.0.as_str()).collect();
        let numbers: Vec<i32> = partitions.iter().map(|p| p.1).collect();
        let mut conn = self.conn().await?;
        let rows = sqlx::query(sql::DUE_HEADS_SQL)
            .bind(group)
            .bind(&topics)
            .bind(&numbers)
            .bind(i64::from(limit))
            .fetch_all(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        let rows = conn.checked(rows)?;
        rows.iter()
            .map(|r| head_of(r).map_err(|e| classify(e, false)))
            .collect()
    }

    /// Takes the head at `offset` to run it: this owner's later looks do not pick it again for
    /// `bound` (how long a run may take), a later owner's do.
    pub(crate) async fn take_head(
        &self,
        partition: &ParkedPartition,
        epoch: ParkEpoch,
        offset: i64,
        bound: Duration,
    ) -> Result<HeadTaken, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let row = sqlx::query(sql::TAKE_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(epoch.0)
            .bind(offset)
            .bind(secs(bound))
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        let row = conn.checked(row)?;
        let owned: bool = row.try_get("owned").map_err(|e| classify(e, false))?;
        let taken: bool = row.try_get("taken").map_err(|e| classify(e, false))?;
        Ok(match (owned, taken) {
            (false, _) => HeadTaken::Fenced,
            (true, true) => HeadTaken::Taken,
            (true, false) => HeadTaken::Gone,
        })
    }

    /// The head at `offset` settled (it ran, was replayed, or was dead-lettered): its row goes.
    /// With `hold_rest` (the hold policy, after a dead letter) the row stays as the key's held
    /// marker and the key's other messages wait with it for an operator (`dedup unpark`, `dedup
    /// drop`); the owner then removes the marker without running it.
    pub(crate) async fn settle_head(
        &self,
        partition: &ParkedPartition,
        epoch: ParkEpoch,
        offset: i64,
        hold_rest: bool,
    ) -> Result<HeadSettled, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let row = sqlx::query(sql::SETTLE_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(epoch.0)
            .bind(offset)
            .bind(hold_rest)
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        let row = conn.checked(row)?;
        let owned: bool = row.try_get("owned").map_err(|e| classify(e, false))?;
        let deleted: bool = row.try_get("deleted").map_err(|e| classify(e, false))?;
        Ok(match (owned, deleted) {
            (false, _) => HeadSettled::Fenced,
            (true, true) if hold_rest => HeadSettled::Held,
            (true, true) => HeadSettled::Removed,
            (true, false) => HeadSettled::Gone,
        })
    }

    /// The head at `offset` failed again: records `error` and `attempts`, due again in `due_in`.
    /// False: another owner took the partition, or the head went.
    pub(crate) async fn defer_head(
        &self,
        partition: &ParkedPartition,
        epoch: ParkEpoch,
        offset: i64,
        error: &str,
        attempts: u32,
        due_in: Duration,
    ) -> Result<bool, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let row = sqlx::query(sql::DEFER_SQL)
            .bind(&partition.group)
            .bind(&partition.topic)
            .bind(partition.partition)
            .bind(epoch.0)
            .bind(offset)
            .bind(safe_text(error))
            .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
            .bind(secs(due_in))
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        Ok(conn.checked(row)?.is_some())
    }
}
