//! Every statement over `dedup_records` partitioned by its key's partition day (`kt`,
//! docs/design/window-partitions.md), with the stand-in mapping of `support::partition_records`:
//! the conformance suite runs over that layout too (`conformance::partitioned`); here, every
//! writer racing for the same keys across partitions (transaction mode by the batch, lease mode
//! one by one and by the batch, a claim inside the caller's transaction, a request's claim in a
//! transaction of its own) leaves one record and
//! one effect per key, and every statement that finds a record by its key reads only that key's
//! partition.

use std::time::Duration;

use bytes::Bytes;
use dedup_core::{ClaimOutcome, ClaimRequest, Fingerprint, HandlerError, Lease, Store};
use dedup_pg::{BatchBody, BatchRequest, ItemResult, PgStore, TxBatchConfig, TxClaim};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::time::sleep;

use crate::support::{
    Boom, acquired, effect_rows, effects_table, insert_effect, key, misplaced_records,
    partition_records, records_by_partition, req,
};

fn request(name: &str) -> ClaimRequest {
    req(&key(name), "partitioned").with_fingerprint(Some(Fingerprint::of(name.as_bytes())))
}

fn name_of(lease: &Lease) -> String {
    String::from_utf8(lease.key.key_bytes().to_vec()).unwrap()
}

/// Transaction mode's batch handler: each message's effect row, in the batch's transaction.
fn effects() -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send
{
    |tx, leases| {
        Box::pin(async move {
            for l in leases {
                insert_effect(&mut *tx, &name_of(l), l.token, "tx-batch")
                    .await
                    .map_err(|_| HandlerError::Retryable(Boom("insert")))?;
            }
            Ok(leases
                .iter()
                .map(|_| -> ItemResult<Boom> { Ok(Bytes::from_static(b"ok")) })
                .collect())
        })
    }
}

/// Whether `answer` settles its key for a writer: done by it or by another.
fn settled(answer: &ClaimOutcome) -> bool {
    matches!(answer, ClaimOutcome::Completed { .. })
}

/// One writer's way of running keys. Answers the keys it has not seen settled yet.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Writer {
    /// `PgStore::transact_batch`: the claims, the effects and the completions in one transaction.
    TxBatch,
    /// Lease mode by the batch: `claim_batch`, the effects, `complete_batch`.
    LeaseBatch,
    /// Lease mode one by one: `claim`, the effect, `complete`.
    LeaseOne,
    /// `PgStore::claim_in` inside the caller's transaction, with the effect and `complete_in`.
    InTx,
    /// `PgStore::begin_claim` (the HTTP layer's transactional path): the claim, the effect and
    /// the completion in the request's own transaction.
    TxOne,
}

