//! Postgres-only scenarios: transactional mode, zombies, the storm with real effect rows.
//!
//! Zombies are fenced out with their business writes; transaction-mode claims; a connection
//! terminated before COMMIT; corrupt rows. (The statements whose plans must not depend on the
//! table's statistics are in `pg_plans`.)

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    ClaimOutcome, Completion, Dedup, HandlerError, Lease, Policy, Processed, State, Store,
    StoreError,
};
use dedup_pg::PgStore;
use sqlx::PgPool;
use tokio::time::sleep;

use crate::support::{
    Boom, acquired, bytes, effect_in_tx, effect_rows, effects_table, insert_effect, key, ms, req,
    short_lease,
};

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn storm_in_transactional_mode_writes_one_effect_per_key(pool: PgPool) {
    // 32 tasks make 2,000 deliveries over 200 keys; each handler writes its effect row in the
    // same transaction as its fenced completion.
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let dedup = Arc::new(
        Dedup::new(store.clone())
            .with_in_flight_wait(Duration::from_secs(60))
            .unwrap(),
    );
    let mut tasks = Vec::new();
    for t in 0..32u32 {
        let (dedup, store) = (Arc::clone(&dedup), store.clone());
        tasks.push(tokio::spawn(async move {
            let (mut executed, mut replayed) = (0u32, 0u32);
            for d in (t..2000).step_by(32) {
                let n = (d * 7919) % 200;
                let name = format!("storm-{n}");
                let done = dedup
                    .process(&key(&name), None, |ctx| {
                        let (store, name) = (store.clone(), name.clone());
                        async move {
                            let result = Bytes::from(format!("done {name}"));
                            effect_in_tx(&store, &ctx, name, format!("task-{t}"), result).await
                        }
                    })
                    .await
                    .unwrap();
                assert_eq!(done.result(), format!("done storm-{n}").as_bytes());
                match done {
                    Processed::Executed { .. } => executed += 1,
                    _ => replayed += 1,
                }
            }
            (executed, replayed)
        }));
    }
    let (mut executed, mut replayed) = (0, 0);
    for t in tasks {
        let (e, r) = t.await.unwrap();
        executed += e;
        replayed += r;
    }
    assert_eq!((executed, replayed), (200, 1800));
    let (rows, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, keys), (200, 200), "exactly one effect row per key");
    // Each effect was written under the token that completed its key.
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM effects e JOIN dedup_records r ON r.key = convert_to(e.key, 'UTF8') \
         WHERE r.state <> 'completed' OR r.token <> e.token",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(mismatched, 0);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_zombie_is_fenced_out_with_its_business_writes(pool: PgPool) {
    // A claims and stalls past its lease mid-transaction (a GC pause, SIGSTOP); B takes over and
    // completes. A's late completion is refused, and its business write rolls back with it.
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("payment-1");
    let a = acquired(
        store
            .claim(&req(&k, "A").with_policy(short_lease(300)))
            .await
            .unwrap(),
    );
    let mut tx_a = pool.begin().await.unwrap();
    insert_effect(&mut tx_a, "payment-1", a.token, "A")
        .await
        .unwrap();
    sleep(ms(600)).await; // A stalls; its lease runs out.

    let b = acquired(store.claim(&req(&k, "B")).await.unwrap());
    assert!(b.token > a.token);
    let mut tx_b = pool.begin().await.unwrap();
    insert_effect(&mut tx_b, "payment-1", b.token, "B")
        .await
        .unwrap();
    PgStore::complete_in(&mut tx_b, &b, b"B's receipt")
        .await
        .unwrap();
    store.commit(tx_b, &b).await.unwrap();

    // A wakes up and tries to finish.
    let err = PgStore::complete_in(&mut tx_a, &a, b"A's receipt")
        .await
        .unwrap_err();
    assert!(err.is_lease_lost(), "{err:?}");
    drop(tx_a); // A's transaction rolls back, its effect row with it.

    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].2, "B");
    let rec = store.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.token), (State::Completed, b.token));
    assert_eq!(rec.result, Some(bytes("B's receipt")));
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_late_holder_that_commits_first_wins_and_the_takeover_replays(pool: PgPool) {
    // The other order: A's lease ran out, but A completes (holding the row) before B's takeover
    // lands. B's claim waits on A's row, then sees COMPLETED and replays: still one effect.
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("payment-2");
    let a = acquired(
        store
            .claim(&req(&k, "A").with_policy(short_lease(200)))
            .await
            .unwrap(),
    );
    sleep(ms(400)).await;
    let mut tx_a = pool.begin().await.unwrap();
    insert_effect(&mut tx_a, "payment-2", a.token, "A")
        .await
        .unwrap();
    PgStore::complete_in(&mut tx_a, &a, b"A's receipt")
        .await
        .unwrap();

    let claimer = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move { store.claim(&req(&k, "B")).await })
    };
    sleep(ms(300)).await;
    assert!(
        !claimer.is_finished(),
        "B's takeover must wait on A's uncommitted completion"
    );
    store.commit(tx_a, &a).await.unwrap();
    assert_eq!(
        claimer.await.unwrap().unwrap(),
        ClaimOutcome::Completed {
            result: bytes("A's receipt"),
            token: a.token,
            fingerprint: None,
        }
    );
    assert_eq!(effect_rows(&pool).await.len(), 1);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn transaction_mode_claim_is_a_lock_until_commit(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let k = key("k");
    let mut tx1 = pool.begin().await.unwrap();
    let lease = acquired(PgStore::claim_in(&mut tx1, &req(&k, "tx1")).await.unwrap());

    // Nobody else sees the uncommitted claim, but nobody can claim past it either.
    assert_eq!(store.get(&k).await.unwrap(), None);
    let mut tx2 = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '200ms'")
        .execute(&mut *tx2)
        .await
        .unwrap();
    assert_eq!(
        PgStore::claim_in(&mut tx2, &req(&k, "tx2")).await.unwrap(),
        ClaimOutcome::InFlight {
            owner: None,
            lease_until: None
        }
    );
    tx2.rollback().await.unwrap();

    // A claimer without a lock timeout waits for tx1 to end.
    let waiter = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move { store.claim(&req(&k, "waiter")).await })
    };
    sleep(ms(300)).await;
    assert!(
        !waiter.is_finished(),
        "the second claim must wait on the uncommitted one"
    );
    PgStore::complete_in(&mut tx1, &lease, b"one transaction")
        .await
        .unwrap();
    store.commit(tx1, &lease).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap().owner, None);
    assert!(matches!(
        waiter.await.unwrap().unwrap(),
        ClaimOutcome::Completed { result, .. } if result == bytes("one transaction")
    ));
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn transaction_mode_rollback_leaves_nothing_behind(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let k = key("k");
    let mut tx = pool.begin().await.unwrap();
    acquired(
        PgStore::claim_in(&mut tx, &req(&k, "crashes"))
            .await
            .unwrap(),
    );
    tx.rollback().await.unwrap(); // as a crash would
    assert_eq!(store.get(&k).await.unwrap(), None);
    let lease = acquired(store.claim(&req(&k, "next")).await.unwrap());
    assert_eq!(lease.attempts, 1);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_commit_on_a_terminated_connection_is_not_taken_for_success(pool: PgPool) {
    // The server drops the transaction's connection before COMMIT: the commit reports a retryable
    // error, nothing landed, and the lease can still complete.
    let store = PgStore::new(pool.clone());
    let k = key("k");
    let lease = acquired(store.claim(&req(&k, "a")).await.unwrap());
    let mut tx = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    PgStore::complete_in(&mut tx, &lease, b"lost")
        .await
        .unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(killed);
    sleep(ms(100)).await;
    let err = store.commit(tx, &lease).await.unwrap_err();
    assert!(err.is_retryable() && !err.is_lease_lost(), "{err:?}");
    let rec = store.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.token), (State::InProgress, lease.token));
    store.complete(&lease, b"second try").await.unwrap();
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn migrations_apply_once_and_rerun_cleanly(pool: PgPool) {
    dedup_pg::migrate(&pool).await.unwrap();
    dedup_pg::migrate(&pool).await.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_migrations WHERE success")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        applied,
        i64::try_from(dedup_pg::MIGRATOR.iter().count()).unwrap()
    );
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn foreign_rows_read_as_corrupt_not_as_answers(pool: PgPool) {
    // A row written by something else (here: a fingerprint of the wrong length slipped in with
    // the constraint dropped) is a typed error, never a panic or a wrong answer.
    sqlx::query("ALTER TABLE dedup_records DROP CONSTRAINT dedup_records_fingerprint_check")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, fingerprint, created_at, \
         updated_at, expires_at) VALUES ('test', 'bad', 'completed', 1, 1, '\\x0102', now(), now(), \
         now() + interval '1 day')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let store = PgStore::new(pool);
    let k = key("bad");
    let err = store.get(&k).await.unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
    let err = store.claim(&req(&k, "a")).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { .. }) && !err.is_retryable(),
        "{err:?}"
    );
    let dedup = Dedup::new(store).with_policy(Policy::default()).unwrap();
    let out = dedup
        .process(&k, None, |_| async {
            Ok::<_, HandlerError<Boom>>(Completion::store("x"))
        })
        .await;
    assert!(out.is_err(), "{out:?}");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_fencing_storm_with_zombies_leaves_one_effect_per_key(pool: PgPool) {
    // 16 holders work 40 keys on 60 ms leases and often stall past them mid-transaction, with no
    // heartbeat: takeovers and zombies race. Four groups of four walk the keys in step, so every
    // key is contended by four holders at once. Fencing must leave exactly one committed effect per
    // key, written under the token that completed it.
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let policy = short_lease(60).with_max_attempts(10_000);
    let mut tasks = Vec::new();
    for t in 0..16u64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let (mut fenced, mut committed) = (0u32, 0u32);
            for i in 0..40u64 {
                let name = format!("k{}", (10 * (t % 4) + i) % 40);
                let k = key(&name);
                loop {
                    match store
                        .claim(&req(&k, &format!("t{t}")).with_policy(policy))
                        .await
                        .unwrap()
                    {
                        ClaimOutcome::Acquired(lease) => {
                            let mut tx = store.pool().begin().await.unwrap();
                            insert_effect(&mut tx, &name, lease.token, &format!("t{t}"))
                                .await
                                .unwrap();
                            // Stall for 0 to 119 ms: past the lease about half the time.
                            sleep(ms((t * 31 + i * 17).wrapping_mul(2_654_435_761) % 120)).await;
                            match PgStore::complete_in(&mut tx, &lease, name.as_bytes()).await {
                                Ok(()) => {
                                    store.commit(tx, &lease).await.unwrap();
                                    committed += 1;
                                }
                                Err(e) if e.is_lease_lost() => fenced += 1, // tx rolls back
                                Err(e) => panic!("{e:?}"),
                            }
                            break;
                        }
                        ClaimOutcome::Completed { .. } => break,
                        ClaimOutcome::InFlight { .. } => sleep(ms(5)).await,
                        other => panic!("unexpected {other:?}"),
                    }
                }
            }
            (fenced, committed)
        }));
    }
    let (mut fenced, mut committed) = (0, 0);
    for t in tasks {
        let (f, c) = t.await.unwrap();
        fenced += f;
        committed += c;
    }
    assert!(
        fenced > 0,
        "the storm must produce zombies for the test to mean anything"
    );
    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 40, "one effect per key: {rows:?}");
    assert_eq!(committed, 40);
    for (name, token, _) in rows {
        let rec = store.get(&key(&name)).await.unwrap().unwrap();
        assert_eq!(rec.state, State::Completed);
        assert_eq!(i64::try_from(rec.token.get()).unwrap(), token, "{name}");
    }
    eprintln!("fencing storm: {fenced} zombie completions refused, 40 keys committed once");
}

