//! Transaction mode by the batch (`PgStore::transact_batch`): claims, the handler's writes for
//! the whole batch and the completions in one transaction.
//!
//! A batch with repeats, keys done before and a reused key in one transaction (handler once,
//! statements counted); a poisoned message and a refused one handled alone while their neighbours
//! commit; a withdrawn one spends no attempt while its neighbours commit; an oversized result
//! fails its message alone; a key held by another batch answers InFlight without waiting; a key
//! held by a `claim_in` transaction holds the batch no longer than its lock timeout; a batch idle
//! in its transaction past its bound is rolled back by the server; concurrent batches in opposite
//! orders run each key once; ordering groups held back after a failure, a held key and a poisoned
//! message; a fresh key taken by a lease-mode claim mid-batch fails the batch whole; a handler
//! that leaves the transaction aborted fails only its message; the caller's own writes are told
//! which messages settle and commit with the batch or not at all (the Kafka consumer's stored
//! position is built on them: `crates/dedup-kafka/src/batch/tx/offsets/tests.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{AfterHandlerError, ClaimRequest, Fingerprint, HandlerError, Lease, State, Store};
use dedup_pg::{
    BatchAnswer, BatchBody, BatchRequest, BatchWrites, BatchWritesFuture, ItemResult, PgStore,
    TxBatchConfig,
};
use sqlx::{PgConnection, PgPool};

use crate::support::{Boom, acquired, effect_rows, effects_table, key, req};

/// The batch handler the tests use: one statement writes every message's effect row; a key named
/// in `poison` fails the whole call (as a constraint violation would), and one named in `refuse`
/// is answered as failed on its own.
fn ledger(
    calls: Arc<AtomicU32>,
    poison: &'static [&'static str],
    refuse: &'static [&'static str],
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    move |tx, leases| {
        calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let names: Vec<String> = leases
                .iter()
                .map(|l| String::from_utf8(l.key.key_bytes().to_vec()).unwrap())
                .collect();
            if names.iter().any(|n| poison.contains(&n.as_str())) {
                return Err(HandlerError::Permanent(Boom("poisoned batch")));
            }
            let tokens: Vec<i64> = leases
                .iter()
                .map(|l| i64::try_from(l.token.get()).unwrap())
                .collect();
            sqlx::query(
                "INSERT INTO effects SELECT k, t, 'batch' FROM unnest($1::text[], $2::int8[]) AS u(k, t)",
            )
            .bind(&names)
            .bind(&tokens)
            .execute(&mut *tx)
            .await
            .map_err(|_| HandlerError::Retryable(Boom("insert failed")))?;
            Ok(names
                .iter()
                .map(|n| -> ItemResult<Boom> {
                    if refuse.contains(&n.as_str()) {
                        Err(HandlerError::Retryable(Boom("refused")))
                    } else {
                        Ok(Bytes::from(format!("booked {n}")))
                    }
                })
                .collect())
        })
    }
}

fn reqs(names: &[&str]) -> Vec<ClaimRequest> {
    names
        .iter()
        .map(|n| req(&key(n), "batch").with_fingerprint(Some(Fingerprint::of(n.as_bytes()))))
        .collect()
}