impl Writer {
    async fn round(self, store: &PgStore, pending: Vec<String>) -> Vec<String> {
        match self {
            Writer::TxBatch => {
                let reqs: Vec<ClaimRequest> = pending.iter().map(|n| request(n)).collect();
                let answers = store
                    .transact_batch(BatchRequest::new(&reqs), effects())
                    .await;
                match answers {
                    Ok(answers) => pending
                        .into_iter()
                        .zip(answers)
                        .filter(|(_, a)| a.is_retryable())
                        .map(|(n, _)| n)
                        .collect(),
                    // A fresh key another writer took mid-batch fails the batch whole: again.
                    Err(e) if e.is_retryable() => pending,
                    Err(e) => panic!("{e:?}"),
                }
            }
            Writer::LeaseBatch => {
                let reqs: Vec<ClaimRequest> = pending.iter().map(|n| request(n)).collect();
                let answers = store.claim_batch(&reqs).await;
                let mut left = Vec::new();
                let mut done = Vec::new();
                for (n, a) in pending.into_iter().zip(answers) {
                    match a.unwrap() {
                        ClaimOutcome::Acquired(lease) => {
                            let mut conn = store.pool().acquire().await.unwrap();
                            insert_effect(&mut conn, &n, lease.token, "lease-batch")
                                .await
                                .unwrap();
                            done.push((lease, Bytes::from_static(b"ok")));
                        }
                        a if settled(&a) => {}
                        _ => left.push(n),
                    }
                }
                for r in store.complete_batch(&done).await {
                    r.unwrap();
                }
                left
            }
            Writer::LeaseOne => {
                let mut left = Vec::new();
                for n in pending {
                    match store.claim(&request(&n)).await.unwrap() {
                        ClaimOutcome::Acquired(lease) => {
                            let mut conn = store.pool().acquire().await.unwrap();
                            insert_effect(&mut conn, &n, lease.token, "lease-one")
                                .await
                                .unwrap();
                            store.complete(&lease, b"ok").await.unwrap();
                        }
                        a if settled(&a) => {}
                        _ => left.push(n),
                    }
                }
                left
            }
            Writer::InTx => {
                let mut left = Vec::new();
                for n in pending {
                    let mut tx = store.pool().begin().await.unwrap();
                    match PgStore::claim_in(&mut tx, &request(&n)).await {
                        Ok(ClaimOutcome::Acquired(lease)) => {
                            insert_effect(&mut tx, &n, lease.token, "in-tx")
                                .await
                                .unwrap();
                            PgStore::complete_in(&mut tx, &lease, b"ok").await.unwrap();
                            store.commit(tx, &lease).await.unwrap();
                        }
                        Ok(a) if settled(&a) => {}
                        // In flight, or a lock it waited on past its bound: again.
                        Ok(_) => left.push(n),
                        Err(e) if e.is_retryable() => left.push(n),
                        Err(e) => panic!("{e:?}"),
                    }
                }
                left
            }
            Writer::TxOne => {
                let mut left = Vec::new();
                for n in pending {
                    match store
                        .begin_claim(&request(&n), TxBatchConfig::default())
                        .await
                    {
                        Ok(TxClaim::Acquired(mut tx)) => {
                            let token = tx.lease().token;
                            insert_effect(&mut tx, &n, token, "tx-one").await.unwrap();
                            match tx.commit(b"ok").await {
                                Ok(()) => {}
                                // A fresh key another writer took meanwhile: again.
                                Err(e) if e.is_retryable() => left.push(n),
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                        Ok(TxClaim::Answered(a)) if settled(&a) => {}
                        Ok(_) => left.push(n),
                        Err(e) if e.is_retryable() => left.push(n),
                        Err(e) => panic!("{e:?}"),
                    }
                }
                left
            }
        }
    }
}

/// One effect per key, one completed record per key, each where `dedup_kt` puts it.
pub(crate) async fn each_key_ran_once(pool: &PgPool) {
    let effects = effect_rows(pool).await;
    let mut keys: Vec<&str> = effects.iter().map(|e| e.0.as_str()).collect();
    keys.dedup();
    assert_eq!(
        (effects.len(), keys.len()),
        (48, 48),
        "one effect per key: {effects:?}"
    );
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE state = 'completed'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(completed, 48);
    assert_eq!(misplaced_records(pool).await, 0);
}

/// Starts each of `writers` on `names` (every other one in reverse order), `chunk` keys a round,
/// until every key is settled for it.
pub(crate) fn spawn_writers(
    pool: &PgPool,
    writers: &[Writer],
    names: &[String],
    chunk: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    writers
        .iter()
        .enumerate()
        .map(|(i, &writer)| {
            let store = PgStore::new(pool.clone());
            let mut pending = names.to_vec();
            if i % 2 == 1 {
                pending.reverse();
            }
            tokio::spawn(async move {
                for _ in 0..2000 {
                    if pending.is_empty() {
                        return;
                    }
                    let rest = pending.split_off(pending.len().min(chunk));
                    let mut left = writer.round(&store, pending).await;
                    left.extend(rest);
                    pending = left;
                    sleep(Duration::from_millis(2)).await;
                }
                panic!("{writer:?}: keys never settled: {pending:?}");
            })
        })
        .collect()
}

/// Keys of three day partitions and the untimed one, run at once by every kind of writer, each
/// of two of them going through the keys in the other order: one record and one effect per key,
/// every record where `dedup_kt` puts it.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn every_writer_racing_across_partitions_runs_each_key_once(pool: PgPool) {
    partition_records(&pool).await;
    effects_table(&pool).await;
    let names: Vec<String> = (0..48).map(|i| format!("race-{i}")).collect();
    let writers = [
        Writer::TxBatch,
        Writer::TxBatch,
        Writer::LeaseBatch,
        Writer::LeaseBatch,
        Writer::LeaseOne,
        Writer::LeaseOne,
        Writer::InTx,
        Writer::InTx,
        Writer::TxOne,
        Writer::TxOne,
    ];
    for t in spawn_writers(&pool, &writers, &names, names.len()) {
        t.await.unwrap();
    }
    // Which writer wins is the scheduler's: on a loaded machine one batch of all 48 keys may
    // win them all (a clean-clone CI run saw it), so only the outcome is asserted.
    each_key_ran_once(&pool).await;
    let spread = records_by_partition(&pool).await;
    assert_eq!(
        spread.len(),
        4,
        "the keys spread over every partition: {spread:?}"
    );
}

/// (index scans, sequential scans) of each partition, by name.
async fn partition_scans(pool: &PgPool) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "SELECT t.relname::text, coalesce(t.idx_scan, 0), t.seq_scan FROM pg_stat_user_tables t \
         WHERE t.relname LIKE 'dedup\\_records\\_%' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every statement that finds records by their keys, for keys of one day partition only: no
/// other partition is read, by an index or a scan (a statement that did not name `kt` would
/// probe every partition's primary key).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn every_lookup_by_key_reads_only_that_keys_partition(pool: PgPool) {
    partition_records(&pool).await;
    effects_table(&pool).await;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT 'one-' || n FROM generate_series(1, 5000) n \
         WHERE dedup_kt(convert_to('one-' || n, 'UTF8')) >= '2026-01-03' \
         AND dedup_kt(convert_to('one-' || n, 'UTF8')) < '2026-01-05' ORDER BY n LIMIT 25",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(names.len(), 25);
    let before = partition_scans(&pool).await;
    let own = PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let store = PgStore::new(own.clone());
    let reqs: Vec<ClaimRequest> = names.iter().map(|n| request(n)).collect();
    // One by one: claim, heartbeat, complete, then the duplicate's claim and a read.
    let lease = acquired(store.claim(&reqs[0]).await.unwrap());
    store.extend(&lease).await.unwrap();
    store.complete(&lease, b"ok").await.unwrap();
    assert!(settled(&store.claim(&reqs[0]).await.unwrap()));
    assert!(store.get(&lease.key).await.unwrap().is_some());
    // A retryable failure, the claim that takes the released key over, a withdrawal.
    let lease = acquired(store.claim(&reqs[1]).await.unwrap());
    store.fail_retryable(&lease, "again").await.unwrap();
    let lease = acquired(store.claim(&reqs[1]).await.unwrap());
    store.withdraw(&lease).await.unwrap();
    // By the batch: claims of new and known keys, a heartbeat, completions, a read of many.
    let leases: Vec<Lease> = store
        .claim_batch(&reqs[1..12])
        .await
        .into_iter()
        .map(|a| acquired(a.unwrap()))
        .collect();
    for r in store.extend_batch(&leases).await {
        r.unwrap();
    }
    let items: Vec<(Lease, Bytes)> = leases
        .iter()
        .map(|l| (l.clone(), Bytes::from_static(b"ok")))
        .collect();
    for r in store.complete_batch(&items).await {
        r.unwrap();
    }
    for a in store.claim_batch(&reqs[..12]).await {
        assert!(settled(&a.unwrap()));
    }
    assert_eq!(
        store
            .get_many(leases.iter().map(|l| &l.key))
            .await
            .unwrap()
            .len(),
        11
    );
    // Transaction mode by the batch: new keys written completed, known ones answered.
    let answers = store
        .transact_batch(BatchRequest::new(&reqs[6..24]), effects())
        .await
        .unwrap();
    assert_eq!(answers.len(), 18);
    // A claim inside the caller's transaction, and forgetting keys.
    let mut tx = own.begin().await.unwrap();
    assert!(settled(
        &PgStore::claim_in(&mut tx, &reqs[20]).await.unwrap()
    ));
    tx.commit().await.unwrap();
    // A request's claim in its own transaction: a new key written completed, a known one
    // answered.
    match store
        .begin_claim(&reqs[24], TxBatchConfig::default())
        .await
        .unwrap()
    {
        TxClaim::Acquired(tx) => tx.commit(b"ok").await.unwrap(),
        other => panic!("{other:?}"),
    }
    match store
        .begin_claim(&reqs[20], TxBatchConfig::default())
        .await
        .unwrap()
    {
        TxClaim::Answered(a) => assert!(settled(&a)),
        other => panic!("{other:?}"),
    }
    let report = store
        .forget_keys(std::slice::from_ref(&lease.key))
        .await
        .unwrap();
    assert_eq!(report.forgotten, vec![lease.key.clone()]);
    assert!(store.get(&lease.key).await.unwrap().is_none());
    own.close().await;