/// A batch of new keys is one statement, and so is its completion; a batch of duplicates too.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_is_one_statement(pool: PgPool) {
    let store = PgStore::new(pool);
    let keys: Vec<_> = (0..100).map(|i| key(format!("k{i}"))).collect();
    let reqs: Vec<_> = keys.iter().map(|k| req(k, "w")).collect();
    let before = store.statements();
    let out = store.claim_batch(&reqs).await;
    assert_eq!(store.statements() - before, 1);
    let items: Vec<(Lease, Bytes)> = out
        .into_iter()
        .map(|o| (acquired(o.unwrap()), bytes("ok")))
        .collect();
    let before = store.statements();
    assert!(store.complete_batch(&items).await.iter().all(Result::is_ok));
    assert_eq!(store.statements() - before, 1);
    let before = store.statements();
    let again = store.claim_batch(&reqs).await;
    assert_eq!(store.statements() - before, 1);
    assert!(again.iter().all(
        |o| matches!(o, Ok(ClaimOutcome::Completed { result, .. }) if result == &bytes("ok"))
    ));
}

/// Transactional batch completion: the business writes and the fenced completions of a batch
/// commit together; a batch holding a lease that was taken over must roll back, and nothing of it
/// lands.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_transactional_batch_commits_or_rolls_back_whole(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let quick = short_lease(100);
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let la = acquired(store.claim(&req(&a, "w")).await.unwrap());
    let lb = acquired(store.claim(&req(&b, "w").with_policy(quick)).await.unwrap());
    let lc = acquired(store.claim(&req(&c, "w")).await.unwrap());

    // b's lease is taken over while the batch runs: the batch must not commit.
    sleep(ms(150)).await;
    let lb2 = acquired(
        store
            .claim(&req(&b, "other").with_policy(quick))
            .await
            .unwrap(),
    );
    let mut tx = pool.begin().await.unwrap();
    for lease in [&la, &lb] {
        insert_effect(&mut tx, "batch", lease.token, "w")
            .await
            .unwrap();
    }
    let out =
        PgStore::complete_batch_in(&mut tx, &[(la.clone(), bytes("ra")), (lb, bytes("rb"))]).await;
    assert!(out[0].is_ok());
    assert!(out[1].as_ref().unwrap_err().is_lease_lost());
    tx.rollback().await.unwrap();
    assert!(effect_rows(&pool).await.is_empty());
    assert_eq!(
        store.get(&a).await.unwrap().unwrap().state,
        State::InProgress
    );

    // Without b, a and c commit with their writes.
    let mut tx = pool.begin().await.unwrap();
    for lease in [&la, &lc] {
        insert_effect(&mut tx, "batch", lease.token, "w")
            .await
            .unwrap();
    }
    let items = [(la.clone(), bytes("ra")), (lc.clone(), bytes("rc"))];
    let out = PgStore::complete_batch_in(&mut tx, &items).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    store.commit_batch(tx, &[la, lc]).await.unwrap();
    assert_eq!(effect_rows(&pool).await.len(), 2);
    for (k, r) in [(&a, "ra"), (&c, "rc")] {
        let rec = store.get(k).await.unwrap().unwrap();
        assert_eq!((rec.state, rec.result), (State::Completed, Some(bytes(r))));
    }
    assert!(store.complete(&lb2, b"rb").await.is_ok());
}

