//! One key claimed inside a transaction held open for the caller's writes
//! (`PgStore::begin_claim`, the HTTP layer's transactional path): the claim, the effect and the
//! completion in one commit.
//!
//! A fresh key is held with nothing committed until the commit, and a second claimer answers
//! InFlight at once; committed, it is COMPLETED with the effect; rolled back, it is free again
//! with no attempt spent; a key done before is answered from its record, and one reused with
//! another payload is refused; a lease that ran out is taken over under a higher token, and a
//! live one answers InFlight; a lease-mode claim that writes the fresh key meanwhile makes the
//! commit fail, retryably, with nothing of the transaction kept.

use std::time::Duration;

use dedup_core::{ClaimOutcome, Fingerprint, State, Store};
use dedup_pg::{ClaimedTx, PgStore, TxBatchConfig, TxClaim};
use sqlx::PgPool;

use crate::support::{acquired, effect_rows, effects_table, key, req, short_lease};

async fn claimed(store: &PgStore, r: &dedup_core::ClaimRequest) -> ClaimedTx {
    match store
        .begin_claim(r, TxBatchConfig::default())
        .await
        .unwrap()
    {
        TxClaim::Acquired(tx) => tx,
        other => panic!("expected the key held, got {other:?}"),
    }
}

async fn answered(store: &PgStore, r: &dedup_core::ClaimRequest) -> ClaimOutcome {
    match store
        .begin_claim(r, TxBatchConfig::default())
        .await
        .unwrap()
    {
        TxClaim::Answered(outcome) => outcome,
        other => panic!("expected an answer, got {other:?}"),
    }
}

/// A pool of one connection on `pool`'s database: whatever it hands out next is the session the
/// last user gave back.
async fn one_connection(pool: &PgPool) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

async fn effect(tx: &mut ClaimedTx, name: &str) {
    let token = i64::try_from(tx.lease().token.get()).unwrap();
    sqlx::query("INSERT INTO effects VALUES ($1, $2, 'tx')")
        .bind(name)
        .bind(token)
        .execute(&mut **tx)
        .await
        .unwrap();
}

/// A fresh key: held in the open transaction with nothing committed (the record is absent to
/// everyone else), a second claimer answered InFlight at once; the commit writes the effect and
/// the COMPLETED record together, and the key is answered from it afterwards.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_fresh_key_commits_its_claim_effect_and_completion_at_once(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("one");
    let r = req(&k, "w1").with_fingerprint(Some(Fingerprint::of(b"a")));
    let mut tx = claimed(&store, &r).await;
    assert_eq!(tx.lease().attempts, 1);
    effect(&mut tx, "one").await;
    assert!(
        store.get(&k).await.unwrap().is_none(),
        "nothing committed yet"
    );
    let started = std::time::Instant::now();
    let other = answered(&store, &req(&k, "w2")).await;
    assert!(matches!(other, ClaimOutcome::InFlight { .. }), "{other:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a held key answers at once, not after a lock wait"
    );
    let token = tx.lease().token;
    tx.commit(b"done").await.unwrap();
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.token, record.result.as_deref()),
        (State::Completed, token, Some(&b"done"[..]))
    );
    assert_eq!(effect_rows(&pool).await.len(), 1);
    match answered(&store, &r).await {
        ClaimOutcome::Completed {
            result, token: t, ..
        } => {
            assert_eq!((&result[..], t), (&b"done"[..], token));
        }
        other => panic!("{other:?}"),
    }
    let reused = req(&k, "w3").with_fingerprint(Some(Fingerprint::of(b"b")));
    assert!(matches!(
        answered(&store, &reused).await,
        ClaimOutcome::PayloadMismatch
    ));
}

/// Rolled back (or dropped), nothing stays: no record, no effect, and the next claim finds the
/// key fresh, on its first attempt.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_rolled_back_or_dropped_claim_leaves_nothing_and_spends_no_attempt(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("two");
    let mut tx = claimed(&store, &req(&k, "w1")).await;
    effect(&mut tx, "two").await;
    tx.rollback().await;
    let mut tx = claimed(&store, &req(&k, "w2")).await;
    assert_eq!(tx.lease().attempts, 1);
    effect(&mut tx, "two").await;
    drop(tx);
    // The dropped transaction's connection goes back to the pool, which rolls it back.
    let tx = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match store
                .begin_claim(&req(&k, "w3"), TxBatchConfig::default())
                .await
                .unwrap()
            {
                TxClaim::Acquired(tx) => break tx,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .expect("the dropped transaction let go of the key");
    assert_eq!(tx.lease().attempts, 1);
    tx.rollback().await;
    assert!(store.get(&k).await.unwrap().is_none());
    assert!(effect_rows(&pool).await.is_empty());
}