/// A batch of new keys, repeats, keys done before and a key used with another payload: one
/// transaction, the handler called once, every effect once, repeats answered after the commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_commits_claims_effects_and_completions_together(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    // "done" was completed before; "other" was used with another payload.
    let done = acquired(store.claim(&reqs(&["done"])[0]).await.unwrap());
    store.complete(&done, b"old result").await.unwrap();
    let other = acquired(
        store
            .claim(&req(&key("other"), "x").with_fingerprint(Some(Fingerprint::of(b"x"))))
            .await
            .unwrap(),
    );
    store.complete(&other, b"x").await.unwrap();
    let names: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
    let mut batch: Vec<&str> = names.iter().map(String::as_str).collect();
    batch.extend(["k1", "k2", "done", "other", "k3"]);
    let calls = Arc::new(AtomicU32::new(0));
    let before = store.statements();
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&batch)),
            ledger(calls.clone(), &[], &[]),
        )
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    let statements = store.statements() - before;
    assert!(
        statements <= 6,
        "BEGIN, lock, claim, complete, COMMIT: {statements}"
    );
    for (i, a) in answers.iter().enumerate().take(100) {
        match a {
            BatchAnswer::Executed {
                result, attempts, ..
            } => {
                assert_eq!(result, &Bytes::from(format!("booked k{i}")));
                assert_eq!(*attempts, 1);
            }
            other => panic!("k{i}: {other:?}"),
        }
    }
    assert!(
        matches!(&answers[100], BatchAnswer::Replayed { result, .. } if result == "booked k1"),
        "{:?}",
        answers[100]
    );
    assert!(matches!(&answers[101], BatchAnswer::Replayed { .. }));
    assert!(
        matches!(&answers[102], BatchAnswer::Replayed { result, .. } if result == "old result"),
        "{:?}",
        answers[102]
    );
    assert!(matches!(&answers[103], BatchAnswer::PayloadMismatch));
    assert!(matches!(&answers[104], BatchAnswer::Replayed { .. }));
    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 100, "one effect per new key");
    for n in ["k0", "k50", "k99"] {
        let rec = store.get(&key(n)).await.unwrap().unwrap();
        assert_eq!(rec.state, State::Completed);
        // Written completed at once, with no owner (as every completion leaves a record).
        assert_eq!(rec.owner, None, "{n}");
    }
    // The same batch again: all replays, no handler call, no effect.
    let again = store
        .transact_batch(
            BatchRequest::new(&reqs(&batch[..100])),
            ledger(calls.clone(), &[], &[]),
        )
        .await
        .unwrap();
    assert!(
        again
            .iter()
            .all(|a| matches!(a, BatchAnswer::Replayed { .. }))
    );
    assert_eq!(effect_rows(&pool).await.len(), 100);
}

/// A handler that fails as a whole because of one message, and one that reports a message as
/// failed: the batch runs again in parts under savepoints, the message at fault is handled alone
/// (FAILED, or released with its attempt counted), and its neighbours commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_poisoned_message_fails_alone_and_its_neighbours_commit(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let names: Vec<String> = (0..32).map(|i| format!("m{i}")).collect();
    let batch: Vec<&str> = names.iter().map(String::as_str).collect();
    let calls = Arc::new(AtomicU32::new(0));
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&batch)),
            ledger(calls.clone(), &["m13"], &["m20"]),
        )
        .await
        .unwrap();
    for (i, a) in answers.iter().enumerate() {
        match (i, a) {
            (
                13,
                BatchAnswer::Handler {
                    error: HandlerError::Permanent(e),
                    after: AfterHandlerError::Failed { attempts: 1 },
                },
            ) => assert_eq!(e.0, "poisoned batch"),
            (
                20,
                BatchAnswer::Handler {
                    error: HandlerError::Retryable(e),
                    after: AfterHandlerError::Released { attempts: 1 },
                },
            ) => assert_eq!(e.0, "refused"),
            (13 | 20, other) => panic!("m{i}: {other:?}"),
            (_, BatchAnswer::Executed { .. }) => {}
            (_, other) => panic!("m{i}: {other:?}"),
        }
    }
    // First call failed whole; then halves down to m13 alone: a handful of calls, not 32.
    let n = calls.load(Ordering::SeqCst);
    assert!((3..=16).contains(&n), "{n} handler calls");
    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 30, "every neighbour committed once: {rows:?}");
    assert!(rows.iter().all(|(k, _, _)| k != "m13" && k != "m20"));
    let m13 = store.get(&key("m13")).await.unwrap().unwrap();
    assert_eq!(m13.state, State::Failed);
    let m20 = store.get(&key("m20")).await.unwrap().unwrap();
    assert_eq!((m20.state, m20.attempts), (State::Released, 1));
    // The released one runs in a later batch as attempt 2.
    let later = store
        .transact_batch(
            BatchRequest::new(&reqs(&["m20", "m13"])),
            ledger(calls.clone(), &[], &[]),
        )
        .await
        .unwrap();
    assert!(matches!(
        later[0],
        BatchAnswer::Executed { attempts: 2, .. }
    ));
    assert!(matches!(later[1], BatchAnswer::Failed { .. }));
}

