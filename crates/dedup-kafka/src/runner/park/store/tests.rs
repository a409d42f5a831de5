//! Parked messages in Postgres (`dedup_parked`): parking at most once, each key's head in offset
//! order, the epoch that fences a revoked owner, holds, operator releases and drops.
//!
//! Parked once and read back whole; each key's head in offset order, deferred, released, taken
//! and settled until the key is free; a revoked owner fenced from parking, taking, deferring and
//! settling, and a head its dead run took picked at once by the next owner; the purge keeping a
//! parked message's dedup record, in both layouts of the records. Parking through the runner is
//! `tests/it/kafka/parked.rs`; the operator commands are tested in `crates/dedup-cli/tests/cli.rs`.
//!
//! Against a real Postgres (`DATABASE_URL`, as every `#[sqlx::test]`): `scripts/test` starts one.

use std::collections::HashMap;
use std::time::Duration;

use dedup_pg::PgStore;
use sqlx::PgPool;

use super::{
    HeadSettled, HeadTaken, ParkEpoch, ParkOutcome, ParkedFilter, ParkedMessage, ParkedPartition,
    ParkedQueue,
};

/// `store.parked()`: the queue of the store's database.
trait Queue {
    fn parked(&self) -> ParkedQueue<'_>;
}

impl Queue for PgStore {
    fn parked(&self) -> ParkedQueue<'_> {
        ParkedQueue::new(self)
    }
}

fn msg(offset: i64, key: &str, error: &str) -> ParkedMessage {
    ParkedMessage::new(offset, Some(key.as_bytes().to_vec()), error, 3).with_message(
        Some(key.as_bytes().to_vec()),
        Some(format!("payload {offset}").into_bytes()),
        vec![
            (
                "idempotency-key".to_owned(),
                Some(format!("evt-{offset}").into_bytes()),
            ),
            ("empty".to_owned(), None),
        ],
        Some(1_795_000_000_000 + offset),
    )
}

fn part() -> ParkedPartition {
    ParkedPartition::new("g", "orders", 0)
}

fn owned() -> Vec<(String, i32)> {
    vec![("orders".to_owned(), 0)]
}

