//! Statements that join `dedup_records` to a batch's arrays find each key through the primary key,
//! whatever the table's statistics say (docs/ARCHITECTURE.md, invariant 31).
//!
//! A fresh database, a TRUNCATE, or a VACUUM of an emptied table leaves statistics that say the
//! table is empty. A statement prepared on a pooled connection then is planned as a join over a
//! sequential scan, and the connection kept that plan while the table grew: lease mode ran at half
//! its rate (the batch completion, migration 20261127000001); a batch heartbeat planned that way
//! reads the whole table at every beat (migration 20261128000001); transaction mode's fresh check
//! ran at a third of its rate (migration 20261129000001).
//! Those functions keep one generic plan per connection (migration 20261202000001), made on the
//! first call, and each has no path but a probe per key: the completion, heartbeat, read and
//! re-grant allow only bitmap probes (without that, the plan kept from empty statistics reads the
//! whole primary key at every call), the fresh check and the batch claim a `LATERAL` probe.
//! Each test empties the table's statistics (autovacuum off, so they stay), runs the statements
//! on one connection past the five custom plans a prepared statement gets before its generic one,
//! grows the table, runs them again on the same connection, and counts the table's sequential
//! scans (none) and the index entries read (about one per key: no whole-index scan). Rows are
//! written and read here by statements that never scan the table; every pool is closed before
//! the counters are read, so that its backend's counts are in. A single request's claim
//! (`begin_claim`) probes through `dedup_probe_one`, kept the same way.

use bytes::Bytes;
use dedup_core::{ClaimRequest, Lease, Store};
use dedup_pg::{BatchAnswer, BatchRequest, PgStore};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::time::sleep;

use crate::support::{Boom, acquired, bytes, key, ms, req};

/// No rows, and statistics that say so.
async fn empty_statistics(pool: &PgPool) {
    for sql in [
        "ALTER TABLE dedup_records SET (autovacuum_enabled = false)",
        "VACUUM dedup_records",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// (sequential scans, index scans, index entries read) of dedup_records, over every session. The
/// third catches a plan that reads a whole index (a full scan of the primary key counts as one
/// index scan, but reads every entry).
async fn scans(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as::<_, (i64, i64, i64)>(
        "SELECT t.seq_scan, coalesce(t.idx_scan, 0), \
         (SELECT coalesce(sum(i.idx_tup_read), 0)::int8 FROM pg_stat_user_indexes i \
          WHERE i.relid = t.relid) \
         FROM pg_stat_user_tables t WHERE t.relname = 'dedup_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The counters once at least `index_scans` index scans since `before` are in (a backend reports
/// its counts when it goes idle or closes, and the collector may lag).
async fn settled(pool: &PgPool, before: (i64, i64, i64), index_scans: i64) -> (i64, i64, i64) {
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

/// Once at least `index_scans` index scans since `before` are in: none of them a sequential
/// scan, each at least one index scan, and at most `entries` index entries read in all (a plan
/// that read a whole index once the table had grown would read thousands more per call).
async fn assert_probes_only(
    pool: &PgPool,
    before: (i64, i64, i64),
    index_scans: i64,
    entries: i64,
) {
    let after = settled(pool, before, index_scans).await;
    assert!(
        after.1 - before.1 >= index_scans,
        "every statement found its keys through an index: {before:?} -> {after:?}"
    );
    assert_eq!(after.0, before.0, "no sequential scan of dedup_records");
    assert!(
        after.2 - before.2 <= entries,
        "no statement read a whole index: {before:?} -> {after:?}"
    );
}

/// How many records are COMPLETED.
async fn completed(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dedup_records WHERE state = 'completed'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A pool of one connection: every statement's cached plan is reused.
async fn one_connection(pool: &PgPool) -> PgPool {
    one_connection_under(pool, "").await
}

/// [`one_connection`], its session under `settings` (statements run when it connects).
async fn one_connection_under(pool: &PgPool, settings: &'static str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                if !settings.is_empty() {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(settings))
                        .execute(conn)
                        .await?;
                }
                Ok(())
            })
        })
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
    completions_probe(pool, "").await;
}

/// The same, on a connection whose session rules out the plan the completion's shape relies on
/// (a bitmap probe in a nested loop) and turns JIT on: the function's own settings decide the
/// plan it keeps (migration 20261202000001), not the session's at its first call. Without them
/// the kept plan is a whole scan of the primary key at every call.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_sessions_planner_settings_do_not_shape_the_completions_kept_plan(pool: PgPool) {
    completions_probe(
        pool,
        "SET enable_bitmapscan = off; SET enable_nestloop = off; SET jit_above_cost = 0",
    )
    .await;
}