/// A key with a record: a live lease-mode lease answers InFlight; once it ran out, the key is
/// taken over in the transaction under a higher token, on the next attempt, and the old holder's
/// completion is refused.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_lease_that_ran_out_is_taken_over_and_a_live_one_answers_in_flight(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("three");
    let old = acquired(
        store
            .claim(&req(&k, "lease").with_policy(short_lease(300)))
            .await
            .unwrap(),
    );
    assert!(matches!(
        answered(&store, &req(&k, "w1")).await,
        ClaimOutcome::InFlight { .. }
    ));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut tx = claimed(&store, &req(&k, "w2")).await;
    assert!(tx.lease().token > old.token);
    assert_eq!(tx.lease().attempts, 2);
    effect(&mut tx, "three").await;
    tx.commit(b"taken over").await.unwrap();
    assert!(store.complete(&old, b"zombie").await.is_err());
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(record.result.as_deref(), Some(&b"taken over"[..]));
}

/// A lease-mode claim (which takes no advisory lock) writes the fresh key while the
/// transaction holds it: the commit fails retryably and nothing of the transaction stays; the
/// lease-mode holder keeps the key.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_fresh_key_claimed_in_lease_mode_meanwhile_fails_the_commit(pool: PgPool) {
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("four");
    let mut tx = claimed(&store, &req(&k, "tx")).await;
    effect(&mut tx, "four").await;
    let lease = acquired(store.claim(&req(&k, "lease")).await.unwrap());
    let err = tx.commit(b"mine").await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(
        effect_rows(&pool).await.is_empty(),
        "the effect rolled back"
    );
    store.complete(&lease, b"theirs").await.unwrap();
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(record.result.as_deref(), Some(&b"theirs"[..]));
}

/// A failed attempt is recorded in a transaction of its own (`ClaimedTx::fail`): a fresh key is
/// written as released with its first attempt, the next claim is its second, and past the
/// policy's attempts the key fails for good and is answered so.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn failed_attempts_are_recorded_and_a_key_out_of_attempts_fails(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let k = key("five");
    let r = req(&k, "w1").with_policy(dedup_core::Policy::default().with_max_attempts(2));
    let tx = claimed(&store, &r).await;
    assert_eq!(
        tx.fail("panicked", false).await.unwrap(),
        dedup_core::AfterFailure::Released { attempts: 1 }
    );
    let tx = claimed(&store, &r).await;
    assert_eq!(tx.lease().attempts, 2);
    assert!(matches!(
        tx.fail("panicked again", false).await.unwrap(),
        dedup_core::AfterFailure::Failed { .. }
    ));
    assert!(matches!(
        answered(&store, &r).await,
        ClaimOutcome::Failed { .. }
    ));
    let k = key("six");
    let tx = claimed(&store, &req(&k, "w1")).await;
    assert!(matches!(
        tx.fail("cannot be stored", true).await.unwrap(),
        dedup_core::AfterFailure::Failed { .. }
    ));
    assert_eq!(store.get(&k).await.unwrap().unwrap().state, State::Failed);
}

/// A lease longer than Postgres's idle bound can hold (an `int` of milliseconds, 24.8 days)
/// bounds the transaction at that, rather than failing every claim.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_lease_past_the_servers_bound_still_claims(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let k = key("seven");
    let config = TxBatchConfig::default().with_idle_timeout(Duration::from_secs(40 * 24 * 3600));
    let tx = match store.begin_claim(&req(&k, "w1"), config).await.unwrap() {
        TxClaim::Acquired(tx) => tx,
        other => panic!("{other:?}"),
    };
    tx.commit(b"ok").await.unwrap();
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().state,
        State::Completed
    );
}