/// Heads due now: (offset, key).
async fn heads(store: &PgStore) -> Vec<(i64, String)> {
    store
        .parked()
        .due_heads("g", &owned(), 100)
        .await
        .unwrap()
        .into_iter()
        .map(|h| {
            (
                h.message.offset,
                String::from_utf8(h.message.ordering_key.unwrap_or_default()).unwrap(),
            )
        })
        .collect()
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_message_is_parked_once_and_read_back_whole(pool: PgPool) {
    let store = PgStore::new(pool);
    let (epoch, keys) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    assert_eq!(epoch, ParkEpoch(1));
    assert!(keys.is_empty());
    let m = msg(7, "acct-1", "down");
    assert_eq!(
        store
            .parked()
            .park(&part(), epoch, &m, Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Parked
    );
    // A replay after a crash parks nothing twice.
    assert_eq!(
        store
            .parked()
            .park(&part(), epoch, &m, Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::AlreadyParked
    );
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message, m);
    assert_eq!((got[0].topic.as_str(), got[0].partition), ("orders", 0));
    // Another group, another partition: nothing.
    assert!(
        store
            .parked()
            .due_heads("other", &owned(), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .parked()
            .due_heads("g", &[("orders".to_owned(), 1)], 10)
            .await
            .unwrap()
            .is_empty()
    );
    // A new owner's barrier counts it.
    let (epoch2, keys) = store.parked().acquire_parked(&part(), "b#1").await.unwrap();
    assert_eq!(epoch2, ParkEpoch(2));
    assert_eq!(keys, HashMap::from([(Some(b"acct-1".to_vec()), 1)]));
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn each_key_runs_its_head_in_offset_order_and_is_free_when_empty(pool: PgPool) {
    let store = PgStore::new(pool);
    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    // acct-1: 3, 5, 9 (parked behind the head); acct-2: 4; keyless: 6.
    for (offset, key) in [(3, "acct-1"), (4, "acct-2"), (5, "acct-1"), (9, "acct-1")] {
        store
            .parked()
            .park(&part(), e, &msg(offset, key, "down"), Duration::ZERO)
            .await
            .unwrap();
    }
    let keyless = ParkedMessage::new(6, None, "down", 1);
    store
        .parked()
        .park(&part(), e, &keyless, Duration::ZERO)
        .await
        .unwrap();
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    let offsets: Vec<i64> = got.iter().map(|h| h.message.offset).collect();
    assert_eq!(offsets, vec![3, 4, 6]);
    assert_eq!(got[2].message.ordering_key, None);

    // The head fails again: not due until its backoff passes; the other keys are.
    assert!(
        store
            .parked()
            .defer_head(&part(), e, 3, "still down", 4, Duration::from_secs(3600))
            .await
            .unwrap()
    );
    assert_eq!(heads_offsets(&store).await, vec![4, 6]);
    // The keyless queue is an operator's to release too.
    assert_eq!(
        store
            .parked()
            .unpark("g", None, &ParkedFilter::all())
            .await
            .unwrap(),
        1
    );
    let summary = store
        .parked()
        .parked_summary("g", &ParkedFilter::all())
        .await
        .unwrap();
    let acct1 = summary
        .iter()
        .find(|s| s.ordering_key.as_deref() == Some(b"acct-1".as_slice()))
        .unwrap();
    assert_eq!(
        (
            acct1.messages,
            acct1.head_attempts,
            acct1.head_error.as_str()
        ),
        (3, 4, "still down")
    );
    assert!(acct1.head_due > acct1.oldest);

    // An operator makes it due now; it runs and settles; the next of the key is the head.
    assert_eq!(
        store
            .parked()
            .unpark("g", Some(b"acct-1"), &ParkedFilter::all())
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        store
            .parked()
            .take_head(&part(), e, 3, Duration::from_secs(60))
            .await
            .unwrap(),
        HeadTaken::Taken
    );
    // Taken: not picked again while it runs.
    assert_eq!(heads_offsets(&store).await, vec![4, 6]);
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 3, false)
            .await
            .unwrap(),
        HeadSettled::Removed
    );
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 3, false)
            .await
            .unwrap(),
        HeadSettled::Gone
    );
    assert_eq!(heads_offsets(&store).await, vec![4, 5, 6]);
    for o in [5, 9, 4, 6] {
        assert_eq!(
            store
                .parked()
                .settle_head(&part(), e, o, false)
                .await
                .unwrap(),
            HeadSettled::Removed
        );
    }
    assert!(heads(&store).await.is_empty());
    let (_, keys) = store.parked().acquire_parked(&part(), "a#2").await.unwrap();
    assert!(keys.is_empty(), "every key is free: {keys:?}");
}

async fn heads_offsets(store: &PgStore) -> Vec<i64> {
    heads(store).await.into_iter().map(|h| h.0).collect()
}