/// A key another batch holds (uncommitted) does not hold this batch: it answers InFlight at once
/// and the other keys commit; once the other batch commits, the key replays.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_key_held_by_another_batch_answers_in_flight_without_waiting(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    // The other batch holds "held" inside its transaction until it is told to finish.
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let other = {
        let store = store.clone();
        let mut signal = Some((started_tx, finish_rx));
        tokio::spawn(async move {
            store
                .transact_batch(
                    BatchRequest::new(&reqs(&["held"])),
                    move |_tx: &mut PgConnection, leases: &[Lease]| -> BatchBody<'_, Boom> {
                        let signal = signal.take();
                        Box::pin(async move {
                            if let Some((started, finish)) = signal {
                                let _ = started.send(());
                                let _ = finish.await;
                            }
                            Ok(leases.iter().map(|_| Ok(Bytes::from("other"))).collect())
                        })
                    },
                )
                .await
        })
    };
    started.await.unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    // Were it to wait on the other batch, it would wait until after this test ends.
    let answers = tokio::time::timeout(
        Duration::from_secs(60),
        store.transact_batch(
            BatchRequest::new(&reqs(&["a", "held", "b"])),
            ledger(calls.clone(), &[], &[]),
        ),
    )
    .await
    .expect("the batch did not wait for the other one")
    .unwrap();
    assert!(matches!(answers[0], BatchAnswer::Executed { .. }));
    assert!(
        matches!(answers[1], BatchAnswer::InFlight),
        "{:?}",
        answers[1]
    );
    assert!(answers[1].is_retryable());
    assert!(matches!(answers[2], BatchAnswer::Executed { .. }));
    finish.send(()).unwrap();
    let theirs = other.await.unwrap().unwrap();
    assert!(matches!(theirs[0], BatchAnswer::Executed { .. }));
    let retried = store
        .transact_batch(BatchRequest::new(&reqs(&["held"])), ledger(calls, &[], &[]))
        .await
        .unwrap();
    assert!(
        matches!(&retried[0], BatchAnswer::Replayed { result, .. } if result == "other"),
        "{:?}",
        retried[0]
    );
    assert_eq!(effect_rows(&pool).await.len(), 2);
}

/// A key a `claim_in` transaction holds uncommitted makes the batch wait on its row, but only up
/// to the batch's lock timeout: the batch then fails as a whole, retryably, having written
/// nothing, and runs once the other transaction is gone.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_key_held_by_a_claim_in_transaction_holds_the_batch_no_longer_than_its_bound(
    pool: PgPool,
) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let mut other = pool.begin().await.unwrap();
    acquired(
        PgStore::claim_in(&mut other, &reqs(&["held"])[0])
            .await
            .unwrap(),
    );
    let calls = Arc::new(AtomicU32::new(0));
    let bounded = TxBatchConfig::default().with_lock_timeout(Duration::from_millis(300));
    let err = store
        .transact_batch(
            BatchRequest::new(&reqs(&["a", "held"])).with_config(bounded),
            ledger(calls.clone(), &[], &[]),
        )
        .await
        .expect_err("the lock timeout fails the batch");
    assert!(err.is_retryable() && !err.is_outcome_unknown(), "{err:?}");
    assert_eq!(dedup_pg::sqlstate(&err).as_deref(), Some("55P03"));
    // The uncommitted row is invisible, so "held" looked fresh and the handler may have run;
    // the insert of its completed row waited on the other transaction's row lock, and the whole
    // batch rolled back.
    assert!(
        effect_rows(&pool).await.is_empty(),
        "nothing of the batch was written"
    );
    assert!(store.get(&key("a")).await.unwrap().is_none());
    other.rollback().await.unwrap();
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&["a", "held"])).with_config(bounded),
            ledger(calls, &[], &[]),
        )
        .await
        .unwrap();
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, BatchAnswer::Executed { attempts: 1, .. }))
    );
    assert_eq!(effect_rows(&pool).await.len(), 2);
}

