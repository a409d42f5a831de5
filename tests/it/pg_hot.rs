//! A lease-mode completion is a HOT update (migration 20261130000001, docs/ARCHITECTURE.md
//! invariant 32): it changes no indexed column, so Postgres writes the completed row version on
//! the same page without a new index entry. What that asks of the layout, tested here:
//! - the completion keeps the record's `expires_at` when that already covers the retention from
//!   now, and moves it when it does not (a lease that ran past its end);
//! - a completed record reads with no lease end, though the row keeps it;
//! - adoption still finds live leases through an index, not a scan, with completed records
//!   (which keep a lease end) beside them, and leaves those alone.
//!
//! Counters are read after the store's pool is closed: a backend reports its counts when it
//! exits.

use std::time::Duration;

use bytes::Bytes;
use dedup_core::{InstanceId, Lease, Record, State, Store, Timestamp};
use dedup_pg::PgStore;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::time::sleep;

use crate::support::{acquired, key, ms, req, short_lease};

/// A pool of its own for the store, so that closing it reports its counts.
async fn own_pool(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

/// (updates, HOT updates) of dedup_records, over every session.
async fn updates(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'dedup_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// (sequential scans of dedup_records, scans of the lease-end index).
async fn scans(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT t.seq_scan, i.idx_scan FROM pg_stat_user_tables t \
         JOIN pg_stat_user_indexes i ON i.relid = t.relid \
         WHERE t.relname = 'dedup_records' AND i.indexrelname = 'dedup_records_lease_idx'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn record(store: &PgStore, lease: &Lease) -> Record {
    store.get(&lease.key).await.unwrap().unwrap()
}

/// Ten leases completed, five one by one and five in a batch: every completion is a HOT update,
/// each keeps the expiry its claim set (the lease's end plus the retention, which covers the
/// retention from the completion), and each completed record reads with no lease end.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn completions_within_their_lease_are_hot_and_keep_the_expiry(pool: PgPool) {
    let work = own_pool(&pool).await;
    let store = PgStore::new(work.clone());
    let retention = Duration::from_secs(3600);
    let policy = short_lease(60_000).with_retention(retention);
    let mut leases = Vec::new();
    for i in 0..10 {
        let k = key(format!("hot-{i}"));
        leases.push(acquired(
            store
                .claim(&req(&k, "a").with_policy(policy))
                .await
                .unwrap(),
        ));
    }
    let mut claimed = Vec::new();
    for lease in &leases {
        claimed.push(record(&store, lease).await);
    }
    let before = updates(&pool).await;
    for lease in &leases[..5] {
        store.complete(lease, b"done").await.unwrap();
    }
    let items: Vec<(Lease, Bytes)> = leases[5..]
        .iter()
        .map(|l| (l.clone(), Bytes::from_static(b"done")))
        .collect();
    for r in store.complete_batch(&items).await {
        r.unwrap();
    }
    for (lease, at_claim) in leases.iter().zip(&claimed) {
        let done = record(&store, lease).await;
        assert_eq!(done.state, State::Completed);
        assert_eq!(done.result.as_deref(), Some(&b"done"[..]));
        assert_eq!(done.lease_until, None, "a completed record has no lease");
        assert_eq!(
            done.expires_at, at_claim.expires_at,
            "a completion within its lease keeps the claim's expiry"
        );
        assert!(
            done.expires_at >= done.updated_at.plus(retention),
            "kept at least the retention after the completion: {done:?}"
        );
    }
    work.close().await;

    let mut after = updates(&pool).await;
    for _ in 0..100 {
        if after.0 - before.0 >= 10 {
            break;
        }
        sleep(ms(100)).await;
        after = updates(&pool).await;
    }
    assert_eq!(
        after.0 - before.0,
        10,
        "ten completions: {before:?} -> {after:?}"
    );
    assert_eq!(
        after.1 - before.1,
        10,
        "every completion is a HOT update: {before:?} -> {after:?}"
    );
}

/// A lease that ran past its end (nobody took it over) completes with its expiry moved to the
/// retention from the completion, one by one and in a batch: the record is never kept less than
/// its retention after it completed.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_completion_after_its_lease_ended_keeps_the_retention_from_now(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let retention = Duration::from_secs(2);
    let policy = short_lease(200).with_retention(retention);
    let one = acquired(
        store
            .claim(&req(&key("late-1"), "a").with_policy(policy))
            .await
            .unwrap(),
    );
    let two = acquired(
        store
            .claim(&req(&key("late-2"), "a").with_policy(policy))
            .await
            .unwrap(),
    );
    let claimed = record(&store, &one).await.expires_at;
    // Past the lease's end plus most of the retention: the claim's expiry no longer covers it.
    sleep(ms(1_800)).await;
    store.complete(&one, b"late").await.unwrap();
    for r in store
        .complete_batch(&[(two.clone(), Bytes::from_static(b"late"))])
        .await
    {
        r.unwrap();
    }
    for lease in [&one, &two] {
        let done = record(&store, lease).await;
        assert_eq!(done.state, State::Completed);
        assert!(done.expires_at > claimed, "{done:?}");
        assert!(
            done.expires_at >= done.updated_at.plus(retention),
            "kept the retention from the completion: {done:?}"
        );
        assert!(done.expires_at > Timestamp::now(), "{done:?}");
    }
}

/// An identity's earlier incarnation left one live lease and one record it completed a moment ago
/// (whose row keeps a lease end in the future), among 5,000 completed records of transaction
/// mode's kind (no lease end). Adoption ends the live lease, leaves the completed record as it
/// was, and finds them through the lease-end index: no sequential scan of the table.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn adoption_finds_live_leases_by_their_end_and_leaves_completed_records(pool: PgPool) {
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, owner, token, attempts, result, \
         created_at, updated_at, expires_at) \
         SELECT 'test', convert_to('done-' || i, 'UTF8'), 'completed', 'tx', \
         nextval('dedup_token_seq'), 1, '\\x00', now(), now(), now() + interval '1 day' \
         FROM generate_series(1, 5000) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE dedup_records")
        .execute(&pool)
        .await
        .unwrap();

    let work = own_pool(&pool).await;
    let store = PgStore::new(work.clone());
    let policy = short_lease(600_000);
    let live = acquired(
        store
            .claim(&req(&key("live"), "node-h/old#1").with_policy(policy))
            .await
            .unwrap(),
    );
    let finished = acquired(
        store
            .claim(&req(&key("finished"), "node-h/old#2").with_policy(policy))
            .await
            .unwrap(),
    );
    store.complete(&finished, b"kept").await.unwrap();
    let completed = record(&store, &finished).await;
    let before = scans(&pool).await;

    let adoption = store
        .adopt(&InstanceId::new("node-h").unwrap(), "node-h/new")
        .await
        .unwrap();
    assert_eq!(adoption.adopted(), 1, "{adoption:?}");
    let ended = record(&store, &live).await;
    assert_eq!(ended.state, State::InProgress);
    assert!(
        ended.lease_until.unwrap() <= Timestamp::now(),
        "the live lease was ended: {ended:?}"
    );
    assert_eq!(
        record(&store, &finished).await,
        completed,
        "a completed record is not adopted"
    );
    work.close().await;

    let mut after = scans(&pool).await;
    for _ in 0..100 {
        if after.1 > before.1 {
            break;
        }
        sleep(ms(100)).await;
        after = scans(&pool).await;
    }
    assert!(
        after.1 > before.1,
        "adoption used the lease-end index: {before:?} -> {after:?}"
    );
    assert_eq!(
        after.0, before.0,
        "no sequential scan: {before:?} -> {after:?}"
    );
}