/// A partition's new owner bumps the epoch: the revoked owner can neither park into it nor drive
/// its keys, and changes nothing trying.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_revoked_owner_can_neither_park_nor_drive(pool: PgPool) {
    let store = PgStore::new(pool);
    let (old, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    store
        .parked()
        .park(&part(), old, &msg(1, "acct-1", "down"), Duration::ZERO)
        .await
        .unwrap();
    // The old owner takes the head to run it, and dies: its owner does not pick it again for
    // the run's bound, a new owner does at once.
    assert_eq!(
        store
            .parked()
            .take_head(&part(), old, 1, Duration::from_secs(600))
            .await
            .unwrap(),
        HeadTaken::Taken
    );
    assert!(heads(&store).await.is_empty());
    let (new, keys) = store.parked().acquire_parked(&part(), "b#1").await.unwrap();
    assert!(new > old);
    assert_eq!(keys.len(), 1);
    assert_eq!(heads_offsets(&store).await, vec![1]);
    // An acquire whose ownership ended while it waited for a connection bumps nothing: the new
    // owner is not fenced out by a late bump.
    assert!(
        store
            .parked()
            .acquire_parked_while(&part(), "a#late", &|| false)
            .await
            .unwrap()
            .is_none()
    );

    assert_eq!(
        store
            .parked()
            .park(&part(), old, &msg(2, "acct-1", "down"), Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Fenced
    );
    assert_eq!(
        store
            .parked()
            .take_head(&part(), old, 1, Duration::from_secs(60))
            .await
            .unwrap(),
        HeadTaken::Fenced
    );
    assert!(
        !store
            .parked()
            .defer_head(&part(), old, 1, "late", 9, Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), old, 1, true)
            .await
            .unwrap(),
        HeadSettled::Fenced
    );
    // Untouched: still due, attempts as parked, and only the one message.
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message, msg(1, "acct-1", "down"));
    // The new owner drives it.
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), new, 1, false)
            .await
            .unwrap(),
        HeadSettled::Removed
    );
    // A partition never owned fences everyone.
    let other = ParkedPartition::new("g", "orders", 5);
    assert_eq!(
        store
            .parked()
            .park(&other, new, &msg(1, "acct-1", "down"), Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Fenced
    );
}

/// Under the hold policy a dead-lettered head holds the key's other messages for an operator;
/// `unpark` releases them. `drop` hands every message of a key to its owner to dead-letter,
/// whatever their due time.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_held_key_waits_for_an_operator_and_a_dropped_one_is_handed_back(pool: PgPool) {
    let store = PgStore::new(pool);
    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    for (offset, key) in [(1, "acct-1"), (2, "acct-1"), (3, "acct-2"), (4, "acct-2")] {
        store
            .parked()
            .park(&part(), e, &msg(offset, key, "down"), Duration::ZERO)
            .await
            .unwrap();
    }
    // acct-1's head was dead-lettered under the hold policy: it stays as the key's held marker,
    // and the key's other message is held with it.
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 1, true)
            .await
            .unwrap(),
        HeadSettled::Held
    );
    assert_eq!(heads_offsets(&store).await, vec![3]);
    let summary = store
        .parked()
        .parked_summary("g", &ParkedFilter::all())
        .await
        .unwrap();
    assert!(summary.iter().any(|s| s.held && s.messages == 2));
    // Released: the marker is the head again (the owner removes it without running it), then
    // the message behind it.
    assert_eq!(
        store
            .parked()
            .unpark("g", Some(b"acct-1"), &ParkedFilter::all())
            .await
            .unwrap(),
        2
    );
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    assert_eq!(
        got.iter()
            .map(|h| (h.message.offset, h.gave_up))
            .collect::<Vec<_>>(),
        vec![(1, true), (3, false)]
    );
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 1, false)
            .await
            .unwrap(),
        HeadSettled::Removed
    );
    assert_eq!(heads_offsets(&store).await, vec![2, 3]);

    // acct-2's head is deferred an hour; a drop makes both of its messages come back, dropped.
    assert!(
        store
            .parked()
            .defer_head(&part(), e, 3, "down", 5, Duration::from_secs(3600))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .parked()
            .drop_parked("g", Some(b"acct-2"), &ParkedFilter::all())
            .await
            .unwrap(),
        2
    );
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    let dropped: Vec<(i64, bool)> = got.iter().map(|h| (h.message.offset, h.dropped)).collect();
    assert_eq!(dropped, vec![(2, false), (3, true)]);
    assert_eq!(
        store
            .parked()
            .unpark("g", Some(b"nobody"), &ParkedFilter::all())
            .await
            .unwrap(),
        0
    );

    let gauges = store.parked().parked_gauges("g", &owned()).await.unwrap();
    assert_eq!((gauges.keys, gauges.messages), (2, 3));
}