/// A result too large to store fails its own message (FAILED, its writes undone), not the batch.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn an_oversized_result_fails_its_message_alone(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let policy = dedup_core::Policy::default().with_max_result_bytes(16);
    let batch: Vec<ClaimRequest> = ["r1", "huge", "r3"]
        .iter()
        .map(|n| req(&key(n), "batch").with_policy(policy))
        .collect();
    let answers = store
        .transact_batch(
            BatchRequest::new(&batch),
            |tx: &mut PgConnection, leases: &[Lease]| -> BatchBody<'_, Boom> {
                Box::pin(async move {
                    let mut out = Vec::new();
                    for l in leases {
                        let name = String::from_utf8(l.key.key_bytes().to_vec()).unwrap();
                        crate::support::insert_effect(tx, &name, l.token, "batch")
                            .await
                            .unwrap();
                        out.push(Ok(if name == "huge" {
                            Bytes::from(vec![b'x'; 1024])
                        } else {
                            Bytes::from("ok")
                        }));
                    }
                    Ok(out)
                })
            },
        )
        .await
        .unwrap();
    assert!(matches!(answers[0], BatchAnswer::Executed { .. }));
    assert!(
        matches!(
            &answers[1],
            BatchAnswer::Handler {
                error: HandlerError::Store(dedup_core::StoreError::Input(_)),
                after: AfterHandlerError::Failed { .. }
            }
        ),
        "{:?}",
        answers[1]
    );
    assert!(matches!(answers[2], BatchAnswer::Executed { .. }));
    let rows: Vec<String> = effect_rows(&pool).await.into_iter().map(|r| r.0).collect();
    assert_eq!(rows, ["r1", "r3"], "the oversized one's write was undone");
    assert_eq!(
        store.get(&key("huge")).await.unwrap().unwrap().state,
        State::Failed
    );
}

/// A batch whose client stops inside the transaction (here: a handler that never returns in
/// time) holds its keys only until `idle_in_transaction_session_timeout` ends the session; the
/// batch rolls back whole, and a later batch runs every key once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_stuck_in_its_transaction_is_rolled_back_by_the_server(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let stuck = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .transact_batch(
                    BatchRequest::new(&reqs(&["s1", "s2"])).with_config(
                        TxBatchConfig::default().with_idle_timeout(Duration::from_millis(300)),
                    ),
                    |tx: &mut PgConnection, leases: &[Lease]| -> BatchBody<'_, Boom> {
                        Box::pin(async move {
                            sqlx::query("INSERT INTO effects VALUES ('s1', 0, 'stuck')")
                                .execute(&mut *tx)
                                .await
                                .unwrap();
                            // Idle in the transaction far past its bound.
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            Ok(leases.iter().map(|_| Ok(Bytes::from("late"))).collect())
                        })
                    },
                )
                .await
        })
    };
    let out = stuck.await.unwrap();
    let err = out.expect_err("the server ended the session: the commit cannot succeed");
    assert!(err.is_retryable(), "{err:?}");
    assert!(effect_rows(&pool).await.is_empty(), "rolled back whole");
    let calls = Arc::new(AtomicU32::new(0));
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&["s1", "s2"])),
            ledger(calls, &[], &[]),
        )
        .await
        .unwrap();
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, BatchAnswer::Executed { attempts: 1, .. }))
    );
    assert_eq!(effect_rows(&pool).await.len(), 2);
}