async fn completions_probe(pool: PgPool, settings: &'static str) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let completions = one_connection_under(&pool, settings).await;
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
    // 3,012 reads by key and 12 completion statements, each at least one scan; one entry per
    // key probed (and per read of `leases`), and 500 for the tiny table's calls.
    assert_probes_only(&pool, before, 3_012 + 12, 2 * 3_012 + 500).await;
    assert_eq!(completed(&pool).await, 3_012);
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
    // First while the table is empty (no page at all): keys it does not hold, each statement
    // past its five custom plans.
    let none: Vec<dedup_core::IdempotencyKey> = (0..2).map(|i| key(format!("absent{i}"))).collect();
    for _ in 0..7 {
        assert!(store.get_many(none.iter()).await.unwrap().is_empty());
    }
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
    // Each update leaves a version behind (the heartbeat changes the indexed expiry), so the read
    // after it meets two entries per key, and the re-grant two: 1 + 2 + 2 per key, and `leases`.
    assert_probes_only(&pool, before, probes + 3_012, 6 * 3_012 + 500).await;
}

/// Transaction mode's fresh check finds each key by a probe, though its plan is kept per
/// connection (migration 20261129000001): one connection runs batches of new keys past the check's
/// five custom plans, two keys at a time while the table is empty and then tiny, then 500 at a
/// time once the table holds 2,000 records more. (Repeats of done keys would go on to the batch
/// claim, which a VACUUM of the emptied table still sends to a sequential scan: docs/PERFORMANCE.md.)
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn fresh_checks_never_scan_the_table_whatever_its_statistics_say(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let batch = async |prefix: &str, n: usize| {
        let reqs: Vec<ClaimRequest> = (0..n)
            .map(|i| req(&key(format!("{prefix}{i}")), "b"))
            .collect();
        let answers = store
            .transact_batch(BatchRequest::new(&reqs), |_tx, leases| {
                let n = leases.len();
                Box::pin(
                    async move { Ok((0..n).map(|_| Ok(Bytes::from_static(b"done"))).collect()) },
                )
            })
            .await
            .unwrap();
        assert_eq!(answers.len(), n);
        for a in &answers {
            assert!(matches!(a, BatchAnswer::<Boom>::Executed { .. }), "{a:?}");
        }
    };
    for round in 0..7 {
        batch(&format!("tiny{round}-"), 2).await;
    }
    for round in 0..4 {
        batch(&format!("grown{round}-"), 500).await;
    }
    conn.close().await;
    // One probe per key checked (14 while tiny, 2,000 once grown); a fresh key's probe finds
    // nothing (the insert's uniqueness check may read what it meets).
    assert_probes_only(&pool, before, 2_014, 2_014 + 500).await;
    assert_eq!(completed(&pool).await, 2_014);
}

/// Rows `names` IN_PROGRESS under leases that ended a second ago (a batch claim takes each one
/// over), written without reading the table.
async fn expired(pool: &PgPool, names: &[String]) {
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, owner, token, lease_until, attempts, \
         created_at, updated_at, expires_at) \
         SELECT 'test', convert_to(n, 'UTF8'), 'in_progress', 'dead', \
         nextval('dedup_token_seq'), now() - interval '1 second', 1, now(), now(), \
         now() + interval '1 day' FROM unnest($1::text[]) AS n",
    )
    .bind(names)
    .execute(pool)
    .await
    .unwrap();
}

