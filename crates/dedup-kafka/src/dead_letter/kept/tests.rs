//! Dead letters kept in Postgres because their dead-letter topic refused them for good
//! (`dedup_dead_letters`): each is kept under its coordinates and the digest
//! of its content, so a different letter at the coordinates of an old one (a topic deleted and
//! made again, whose offsets start at 0 again) is kept beside it while the same letter written
//! again after a crash is kept once; rows name their idempotency key; one is removed exactly by
//! its digest; the old ones are purged by age; a letter that cannot be kept is an error, not a
//! silent loss; and a binary of generation 11 still works on the table. Keeping them through the
//! runner is `tests/it/kafka/dead_letters.rs`; `dedup dead-letters` and `dedup forget
//! --kept-dead-letters` are tested in `crates/dedup-cli/tests/dead_letters.rs`.

use std::time::Duration;

use dedup_core::{IdempotencyKey, Scope};
use dedup_pg::PgStore;

use super::{KeptDeadLetters, RefusedDeadLetter};
use sqlx::PgPool;

/// A dead letter of group `g` at `t`/0/`offset` holding `payload`.
fn letter(offset: i64, payload: &str, timestamp_ms: i64) -> RefusedDeadLetter {
    let mut d = RefusedDeadLetter::new("g", "t", 0, offset);
    d.payload = Some(payload.as_bytes().to_vec());
    d.headers = vec![
        (b"idempotency-key".to_vec(), Some(b"evt-1".to_vec())),
        (b"empty".to_vec(), None),
    ];
    d.timestamp_ms = Some(timestamp_ms);
    d.reason = "the handler failed permanently: bug".into();
    d.attempts = 1;
    d.dead_letter_topic = "t.dlq".into();
    d.refusal = "Message production error: MessageSizeTooLarge".into();
    d
}

async fn rows_at(pool: &PgPool, offset: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM dedup_dead_letters WHERE consumer_group = 'g' AND topic = 't' \
         AND partition = 0 AND \"offset\" = $1",
    )
    .bind(offset)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Issue #57, item 3: an old letter at (g, t, 0, 0), then a different one at the same
/// coordinates (the topic was made again). Both are kept; the same letter written again (a replay
/// after a crash, its attempts and reason changed) is kept once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_letter_at_the_coordinates_of_an_old_one_is_kept_beside_it_and_the_same_one_once(
    pool: PgPool,
) {
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let old = letter(0, "the old topic's letter", 1_700_000_000_000);
    store.keep(&old).await.unwrap();
    let new = letter(0, "the new topic's letter", 1_800_000_000_000);
    store.keep(&new).await.unwrap();
    assert_eq!(
        rows_at(&pool, 0).await,
        2,
        "a different letter at the coordinates of a kept one is kept beside it, not lost"
    );
    let mut again = new.clone();
    again.attempts = 2;
    again.reason = "written again after a crash".into();
    store.keep(&again).await.unwrap();
    store.keep(&old).await.unwrap();
    assert_eq!(rows_at(&pool, 0).await, 2, "the same letter is kept once");
    let mut payloads: Vec<Vec<u8>> = store
        .list("g")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|d| d.payload)
        .collect();
    payloads.sort();
    assert_eq!(
        payloads,
        [&b"the new topic's letter"[..], b"the old topic's letter"]
    );
}

/// What a row holds and how one is addressed: the keep answers whether it wrote, a row names its
/// idempotency key (none for a letter without one), one of two letters at the same coordinates is
/// removed by its digest, and the purge removes only the group's letters older than it is given.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn rows_name_their_key_are_removed_one_by_one_and_purged_by_age(pool: PgPool) {
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let key = IdempotencyKey::new(Scope::new("payments").unwrap(), "evt-1").unwrap();
    let mut keyed = letter(0, "first", 1);
    keyed.idempotency_key = Some(key.clone());
    let keyless = letter(0, "second", 2);
    assert!(store.keep(&keyed).await.unwrap());
    assert!(!store.keep(&keyed).await.unwrap());
    assert!(store.keep(&keyless).await.unwrap());
    let mut other_group = letter(5, "another group's", 3);
    other_group.group = "h".into();
    store.keep(&other_group).await.unwrap();

    let kept = store.list("g").await.unwrap();
    assert_eq!(kept.len(), 2);
    let by_payload = |p: &str| {
        kept.iter()
            .find(|d| d.payload.as_deref() == Some(p.as_bytes()))
            .unwrap()
    };
    let (first, second) = (by_payload("first"), by_payload("second"));
    assert_eq!(first.idempotency_key.as_ref(), Some(&key));
    assert_eq!(second.idempotency_key, None);
    assert_eq!(first.digest, keyed.content_digest());
    assert_ne!(first.digest, second.digest);

    assert!(store.remove("g", "t", 0, 0, &second.digest).await.unwrap());
    assert!(!store.remove("g", "t", 0, 0, &second.digest).await.unwrap());
    let left = store.list("g").await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].payload.as_deref(), Some(&b"first"[..]));

    // One letter of each group kept two days ago, and one of `g` now.
    store.keep(&letter(1, "recent", 4)).await.unwrap();
    sqlx::query(
        "UPDATE dedup_dead_letters SET stored_at = now() - interval '2 days' \
         WHERE \"offset\" IN (0, 5)",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        store.purge("g", Duration::from_secs(86_400)).await.unwrap(),
        1
    );
    let left = store.list("g").await.unwrap();
    assert_eq!(
        left.iter().map(|d| d.offset).collect::<Vec<_>>(),
        [1],
        "the recent one stays"
    );
    assert_eq!(store.list("h").await.unwrap().len(), 1);
}