/// Concurrent batches over overlapping keys in opposite orders: no deadlock, each key's effect
/// once; what one batch found held, a later round runs.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn concurrent_batches_run_each_key_once(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let names: Vec<String> = (0..60).map(|i| format!("c{i}")).collect();
    let mut tasks = Vec::new();
    for t in 0..6 {
        let store = store.clone();
        let mut mine: Vec<String> = names.clone();
        if t % 2 == 1 {
            mine.reverse();
        }
        tasks.push(tokio::spawn(async move {
            let calls = Arc::new(AtomicU32::new(0));
            let mut pending: Vec<String> = mine;
            for _ in 0..200 {
                if pending.is_empty() {
                    return;
                }
                let batch: Vec<&str> = pending.iter().map(String::as_str).collect();
                let answers = store
                    .transact_batch(
                        BatchRequest::new(&reqs(&batch)),
                        ledger(calls.clone(), &[], &[]),
                    )
                    .await
                    .unwrap();
                pending = pending
                    .iter()
                    .zip(answers)
                    .filter(|(_, a)| a.is_retryable())
                    .map(|(n, _)| n.clone())
                    .collect();
                tokio::task::yield_now().await;
            }
            panic!("keys never settled: {pending:?}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 60, "one effect per key");
    let mut keys: Vec<_> = rows.iter().map(|r| r.0.clone()).collect();
    keys.dedup();
    assert_eq!(keys.len(), 60);
}

/// A batch handler that writes every message's effect but `w1`'s, and answers `w1` `Withdraw`.
fn withdrawing()
-> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    move |tx, leases| {
        Box::pin(async move {
            let names: Vec<String> = leases
                .iter()
                .map(|l| String::from_utf8(l.key.key_bytes().to_vec()).unwrap())
                .collect();
            let keep: Vec<&String> = names.iter().filter(|n| *n != "w1").collect();
            sqlx::query("INSERT INTO effects SELECT k, 0, 'batch' FROM unnest($1::text[]) AS u(k)")
                .bind(&keep)
                .execute(&mut *tx)
                .await
                .map_err(|_| HandlerError::Retryable(Boom("insert failed")))?;
            Ok(names
                .iter()
                .map(|n| -> ItemResult<Boom> {
                    if n == "w1" {
                        Err(HandlerError::Withdraw(Boom("not kept")))
                    } else {
                        Ok(Bytes::from(format!("booked {n}")))
                    }
                })
                .collect())
        })
    }
}

/// A message the handler answers `Withdraw` (an outcome it chose not to keep): given back with
/// no attempt spent (a first attempt's record goes), while its neighbours commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_withdrawn_message_spends_no_attempt_and_its_neighbours_commit(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    for round in 0..3 {
        let answers = store
            .transact_batch(BatchRequest::new(&reqs(&["w0", "w1", "w2"])), withdrawing())
            .await
            .unwrap();
        match &answers[1] {
            BatchAnswer::Handler {
                error: HandlerError::Withdraw(e),
                after: AfterHandlerError::Released { attempts: 0 },
            } => assert_eq!(e.0, "not kept"),
            other => panic!("round {round}: {other:?}"),
        }
        assert!(
            store.get(&key("w1")).await.unwrap().is_none(),
            "round {round}: as if never claimed"
        );
        if round == 0 {
            assert!(
                matches!(answers[0], BatchAnswer::Executed { .. }),
                "{answers:?}"
            );
            assert!(
                matches!(answers[2], BatchAnswer::Executed { .. }),
                "{answers:?}"
            );
        }
    }
    let rows = effect_rows(&pool).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
}

/// Ordering groups: a message whose handler fails holds back its group's later messages in the
/// batch (answered Deferred, their claims given back, no attempt spent), while other groups
/// commit; without groups the same batch lets the later message run. Run again, the group
/// settles in order.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn an_ordered_batch_holds_back_a_groups_later_messages_after_a_failure(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let calls = Arc::new(AtomicU32::new(0));
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&["a1", "a2", "a3", "b1", "b2"])).ordered(&[1, 1, 1, 2, 2]),
            ledger(calls.clone(), &[], &["a2"]),
        )
        .await
        .unwrap();
    assert!(
        matches!(answers[0], BatchAnswer::Executed { .. }),
        "{:?}",
        answers[0]
    );
    assert!(
        matches!(
            answers[1],
            BatchAnswer::Handler {
                after: AfterHandlerError::Released { attempts: 1 },
                ..
            }
        ),
        "{:?}",
        answers[1]
    );
    assert!(
        matches!(answers[2], BatchAnswer::Deferred),
        "{:?}",
        answers[2]
    );
    assert!(answers[2].is_retryable());
    assert!(matches!(answers[3], BatchAnswer::Executed { .. }));
    assert!(matches!(answers[4], BatchAnswer::Executed { .. }));
    assert!(
        store.get(&key("a3")).await.unwrap().is_none(),
        "a3's claim was given back"
    );
    let keys = |rows: Vec<(String, i64, String)>| {
        let mut k: Vec<String> = rows.into_iter().map(|(k, _, _)| k).collect();
        k.sort();
        k
    };
    assert_eq!(keys(effect_rows(&pool).await), ["a1", "b1", "b2"]);
    // Again: a2 (its second attempt) and then a3 (its first: nothing was spent).
    let again = store
        .transact_batch(
            BatchRequest::new(&reqs(&["a2", "a3"])).ordered(&[1, 1]),
            ledger(calls.clone(), &[], &[]),
        )
        .await
        .unwrap();
    assert!(
        matches!(again[0], BatchAnswer::Executed { attempts: 2, .. }),
        "{:?}",
        again[0]
    );
    assert!(
        matches!(again[1], BatchAnswer::Executed { attempts: 1, .. }),
        "{:?}",
        again[1]
    );
    // Without groups, the later message of the same batch is not held back.
    let free = store
        .transact_batch(
            BatchRequest::new(&reqs(&["c1", "c2", "c3"])),
            ledger(calls, &[], &["c2"]),
        )
        .await
        .unwrap();
    assert!(
        matches!(free[2], BatchAnswer::Executed { .. }),
        "{:?}",
        free[2]
    );
    // A mismatched group list is refused before anything runs.
    let err = store
        .transact_batch(
            BatchRequest::new(&reqs(&["d1"])).ordered(&[]),
            ledger(Arc::new(AtomicU32::new(0)), &[], &[]),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, dedup_core::StoreError::Input(_)), "{err:?}");
}