/// Concurrent callers' claims and completions are grouped into batch calls (group commit), and
/// each key still runs once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn batched_groups_concurrent_calls(pool: PgPool) {
    let store = PgStore::new(pool);
    let config = dedup_core::BatchConfig::default().with_max_flushes(1);
    let dedup = Arc::new(Dedup::new(dedup_core::Batched::new(store.clone(), config)));
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..256u32 {
        let (dedup, runs) = (Arc::clone(&dedup), Arc::clone(&runs));
        tasks.spawn(async move {
            let k = key(format!("k{}", i % 64));
            dedup
                .process(&k, None, |_| async {
                    runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok::<_, HandlerError<Boom>>(Completion::store("ok"))
                })
                .await
                .unwrap()
        });
    }
    let mut executed = 0;
    while let Some(done) = tasks.join_next().await {
        executed += u32::from(done.unwrap().executed());
    }
    assert_eq!(
        (executed, runs.load(std::sync::atomic::Ordering::Relaxed)),
        (64, 64)
    );
    let counts = dedup.store().batch_counts();
    let (claim_calls, claims) = (counts.claim_calls, counts.claims);
    let (completion_calls, completions) = (counts.completion_calls, counts.completions);
    assert_eq!(completions, 64);
    assert!(claims >= 256, "{claims}");
    assert!(
        claim_calls < claims / 4 && completion_calls < completions,
        "claims {claims} in {claim_calls} calls, completions {completions} in {completion_calls}"
    );
    // Duplicates that found their key in flight claimed again (Dedup waits them out): every
    // claim counts, and still the statements are far fewer.
    let statements = store.statements();
    assert!(
        statements < (claims + completions) / 2,
        "{statements} statements for {claims} claims and {completions} completions"
    );
}