/// A letter that cannot be kept (a row under its digest holds another content: a digest
/// collision, here made by hand) is an error that retrying does not cure, naming the
/// coordinates; the runner stalls its partition on it, loudly, rather than moving on.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_letter_that_cannot_be_kept_is_an_error(pool: PgPool) {
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let d = letter(3, "mine", 1);
    store.keep(&d).await.unwrap();
    sqlx::query("UPDATE dedup_dead_letters SET payload = 'someone else''s'")
        .execute(&pool)
        .await
        .unwrap();
    let err = store.keep(&d).await.unwrap_err();
    assert!(!err.is_retryable(), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("t/0/3") && message.contains("cannot be kept"),
        "{message}"
    );
}

/// A binary of generation 11 beside this one (a rolling deploy, a rollback): its own statements
/// still insert (the empty digest), meet their own row again, and delete by coordinates; a row it
/// kept is not kept a second time by this binary when it holds the same letter, and a different
/// letter at its coordinates is kept beside it.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_generation_11_binary_still_keeps_reads_and_removes(pool: PgPool) {
    const OLD_KEEP: &str = "INSERT INTO dedup_dead_letters (consumer_group, topic, partition, \
        \"offset\", message_key, payload, header_names, header_values, timestamp_ms, reason, \
        attempts, dead_letter_topic, refusal, stored_at) VALUES ($1, $2, $3, $4, $5, $6, $7, \
        $8, $9, $10, $11, $12, $13, statement_timestamp()) ON CONFLICT DO NOTHING";
    let old_keep = |d: RefusedDeadLetter| {
        let pool = pool.clone();
        async move {
            let names: Vec<Vec<u8>> = d.headers.iter().map(|h| h.0.clone()).collect();
            let values: Vec<Option<Vec<u8>>> = d.headers.iter().map(|h| h.1.clone()).collect();
            sqlx::query(OLD_KEEP)
                .bind(&d.group)
                .bind(&d.topic)
                .bind(d.partition)
                .bind(d.offset)
                .bind(d.message_key.as_deref())
                .bind(d.payload.as_deref())
                .bind(&names)
                .bind(&values)
                .bind(d.timestamp_ms)
                .bind(&d.reason)
                .bind(1_i32)
                .bind(&d.dead_letter_topic)
                .bind(&d.refusal)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected()
        }
    };
    let pg = PgStore::new(pool.clone());
    let store = KeptDeadLetters::new(&pg);
    let d = letter(7, "kept by the old binary", 1);
    assert_eq!(old_keep(d.clone()).await, 1);
    assert_eq!(old_keep(d.clone()).await, 0, "its own row again");
    assert!(
        !store.keep(&d).await.unwrap(),
        "the same letter, kept by the old binary, is not kept twice"
    );
    assert_eq!(rows_at(&pool, 7).await, 1);
    let kept = store.list("g").await.unwrap();
    assert!(kept[0].digest.is_empty(), "{:?}", kept[0].digest);
    assert!(store.keep(&letter(7, "a new letter", 2)).await.unwrap());
    assert_eq!(rows_at(&pool, 7).await, 2);
    // The old binary lists by group (the columns it names) and deletes by coordinates.
    let listed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT topic, partition, \"offset\", message_key, payload, \
         header_names, header_values, timestamp_ms, reason, attempts, dead_letter_topic, \
         refusal, stored_at FROM dedup_dead_letters WHERE consumer_group = 'g') l",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(listed, 2);
    let removed = sqlx::query(
        "DELETE FROM dedup_dead_letters WHERE consumer_group = $1 AND topic = $2 \
         AND partition = $3 AND \"offset\" = $4",
    )
    .bind("g")
    .bind("t")
    .bind(0_i32)
    .bind(7_i64)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(removed.rows_affected(), 2);
}