/// A record past its retention is purged, unless a parked message carries its key: a re-run
/// after a long wait must still find the result stored before, or the effect would run twice.
/// Once the message settles, the record goes with the next purge.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_parked_messages_dedup_record_outlives_its_retention(pool: PgPool) {
    use dedup_core::{Policy, Store};

    let store = PgStore::new(pool);
    let gone = Policy::default().with_retention(Duration::ZERO);
    for name in ["evt-parked", "evt-free"] {
        let k = support::key(name);
        let lease = support::acquired(
            store
                .claim(&support::req(&k, "w#1").with_policy(gone))
                .await
                .unwrap(),
        );
        store.complete(&lease, b"done").await.unwrap();
    }
    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    let m = msg(1, "acct-1", "down").with_dedup_key("test", b"evt-parked".to_vec());
    store
        .parked()
        .park(&part(), e, &m, Duration::ZERO)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;

    assert_eq!(store.purge(10).await.unwrap(), 1, "only the free one");
    let parked_key = support::key("evt-parked");
    assert!(store.get(&parked_key).await.unwrap().is_some());
    assert_eq!(
        store.parked().due_heads("g", &owned(), 10).await.unwrap()[0]
            .message
            .dedup_key,
        Some(("test".to_owned(), b"evt-parked".to_vec()))
    );
    store
        .parked()
        .settle_head(&part(), e, 1, false)
        .await
        .unwrap();
    assert_eq!(store.purge(10).await.unwrap(), 1);
    assert!(store.get(&parked_key).await.unwrap().is_none());
}

/// The record's `expires_at` as text ('infinity' while pinned).
async fn expires_of(pool: &PgPool, name: &str) -> String {
    sqlx::query_scalar(
        "SELECT expires_at::text FROM dedup_records WHERE scope = 'test' AND key = $1",
    )
    .bind(name.as_bytes())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A message parked longer than the retention must not run its effect again: the record it
/// names is pinned while it is named, so a claim past the retention still answers the stored
/// result (a completed X), and a failing head's attempts do not reset. Once the message
/// settles, the record lives its span again from then, and then expires as any other.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_record_named_by_a_parked_message_is_never_taken_over_as_expired(pool: PgPool) {
    a_record_named_by_a_parked_message_is_never_taken_over_as_expired_in(pool).await;
}

/// The same over `dedup_records` partitioned by `kt` (`support::partition_records`).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_record_named_by_a_parked_message_is_never_taken_over_as_expired_partitioned(
    pool: PgPool,
) {
    support::partition_records(&pool).await;
    a_record_named_by_a_parked_message_is_never_taken_over_as_expired_in(pool.clone()).await;
    assert_eq!(support::misplaced_records(&pool).await, 0);
}

