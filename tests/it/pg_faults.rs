//! Postgres under faults: claims that wait on locks, callers cancelled mid-batch, passing errors
//! raised by a live server, and a server crashed between a handler and its completion.
//!
//! A claim (single and batch) that waited on an uncommitted claim past its lease still gets a
//! live lease; callers cancelled in `Batched` (queued, and in flight) leave no lease behind;
//! a batch takeover that met a row changed after its snapshot grants it once; a read of many
//! records that waited for the table's lock sees what the lock's holder committed;
//! `statement_timeout`, `pg_cancel_backend` and a read-only database raise passing errors and the
//! read-only connection is not reused; a Postgres of the test's own (`support::PgServer`) crashed
//! with `pg_ctl stop -m immediate` between a handler and its completion, and started again: the
//! effect runs once. `an_identity_lock_is_taken_again_after_a_postgres_restart`: a live
//! instance's lock comes back by itself after such a crash and a restart, so a second process
//! with the same identity adopts nothing and the live lease stands.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_core::{
    BatchConfig, Batched, ClaimOutcome, Completion, Dedup, HandlerError, Policy, ProcessError,
    State, Store, StoreError,
};
use dedup_pg::PgStore;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::time::{Instant, sleep};

use crate::support::{PgServer, acquired, bytes, key, ms, req, short_lease, url_of};

/// How many sessions of this test's database wait on a lock now.
async fn lock_waits(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `n` sessions wait on a lock: the interleaving a test needs, observed rather than
/// slept for.
async fn until_lock_waits(pool: &PgPool, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while lock_waits(pool).await != n {
        assert!(Instant::now() < deadline, "never saw {n} lock waits");
        sleep(ms(10)).await;
    }
}

fn in_flight(outcome: &ClaimOutcome) -> bool {
    matches!(outcome, ClaimOutcome::InFlight { .. })
}

/// T1 holds a new key uncommitted (transaction mode) for 2 s, then rolls back. C2 claims it with
/// a 1 s lease meanwhile: its statement waits on T1's row, and its values were computed before
/// the wait. C2 must be granted a lease that runs from when its claim took effect: C3, claiming
/// right after, gets InFlight, and C2's heartbeat succeeds.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_claim_that_waited_on_a_lock_gets_a_lease_from_when_it_took_effect(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let k = key("waited");
    let mut t1 = pool.begin().await.unwrap();
    acquired(PgStore::claim_in(&mut t1, &req(&k, "t1")).await.unwrap());
    let c2 = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move {
            store
                .claim(&req(&k, "c2").with_policy(short_lease(1000)))
                .await
        })
    };
    until_lock_waits(&pool, 1).await;
    sleep(Duration::from_secs(2)).await;
    t1.rollback().await.unwrap();
    let lease = acquired(c2.await.unwrap().unwrap());
    let c3 = store
        .claim(&req(&k, "c3").with_policy(short_lease(1000)))
        .await
        .unwrap();
    assert!(
        in_flight(&c3),
        "C2's lease ended before it was granted: {c3:?}"
    );
    store.extend(&lease).await.expect("C2's heartbeat");
    let rec = store.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.token, lease.token);
    assert_eq!(rec.owner.as_ref().map(|o| o.as_str()), Some("c2"));
}

/// The same through the batch claim: every lease of a batch whose statement waited is granted
/// from when the batch took effect, the key that waited and the one that did not.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_that_waited_on_a_lock_gets_leases_from_when_it_took_effect(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let (held, free) = (key("held"), key("free"));
    let mut t1 = pool.begin().await.unwrap();
    acquired(PgStore::claim_in(&mut t1, &req(&held, "t1")).await.unwrap());
    let c2 = {
        let store = store.clone();
        let reqs = vec![
            req(&held, "c2-held").with_policy(short_lease(1000)),
            req(&free, "c2-free").with_policy(short_lease(1000)),
        ];
        tokio::spawn(async move { store.claim_batch(&reqs).await })
    };
    until_lock_waits(&pool, 1).await;
    sleep(Duration::from_secs(2)).await;
    t1.rollback().await.unwrap();
    let leases: Vec<_> = c2
        .await
        .unwrap()
        .into_iter()
        .map(|a| acquired(a.unwrap()))
        .collect();
    for (k, lease) in [&held, &free].into_iter().zip(&leases) {
        let c3 = store
            .claim(&req(k, "c3").with_policy(short_lease(1000)))
            .await
            .unwrap();
        assert!(
            in_flight(&c3),
            "{k}: lease ended before it was granted: {c3:?}"
        );
        store.extend(lease).await.expect("the heartbeat");
    }
}