/// A key another holder has (a live lease) answers InFlight and holds back its group's later
/// message; a poisoned message that fails the whole call does the same once the halving finds
/// it, and the messages before it commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn an_ordered_batch_holds_back_behind_a_held_key_and_a_poisoned_message(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let _lease = acquired(store.claim(&reqs(&["h1"])[0]).await.unwrap());
    let calls = Arc::new(AtomicU32::new(0));
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&["h1", "h2", "c1", "p1", "p2", "p3"]))
                .ordered(&[7, 7, 8, 9, 9, 9]),
            ledger(calls, &["p2"], &[]),
        )
        .await
        .unwrap();
    assert!(
        matches!(answers[0], BatchAnswer::InFlight),
        "{:?}",
        answers[0]
    );
    assert!(
        matches!(answers[1], BatchAnswer::Deferred),
        "{:?}",
        answers[1]
    );
    assert!(
        matches!(answers[2], BatchAnswer::Executed { .. }),
        "{:?}",
        answers[2]
    );
    assert!(
        matches!(answers[3], BatchAnswer::Executed { .. }),
        "{:?}",
        answers[3]
    );
    assert!(
        matches!(
            answers[4],
            BatchAnswer::Handler {
                after: AfterHandlerError::Failed { .. },
                ..
            }
        ),
        "{:?}",
        answers[4]
    );
    assert!(
        matches!(answers[5], BatchAnswer::Deferred),
        "{:?}",
        answers[5]
    );
    for k in ["h2", "p3"] {
        assert!(
            store.get(&key(k)).await.unwrap().is_none(),
            "{k} was given back"
        );
    }
    let mut rows: Vec<String> = effect_rows(&pool)
        .await
        .into_iter()
        .map(|(k, _, _)| k)
        .collect();
    rows.sort();
    assert_eq!(rows, ["c1", "p1"]);
}

/// A fresh key (no row when the batch read it) is written only at the end, COMPLETED at once. A
/// lease-mode claim that takes no advisory lock can write it in the meantime: the batch then
/// fails whole, retryably, writing nothing, and run again it finds the key held.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_fresh_key_claimed_by_another_writer_during_the_batch_fails_it_whole(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let handler = racing(store.clone());
    let err = store
        .transact_batch(BatchRequest::new(&reqs(&["x", "y"])), handler)
        .await
        .expect_err("the batch must not commit over the other writer's row");
    assert!(err.is_retryable() && !err.is_outcome_unknown(), "{err:?}");
    assert!(
        effect_rows(&pool).await.is_empty(),
        "nothing of the batch was written"
    );
    assert!(store.get(&key("y")).await.unwrap().is_none());
    let x = store.get(&key("x")).await.unwrap().unwrap();
    assert_eq!(
        x.state,
        State::InProgress,
        "the other writer's claim stands"
    );
    let again = store
        .transact_batch(
            BatchRequest::new(&reqs(&["x", "y"])),
            ledger(Arc::new(AtomicU32::new(0)), &[], &[]),
        )
        .await
        .unwrap();
    assert!(matches!(again[0], BatchAnswer::InFlight), "{:?}", again[0]);
    assert!(
        matches!(again[1], BatchAnswer::Executed { attempts: 1, .. }),
        "{:?}",
        again[1]
    );
    let y = store.get(&key("y")).await.unwrap().unwrap();
    assert_eq!((y.state, y.attempts), (State::Completed, 1));
}