    let mut after = partition_scans(&pool).await;
    for _ in 0..100 {
        let d1 = after.iter().find(|p| p.0 == "dedup_records_d1").unwrap().1;
        let d1_before = before.iter().find(|p| p.0 == "dedup_records_d1").unwrap().1;
        if d1 - d1_before >= 20 {
            break;
        }
        sleep(Duration::from_millis(100)).await;
        after = partition_scans(&pool).await;
    }
    for ((name, idx, seq), (_, idx0, seq0)) in after.iter().zip(&before) {
        if name == "dedup_records_d1" {
            assert!(
                idx - idx0 >= 20,
                "{name} was read through its key: {before:?} -> {after:?}"
            );
        } else {
            assert_eq!(
                (idx - idx0, seq - seq0),
                (0, 0),
                "{name} was never read: {before:?} -> {after:?}"
            );
        }
    }
}

/// A UUIDv7 key, as canonical text, made at `ms` milliseconds after the epoch.
pub(crate) fn v7(ms: i64, n: u64) -> String {
    format!(
        "{:08x}-{:04x}-7abc-8def-{:012x}",
        ms >> 16,
        ms & 0xffff,
        n & 0xffff_ffff_ffff
    )
}

pub(crate) fn now_ms() -> i64 {
    dedup_core::Timestamp::now().as_micros() / 1000
}