/// A caller leading a batch can be cancelled (a dropped future, an aborted task) while its batch
/// waits on Postgres: the callers queued behind it are not stranded; one of them leads next.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_cancelled_batch_leader_strands_nobody(pool: PgPool) {
    let store = Arc::new(dedup_core::Batched::new(
        PgStore::new(pool.clone()),
        dedup_core::BatchConfig::default().with_max_flushes(1),
    ));
    // An uncommitted claim of x (transaction mode) makes the next claim of x wait on its row.
    let mut tx = pool.begin().await.unwrap();
    let held = acquired(
        PgStore::claim_in(&mut tx, &req(&key("x"), "tx"))
            .await
            .unwrap(),
    );
    let leader = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.claim(&req(&key("x"), "leader")).await })
    };
    sleep(ms(200)).await;
    // The only flush slot is taken by the leader's batch: this claim queues behind it.
    let follower = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.claim(&req(&key("y"), "follower")).await })
    };
    sleep(ms(200)).await;
    assert!(!follower.is_finished());
    leader.abort();
    let answer = tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("the follower leads once the cancelled leader's slot is freed")
        .unwrap()
        .unwrap();
    acquired(answer);
    assert_eq!(store.batch_counts().claim_calls, 2);
    tx.rollback().await.unwrap();
    drop(held);
}

