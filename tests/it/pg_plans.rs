//! Statements that join `dedup_records` to a batch's arrays find each key through the primary key,
//! whatever the table's statistics say (docs/ARCHITECTURE.md, invariant 31).
//!
//! A fresh database, a TRUNCATE, or a VACUUM of an emptied table leaves statistics that say the
//! table is empty. A statement prepared on a pooled connection then is planned as a join over a
//! sequential scan, and the connection kept that plan while the table grew: lease mode ran at half
//! its rate (the batch completion, migration 20261127000001), and transaction mode's first run on
//! a fresh database at under a third of its rate (the fresh check, migration 20261128000001).
//! Each test empties the table's statistics (autovacuum off, so they stay), runs the statements
//! on one connection past the five custom plans a prepared statement gets before its generic one,
//! grows the table, runs them again on the same connection, and counts the table's sequential
//! scans: none. Rows are written and read here by statements that never scan the table; every
//! pool is closed before the counters are read, so that its backend's counts are in.

use bytes::Bytes;
use dedup_core::{ClaimRequest, Fingerprint, Lease, Store};
use dedup_pg::{BatchAnswer, BatchBody, BatchRequest, ItemResult, PgStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::time::sleep;

use crate::support::{Boom, bytes, key, ms, req};

/// No rows, and statistics that say so.
async fn empty_statistics(pool: &PgPool) {
    for sql in [
        "ALTER TABLE dedup_records SET (autovacuum_enabled = false)",
        "VACUUM dedup_records",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// (sequential scans, index scans) of dedup_records, over every session.
async fn scans(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as::<_, (i64, i64)>(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables \
         WHERE relname = 'dedup_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The counters once at least `index_scans` index scans since `before` are in (a backend reports
/// its counts when it goes idle or closes, and the collector may lag).
async fn settled(pool: &PgPool, before: (i64, i64), index_scans: i64) -> (i64, i64) {
    let mut after = scans(pool).await;
    for _ in 0..100 {
        if after.1 - before.1 >= index_scans {
            break;
        }
        sleep(ms(100)).await;
        after = scans(pool).await;
    }
    after
}

/// A pool of one connection: every statement's cached plan is reused.
async fn one_connection(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

/// Rows `from..to` IN_PROGRESS, written without reading the table, and their leases, each read by
/// its primary key on a pool that rules sequential scans out (so that the reads' plans cannot
/// count here), closed after.
async fn leases(pool: &PgPool, from: i32, to: i32) -> Vec<Lease> {
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, owner, token, lease_until, attempts, \
         created_at, updated_at, expires_at) \
         SELECT 'sc', convert_to('k' || i, 'UTF8'), 'in_progress', 'a', \
         nextval('dedup_token_seq'), now() + interval '1 hour', 1, now(), now(), \
         now() + interval '1 day' FROM generate_series($1::int4, $2::int4 - 1) AS i",
    )
    .bind(from)
    .bind(to)
    .execute(pool)
    .await
    .unwrap();
    let reads = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET enable_seqscan = off")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let store = PgStore::new(reads.clone());
    let mut out = Vec::new();
    for i in from..to {
        let k =
            dedup_core::IdempotencyKey::new(dedup_core::Scope::new("sc").unwrap(), format!("k{i}"))
                .unwrap();
        let record = store.get(&k).await.unwrap().unwrap();
        out.push(Lease::of_record(&record).unwrap());
    }
    reads.close().await;
    out
}

/// A batch completion finds each key through the primary key: a connection completes a few keys
/// while the table is tiny, then the table grows to 3,000 keys and the same connection completes
/// them in batches of 500.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_completion_never_scans_the_table_whatever_its_statistics_say(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let completions = one_connection(&pool).await;
    let store = PgStore::new(completions.clone());
    let done = |ls: Vec<Lease>| {
        ls.into_iter()
            .map(|l| (l, bytes("done")))
            .collect::<Vec<_>>()
    };
    let tiny = done(leases(&pool, 0, 12).await);
    for pair in tiny.chunks(2) {
        assert!(store.complete_batch(pair).await.iter().all(Result::is_ok));
    }
    let grown = done(leases(&pool, 12, 3_012).await);
    for chunk in grown.chunks(500) {
        assert!(store.complete_batch(chunk).await.iter().all(Result::is_ok));
    }
    completions.close().await;
    // 3,012 reads by key and 12 completion statements, each at least one scan.
    let after = settled(&pool, before, 3_012 + 12).await;
    assert!(
        after.1 - before.1 >= 3_012 + 12,
        "every read and completion found its keys through an index: {before:?} -> {after:?}"
    );
    assert_eq!(after.0, before.0, "no sequential scan of dedup_records");
    let done: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE state = 'completed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(done, 3_012);
}

/// A batch handler that writes nothing and answers every message.
fn answer_all()
-> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    |_tx, leases| {
        Box::pin(async move {
            Ok(leases
                .iter()
                .map(|_| -> ItemResult<Boom> { Ok(Bytes::from_static(b"ok")) })
                .collect())
        })
    }
}

/// Transaction mode's check of which keys are fresh finds each key through the primary key: one
/// connection runs eight batches of two new keys while the table is tiny, the table grows to
/// 3,000 records, and the same connection runs six batches of 100 new keys. Before the fresh
/// check went through `dedup_fresh_batch`, every one of its statements here scanned the table.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn transaction_mode_finds_fresh_keys_whatever_the_statistics_say(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let batch = |from: usize, n: usize| -> Vec<ClaimRequest> {
        (from..from + n)
            .map(|i| {
                let name = format!("t{i}");
                req(&key(&name), "batch").with_fingerprint(Some(Fingerprint::of(name.as_bytes())))
            })
            .collect()
    };
    let mut fresh = 0i64;
    let mut run = async |reqs: Vec<ClaimRequest>| {
        let answers = store
            .transact_batch(BatchRequest::new(&reqs), answer_all())
            .await
            .unwrap();
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, BatchAnswer::Executed { .. })),
            "{answers:?}"
        );
        fresh += i64::try_from(reqs.len()).unwrap();
    };
    for b in 0..8 {
        run(batch(b * 2, 2)).await;
    }
    drop(leases(&pool, 0, 3_000).await);
    for b in 0..6 {
        run(batch(1_000 + b * 100, 100)).await;
    }
    conn.close().await;
    // Each fresh check probes the primary key once per key; the reads of `leases` 3,000 more.
    let after = settled(&pool, before, fresh + 3_000).await;
    assert!(
        after.1 - before.1 >= fresh + 3_000,
        "every fresh check found its keys through an index: {before:?} -> {after:?}"
    );
    assert_eq!(after.0, before.0, "no sequential scan of dedup_records");
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_records WHERE state = 'completed' \
         AND convert_from(key, 'UTF8') LIKE 't%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(done, fresh, "every fresh key was written completed once");
}