/// A batch handler that, on its first call, lets a lease-mode claim of "x" commit on another
/// connection, then writes every message's effect.
fn racing(
    other: PgStore,
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    let mut raced = false;
    move |tx, leases| {
        let race = (!raced).then(|| other.clone());
        raced = true;
        Box::pin(async move {
            if let Some(other) = race {
                acquired(other.claim(&reqs(&["x"])[0]).await.unwrap());
            }
            for l in leases {
                let name = String::from_utf8(l.key.key_bytes().to_vec()).unwrap();
                crate::support::insert_effect(&mut *tx, &name, l.token, "batch")
                    .await
                    .unwrap();
            }
            Ok(leases.iter().map(|_| Ok(Bytes::from("ok"))).collect())
        })
    }
}

/// Writes of the test's own in a batch's transaction: each call is noted with what it was told
/// settles, and writes a row of it (`batch_writes`), or fails when `fail` is set.
#[derive(Debug, Default)]
struct Noting {
    told: std::sync::Mutex<Vec<Vec<bool>>>,
    fail: bool,
}

impl BatchWrites for Noting {
    fn write<'c>(&'c self, tx: &'c mut PgConnection, settled: &'c [bool]) -> BatchWritesFuture<'c> {
        Box::pin(async move {
            self.told.lock().unwrap().push(settled.to_vec());
            if self.fail {
                // A statement that fails: the transaction is aborted and the batch fails.
                sqlx::query("SELECT 1 / 0")
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| dedup_pg::classify(e, false))?;
            }
            sqlx::query("INSERT INTO batch_writes (settled) VALUES ($1)")
                .bind(settled.to_vec())
                .execute(&mut *tx)
                .await
                .map_err(|e| dedup_pg::classify(e, true))?;
            Ok(1)
        })
    }
}