/// Invariant 23, durability is never the lever: nothing dedup ships sets `synchronous_commit` or
/// `fsync` (a statement, a migration, a script, a connection option), and an engine's sessions,
/// after claims, batches and completions, still run with both on.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn dedup_never_turns_durability_off(pool: PgPool) {
    fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, out);
            } else if path
                .extension()
                .is_some_and(|e| e == "rs" || e == "sql" || e == "lua")
            {
                out.push(path);
            }
        }
    }
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    let mut shipped = Vec::new();
    for c in [
        "dedup-core",
        "dedup-pg",
        "dedup-redis",
        "dedup-kafka",
        "dedup-http",
        "dedup",
    ] {
        files(&crates.join(c), &mut shipped);
    }
    assert!(shipped.len() > 50, "the crates' sources were not found");
    let mut settings = Vec::new();
    for path in &shipped {
        let text = std::fs::read_to_string(path).unwrap().to_lowercase();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            let code = code.split("--").next().unwrap_or_default();
            if (code.contains("synchronous_commit") || code.contains("fsync"))
                && !code.contains("show synchronous_commit")
            {
                settings.push(format!("{}:{}: {line}", path.display(), n + 1));
            }
        }
    }
    assert!(
        settings.is_empty(),
        "dedup touches durability: {settings:#?}"
    );

    // An engine's sessions after a claim, a completion and a batch through group commit.
    let engine = dedup::Engine::builder()
        .postgres(pool.clone())
        .scope("durability")
        .build()
        .await
        .unwrap();
    let runs = (0..64).map(|i| {
        let engine = engine.clone();
        async move {
            let k = key(format!("d-{i}"));
            engine
                .dedup()
                .process(&k, None, |_lease| async {
                    Ok::<_, HandlerError<String>>(dedup_core::Completion::store(
                        Bytes::from_static(b"ok"),
                    ))
                })
                .await
                .unwrap();
        }
    });
    futures_util::future::join_all(runs).await;
    let pg = engine.pool().unwrap();
    let mut held = Vec::new();
    for _ in 0..pg.size() {
        let Ok(mut conn) = pg.try_acquire().ok_or(()) else {
            break;
        };
        for (setting, show) in [
            ("synchronous_commit", "SHOW synchronous_commit"),
            ("fsync", "SHOW fsync"),
        ] {
            let value: String = sqlx::query_scalar(show)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            assert_eq!(value, "on", "{setting} on an engine session");
        }
        held.push(conn);
    }
    assert!(!held.is_empty(), "no engine session was checked");
}