/// The claim and a fresh key's completion go to Postgres as simple queries with the scope, the
/// key, the fingerprint and the result written as hex: a scope with quotes and non-ASCII text, a
/// key and a result of every byte value (quotes, backslashes, NUL) are stored exactly; the key is
/// locked under the hash transaction mode's batches take (a batch finds it InFlight while the
/// request holds it), and afterwards the batch replays the request's result.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn any_scope_key_and_result_round_trips_and_locks_as_a_batch_does(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let scope = dedup_core::Scope::new("it's a \"scope\" \\ ünïcödé; DROP TABLE x; --").unwrap();
    let bytes: Vec<u8> = (0..=255u8).collect();
    let k = dedup_core::IdempotencyKey::new(scope, &bytes).unwrap();
    let fingerprint = Some(Fingerprint::of(b"payload"));
    let r = req(&k, "w1").with_fingerprint(fingerprint);
    let tx = claimed(&store, &r).await;
    let batch = [r.clone()];
    let answers = store
        .transact_batch(
            dedup_pg::BatchRequest::new(&batch),
            |_tx: &mut sqlx::PgConnection,
             leases: &[dedup_core::Lease]|
             -> dedup_pg::BatchBody<'_, crate::support::Boom> {
                let n = leases.len();
                Box::pin(
                    async move { Ok((0..n).map(|_| Ok(bytes::Bytes::from("batch"))).collect()) },
                )
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(answers[0], dedup_pg::BatchAnswer::InFlight),
        "the batch takes the same lock: {:?}",
        answers[0]
    );
    let token = tx.lease().token;
    let result: Vec<u8> = bytes.iter().rev().copied().chain(*b"'\\x00'; --").collect();
    tx.commit(&result).await.unwrap();
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (
            record.state,
            record.token,
            record.result.as_deref(),
            record.fingerprint
        ),
        (State::Completed, token, Some(&result[..]), fingerprint)
    );
    let answers = store
        .transact_batch(
            dedup_pg::BatchRequest::new(&batch),
            |_tx: &mut sqlx::PgConnection,
             _: &[dedup_core::Lease]|
             -> dedup_pg::BatchBody<'_, crate::support::Boom> {
                Box::pin(async { panic!("a completed key does not run again") })
            },
        )
        .await
        .unwrap();
    assert!(
        matches!(&answers[0], dedup_pg::BatchAnswer::Replayed { result: r, .. } if r[..] == result[..]),
        "{:?}",
        answers[0]
    );
}

/// A constraint of the caller's own that fails only at COMMIT (deferred) is its error, not a
/// key taken meanwhile: final (a retry would fail the same way), with nothing committed, and the
/// key free for the next claim, still on its first attempt.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_deferred_constraint_failing_at_the_commit_is_the_callers_error(pool: PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE orders (id int, CONSTRAINT one_order UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let store = PgStore::new(pool.clone());
    let k = key("deferred");
    let mut tx = claimed(&store, &req(&k, "w1")).await;
    sqlx::raw_sql("INSERT INTO orders VALUES (1), (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = tx.commit(b"ordered").await.unwrap_err();
    assert!(
        !err.is_retryable() && !err.is_outcome_unknown(),
        "the route's own violation, not a taken key: {err}"
    );
    assert!(store.get(&k).await.unwrap().is_none(), "nothing committed");
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 0);
    let tx = claimed(&store, &req(&k, "w2")).await;
    assert_eq!(tx.lease().attempts, 1);
    tx.rollback().await;
}

/// A commit whose future is dropped while Postgres has not answered (here: its insert waits on a
/// lease-mode claim of the key, uncommitted in another transaction) closes its connection: the
/// pool never hands out that session again, open or aborted, and nothing of it is kept.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_commit_dropped_before_postgres_answered_closes_its_connection(pool: PgPool) {
    effects_table(&pool).await;
    let one = one_connection(&pool).await;
    let store = PgStore::new(one.clone());
    let k = key("dropped");
    let mut tx = claimed(&store, &req(&k, "tx")).await;
    effect(&mut tx, "dropped").await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let mut other = pool.begin().await.unwrap();
    let lease = acquired(
        PgStore::claim_in(&mut other, &req(&k, "lease"))
            .await
            .unwrap(),
    );
    let waited = tokio::time::timeout(Duration::from_millis(300), tx.commit(b"mine")).await;
    assert!(waited.is_err(), "the insert waits on the other claim");
    other.rollback().await.unwrap();
    drop(lease);
    let next: i32 = tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&one),
    )
    .await
    .expect("the pool hands out a connection")
    .unwrap();
    assert_ne!(
        next, pid,
        "the dropped commit's session is not pooled again"
    );
    one.close().await;
}