/// A batch claim's takeover meets a row that a concurrent writer changed after the claim's
/// snapshot: the writer holds the released row locked, the batch's takeover waits on it, the
/// writer commits. Depending on the minor release, the takeover either follows the row to its
/// newest version or leaves the key out and answers it from what it read; then the single-key
/// claim takes it over. Either way the key is granted once, under the token stored, and the keys
/// beside it (a new one, another released one) are granted by the batch.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_takeover_of_a_row_changed_meanwhile_grants_it_once(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let (changed, other, fresh) = (key("changed"), key("other"), key("fresh"));
    for k in [&changed, &other] {
        let lease = acquired(store.claim(&req(k, "first")).await.unwrap());
        store.fail_retryable(&lease, "boom").await.unwrap();
    }
    let mut writer = pool.begin().await.unwrap();
    sqlx::query("UPDATE dedup_records SET updated_at = now() WHERE key = $1")
        .bind(changed.key_bytes())
        .execute(&mut *writer)
        .await
        .unwrap();
    let batch = {
        let store = store.clone();
        let reqs = vec![req(&changed, "b"), req(&other, "b"), req(&fresh, "b")];
        tokio::spawn(async move { store.claim_batch(&reqs).await })
    };
    until_lock_waits(&pool, 1).await;
    writer.commit().await.unwrap();
    let leases: Vec<_> = batch
        .await
        .unwrap()
        .into_iter()
        .map(|a| acquired(a.unwrap()))
        .collect();
    for (k, lease) in [&changed, &other, &fresh].into_iter().zip(&leases) {
        let record = store.get(k).await.unwrap().unwrap();
        assert_eq!(record.state, State::InProgress, "{k}");
        assert_eq!(record.token, lease.token, "{k}: the lease holds the key");
        assert_eq!(record.owner.as_ref().map(|o| o.as_str()), Some("b"), "{k}");
        let attempts = if k == &fresh { 1 } else { 2 };
        assert_eq!(lease.attempts, attempts, "{k}: one attempt spent per grant");
        store
            .complete(lease, b"done")
            .await
            .expect("the lease completes");
    }
    // One grant each: a second claim finds every key done.
    for k in [&changed, &other, &fresh] {
        let again = store.claim(&req(k, "late")).await.unwrap();
        assert!(
            matches!(again, ClaimOutcome::Completed { .. }),
            "{k}: {again:?}"
        );
    }
}

/// A caller cancelled while its claim waits in `Batched`'s queue withdraws it before the flush
/// (nothing reaches Postgres); one cancelled while its claim is in a flush has the lease it was
/// granted given back, without spending an attempt.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn cancelled_callers_leave_no_lease_behind_in_batched(pool: PgPool) {
    let store = Arc::new(Batched::new(
        PgStore::new(pool.clone()),
        BatchConfig::default().with_max_flushes(1),
    ));
    let (x, x2, queued, flushed) = (key("x"), key("x2"), key("queued"), key("flushed"));
    // T1 holds x: the leader's batch of x waits on it, holding the only flush slot.
    let mut t1 = pool.begin().await.unwrap();
    acquired(PgStore::claim_in(&mut t1, &req(&x, "t1")).await.unwrap());
    let leader = {
        let (store, x) = (Arc::clone(&store), x.clone());
        tokio::spawn(async move { store.claim(&req(&x, "leader")).await })
    };
    until_lock_waits(&pool, 1).await;
    // A caller queues (one poll) and is cancelled before any flush takes it.
    let req_queued = req(&queued, "cancelled-while-queued");
    let mut cancelled = Box::pin(store.claim(&req_queued));
    assert!(
        tokio::time::timeout(Duration::ZERO, &mut cancelled)
            .await
            .is_err()
    );
    drop(cancelled);
    // Another caller queues and stays, not polled again, while its batch runs.
    let req_flushed = req(&flushed, "cancelled-in-flight");
    let mut in_flight_caller = Box::pin(store.claim(&req_flushed));
    assert!(
        tokio::time::timeout(Duration::ZERO, &mut in_flight_caller)
            .await
            .is_err()
    );
    // T2 holds x2: the next batch (x2 and `flushed`) will wait on it.
    let mut t2 = pool.begin().await.unwrap();
    acquired(PgStore::claim_in(&mut t2, &req(&x2, "t2")).await.unwrap());
    let next = {
        let (store, x2) = (Arc::clone(&store), x2.clone());
        tokio::spawn(async move { store.claim(&req(&x2, "next")).await })
    };
    t1.rollback().await.unwrap();
    acquired(leader.await.unwrap().unwrap());
    // `next` leads the second batch (the other caller is not polled), which waits on T2.
    until_lock_waits(&pool, 1).await;
    drop(in_flight_caller);
    t2.rollback().await.unwrap();
    acquired(next.await.unwrap().unwrap());
    let counts = store.batch_counts();
    let (calls, claims) = (counts.claim_calls, counts.claims);
    assert_eq!(
        (calls, claims),
        (2, 3),
        "two batches, [x] and [flushed, x2]: the queued claim never went"
    );
    assert_eq!(store.get(&queued).await.unwrap(), None, "never sent");
    assert_eq!(
        store.get(&flushed).await.unwrap(),
        None,
        "granted in flight, then given back with its attempt"
    );
    let again = acquired(store.claim(&req(&flushed, "later")).await.unwrap());
    assert_eq!(again.attempts, 1);
}