/// The partition that holds `name`'s record.
async fn partition_of(pool: &PgPool, name: &[u8]) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM dedup_records WHERE key = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The switch in place (`dedup_pg::partition_by_key_time`), over records of every kind: random
/// keys and UUIDv7 keys made before it stay in the untimed partition; UUIDv7 keys from a clock
/// running ahead (text and raw, one under a live lease) move to their day's partition with their
/// columns; one centuries ahead stays untimed. Afterwards every record is found (a duplicate
/// replays its result, the held lease completes), new keys with a day go to `future`, the floor
/// is 7, and a second run changes nothing.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_switch_in_place_keeps_every_record_where_its_lookups_find_it(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let now = now_ms();
    let day = 86_400_000;
    let mut done: Vec<Vec<u8>> = vec![
        b"order-1".to_vec(),
        b"7d3f1c52-93a1-4c1e-8f00-5b1f0c2d3e4f".to_vec(),
        v7(now - 3_600_000, 1).into_bytes(),
        v7(now + day, 2).into_bytes(),
        v7(now + 300 * 365 * day, 3).into_bytes(),
    ];
    let mut raw = uuid_bytes(now + 2 * day);
    raw[15] = 9;
    done.push(raw.to_vec());
    for k in &done {
        let lease = acquired(store.claim(&req(&key(k), "before")).await.unwrap());
        store.complete(&lease, k).await.unwrap();
    }
    let held_key = v7(now + 3 * day, 4);
    let held = acquired(store.claim(&req(&key(&held_key), "before")).await.unwrap());
    // What an operator gave the table and the functions: carried over.
    for sql in [
        "GRANT SELECT, INSERT, UPDATE, DELETE ON dedup_records TO PUBLIC",
        "ALTER TABLE dedup_records SET (fillfactor = 90)",
        "REVOKE EXECUTE ON FUNCTION dedup_get_many(text[], bytea[]) FROM PUBLIC",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }

    let switched = dedup_pg::partition_by_key_time(&pool).await.unwrap();
    let dedup_pg::KeyTimeLayout::Switched { t0_ms, moved, .. } = switched else {
        panic!("{switched:?}");
    };
    assert!(t0_ms >= now, "{t0_ms} {now}");
    assert_eq!(moved, 3, "the two completed keys ahead and the held one");

    for k in &done {
        match store.claim(&req(&key(k), "after")).await.unwrap() {
            ClaimOutcome::Completed { result, .. } => assert_eq!(&result[..], &k[..]),
            other => panic!("{}: {other:?}", String::from_utf8_lossy(k)),
        }
    }
    store.complete(&held, b"held").await.unwrap();
    // Moved to their day's partition: `future`, then the range the switch made of that day.
    for (k, untimed) in [
        (done[0].clone(), true),
        (done[2].clone(), true),
        (done[3].clone(), false),
        (done[4].clone(), true),
        (done[5].clone(), false),
        (held_key.clone().into_bytes(), false),
    ] {
        assert_eq!(
            partition_of(&pool, &k).await == "dedup_records_untimed",
            untimed,
            "{}",
            String::from_utf8_lossy(&k)
        );
    }
    let fresh = v7(now_ms() + 1000, 5);
    acquired(store.claim(&req(&key(&fresh), "after")).await.unwrap());
    let today = partition_of(&pool, fresh.as_bytes()).await;
    assert!(
        today.starts_with("dedup_records_20"),
        "a new key goes to the range of its day, made by the switch: {today}"
    );
    let range_options: Option<Vec<String>> =
        sqlx::query_scalar("SELECT reloptions::text[] FROM pg_class WHERE relname = $1")
            .bind(&today)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        range_options,
        Some(vec!["fillfactor=90".to_owned()]),
        "the ranges get the table's storage settings"
    );
    assert_eq!(misplaced_records(&pool).await, 0);
    let floor: i32 = sqlx::query_scalar("SELECT compat_floor FROM dedup_schema")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(floor, 9);
    let index: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relname = 'dedup_records_key_time_idx'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(index, 0, "the switch's own index is gone");
    let carried: (bool, bool, bool, Option<Vec<String>>, String) = sqlx::query_as(
        "SELECT has_table_privilege('public', 'dedup_records', 'INSERT'), \
         has_table_privilege('public', 'dedup_records_future', 'UPDATE'), \
         has_function_privilege('public', 'dedup_get_many(text[], bytea[])', 'EXECUTE'), \
         (SELECT reloptions::text[] FROM pg_class WHERE relname = 'dedup_records_future'), \
         (SELECT prorettype::regtype::text FROM pg_proc WHERE proname = 'dedup_get_many')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        carried,
        (
            true,
            true,
            false,
            Some(vec!["fillfactor=90".to_owned()]),
            "dedup_records".to_owned()
        ),
        "grants, settings and the functions' row type carried over"
    );
    // A run killed after its transaction left its index: the next run drops it.
    sqlx::query(
        "CREATE INDEX dedup_records_key_time_idx ON dedup_records_untimed (dedup_key_ms_v1(key))",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        dedup_pg::partition_by_key_time(&pool).await.unwrap(),
        dedup_pg::KeyTimeLayout::AlreadyPartitioned
    );
    let index: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relname = 'dedup_records_key_time_idx'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(index, 0, "a leftover index is dropped by the next run");
    // A writer that leaves kt out is refused, not misplaced.
    let err = sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, created_at, updated_at, \
         expires_at) VALUES ('test', $1, 'completed', 1, 1, now(), now(), now())",
    )
    .bind(v7(now_ms() + 1000, 6).as_bytes())
    .execute(&pool)
    .await
    .unwrap_err();
    let code = err
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("23514"), "{err}");
}