/// The batch claim finds each key that has a row by a probe, and takes it over by its ctid,
/// though its plan is kept per connection (migration 20261129000001): one connection takes over
/// expired leases, and answers repeats of done keys (transaction mode sends them to the batch
/// claim), past the claim's five custom plans, two keys at a time while the table is empty and
/// then tiny, then 500 at a time over 2,000 expired leases and 2,000 done keys.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn batch_claims_never_scan_the_table_whatever_its_statistics_say(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let names = |prefix: &str, n: usize| -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>()
    };
    let run = async |taken: &[String], done: &[String]| {
        // Takeovers of expired leases: the batch claim's update by ctid.
        expired(&pool, taken).await;
        let reqs: Vec<ClaimRequest> = taken.iter().map(|n| req(&key(n), "b")).collect();
        for outcome in store.claim_batch(&reqs).await {
            let lease = acquired(outcome.unwrap());
            assert_eq!(lease.attempts, 2, "{lease:?}");
        }
        // New keys (the fresh check), then the same keys again (the fresh check finds them,
        // and the batch claim reads them and answers their results).
        let reqs: Vec<ClaimRequest> = done.iter().map(|n| req(&key(n), "b")).collect();
        for replay in [false, true] {
            let answers = store
                .transact_batch(BatchRequest::new(&reqs), |_tx, leases| {
                    let n = leases.len();
                    Box::pin(async move {
                        Ok((0..n).map(|_| Ok(Bytes::from_static(b"done"))).collect())
                    })
                })
                .await
                .unwrap();
            for a in &answers {
                match a {
                    BatchAnswer::<Boom>::Executed { .. } if !replay => {}
                    BatchAnswer::Replayed { result, .. } if replay && result == "done" => {}
                    other => panic!("replay {replay}: {other:?}"),
                }
            }
        }
    };
    for round in 0..7 {
        run(
            &names(&format!("x{round}-"), 2),
            &names(&format!("n{round}-"), 2),
        )
        .await;
    }
    let taken = names("gx", 2_000);
    let done = names("gn", 2_000);
    for (t, d) in taken.chunks(500).zip(done.chunks(500)) {
        run(t, d).await;
    }
    conn.close().await;
    // Once the table has grown: per key taken over, the insert's check and the probe; per done
    // key, the fresh check twice, the insert's check and the probe. About one entry per probe
    // (10,070 in all when written).
    let probes = 2 * 2_000 + 4 * 2_000;
    assert_probes_only(&pool, before, probes, probes + 500).await;
    assert_eq!(completed(&pool).await, 2_000 + 2 * 7);
}

/// A request claimed in a transaction of its own (`PgStore::begin_claim`, the HTTP layer's
/// transactional path) finds its key through the primary key, fresh or not, while the table is
/// tiny and once it has grown: its probe (`dedup_probe_one`) keeps one plan per connection, made
/// on empty statistics here, which can only probe. As a pooled statement it kept a sequential
/// scan made then (107 here); sent inline with the scope from `convert_from`, it compared in that
/// function's collation ("C"), which no index has, and read the whole table at every call.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn single_request_claims_never_scan_the_table_whatever_its_statistics_say(pool: PgPool) {
    empty_statistics(&pool).await;
    let before = scans(&pool).await;
    let conn = one_connection(&pool).await;
    let store = PgStore::new(conn.clone());
    let claim = async |name: String| {
        store
            .begin_claim(&req(&key(name), "r"), dedup_pg::TxBatchConfig::default())
            .await
            .unwrap()
    };
    let commit = async |name: String| match claim(name).await {
        dedup_pg::TxClaim::Acquired(tx) => tx.commit(b"done").await.unwrap(),
        other => panic!("expected the key held: {other:?}"),
    };
    for i in 0..7 {
        commit(format!("tiny{i}")).await;
    }
    // 3,000 keys done before, written without reading the table.
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, result, created_at, \
         updated_at, expires_at) \
         SELECT 'test', convert_to('grown' || i, 'UTF8'), 'completed', nextval('dedup_token_seq'), \
         1, '\\x00', now(), now(), now() + interval '1 day' FROM generate_series(0, 2999) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();
    for i in 0..50 {
        commit(format!("fresh{i}")).await;
        match claim(format!("grown{i}")).await {
            dedup_pg::TxClaim::Answered(dedup_core::ClaimOutcome::Completed { .. }) => {}
            other => panic!("expected a replay: {other:?}"),
        }
    }
    conn.close().await;
    // A probe per claim (57 fresh, 50 done before, whose claim statement reads the key twice).
    assert_probes_only(&pool, before, 207, 1_000).await;
    assert_eq!(completed(&pool).await, 3_057);
}