fn assert_passing(e: &StoreError, code: &str) {
    assert!(
        e.is_retryable() && !e.is_outcome_unknown() && !e.is_lease_lost(),
        "{code} must be a passing error that did not apply: {e:?}"
    );
    assert_eq!(dedup_pg::sqlstate(e).as_deref(), Some(code), "{e:?}");
}

/// A statement timeout and a cancelled query (SQLSTATE 57014) are passing errors: retried, never
/// taken for a permanent failure.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_statement_timeout_and_a_cancelled_query_are_passing_errors(pool: PgPool) {
    let k = key("held");
    let mut t1 = pool.begin().await.unwrap();
    acquired(PgStore::claim_in(&mut t1, &req(&k, "t1")).await.unwrap());

    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET statement_timeout = '200ms'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let e = PgStore::claim_in(&mut conn, &req(&k, "c"))
        .await
        .unwrap_err();
    assert_passing(&e, "57014");
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await
        .unwrap();

    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move { PgStore::claim_in(&mut conn, &req(&k, "c")).await })
    };
    until_lock_waits(&pool, 1).await;
    let cancelled: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(cancelled);
    assert_passing(&waiting.await.unwrap().unwrap_err(), "57014");
    t1.rollback().await.unwrap();

    // In the consumer API a passing error is retryable: the runner retries, never dead-letters.
    let err = ProcessError::<String>::Store(e);
    assert!(err.is_retryable());
}

/// A read-only server (SQLSTATE 25006, as a primary demoted in a failover answers) is a passing
/// error; the connection that saw it is closed, not reused, so once the database takes writes
/// again the next call succeeds on a new connection. A handler's transaction that meets it gives
/// its key back without spending an attempt.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_read_only_server_is_passing_and_its_connection_is_discarded(pool: PgPool) {
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let read_only = |on: bool| {
        let (pool, db) = (pool.clone(), db.clone());
        async move {
            let sql = if on {
                format!("ALTER DATABASE \"{db}\" SET default_transaction_read_only = on")
            } else {
                format!("ALTER DATABASE \"{db}\" RESET default_transaction_read_only")
            };
            // The name is the database sqlx::test made, quoted.
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    let url = url_of(&pool);
    let one_connection = || PgPoolOptions::new().max_connections(1).connect(&url);

    read_only(true).await;
    let ro = one_connection().await.unwrap();
    let store = PgStore::new(ro.clone());
    let e = store.claim(&req(&key("k"), "a")).await.unwrap_err();
    assert_passing(&e, "25006");
    read_only(false).await;
    // Its one connection still has the read-only default it started with: had it been returned
    // to the pool, this claim would fail the same way.
    acquired(store.claim(&req(&key("k"), "b")).await.unwrap());

    // A handler whose transaction meets the read-only server: nothing ran, and the key is given
    // back with its attempt, so passing errors alone never exhaust a healthy message.
    read_only(true).await;
    let ro_handler_store = PgStore::new(one_connection().await.unwrap());
    read_only(false).await;
    let dedup = Dedup::new(PgStore::new(pool.clone()));
    let k = key("effect");
    let err = dedup
        .process(&k, None, |lease| {
            let s = ro_handler_store.clone();
            async move {
                s.transact(&lease, |_tx| Box::pin(async { Ok(bytes("booked")) }))
                    .await
            }
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ProcessError::<String>::Store(e) if e.is_retryable()),
        "{err:?}"
    );
    assert_eq!(
        dedup.store().get(&k).await.unwrap(),
        None,
        "no attempt spent"
    );
    let done = dedup
        .process(&k, None, |_| async {
            Ok::<_, HandlerError<String>>(Completion::store(bytes("booked")))
        })
        .await
        .unwrap();
    assert!(matches!(
        done,
        dedup_core::Processed::Executed { attempts: 1, .. }
    ));
}

/// Postgres crashes (`pg_ctl stop -m immediate`) right after a handler's external effect and
/// comes back a second later, well inside the lease. dedup keeps the lease and keeps trying to
/// record the completion until it lands; a redelivery after the lease would have lapsed replays
/// the result: the effect ran exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_between_handler_and_completion_runs_the_effect_once() {
    let pg = Arc::new(PgServer::start());
    let pool = pg.migrated_pool().await;
    let lease = Duration::from_secs(6);
    let dedup = Dedup::new(PgStore::new(pool.clone()))
        .with_policy(Policy::default().with_lease(lease))
        .unwrap()
        .with_in_flight_wait(Duration::from_secs(30))
        .unwrap();
    let effects = Arc::new(AtomicU32::new(0));
    let k = key("payment-1");
    let restarted = {
        let (pg, effects) = (Arc::clone(&pg), Arc::clone(&effects));
        let mut restart = None;
        let done = dedup
            .process(&k, None, |_| {
                effects.fetch_add(1, Ordering::SeqCst);
                pg.crash();
                let pg = Arc::clone(&pg);
                restart = Some(tokio::task::spawn_blocking(move || {
                    std::thread::sleep(Duration::from_secs(1));
                    pg.start_again();
                }));
                async { Ok::<_, HandlerError<String>>(Completion::store(bytes("paid"))) }
            })
            .await
            .unwrap();
        assert!(done.executed(), "{done:?}");
        restart
    };
    restarted.unwrap().await.unwrap();
    // Past the point where the lease would have lapsed had the completion been given up.
    sleep(lease + Duration::from_secs(1)).await;
    let again = dedup
        .process(&k, None, |_| {
            effects.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError<String>>(Completion::store(bytes("paid twice"))) }
        })
        .await
        .unwrap();
    assert_eq!(again.result(), &bytes("paid"));
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect ran once");
    let rec = dedup.store().get(&k).await.unwrap().unwrap();
    assert_eq!(rec.state, State::Completed);
}

