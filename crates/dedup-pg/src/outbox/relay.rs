//! The relay's side of the outbox in Postgres: the lease, the read, the position, the ring.
//!
//! - **The lease.** One row, `dedup_outbox_relay`, names the leader, its epoch and until when its
//!   lease holds. [`RelayStore::acquire`] takes a lease that ran out (or was let go) with a new
//!   epoch; [`RelayStore::renew`] extends it only under that epoch; the position moves only under
//!   it ([`RelayStore::advance`]). A relay paused past its lease and resumed after another took
//!   over cannot move the position: what it still sends is a duplicate, with the same derived key.
//! - **The read.** A [`Position`] is a snapshot (`pg_current_snapshot()`, as text) in which every
//!   visible row is published. [`RelayStore::snapshot`] takes the next one, in a statement of its
//!   own (no transaction id); [`RelayStore::read`] answers the rows of the transactions visible in
//!   it and not in the position, in `(xid8, pos)` order, a page at a time. A transaction that
//!   commits late with a lower id is read once it commits; one that stays open holds nothing back.
//! - **The ring.** [`RelayStore::rotate`] truncates the next table of the ring once none of its
//!   committed rows is unpublished (under the table's exclusive lock, taken within a short lock
//!   timeout so no writer waits behind it), and points the writers at it.

use std::time::Duration;

use bytes::Bytes;
use dedup_core::StoreError;
use sqlx::Row as _;

use crate::PgStore;
use crate::classify::classify;

/// A relay's lease: the epoch it holds the outbox under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxLease {
    /// The leader's name.
    pub leader: String,
    /// The epoch: every change the relay makes names it, and one taken over since fails.
    pub epoch: i64,
}

/// A relay position: a Postgres snapshot (`pg_snapshot` as text); every row visible in it has
/// been published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position(pub String);

/// Where the relay stands: its position, and the round in progress, if one was left mid-way
/// (the snapshot it reads up to, and the last row published).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// Every row visible in it is published.
    pub position: Position,
    /// The round in progress: its snapshot, and the `(xid, pos)` of its last row published.
    pub round: Option<(Position, (i64, i64))>,
}

/// How far [`RelayStore::advance`] moves.
#[derive(Clone, Copy, Debug)]
pub enum Step<'a> {
    /// A page of the round reading up to the snapshot was published, up to the row `(xid, pos)`:
    /// a relay that takes over resumes after it.
    Page(&'a Position, (i64, i64)),
    /// The round is done: the position is the snapshot.
    Done(&'a Position),
}

/// A row to publish, as stored.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutboxRow {
    /// The writing transaction's id.
    pub xid: i64,
    /// Its place in the publication order within that transaction.
    pub pos: i64,
    /// The topic.
    pub topic: String,
    /// The message key.
    pub key: Option<Bytes>,
    /// The payload (`None`: a tombstone).
    pub payload: Option<Bytes>,
    /// The headers as queued, encoded ([`decode_headers`](super::decode_headers)).
    pub headers: Bytes,
    /// The derived idempotency key.
    pub idem_key: Bytes,
    /// The cause's scope.
    pub cause_scope: String,
    /// The cause's key.
    pub cause_key: Bytes,
    /// When it was written, in milliseconds since the Unix epoch: the Kafka timestamp.
    pub written_ms: i64,
}

/// A message the broker refused for good, kept with the reason.
#[derive(Clone, Debug)]
pub struct OutboxDeadLetter {
    /// The row.
    pub row: OutboxRow,
    /// Why it was refused.
    pub reason: String,
}

/// What [`RelayStore::status`] answers.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// The leader, if a lease holds now.
    pub leader: Option<String>,
    /// The current epoch.
    pub epoch: i64,
    /// Committed rows not yet published, counted up to [`STATUS_COUNT_CAP`].
    pub unpublished: i64,
    /// How long the first of them in publication order has waited, in milliseconds (0 when
    /// none waits).
    pub oldest_ms: i64,
    /// Rows published since the outbox was made.
    pub published: i64,
    /// When the position last moved, in milliseconds before now.
    pub moved_ms_ago: i64,
    /// Messages the broker refused for good (`dedup_outbox_dead`).
    pub dead_letters: i64,
    /// The ring table being written (0 to 2).
    pub ring: i16,
}

