//! Dead letters the dead-letter topic refused for good (`dedup_dead_letters`): a message larger
//! than the topic accepts, or a record it calls invalid, would stall its partition on the path
//! meant to unstall it. Where the store is Postgres the consumer keeps such a dead letter here,
//! whole, and moves on; operators list, remove and purge them (`dedup dead-letters`). These rows
//! block nothing (unlike `dedup_parked`, whose rows hold their key).
//!
//! A row is keyed by its coordinates (group, topic, partition, offset) and the digest of what
//! the message holds: the same letter written again after a crash meets its own row and writes
//! nothing, while a different letter at the same coordinates (a topic deleted and made again,
//! whose offsets start at 0 again; two clusters' topics of one name) is kept beside it. A row
//! also names the message's idempotency key where it had one (`dedup forget
//! --kept-dead-letters`). [`KeptDeadLetters`] has the calls: `keep` (the consumer's), `list`,
//! `remove` and `purge` (operators').

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_core::{IdempotencyKey, Scope, StoreError};
use sha2::{Digest, Sha256};
use sqlx::Row;

use dedup_pg::{PgStore, classify, safe_text};

/// The same content as the letter bound to $6 to $10 (message key, payload, header names, header
/// values, timestamp), in the row `o`.
macro_rules! same_content {
    () => {
        concat!(
            " o.message_key IS NOT DISTINCT FROM $6 AND o.payload IS NOT DISTINCT FROM $7",
            " AND o.header_names = $8 AND o.header_values = $9",
            " AND o.timestamp_ms IS NOT DISTINCT FROM $10",
        )
    };
}

/// Keeps one, unless the same letter is kept already at its coordinates: a row of its digest
/// (written again after a crash), or a row of the empty digest (kept by a binary of generation 11
/// or older) holding the same content. Answers whether it wrote the row (`written`) and whether
/// the same letter was there before (`there`); neither means a row of its digest holds another
/// content. $1 group, $2 topic, $3 partition, $4 offset, $5 digest, $6 message key, $7 payload,
/// $8 header names (bytes), $9 header values, $10 timestamp, $11 reason, $12 attempts,
/// $13 dead-letter topic, $14 refusal, $15 the idempotency key's scope, $16 its bytes.
const KEEP_SQL: &str = concat!(
    "WITH kept AS (INSERT INTO dedup_dead_letters (consumer_group, topic, partition, \"offset\",",
    " digest, message_key, payload, header_names, header_values, timestamp_ms, reason, attempts,",
    " dead_letter_topic, refusal, scope, dedup_key, stored_at)",
    " SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,",
    " statement_timestamp()",
    " WHERE NOT EXISTS (SELECT 1 FROM dedup_dead_letters o WHERE o.consumer_group = $1",
    " AND o.topic = $2 AND o.partition = $3 AND o.\"offset\" = $4 AND o.digest = '\\x' AND",
    same_content!(),
    ") ON CONFLICT DO NOTHING RETURNING 1)",
    " SELECT EXISTS (SELECT 1 FROM kept) AS written,",
    " EXISTS (SELECT 1 FROM dedup_dead_letters o WHERE o.consumer_group = $1 AND o.topic = $2",
    " AND o.partition = $3 AND o.\"offset\" = $4 AND o.digest IN ($5, '\\x') AND",
    same_content!(),
    ") AS there",
);

/// A group's kept dead letters, oldest first. $1 group.
const LIST_SQL: &str = concat!(
    "SELECT topic, partition, \"offset\", digest, message_key, payload, header_names,",
    " header_values, timestamp_ms, reason, attempts, dead_letter_topic, refusal, scope, dedup_key,",
    " (EXTRACT(EPOCH FROM stored_at) * 1e6)::int8 AS stored_us",
    " FROM dedup_dead_letters WHERE consumer_group = $1 ORDER BY stored_at, topic, partition,",
    " \"offset\", digest",
);

/// Removes one. $1 group, $2 topic, $3 partition, $4 offset, $5 digest.
const REMOVE_SQL: &str = concat!(
    "DELETE FROM dedup_dead_letters WHERE consumer_group = $1 AND topic = $2",
    " AND partition = $3 AND \"offset\" = $4 AND digest = $5",
);