async fn a_record_named_by_a_parked_message_is_never_taken_over_as_expired_in(pool: PgPool) {
    use dedup_core::{ClaimOutcome, Policy, Store};

    let store = PgStore::new(pool.clone());
    let short = Policy::default()
        .with_retention(Duration::from_millis(800))
        .with_lease(Duration::from_millis(500));
    // X completed in place; a resent copy of X parks behind its key.
    let x = support::key("evt-x");
    let lease = support::acquired(
        store
            .claim(&support::req(&x, "w#1").with_policy(short))
            .await
            .unwrap(),
    );
    store.complete(&lease, b"x done").await.unwrap();
    // Y failed once (retryably) and is parked as its key's head.
    let y = support::key("evt-y");
    let lease = support::acquired(
        store
            .claim(&support::req(&y, "w#1").with_policy(short))
            .await
            .unwrap(),
    );
    store.fail_retryable(&lease, "ledger down").await.unwrap();

    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    let park = |offset: i64, name: &str| {
        msg(offset, "acct-1", "down").with_dedup_key("test", name.as_bytes().to_vec())
    };
    for (offset, name) in [(1, "evt-y"), (2, "evt-x")] {
        assert_eq!(
            store
                .parked()
                .park(&part(), e, &park(offset, name), Duration::ZERO)
                .await
                .unwrap(),
            ParkOutcome::Parked
        );
    }
    assert_eq!(expires_of(&pool, "evt-x").await, "infinity");
    assert_eq!(expires_of(&pool, "evt-y").await, "infinity");

    // Far past the retention (and the purge runs meanwhile).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    store.purge(100).await.unwrap();
    // The head Y runs again: its attempts go on from 1, they do not start over.
    let lease = support::acquired(
        store
            .claim(&support::req(&y, "w#2").with_policy(short))
            .await
            .unwrap(),
    );
    assert_eq!(
        lease.attempts, 2,
        "the failing head's attempts did not reset"
    );
    assert_eq!(
        expires_of(&pool, "evt-y").await,
        "infinity",
        "a run keeps the pin"
    );
    store
        .fail_retryable(&lease, "ledger still down")
        .await
        .unwrap();
    assert!(
        store
            .parked()
            .defer_head(&part(), e, 1, "ledger still down", 2, Duration::ZERO)
            .await
            .unwrap()
    );
    // The copy of X reaches the head: the claim answers X's stored result, it does not take X
    // over as fresh.
    match store
        .claim(&support::req(&x, "w#2").with_policy(short))
        .await
        .unwrap()
    {
        ClaimOutcome::Completed { result, .. } => assert_eq!(&result[..], b"x done"),
        other => panic!("a parked message's record was taken over: {other:?}"),
    }

    // Settled, each record gets its span back from now, and then expires as any other.
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 2, false)
            .await
            .unwrap(),
        HeadSettled::Removed
    );
    assert_eq!(
        store
            .parked()
            .settle_head(&part(), e, 1, false)
            .await
            .unwrap(),
        HeadSettled::Removed
    );
    for name in ["evt-x", "evt-y"] {
        assert_ne!(expires_of(&pool, name).await, "infinity", "{name} unpinned");
    }
    let pinned: Option<sqlx::postgres::types::PgInterval> = sqlx::query_scalar(
        "SELECT pinned_ttl FROM dedup_records WHERE scope = 'test' AND key = 'evt-x'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(pinned.is_none());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let lease = support::acquired(
        store
            .claim(&support::req(&x, "w#3").with_policy(short))
            .await
            .unwrap(),
    );
    assert_eq!(
        lease.attempts, 1,
        "past its span after settling, X is fresh again"
    );
}

/// Two parked messages naming one record: it stays pinned until the last of them settles.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_record_stays_pinned_until_its_last_parked_message_settles(pool: PgPool) {
    a_record_stays_pinned_until_its_last_parked_message_settles_in(pool).await;
}

/// The same over `dedup_records` partitioned by `kt` (`support::partition_records`).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_record_stays_pinned_until_its_last_parked_message_settles_partitioned(pool: PgPool) {
    support::partition_records(&pool).await;
    a_record_stays_pinned_until_its_last_parked_message_settles_in(pool.clone()).await;
    assert_eq!(support::misplaced_records(&pool).await, 0);
}

async fn a_record_stays_pinned_until_its_last_parked_message_settles_in(pool: PgPool) {
    use dedup_core::Store;

    let store = PgStore::new(pool.clone());
    let x = support::key("evt-x");
    let lease = support::acquired(store.claim(&support::req(&x, "w#1")).await.unwrap());
    store.complete(&lease, b"x done").await.unwrap();
    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    for offset in [1, 2] {
        let m = msg(offset, "acct-1", "down").with_dedup_key("test", b"evt-x".to_vec());
        store
            .parked()
            .park(&part(), e, &m, Duration::ZERO)
            .await
            .unwrap();
    }
    store
        .parked()
        .settle_head(&part(), e, 1, false)
        .await
        .unwrap();
    assert_eq!(
        expires_of(&pool, "evt-x").await,
        "infinity",
        "still named by offset 2"
    );
    store
        .parked()
        .settle_head(&part(), e, 2, false)
        .await
        .unwrap();
    assert_ne!(expires_of(&pool, "evt-x").await, "infinity");
}