/// What the batches' own writes committed, in order.
async fn committed_writes(pool: &PgPool) -> Vec<Vec<bool>> {
    sqlx::query_scalar("SELECT settled FROM batch_writes ORDER BY n")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The caller's own writes (`BatchRequest::with_writes`) in an ordered batch: told which messages
/// settle (executed or replayed; not one that failed, retryably or to be dead-lettered, nor one
/// held behind its group), made in the transaction that commits, once; a write that fails fails
/// the batch whole, effects included.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batchs_own_writes_are_told_what_settles_and_commit_with_it(pool: PgPool) {
    effects_table(&pool).await;
    sqlx::query("CREATE TABLE batch_writes (n bigserial PRIMARY KEY, settled bool[] NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = PgStore::new(pool.clone());
    let calls = Arc::new(AtomicU32::new(0));
    // "c" fails retryably; "d" is in a group of its own and runs; "e" waits behind "c".
    let r = reqs(&["a", "b", "c", "d", "e"]);
    let noting = Noting::default();
    store
        .transact_batch(
            BatchRequest::new(&r)
                .ordered(&[0, 1, 2, 3, 2])
                .with_writes(&noting),
            ledger(calls.clone(), &[], &["c"]),
        )
        .await
        .unwrap();
    let settled = vec![true, true, false, true, false];
    assert_eq!(committed_writes(&pool).await, vec![settled.clone()]);
    assert_eq!(noting.told.lock().unwrap().last(), Some(&settled));
    // Replays settle; a message failing for good (to be dead-lettered) does not.
    let r = reqs(&["a", "p", "h"]);
    let noting = Noting::default();
    let answers = store
        .transact_batch(
            BatchRequest::new(&r)
                .ordered(&[0, 1, 2])
                .with_writes(&noting),
            ledger(calls.clone(), &["p"], &[]),
        )
        .await
        .unwrap();
    assert!(
        matches!(answers[0], BatchAnswer::Replayed { .. }),
        "{answers:?}"
    );
    assert!(
        matches!(
            answers[1],
            BatchAnswer::Handler {
                after: AfterHandlerError::Failed { .. },
                ..
            }
        ),
        "{answers:?}"
    );
    assert_eq!(
        committed_writes(&pool).await.last(),
        Some(&vec![true, false, true])
    );
    // A write that fails fails the batch: nothing of it commits.
    let before = effect_rows(&pool).await.len();
    let r = reqs(&["x", "y"]);
    let failing = Noting {
        fail: true,
        ..Noting::default()
    };
    let err = store
        .transact_batch(
            BatchRequest::new(&r).with_writes(&failing),
            ledger(calls, &[], &[]),
        )
        .await;
    assert!(err.is_err(), "{err:?}");
    assert_eq!(
        effect_rows(&pool).await.len(),
        before,
        "no effect of it committed"
    );
    assert_eq!(committed_writes(&pool).await.len(), 2);
    assert!(!failing.told.lock().unwrap().is_empty());
}

/// The caller's own writes in a batch without ordering groups: a failed message holds back no
/// other, and the writes are told so (the one after it settled).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn independent_messages_are_told_apart_to_the_batchs_own_writes(pool: PgPool) {
    effects_table(&pool).await;
    sqlx::query("CREATE TABLE batch_writes (n bigserial PRIMARY KEY, settled bool[] NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = PgStore::new(pool.clone());
    let calls = Arc::new(AtomicU32::new(0));
    let r = reqs(&["a", "b", "c"]);
    let noting = Noting::default();
    let answers = store
        .transact_batch(
            BatchRequest::new(&r).with_writes(&noting),
            ledger(calls, &[], &["b"]),
        )
        .await
        .unwrap();
    assert!(
        matches!(answers[0], BatchAnswer::Executed { .. }),
        "{answers:?}"
    );
    assert!(
        matches!(answers[1], BatchAnswer::Handler { .. }),
        "{answers:?}"
    );
    // Not deferred behind "b": without groups, "c" ran and committed.
    assert!(
        matches!(answers[2], BatchAnswer::Executed { .. }),
        "{answers:?}"
    );
    assert_eq!(committed_writes(&pool).await, vec![vec![true, false, true]]);
}

/// A handler that answers every message as done but left the transaction aborted (it ignored a
/// failed statement, here for "bad"): the batch is not lost, nor dead-lettered whole. It runs
/// again in parts, the message at fault fails alone, and its neighbours commit.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_handler_that_leaves_the_transaction_aborted_fails_only_its_message(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs(&["a", "bad", "c", "d"])),
            ignoring_a_failure(),
        )
        .await
        .unwrap();
    for (i, a) in answers.iter().enumerate() {
        if i == 1 {
            assert!(
                matches!(
                    a,
                    BatchAnswer::Handler {
                        after: AfterHandlerError::Released { attempts: 1 },
                        ..
                    }
                ),
                "{a:?}"
            );
        } else {
            assert!(matches!(a, BatchAnswer::Executed { .. }), "{i}: {a:?}");
        }
    }
    let mut rows: Vec<String> = effect_rows(&pool)
        .await
        .into_iter()
        .map(|(k, _, _)| k)
        .collect();
    rows.sort();
    assert_eq!(rows, ["a", "c", "d"]);
    assert_eq!(
        store.get(&key("bad")).await.unwrap().unwrap().state,
        State::Released
    );
}

/// Writes every message's effect, then, for "bad", runs a statement that fails and ignores the
/// error (the transaction is then aborted), and answers every message as done.
fn ignoring_a_failure()
-> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    move |tx, leases| {
        Box::pin(async move {
            let mut bad = false;
            for l in leases {
                let name = String::from_utf8(l.key.key_bytes().to_vec()).unwrap();
                crate::support::insert_effect(&mut *tx, &name, l.token, "batch")
                    .await
                    .unwrap();
                bad |= name == "bad";
            }
            if bad {
                let _ignored = sqlx::query("SELECT * FROM no_such_table")
                    .execute(&mut *tx)
                    .await;
            }
            Ok(leases.iter().map(|_| Ok(Bytes::from("ok"))).collect())
        })
    }
}