/// A caller that opens a transaction of its own on the claim's connection (sqlx's
/// `Connection::begin`, as composable repository code does) gets a savepoint, not a second BEGIN:
/// its COMMIT does not commit the claim's transaction early (which would let go of the key with
/// the effect written and no record, so that a retry ran it again), and its rollback undoes only
/// its own writes. Nothing is visible to anyone else until the claim commits, the key stays held,
/// and the connection goes back to the pool outside any transaction.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_nested_transaction_is_a_savepoint_and_commits_nothing_early(pool: PgPool) {
    use sqlx::Connection as _;
    effects_table(&pool).await;
    let one = one_connection(&pool).await;
    let store = PgStore::new(one.clone());
    let k = key("nested");
    let mut tx = claimed(&store, &req(&k, "tx")).await;
    {
        let mut inner = (*tx).begin().await.unwrap();
        sqlx::query("INSERT INTO effects VALUES ('nested', 1, 'inner')")
            .execute(&mut *inner)
            .await
            .unwrap();
        inner.commit().await.unwrap();
    }
    {
        let mut undone = (*tx).begin().await.unwrap();
        sqlx::query("INSERT INTO effects VALUES ('undone', 1, 'inner')")
            .execute(&mut *undone)
            .await
            .unwrap();
        undone.rollback().await.unwrap();
    }
    assert!(
        effect_rows(&pool).await.is_empty(),
        "the nested COMMIT committed nothing: the effect waits for the claim's commit"
    );
    let other = answered(&PgStore::new(pool.clone()), &req(&k, "w2")).await;
    assert!(
        matches!(other, ClaimOutcome::InFlight { .. }),
        "the key is still held after the nested commit: {other:?}"
    );
    tx.commit(b"done").await.unwrap();
    assert_eq!(
        effect_rows(&pool).await,
        vec![("nested".to_owned(), 1, "inner".to_owned())]
    );
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(record.state, State::Completed);
    // The pooled connection is outside any transaction, and sqlx knows it: a transaction begun
    // on it is a real one.
    let mut conn = one.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "idle", "the session is outside a transaction");
    let mut fresh = conn.begin().await.unwrap();
    sqlx::query("INSERT INTO effects VALUES ('after', 1, 'next')")
        .execute(&mut *fresh)
        .await
        .unwrap();
    fresh.commit().await.unwrap();
    drop(conn);
    assert_eq!(effect_rows(&pool).await.len(), 2);
    one.close().await;
}

/// A nested `begin()` that fails (here `begin_with` a BEGIN statement, which sqlx refuses inside
/// a transaction) makes sqlx's guard roll back the whole claim's transaction. The commit then
/// refuses, with a final error, rather than write the key COMPLETED on its own over what the
/// caller's later writes left; the key has no record and is free again.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_claim_rolled_back_under_its_caller_refuses_to_commit(pool: PgPool) {
    use sqlx::Connection as _;
    effects_table(&pool).await;
    let store = PgStore::new(pool.clone());
    let k = key("under");
    let mut tx = claimed(&store, &req(&k, "tx")).await;
    effect(&mut tx, "before").await;
    let refused = (*tx)
        .begin_with("BEGIN ISOLATION LEVEL SERIALIZABLE")
        .await
        .is_err();
    assert!(
        refused,
        "sqlx refuses a BEGIN statement inside a transaction"
    );
    let err = tx.commit(b"done").await.unwrap_err();
    assert!(
        !err.is_retryable() && !err.is_outcome_unknown(),
        "a final error: {err}"
    );
    assert!(err.to_string().contains("rolled back under"), "{err}");
    assert!(store.get(&k).await.unwrap().is_none(), "no record written");
    assert!(
        effect_rows(&pool).await.is_empty(),
        "the first write rolled back"
    );
    let again = claimed(&store, &req(&k, "next")).await;
    again.rollback().await;
}