/// What [`RelayStore::rotate`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rotation {
    /// Not due yet.
    NotDue,
    /// The next table still holds rows not yet published (or a writer still holds it): later.
    NotYet,
    /// The next table was emptied and now takes the writes.
    Rotated {
        /// The ring now written.
        ring: i16,
    },
    /// The lease was taken over: nothing changed.
    LeaseLost,
}

const ACQUIRE_SQL: &str = "\
UPDATE dedup_outbox_relay SET leader = $1, epoch = epoch + 1, \
    lease_until = clock_timestamp() + $2::int8 * interval '1 millisecond' \
WHERE id = 1 AND lease_until < clock_timestamp() RETURNING epoch";

const RENEW_SQL: &str = "\
UPDATE dedup_outbox_relay SET lease_until = clock_timestamp() + $2::int8 * interval '1 millisecond' \
WHERE id = 1 AND epoch = $1 RETURNING 1";

const RELEASE_SQL: &str =
    "UPDATE dedup_outbox_relay SET lease_until = '-infinity' WHERE id = 1 AND epoch = $1";

const READ_SQL: &str = "\
WITH s AS (SELECT $1::text::pg_snapshot AS prev, $2::text::pg_snapshot AS cur) \
SELECT o.xid8::text::int8 AS xid, o.pos, o.topic, o.msg_key, o.payload, o.headers, o.idem_key, \
    o.cause_scope, o.cause_key, (extract(epoch FROM o.written_at) * 1000)::int8 AS written_ms \
FROM ( \
    SELECT o.* FROM dedup_outbox o, s \
    WHERE o.xid8 >= pg_snapshot_xmax(s.prev) AND o.xid8 < pg_snapshot_xmax(s.cur) \
        AND pg_visible_in_snapshot(o.xid8, s.cur) \
    UNION ALL \
    SELECT o.* FROM dedup_outbox o \
    WHERE o.xid8 = ANY (ARRAY( \
        SELECT x FROM s, pg_snapshot_xip(s.prev) x WHERE pg_visible_in_snapshot(x, s.cur))) \
) o \
WHERE (o.xid8, o.pos) > ($3::int8::text::xid8, $4::int8) \
ORDER BY o.xid8, o.pos \
LIMIT $5";

const ADVANCE_SQL: &str = "\
UPDATE dedup_outbox_relay SET position = $2, target = NULL, after_xid = NULL, after_pos = NULL, \
    moved_at = statement_timestamp(), published = published + $3 \
WHERE id = 1 AND epoch = $1 RETURNING 1";

const PAGE_SQL: &str = "\
UPDATE dedup_outbox_relay SET target = $2, after_xid = $4, after_pos = $5, \
    moved_at = statement_timestamp(), published = published + $3 \
WHERE id = 1 AND epoch = $1 RETURNING 1";

const DEAD_SQL: &str = "\
INSERT INTO dedup_outbox_dead (xid8, pos, topic, msg_key, payload, headers, idem_key, \
    cause_scope, cause_key, event_ms, written_at, reason) \
SELECT o.xid8, o.pos, o.topic, o.msg_key, o.payload, o.headers, o.idem_key, o.cause_scope, \
    o.cause_key, o.event_ms, o.written_at, d.reason \
FROM unnest($1::int8[], $2::int8[], $3::text[]) AS d(xid, pos, reason) \
JOIN dedup_outbox o ON o.xid8 = d.xid::text::xid8 AND o.pos = d.pos";