/// Text Postgres refuses is made safe where it is written: a NUL in a failure (finish and
/// exhaust) or a parked message's error is recorded, not refused; an ordering key far past a
/// btree entry's limit parks and is found again by an operator; a header name Postgres cannot
/// hold is refused for good (not a passing error to retry), naming nothing it could not store.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn text_postgres_refuses_is_made_safe_or_refused_for_good(pool: PgPool) {
    use dedup_core::{Policy, Store};

    let store = PgStore::new(pool.clone());
    let k = support::key("evt-nul");
    let lease = support::acquired(store.claim(&support::req(&k, "w#1")).await.unwrap());
    store
        .fail_permanent(&lease, "the payload \0 echoed back")
        .await
        .unwrap();
    let failure: String = sqlx::query_scalar(
        "SELECT failure FROM dedup_records WHERE scope = 'test' AND key = 'evt-nul'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(failure, "the payload \u{FFFD} echoed back");
    // Out of attempts, with a NUL in the last error: the exhaust statement records it too.
    let once = Policy::default()
        .with_max_attempts(1)
        .with_lease(Duration::from_millis(1));
    let k2 = support::key("evt-nul-2");
    let lease = support::acquired(
        store
            .claim(&support::req(&k2, "w#1").with_policy(once))
            .await
            .unwrap(),
    );
    store.fail_retryable(&lease, "down \0 again").await.unwrap();
    let out = store
        .claim(&support::req(&k2, "w#2").with_policy(once))
        .await
        .unwrap();
    assert!(
        matches!(out, dedup_core::ClaimOutcome::Failed { .. }),
        "{out:?}"
    );

    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    // An error with a NUL, and 64 KiB of it: stored, cut and made safe.
    let long_error = format!("bad \0 {}", "x".repeat(65_536));
    let m = msg(1, "acct-1", &long_error);
    assert_eq!(
        store
            .parked()
            .park(&part(), e, &m, Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Parked
    );
    // An ordering key of 8 KB that does not compress.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let long_key: Vec<u8> = (0..8192)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    let mut m = msg(2, "x", "down");
    m.ordering_key = Some(long_key.clone());
    assert_eq!(
        store
            .parked()
            .park(&part(), e, &m, Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Parked
    );
    let summary = store
        .parked()
        .parked_summary("g", &ParkedFilter::all())
        .await
        .unwrap();
    assert!(
        summary
            .iter()
            .any(|s| s.ordering_key.as_deref() == Some(&long_key[..]))
    );
    assert!(
        summary
            .iter()
            .any(|s| s.head_error.len() <= dedup_pg::MAX_TEXT_BYTES
                && s.head_error.starts_with("bad \u{FFFD} "))
    );
    assert_eq!(
        store
            .parked()
            .drop_parked("g", Some(&long_key), &ParkedFilter::all())
            .await
            .unwrap(),
        1
    );
    // A header name with a NUL: refused for good, not retried as a passing error.
    let mut m = msg(3, "acct-3", "down");
    m.headers
        .push(("bad\0name".to_owned(), Some(b"v".to_vec())));
    let err = store
        .parked()
        .park(&part(), e, &m, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(!err.is_retryable() && !err.is_outcome_unknown(), "{err:?}");
}

/// A held marker (a message dead-lettered in place under the hold policy) holds its key: it is
/// never a due head, the key's later messages wait behind it, and once an operator releases the
/// key it comes back as given up (removed without running). Operators' commands are filtered
/// by topic and partition.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_held_marker_holds_its_key_until_an_operator_releases_it(pool: PgPool) {
    let store = PgStore::new(pool);
    let (e, keys) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    assert!(keys.is_empty());
    let marker = msg(1, "acct-1", "permanent").into_held_marker();
    assert_eq!(
        store
            .parked()
            .park(&part(), e, &marker, Duration::ZERO)
            .await
            .unwrap(),
        ParkOutcome::Parked
    );
    store
        .parked()
        .park(&part(), e, &msg(2, "acct-1", "behind"), Duration::ZERO)
        .await
        .unwrap();
    assert!(heads(&store).await.is_empty(), "a held key has no due head");
    let summary = store
        .parked()
        .parked_summary("g", &ParkedFilter::all())
        .await
        .unwrap();
    assert!(summary[0].held && summary[0].messages == 2);
    let other = ParkedFilter::all().topic("payments");
    assert!(
        store
            .parked()
            .parked_summary("g", &other)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store
            .parked()
            .unpark("g", Some(b"acct-1"), &other)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store
            .parked()
            .unpark(
                "g",
                Some(b"acct-1"),
                &ParkedFilter::all().topic("orders").partition(1)
            )
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store
            .parked()
            .unpark(
                "g",
                Some(b"acct-1"),
                &ParkedFilter::all().topic("orders").partition(0)
            )
            .await
            .unwrap(),
        2
    );
    let got = store.parked().due_heads("g", &owned(), 10).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message.offset, 1);
    assert!(got[0].gave_up, "the marker is removed without running");
}

/// A park of a message naming a record commits while the settle of the record's last other
/// naming row waits for the record's row lock: the settle's check for other rows reads its own
/// snapshot (without the new row), and must still leave the record pinned.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_park_that_commits_while_a_settle_waits_leaves_the_record_pinned(pool: PgPool) {
    a_park_that_commits_while_a_settle_waits_leaves_the_record_pinned_in(pool).await;
}