/// Removes a group's letters kept longer ago than $2 seconds. $1 group.
const PURGE_SQL: &str = concat!(
    "DELETE FROM dedup_dead_letters WHERE consumer_group = $1",
    " AND stored_at < statement_timestamp() - $2::float8 * interval '1 second'",
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
    /// The message's idempotency key, where it had a usable one (`dedup forget
    /// --kept-dead-letters` forgets it).
    pub idempotency_key: Option<IdempotencyKey>,
    /// Why it was dead-lettered.
    pub reason: String,
    /// The attempts made.
    pub attempts: u32,
    /// The dead-letter topic that refused it.
    pub dead_letter_topic: String,
    /// What the dead-letter topic answered.
    pub refusal: String,
    /// Read back only: the [`content_digest`](Self::content_digest) it was kept under, which
    /// tells it from another letter kept at the same coordinates (empty for a letter kept by a
    /// binary of generation 11 or older).
    pub digest: Vec<u8>,
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

    /// The sha256 of what the message holds (its key, payload, headers in order and timestamp,
    /// each length-prefixed so that no two contents run together into one): the same message
    /// dead-lettered again after a crash has the same digest, a message of a topic made again
    /// (its offsets from 0 again) or of another cluster has another.
    pub fn content_digest(&self) -> [u8; 32] {
        fn field(h: &mut Sha256, v: Option<&[u8]>) {
            match v {
                None => h.update([0]),
                Some(v) => {
                    h.update([1]);
                    h.update((v.len() as u64).to_be_bytes());
                    h.update(v);
                }
            }
        }
        let mut h = Sha256::new();
        h.update(b"dedup dead letter v1\0");
        field(&mut h, self.message_key.as_deref());
        field(&mut h, self.payload.as_deref());
        h.update((self.headers.len() as u64).to_be_bytes());
        for (name, value) in &self.headers {
            field(&mut h, Some(name));
            field(&mut h, value.as_deref());
        }
        match self.timestamp_ms {
            None => h.update([0]),
            Some(ms) => {
                h.update([1]);
                h.update(ms.to_be_bytes());
            }
        }
        h.finalize().into()
    }
}

/// The idempotency key a kept row names (none where either half is missing or no longer valid).
fn key_of(scope: Option<String>, key: Option<Vec<u8>>) -> Option<IdempotencyKey> {
    IdempotencyKey::new(Scope::new(scope?).ok()?, key?).ok()
}

/// The error of a letter that cannot be kept: a row of its digest holds another content.
#[derive(Debug, thiserror::Error)]
#[error(
    "a different dead letter of group {group} is kept at {topic}/{partition}/{offset} under the \
     same digest: this one cannot be kept beside it (remove the kept one with `dedup \
     dead-letters --remove` once it is dealt with)"
)]
struct DigestTaken {
    group: String,
    topic: String,
    partition: i32,
    offset: i64,
}

/// The dead letters kept in a [`PgStore`]'s database (`dedup_dead_letters`) because their
/// dead-letter topic refused them for good: what operators call (`dedup dead-letters`).
#[derive(Clone, Copy, Debug)]
pub struct KeptDeadLetters<'a>(&'a PgStore);

impl<'a> KeptDeadLetters<'a> {
    /// The kept dead letters of `store`'s database.
    #[must_use]
    pub fn new(store: &'a PgStore) -> Self {
        Self(store)
    }