/// What waits is counted up to [`STATUS_COUNT_CAP`] rows (an index range, cheap every few
/// seconds even in a long outage), less the pages a round in progress recorded; the oldest is
/// the first in publication order.
const STATUS_SQL: &str = "\
SELECT CASE WHEN r.lease_until > clock_timestamp() THEN r.leader END, r.epoch, \
    (SELECT count(*) FROM (SELECT 1 FROM dedup_outbox o \
        WHERE o.xid8 >= pg_snapshot_xmin(r.position::pg_snapshot) \
            AND NOT pg_visible_in_snapshot(o.xid8, r.position::pg_snapshot) \
            AND NOT coalesce(pg_visible_in_snapshot(o.xid8, r.target::pg_snapshot) \
                AND (o.xid8, o.pos) <= (r.after_xid::text::xid8, r.after_pos), false) \
        LIMIT 100000) w), \
    coalesce((SELECT (extract(epoch FROM clock_timestamp() - o.written_at) * 1000)::int8 \
        FROM dedup_outbox o \
        WHERE o.xid8 >= pg_snapshot_xmin(r.position::pg_snapshot) \
            AND NOT pg_visible_in_snapshot(o.xid8, r.position::pg_snapshot) \
            AND NOT coalesce(pg_visible_in_snapshot(o.xid8, r.target::pg_snapshot) \
                AND (o.xid8, o.pos) <= (r.after_xid::text::xid8, r.after_pos), false) \
        ORDER BY o.xid8, o.pos LIMIT 1), 0), \
    r.published, (extract(epoch FROM clock_timestamp() - r.moved_at) * 1000)::int8, \
    (SELECT count(*) FROM dedup_outbox_dead), r.ring \
FROM dedup_outbox_relay r WHERE r.id = 1";

/// The most unpublished rows [`RelayStore::status`] counts.
pub const STATUS_COUNT_CAP: i64 = 100_000;

/// The relay's Postgres side, on a store's pool.
#[derive(Clone, Debug)]
pub struct RelayStore {
    store: PgStore,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl RelayStore {
    /// The relay's side of `store`'s outbox.
    pub fn new(store: PgStore) -> Self {
        Self { store }
    }

    /// Takes the lease for `ttl` if none holds (it ran out, or was let go): a new epoch.
    /// `None` while another relay holds it.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn acquire(
        &self,
        leader: &str,
        ttl: Duration,
    ) -> Result<Option<OutboxLease>, StoreError> {
        self.store.count(1);
        let epoch: Option<i64> = sqlx::query_scalar(ACQUIRE_SQL)
            .bind(leader)
            .bind(millis(ttl))
            .fetch_optional(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        Ok(epoch.map(|epoch| OutboxLease {
            leader: leader.to_owned(),
            epoch,
        }))
    }

    /// Extends the lease for `ttl` from now; `false` once another relay took it.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn renew(&self, lease: &OutboxLease, ttl: Duration) -> Result<bool, StoreError> {
        self.store.count(1);
        let held: Option<i32> = sqlx::query_scalar(RENEW_SQL)
            .bind(lease.epoch)
            .bind(millis(ttl))
            .fetch_optional(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        Ok(held.is_some())
    }

    /// Lets the lease go (a relay stopping), so a stand-by takes over at once.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn release(&self, lease: &OutboxLease) -> Result<(), StoreError> {
        self.store.count(1);
        sqlx::query(RELEASE_SQL)
            .bind(lease.epoch)
            .execute(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        Ok(())
    }

    /// The stored position and the round in progress.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn progress(&self) -> Result<Progress, StoreError> {
        self.store.count(1);
        let (position, target, xid, pos): (String, Option<String>, Option<i64>, Option<i64>) =
            sqlx::query_as(
                "SELECT position, target, after_xid, after_pos FROM dedup_outbox_relay \
                 WHERE id = 1",
            )
            .fetch_one(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        Ok(Progress {
            position: Position(position),
            round: match (target, xid, pos) {
                (Some(t), Some(x), Some(p)) => Some((Position(t), (x, p))),
                _ => None,
            },
        })
    }

    /// The stored position.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn position(&self) -> Result<Position, StoreError> {
        self.store.count(1);
        sqlx::query_scalar("SELECT position FROM dedup_outbox_relay WHERE id = 1")
            .fetch_one(self.store.pool())
            .await
            .map(Position)
            .map_err(|e| classify(e, false))
    }