/// 16 raw bytes of a UUIDv7 made at `ms`.
fn uuid_bytes(ms: i64) -> [u8; 16] {
    let mut b = [0x5au8; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    b
}

/// Every kind of writer racing for UUIDv7 keys made just after the switch's time, while the
/// switch runs: a key claimed before the switch (untimed then) is moved by it, one claimed after
/// goes to its day's partition, and each runs once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn writers_racing_through_the_switch_run_each_key_once(pool: PgPool) {
    effects_table(&pool).await;
    let base = now_ms() + 600_000;
    let names: Vec<String> = (0..48).map(|i| v7(base + i * 1000, i as u64)).collect();
    let writers = [
        Writer::TxBatch,
        Writer::LeaseBatch,
        Writer::LeaseOne,
        Writer::InTx,
        Writer::TxBatch,
        Writer::LeaseOne,
    ];
    // Each writer takes a few keys at a time, so that the switch lands among them.
    let tasks = spawn_writers(&pool, &writers, &names, 4);
    // The switch once the first effect is in (its key's record committed before it).
    while effect_rows(&pool).await.is_empty() {
        sleep(Duration::from_millis(2)).await;
    }
    let switched = dedup_pg::partition_by_key_time(&pool).await.unwrap();
    let dedup_pg::KeyTimeLayout::Switched { moved, .. } = switched else {
        panic!("{switched:?}");
    };
    // The switch lands among the claims: some keys were moved by it (19 to 35 of 48 in three
    // runs on the 2-core machine), the others claimed after it.
    assert!(
        moved > 0,
        "some keys were claimed before the switch and moved by it"
    );
    for t in tasks {
        t.await.unwrap();
    }
    each_key_ran_once(&pool).await;
    let spread = records_by_partition(&pool).await;
    assert!(
        spread
            .iter()
            .all(|(p, _)| p.starts_with("dedup_records_20"))
            && spread.iter().map(|(_, n)| n).sum::<i64>() == 48,
        "every key is after T0, in the range the switch made of its day: {spread:?}"
    );
}