/// The same over `dedup_records` partitioned by `kt` (`support::partition_records`).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_park_that_commits_while_a_settle_waits_leaves_the_record_pinned_partitioned(
    pool: PgPool,
) {
    support::partition_records(&pool).await;
    a_park_that_commits_while_a_settle_waits_leaves_the_record_pinned_in(pool.clone()).await;
    assert_eq!(support::misplaced_records(&pool).await, 0);
}

async fn a_park_that_commits_while_a_settle_waits_leaves_the_record_pinned_in(pool: PgPool) {
    use dedup_core::Store;

    let store = PgStore::new(pool.clone());
    let x = support::key("evt-x");
    let lease = support::acquired(store.claim(&support::req(&x, "w#1")).await.unwrap());
    store.complete(&lease, b"x done").await.unwrap();
    let (e, _) = store.parked().acquire_parked(&part(), "a#1").await.unwrap();
    let m = msg(1, "acct-1", "down").with_dedup_key("test", b"evt-x".to_vec());
    store
        .parked()
        .park(&part(), e, &m, Duration::ZERO)
        .await
        .unwrap();
    // A second park of a copy of X, as PARK_SQL writes it (the pin, then the row), held open.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE dedup_records SET expires_at = 'infinity' WHERE scope = 'test' AND key = 'evt-x'",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(concat!(
        "INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key,",
        " ordering_key, message_key, payload, header_names, header_values, timestamp_ms, error,",
        " attempts, parked_at, due_at, dedup_scope, dedup_key)",
        " SELECT consumer_group, topic, partition, 9, has_key, ordering_key, message_key, payload,",
        " header_names, header_values, timestamp_ms, error, attempts, parked_at, due_at,",
        " dedup_scope, dedup_key FROM dedup_parked WHERE \"offset\" = 1",
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let settling = {
        let store = store.clone();
        tokio::spawn(async move { store.parked().settle_head(&part(), e, 1, false).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !settling.is_finished(),
        "the settle waits for the record's row lock"
    );
    tx.commit().await.unwrap();
    assert_eq!(settling.await.unwrap().unwrap(), HeadSettled::Removed);
    assert_eq!(
        expires_of(&pool, "evt-x").await,
        "infinity",
        "offset 9 names the record: it stays pinned"
    );
}

/// What the tests crate's `support` module has, for these tests.
mod support {
    use dedup_core::{ClaimOutcome, ClaimRequest, IdempotencyKey, Lease, OwnerId, Scope};
    use sqlx::PgPool;

    pub(super) fn key(name: &str) -> IdempotencyKey {
        IdempotencyKey::new(Scope::new("test").unwrap(), name).unwrap()
    }

    pub(super) fn req(key: &IdempotencyKey, owner: &str) -> ClaimRequest {
        ClaimRequest::new(key.clone(), OwnerId::new(owner))
    }

    pub(super) fn acquired(outcome: ClaimOutcome) -> Lease {
        match outcome {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    /// `dedup_records` partitioned by a stand-in key time (a hash of the key's bytes, so that the
    /// keys here spread over three day partitions and the untimed one), with `kt` left without a
    /// default: a statement that writes a record without naming `kt` fails, and one that names
    /// another `kt` than `dedup_kt` gives is counted by [`misplaced_records`]. The tests crate's
    /// `support/partitioned.rs` documents the layout.
    pub(super) async fn partition_records(pool: &PgPool) {
        let mut tx = pool.begin().await.unwrap();
        let mut steps: Vec<String> = [
            "LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE",
            "ALTER TABLE dedup_records RENAME TO dedup_records_untimed",
            "ALTER INDEX dedup_records_pkey RENAME TO dedup_records_untimed_pkey",
            "ALTER INDEX dedup_records_expires_at_idx RENAME TO dedup_records_untimed_expires_at_idx",
            "ALTER INDEX dedup_records_live_owner_idx RENAME TO dedup_records_untimed_live_owner_idx",
            "CREATE TABLE dedup_records (LIKE dedup_records_untimed INCLUDING DEFAULTS \
             INCLUDING CONSTRAINTS) PARTITION BY RANGE (kt)",
            "ALTER TABLE dedup_records_untimed ADD CONSTRAINT dedup_records_untimed_kt \
             CHECK (kt < '1970-01-01')",
            "ALTER TABLE dedup_records ATTACH PARTITION dedup_records_untimed \
             FOR VALUES FROM (MINVALUE) TO ('1970-01-01')",
        ]
        .map(String::from)
        .to_vec();
        for (name, from, to) in [
            ("dedup_records_d0", "2026-01-01", "2026-01-03"),
            ("dedup_records_d1", "2026-01-03", "2026-01-05"),
            ("dedup_records_d2", "2026-01-05", "2026-01-07"),
        ] {
            steps.push(format!(
                "CREATE TABLE {name} (LIKE dedup_records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
            ));
            steps.push(format!("ALTER TABLE {name} ADD PRIMARY KEY (scope, key)"));
            steps.push(format!(
                "ALTER TABLE dedup_records ATTACH PARTITION {name} FOR VALUES FROM ('{from}') TO ('{to}')"
            ));
        }
        steps.extend(
            [
                "CREATE INDEX dedup_records_expires_at_idx ON dedup_records (expires_at)",
                "CREATE INDEX dedup_records_live_owner_idx ON dedup_records \
                 (owner text_pattern_ops) WHERE state = 'in_progress'",
                "CREATE OR REPLACE FUNCTION dedup_kt(p_key bytea) RETURNS date \
                 LANGUAGE sql IMMUTABLE PARALLEL SAFE \
                 RETURN CASE WHEN (hashtext(encode(p_key, 'hex')) & 7) < 6 \
                 THEN date '2026-01-01' + (hashtext(encode(p_key, 'hex')) & 7) \
                 ELSE '-infinity'::date END",
                "ALTER TABLE dedup_records ALTER COLUMN kt DROP DEFAULT",
            ]
            .map(String::from),
        );
        for step in steps {
            // Fixed identifiers and literals of this file only.
            sqlx::query(sqlx::AssertSqlSafe(step.clone()))
                .execute(&mut *tx)
                .await
                .unwrap_or_else(|e| panic!("{step}: {e}"));
        }
        tx.commit().await.unwrap();
    }

    /// Records whose `kt` is not what `dedup_kt` says of their key.
    pub(super) async fn misplaced_records(pool: &PgPool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE kt <> dedup_kt(key)")
            .fetch_one(pool)
            .await
            .unwrap()
    }
}