    /// The next position to read up to: a snapshot taken now, in a statement with no
    /// transaction id of its own.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn snapshot(&self) -> Result<Position, StoreError> {
        self.store.count(1);
        sqlx::query_scalar("SELECT pg_current_snapshot()::text")
            .fetch_one(self.store.pool())
            .await
            .map(Position)
            .map_err(|e| classify(e, false))
    }

    /// Up to `limit` rows of the transactions visible in `cur` and not in `prev`, after
    /// `after` (the `(xid, pos)` of the last row of the page before), in publication order.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn read(
        &self,
        prev: &Position,
        cur: &Position,
        after: Option<(i64, i64)>,
        limit: usize,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let (xid, pos) = after.unwrap_or((0, i64::MIN));
        self.store.count(1);
        let rows = sqlx::query(READ_SQL)
            .bind(&prev.0)
            .bind(&cur.0)
            .bind(xid)
            .bind(pos)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        rows.iter()
            .map(|r| {
                Ok(OutboxRow {
                    xid: r.try_get("xid")?,
                    pos: r.try_get("pos")?,
                    topic: r.try_get("topic")?,
                    key: r.try_get::<Option<Vec<u8>>, _>("msg_key")?.map(Bytes::from),
                    payload: r.try_get::<Option<Vec<u8>>, _>("payload")?.map(Bytes::from),
                    headers: Bytes::from(r.try_get::<Vec<u8>, _>("headers")?),
                    idem_key: Bytes::from(r.try_get::<Vec<u8>, _>("idem_key")?),
                    cause_scope: r.try_get("cause_scope")?,
                    cause_key: Bytes::from(r.try_get::<Vec<u8>, _>("cause_key")?),
                    written_ms: r.try_get("written_ms")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| classify(e, false))
    }

    /// Records a page (the round's progress) or the round's end (the position) under `lease`'s
    /// epoch, counting `published` rows, and keeps `dead` (messages the broker refused for
    /// good), in one transaction. `false`, with nothing changed, once another relay took the
    /// lease.
    ///
    /// # Errors
    /// A statement's, classified; an unknown outcome is read back (the progress is `step`'s or
    /// not).
    pub async fn advance(
        &self,
        lease: &OutboxLease,
        step: Step<'_>,
        published: u64,
        dead: &[OutboxDeadLetter],
    ) -> Result<bool, StoreError> {
        let mut tx = self
            .store
            .pool()
            .begin()
            .await
            .map_err(|e| classify(e, false))?;
        self.store.count(3);
        let published = i64::try_from(published).unwrap_or(i64::MAX);
        let update = match step {
            Step::Done(to) => sqlx::query_scalar(ADVANCE_SQL)
                .bind(lease.epoch)
                .bind(&to.0)
                .bind(published),
            Step::Page(target, (xid, pos)) => sqlx::query_scalar(PAGE_SQL)
                .bind(lease.epoch)
                .bind(&target.0)
                .bind(published)
                .bind(xid)
                .bind(pos),
        };
        let held: Option<i32> = update
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| classify(e, false))?;
        if held.is_none() {
            tx.rollback().await.map_err(|e| classify(e, false))?;
            return Ok(false);
        }
        if !dead.is_empty() {
            self.store.count(1);
            let xids: Vec<i64> = dead.iter().map(|d| d.row.xid).collect();
            let pos: Vec<i64> = dead.iter().map(|d| d.row.pos).collect();
            let reasons: Vec<&str> = dead.iter().map(|d| d.reason.as_str()).collect();
            sqlx::query(DEAD_SQL)
                .bind(&xids)
                .bind(&pos)
                .bind(&reasons)
                .execute(&mut *tx)
                .await
                .map_err(|e| classify(e, false))?;
        }
        match tx.commit().await {
            Ok(()) => Ok(true),
            Err(e) => {
                let err = classify(e, true);
                let landed = |p: Progress| match step {
                    Step::Done(to) => &p.position == to && p.round.is_none(),
                    Step::Page(t, after) => p.round == Some((t.clone(), after)),
                };
                if err.is_outcome_unknown() && self.progress().await.is_ok_and(landed) {
                    return Ok(true);
                }
                Err(err)
            }
        }
    }

    /// Empties the next table of the ring and points the writers at it, under `lease`, if the
    /// last rotation is at least `every` ago and none of that table's committed rows is
    /// unpublished. The table's exclusive lock is waited for at most `lock_wait` (a writer that
    /// still holds it makes this [`Rotation::NotYet`], and no writer waits long behind it).
    ///
    /// # Errors
    /// A statement's, classified (a lock not had in time is [`Rotation::NotYet`]).
    pub async fn rotate(
        &self,
        lease: &OutboxLease,
        every: Duration,
        lock_wait: Duration,
    ) -> Result<Rotation, StoreError> {
        // READ COMMITTED whatever the pool's default: the check after the lock must see every
        // writer that committed while the lock waited.
        let mut conn = self
            .store
            .pool()
            .acquire()
            .await
            .map_err(|e| classify(e, false))?;
        let mut tx = sqlx::Connection::begin_with(
            &mut *conn,
            sqlx::AssertSqlSafe("BEGIN ISOLATION LEVEL READ COMMITTED"),
        )
        .await
        .map_err(|e| classify(e, false))?;
        self.store.count(2);
        let row = sqlx::query(
            "SELECT ring, position, epoch, \
                 rotated_at <= statement_timestamp() - $1::int8 * interval '1 millisecond' AS due \
             FROM dedup_outbox_relay WHERE id = 1 FOR UPDATE",
        )
        .bind(millis(every))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| classify(e, false))?;
        let ring: i16 = row.try_get("ring").map_err(|e| classify(e, false))?;
        let position: String = row.try_get("position").map_err(|e| classify(e, false))?;
        let epoch: i64 = row.try_get("epoch").map_err(|e| classify(e, false))?;
        let due: bool = row.try_get("due").map_err(|e| classify(e, false))?;
        if epoch != lease.epoch {
            return Ok(Rotation::LeaseLost);
        }
        if !due {
            return Ok(Rotation::NotDue);
        }
        let next = (ring + 1) % 3;
        let table = ["dedup_outbox_0", "dedup_outbox_1", "dedup_outbox_2"]
            [usize::from(next.unsigned_abs())];
        self.store.count(1);
        let locked = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{}ms'; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE",
            millis(lock_wait).max(1)
        )))
        .execute(&mut *tx)
        .await;
        if let Err(e) = locked {
            let e = classify(e, false);
            if crate::sqlstate(&e).as_deref() == Some("55P03") {
                return Ok(Rotation::NotYet);
            }
            return Err(e);
        }
        // Once locked, no writer holds the table: every row in it is committed or rolled back.
        self.store.count(1);
        let waiting: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {table} o \
                 WHERE o.xid8 >= pg_snapshot_xmin($1::text::pg_snapshot) \
                     AND NOT pg_visible_in_snapshot(o.xid8, $1::text::pg_snapshot))"
        )))
        .bind(&position)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| classify(e, false))?;
        if waiting {
            return Ok(Rotation::NotYet);
        }
        self.store.count(3);
        sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {table}")))
            .execute(&mut *tx)
            .await
            .map_err(|e| classify(e, false))?;
        sqlx::query(
            "UPDATE dedup_outbox_relay SET ring = $1, rotated_at = statement_timestamp() \
             WHERE id = 1",
        )
        .bind(next)
        .execute(&mut *tx)
        .await
        .map_err(|e| classify(e, false))?;
        tx.commit().await.map_err(|e| classify(e, true))?;
        Ok(Rotation::Rotated { ring: next })
    }

    /// The outbox's state: the leader, what waits and for how long, what was published.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn status(&self) -> Result<OutboxStatus, StoreError> {
        self.store.count(1);
        let r = sqlx::query(STATUS_SQL)
            .fetch_one(self.store.pool())
            .await
            .map_err(|e| classify(e, false))?;
        (|| {
            Ok::<_, sqlx::Error>(OutboxStatus {
                leader: r.try_get(0)?,
                epoch: r.try_get(1)?,
                unpublished: r.try_get(2)?,
                oldest_ms: r.try_get(3)?,
                published: r.try_get(4)?,
                moved_ms_ago: r.try_get(5)?,
                dead_letters: r.try_get(6)?,
                ring: r.try_get(7)?,
            })
        })()
        .map_err(|e| classify(e, false))
    }
}