/// A transaction held open on the table (a caller's `claim_in`, not committed) holds the switch
/// back, not the writers: each try for the lock waits 100 ms and gives way, so a claim queued
/// behind one is answered within about that; once the transaction ends, the switch goes through.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_transaction_held_open_holds_back_the_switch_and_not_the_writers(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    // The steps before the lock done already (as by a run that failed on the lock), so that the
    // switch goes straight to the lock.
    for sql in [
        "ALTER TABLE dedup_records ADD CONSTRAINT dedup_records_untimed_kt \
         CHECK (kt < '1970-01-01')",
        "CREATE INDEX dedup_records_key_time_idx ON dedup_records (dedup_key_ms_v1(key)) \
         WHERE dedup_key_ms_v1(key) IS NOT NULL",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let mut open = pool.begin().await.unwrap();
    acquired(
        PgStore::claim_in(&mut open, &req(&key("held-open"), "caller"))
            .await
            .unwrap(),
    );
    let switching = tokio::spawn({
        let pool = pool.clone();
        async move { dedup_pg::partition_by_key_time(&pool).await }
    });
    sleep(Duration::from_millis(1500)).await;
    assert!(
        !switching.is_finished(),
        "the switch waits for the open transaction"
    );
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = std::time::Instant::now();
        let lease = acquired(
            store
                .claim(&req(&key(format!("beside-{i}")), "writer"))
                .await
                .unwrap(),
        );
        store.complete(&lease, b"ok").await.unwrap();
        slowest = slowest.max(started.elapsed());
        sleep(Duration::from_millis(50)).await;
    }
    assert!(
        slowest < Duration::from_secs(1),
        "a writer waited {slowest:?}"
    );
    open.commit().await.unwrap();
    let switched = switching.await.unwrap().unwrap();
    assert!(
        matches!(switched, dedup_pg::KeyTimeLayout::Switched { .. }),
        "{switched:?}"
    );
    assert!(store.get(&key("held-open")).await.unwrap().is_some());
}