    fn pool(&self) -> &'a sqlx::PgPool {
        self.0.pool()
    }

    /// Keeps a dead letter the dead-letter topic refused, under its
    /// [`content_digest`](RefusedDeadLetter::content_digest): the same letter written again
    /// (a replay after a crash) writes nothing twice, and another letter at the same coordinates
    /// (a topic made again, another cluster's topic of the same name) is kept beside it. Answers
    /// whether this call wrote it (false: the same letter was kept already). A letter that
    /// cannot be kept (a row of its digest holds another content) is an error that retrying does
    /// not cure.
    pub(crate) async fn keep(&self, d: &RefusedDeadLetter) -> Result<bool, StoreError> {
        self.0.count(1);
        let names: Vec<&[u8]> = d.headers.iter().map(|h| h.0.as_slice()).collect();
        let values: Vec<Option<&[u8]>> = d.headers.iter().map(|h| h.1.as_deref()).collect();
        let digest = d.content_digest();
        let key = d.idempotency_key.as_ref();
        let row = sqlx::query(KEEP_SQL)
            .bind(&d.group)
            .bind(&d.topic)
            .bind(d.partition)
            .bind(d.offset)
            .bind(&digest[..])
            .bind(d.message_key.as_deref())
            .bind(d.payload.as_deref())
            .bind(&names)
            .bind(&values)
            .bind(d.timestamp_ms)
            .bind(safe_text(&d.reason))
            .bind(i32::try_from(d.attempts).unwrap_or(i32::MAX))
            .bind(&d.dead_letter_topic)
            .bind(safe_text(&d.refusal))
            .bind(key.map(|k| k.scope().as_str()))
            .bind(key.map(IdempotencyKey::key_bytes))
            .fetch_one(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        let written: bool = row.try_get("written").map_err(|e| classify(e, false))?;
        let there: bool = row.try_get("there").map_err(|e| classify(e, false))?;
        if written || there {
            return Ok(written);
        }
        Err(StoreError::backend(DigestTaken {
            group: d.group.clone(),
            topic: d.topic.clone(),
            partition: d.partition,
            offset: d.offset,
        }))
    }

    /// `group`'s kept dead letters, oldest first (`dedup dead-letters`).
    pub async fn list(&self, group: &str) -> Result<Vec<RefusedDeadLetter>, StoreError> {
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
                    idempotency_key: key_of(r.try_get("scope")?, r.try_get("dedup_key")?),
                    reason: r.try_get("reason")?,
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    dead_letter_topic: r.try_get("dead_letter_topic")?,
                    refusal: r.try_get("refusal")?,
                    digest: r.try_get("digest")?,
                    stored_at: Some(
                        UNIX_EPOCH + Duration::from_micros(u64::try_from(stored).unwrap_or(0)),
                    ),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| classify(e, false))
    }

    /// Removes one kept dead letter (once an operator has re-driven or dealt with it): the one
    /// at its coordinates kept under `digest` (its [`RefusedDeadLetter::digest`] as read back).
    /// Answers whether it was there.
    pub async fn remove(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        offset: i64,
        digest: &[u8],
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(REMOVE_SQL)
            .bind(group)
            .bind(topic)
            .bind(partition)
            .bind(offset)
            .bind(digest)
            .execute(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        Ok(done.rows_affected() == 1)
    }

    /// Removes `group`'s dead letters kept more than `older_than` ago (`dedup dead-letters
    /// --purge-older-than`): the retention of `dedup_dead_letters`, which nothing else purges.
    /// Answers how many were removed.
    pub async fn purge(&self, group: &str, older_than: Duration) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE_SQL)
            .bind(group)
            .bind(older_than.as_secs_f64())
            .execute(self.pool())
            .await
            .map_err(|e| classify(e, true))?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod digest_tests {
    use super::*;

    fn letter() -> RefusedDeadLetter {
        let mut d = RefusedDeadLetter::new("g", "t", 0, 0);
        d.message_key = Some(b"acct-1".to_vec());
        d.payload = Some(b"{}".to_vec());
        d.headers = vec![(b"a".to_vec(), Some(b"b".to_vec())), (b"c".to_vec(), None)];
        d.timestamp_ms = Some(1_700_000_000_000);
        d
    }

    #[test]
    fn the_digest_is_of_the_content_only_and_fields_do_not_run_together() {
        let d = letter();
        let mut same = d.clone();
        same.reason = "another try".into();
        same.attempts = 7;
        same.offset = 9;
        assert_eq!(d.content_digest(), same.content_digest());
        let mut changed: Vec<RefusedDeadLetter> = Vec::new();
        let mut c = d.clone();
        c.message_key = None;
        changed.push(c);
        let mut c = d.clone();
        c.payload = Some(Vec::new());
        changed.push(c);
        let mut c = d.clone();
        c.timestamp_ms = None;
        changed.push(c);
        let mut c = d.clone();
        c.timestamp_ms = Some(1_700_000_000_001);
        changed.push(c);
        // The same bytes split differently between the name and the value of a header.
        let mut c = d.clone();
        c.headers[0] = (b"ab".to_vec(), Some(Vec::new()));
        changed.push(c);
        let mut c = d.clone();
        c.headers[1].1 = Some(Vec::new());
        changed.push(c);
        // The same bytes split differently between the key and the payload.
        let mut c = d.clone();
        c.message_key = Some(b"acct-1{".to_vec());
        c.payload = Some(b"}".to_vec());
        changed.push(c);
        for c in &changed {
            assert_ne!(d.content_digest(), c.content_digest(), "{c:?}");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