/// A batch heartbeat, a read of many records and a re-grant (the statement a claim that waited
/// on a lock sends) each find their keys through the primary key: one connection runs each six
/// times over two keys while the table is tiny, then six times over 500 keys once it holds 3,012.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn heartbeats_reads_and_regrants_of_a_batch_never_scan_the_table(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let mut probes = 0i64;
    let mut each = async |ls: &[Lease]| {
        let beats = store.extend_batch(ls).await;
        assert!(beats.iter().all(Result::is_ok), "{beats:?}");
        let read = store.get_many(ls.iter().map(|l| &l.key)).await.unwrap();
        assert_eq!(read.len(), ls.len());
        let scopes: Vec<&str> = ls.iter().map(|l| l.key.scope().as_str()).collect();
        let keys: Vec<&[u8]> = ls.iter().map(|l| l.key.key_bytes()).collect();
        let tokens: Vec<i64> = ls
            .iter()
            .map(|l| i64::try_from(l.token.get()).unwrap())
            .collect();
        let lease_us = vec![60_000_000i64; ls.len()];
        let ret_us = vec![86_400_000_000i64; ls.len()];
        let regranted: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM dedup_regrant_batch($1::text[], $2::bytea[], $3::int8[], \
             $4::int8[], $5::int8[])",
        )
        .bind(&scopes)
        .bind(&keys)
        .bind(&tokens)
        .bind(&lease_us)
        .bind(&ret_us)
        .fetch_one(&conn)
        .await
        .unwrap();
        assert_eq!(regranted, i64::try_from(ls.len()).unwrap());
        if ls.len() > 2 {
            probes += 3 * i64::try_from(ls.len()).unwrap();
        }
    };
    let tiny = leases(&pool, 0, 12).await;
    for pair in tiny.chunks(2) {
        each(pair).await;
    }
    let grown = leases(&pool, 12, 3_012).await;
    for chunk in grown.chunks(500) {
        each(chunk).await;
    }
    conn.close().await;
    // Once the table has grown, three probes per key (one per statement), and the 3,012 reads of
    // `leases`. (While the table is tiny, a plan may read both keys in one pass of the index.)
    let after = settled(&pool, before, probes + 3_012).await;
    assert!(
        after.1 - before.1 >= probes + 3_012,
        "every heartbeat, read and re-grant found its keys through an index: {before:?} -> {after:?}"
    );
    assert_eq!(after.0, before.0, "no sequential scan of dedup_records");
}

/// A batch claim of keys that have a row (read, and taken over where they may be) finds them
/// through the primary key: one connection claims six batches of two held keys and two new ones
/// while the table is tiny, then six batches of 500 held keys once it holds 3,012. Before the
/// claim went through `dedup_claim_batch`, transaction mode ran at a fifth of its rate after a
/// VACUUM of the emptied table (its repeats of done keys all come here).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_claim_of_known_keys_never_scans_the_table(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let mut held_answers = 0i64;
    let mut claim = async |held: &[Lease], new: &[&str]| {
        let mut reqs: Vec<ClaimRequest> = held.iter().map(|l| req(&l.key, "b")).collect();
        reqs.extend(new.iter().map(|n| req(&key(n), "b")));
        let out = store.claim_batch(&reqs).await;
        for (r, o) in reqs.iter().zip(&out) {
            let held_key = held.iter().any(|l| l.key == r.key);
            match o {
                Ok(dedup_core::ClaimOutcome::InFlight { .. }) if held_key => held_answers += 1,
                Ok(dedup_core::ClaimOutcome::Acquired(_)) if !held_key => {}
                other => panic!("{:?}: {other:?}", r.key),
            }
        }
    };
    let tiny = leases(&pool, 0, 12).await;
    for (i, pair) in tiny.chunks(2).enumerate() {
        let news = [format!("n{i}a"), format!("n{i}b")];
        claim(pair, &[news[0].as_str(), news[1].as_str()]).await;
    }
    let grown = leases(&pool, 12, 3_012).await;
    for chunk in grown.chunks(500) {
        claim(chunk, &[]).await;
    }
    conn.close().await;
    assert_eq!(held_answers, 3_012, "every held key answered in flight");
    // One probe per held key once the table has grown, and the 3,012 reads of `leases`.
    let after = settled(&pool, before, 3_000 + 3_012).await;
    assert!(
        after.1 - before.1 >= 3_000 + 3_012,
        "every batch claim found its keys through an index: {before:?} -> {after:?}"
    );
    assert_eq!(after.0, before.0, "no sequential scan of dedup_records");
}