/// How many instance-identity locks (`pg_try_advisory_lock(class, hashtext(id))`) the server
/// grants now.
async fn identity_locks(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = 1684366453",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A live instance holds its identity's session lock; Postgres crashes (`pg_ctl stop -m
/// immediate`, every session and so every session lock gone) and comes back. The instance takes
/// its lock again by itself, without an `adopt`: a second process started with the same identity
/// afterwards adopts nothing, and the live instance's lease stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_lock_is_taken_again_after_a_postgres_restart() {
    let pg = PgServer::start();
    let pool = pg.migrated_pool().await;
    let id = dedup_core::InstanceId::new("node-r").unwrap();
    let live = Dedup::new(PgStore::new(pool.clone())).with_instance(id.clone());
    assert_eq!(live.adopt().await.unwrap().adopted(), 0);
    let k = key("order-r");
    let held = live
        .store()
        .claim(&req(&k, &format!("{}#1", live.owner_prefix())).with_policy(short_lease(600_000)))
        .await
        .unwrap();
    acquired(held);
    assert_eq!(identity_locks(&pool).await, 1);

    pg.crash();
    pg.start_again();
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query("SELECT 1").execute(&pool).await.is_err() || identity_locks(&pool).await != 1
    {
        assert!(
            Instant::now() < deadline,
            "the live instance never took its identity lock again"
        );
        sleep(ms(100)).await;
    }

    let successor = Dedup::new(PgStore::new(pool.clone()))
        .with_instance(id)
        .with_in_flight_wait(Duration::ZERO)
        .unwrap();
    assert_eq!(
        successor.adopt().await.unwrap(),
        dedup_core::Adoption::HeldElsewhere
    );
    let again = successor.store().claim(&req(&k, "other")).await.unwrap();
    assert!(
        in_flight(&again),
        "the live instance's lease stands: {again:?}"
    );
}

/// A read of many records that waited for a writer holding the table's lock (the ranges'
/// maintenance moves records between partitions under it) answers what that writer committed:
/// the read takes its snapshot after the wait (migration 20261202000001). Declared STABLE, it
/// read with the snapshot its caller's statement took before the wait, and the record was missing.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_read_of_many_that_waited_for_the_tables_lock_sees_what_the_holder_committed(
    pool: PgPool,
) {
    let reads = PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let store = PgStore::new(reads.clone());
    let k = key("moved-under-the-lock");
    // The connection's plan made first, as a pooled connection's is.
    assert!(store.get_many([&k]).await.unwrap().is_empty());
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO dedup_records (scope, key, kt, state, token, attempts, result, created_at, \
         updated_at, expires_at) VALUES ($1, $2, dedup_kt($2), 'completed', \
         nextval('dedup_token_seq'), 1, '\\x6f6b', now(), now(), now() + interval '1 day')",
    )
    .bind(k.scope().as_str())
    .bind(k.key_bytes())
    .execute(&mut *holder)
    .await
    .unwrap();
    let read = {
        let k = k.clone();
        tokio::spawn(async move { store.get_many([&k]).await })
    };
    sleep(ms(300)).await;
    assert!(!read.is_finished(), "the read waits for the table's lock");
    holder.commit().await.unwrap();
    let got = read.await.unwrap().unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[&k].result.as_deref(), Some(&b"ok"[..]));
    reads.close().await;
}
