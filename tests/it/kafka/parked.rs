//! Parking: a message that keeps failing is parked in Postgres and its partition moves on; later
//! messages of its ordering key are parked behind it; the partition's owner re-runs them in order
//! (docs/PARKING.md).
//!
//! On both brokers: one account failing while 10,000 messages of 50 others on its partition
//! settle and the offsets pass it, then its five messages in order; a parked key's new messages
//! arriving in waves, all in offset order; a head out of attempts dead-lettered with reason and
//! attempts (one budget, 5 calls) and the key proceeding; the hold policy and an operator's
//! `unpark`; a partition with parked keys moved to another member; a message parked while its
//! key's last parked message completes; the per-key bound (the partition waits, `park_full`, the
//! gauges); consumer processes SIGKILLed after parking and during a parked run.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{HandlerError, LeaseContext, Policy};
use dedup_kafka::{
    AfterGiveUp, Backoff, DLQ_ATTEMPTS, DLQ_REASON, Delivery, Ordering as KeyOrdering,
    ParkedFilter, ParkedQueue, Parking,
};
use dedup_pg::PgStore;
use sqlx::PgPool;

use super::settings::Settings;
use super::{
    Broker, Event, Running, Setup, committed, committed_to_the_end, consumer_args, event,
    eventually, produce, read_dead_letters, setup, unique,
};
use crate::support::RedisServer;

on_brokers!(
    one_failing_key_is_parked_while_ten_thousand_others_flow_then_runs_in_order,
    a_parked_keys_new_messages_keep_parking_behind_it_and_run_in_offset_order,
    a_parked_head_out_of_attempts_is_dead_lettered_and_its_key_proceeds,
    under_the_hold_policy_a_keys_later_messages_wait_for_an_operator,
    a_partition_with_parked_keys_moved_to_another_member_resumes_them_in_order,
    sigkill_after_parking_and_during_a_parked_run_loses_and_doubles_nothing,
    a_message_parked_while_its_keys_last_parked_message_completes_is_not_stranded,
    at_the_per_key_bound_the_partition_waits_and_goes_on_when_the_key_drains,
    under_the_hold_policy_a_message_failing_in_place_for_good_holds_its_key,
    a_permanent_failure_whose_text_postgres_refuses_runs_once_and_is_recorded,
    an_ordering_key_past_a_btree_entrys_limit_parks_and_runs_in_order,
    a_park_fenced_while_the_partition_is_still_ours_keeps_order_and_moves_the_offset,
    under_the_hold_policy_a_give_up_waits_for_parking_room_instead_of_letting_its_key_go_on,
);

/// What the handler books: one row per message, numbered in the order they ran.
async fn booked_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE booked (seq bigserial, key text NOT NULL, account text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// The booked keys of `account`, in the order they ran.
pub(super) async fn booked_of(pool: &PgPool, account: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT key FROM booked WHERE account = $1 ORDER BY seq")
        .bind(account)
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn booked_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM booked")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every key booked once.
async fn assert_booked_once(pool: &PgPool, n: i64) {
    let (rows, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM booked")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!((rows, keys), (n, n), "one row per key");
}

/// The handler's switches: accounts failing (retryably) while their gate is shut, idempotency
/// keys failing for good, and how often each key was called.
#[derive(Default)]
pub(super) struct Switches {
    pub(super) shut: Mutex<HashSet<String>>,
    always: Mutex<HashSet<String>>,
    /// Idempotency keys failing permanently, with the error text.
    permanent: Mutex<HashMap<String, String>>,
    calls: Mutex<HashMap<String, u32>>,
    pub(super) open: AtomicBool,
    /// A key whose run, once the gate is open, waits inside the handler for `release`.
    stall: Mutex<Option<String>>,
    stalled: std::sync::atomic::AtomicU32,
    release: tokio::sync::Notify,
}

impl Switches {
    fn calls(&self, key: &str) -> u32 {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

type HandlerFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<dedup_core::Completion, HandlerError<String>>>
            + Send,
    >,
>;

/// Books each message in its lease's transaction, unless a switch says it fails.
pub(super) fn booking(
    store: PgStore,
    switches: Arc<Switches>,
) -> impl Fn(Arc<Delivery>, Option<LeaseContext>) -> HandlerFuture + Send + Sync + 'static {
    move |d, lease| {
        let (store, switches) = (store.clone(), switches.clone());
        Box::pin(async move {
            let key = String::from_utf8_lossy(d.header("idempotency-key").unwrap_or_default())
                .into_owned();
            let account = d
                .key
                .as_ref()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_default();
            *switches
                .calls
                .lock()
                .unwrap()
                .entry(key.clone())
                .or_default() += 1;
            if let Some(text) = switches.permanent.lock().unwrap().get(&key) {
                return Err(HandlerError::Permanent(text.clone()));
            }
            if switches.always.lock().unwrap().contains(&key) {
                return Err(HandlerError::Retryable(format!("{key} is broken")));
            }
            if !switches.open.load(Ordering::SeqCst)
                && switches.shut.lock().unwrap().contains(&account)
            {
                return Err(HandlerError::Retryable(format!(
                    "{account}'s service is down"
                )));
            }
            if switches.stall.lock().unwrap().as_deref() == Some(key.as_str()) {
                switches.stalled.fetch_add(1, Ordering::SeqCst);
                switches.release.notified().await;
            }
            let lease = lease.ok_or(HandlerError::Permanent("no key".to_owned()))?;
            store
                .transact(&lease, move |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO booked (key, account) VALUES ($1, $2)")
                            .bind(&key)
                            .bind(&account)
                            .execute(tx)
                            .await
                            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
                        Ok(Bytes::from(format!("booked {key}")))
                    })
                })
                .await
        })
    }
}

/// The engine of a parking test: `max_attempts` in its policy.
pub(super) fn parking_engine(pool: &PgPool, redis: &RedisServer, max_attempts: u32) -> Setup {
    setup(pool, redis).with_policy(
        Policy::default()
            .with_lease(Duration::from_secs(5))
            .with_max_attempts(max_attempts),
    )
}

pub(super) fn parking(after: AfterGiveUp) -> Parking {
    Parking::default()
        .with_in_place_attempts(3)
        .with_backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(400),
        ))
        .with_poll(Duration::from_millis(50))
        .with_after_give_up(after)
}

pub(super) fn keyed(name: &str, account: &str) -> Event {
    let mut e = event(0, 1);
    e.key = Some(name.to_owned());
    e.message_key = Some(account.to_owned());
    e.partition = 0;
    e
}

/// A parking consumer built from an engine, with the booking handler.
async fn spawn(
    broker: &Broker,
    pool: &PgPool,
    group: &str,
    topic: &str,
    setup: Setup,
    switches: &Arc<Switches>,
    after: AfterGiveUp,
) -> Running {
    spawn_parking(broker, pool, group, topic, setup, switches, parking(after)).await
}

/// [`spawn`] with parking settings of the test's own.
async fn spawn_parking(
    broker: &Broker,
    pool: &PgPool,
    group: &str,
    topic: &str,
    setup: Setup,
    switches: &Arc<Switches>,
    parking: Parking,
) -> Running {
    let config: Settings = broker
        .config(group, topic)
        .with_ordering(KeyOrdering::PerKey)
        .with_dead_letter_topic(format!("{topic}.dlq"));
    spawn_parking_config(config, pool, setup, switches, parking).await
}

/// [`spawn_parking`] with a configuration of the test's own.
pub(super) async fn spawn_parking_config(
    config: Settings,
    pool: &PgPool,
    setup: Setup,
    switches: &Arc<Switches>,
    parking: Parking,
) -> Running {
    let store = PgStore::new(pool.clone());
    Running::spawn_built(
        config,
        setup,
        booking(store, switches.clone()),
        |consumer| consumer.parking(parking),
    )
    .await
}

/// `group`'s parked messages per ordering key.
async fn parked(pool: &PgPool, group: &str) -> HashMap<String, u64> {
    ParkedQueue::new(&PgStore::new(pool.clone()))
        .parked_summary(group, &ParkedFilter::all())
        .await
        .unwrap()
        .into_iter()
        .map(|s| {
            (
                String::from_utf8(s.ordering_key.unwrap_or_default()).unwrap(),
                s.messages,
            )
        })
        .collect()
}

/// What every scenario starts from: the booking table, a Redis, a topic of one partition, a
/// group, and the handler's switches.
pub(super) struct Scene {
    pub(super) redis: RedisServer,
    pub(super) topic: String,
    pub(super) group: String,
    pub(super) switches: Arc<Switches>,
}

pub(super) async fn scene(broker: &Broker, pool: &PgPool) -> Scene {
    booked_table(pool).await;
    let topic = unique("parked");
    broker.create_topic(&topic, 1).await;
    Scene {
        redis: RedisServer::start(),
        topic,
        group: unique("g"),
        switches: Arc::new(Switches::default()),
    }
}

/// Waits until `account` has `n` messages parked in `group`.
async fn until_parked(pool: &PgPool, group: &str, account: &str, n: u64) {
    eventually(60, &format!("{n} of {account} parked"), || async move {
        parked(pool, group).await.get(account) == Some(&n)
    })
    .await;
}

/// Waits until nothing is parked in `group`.
async fn until_parked_empty(pool: &PgPool, group: &str) {
    eventually(30, "no key parked", || async move {
        parked(pool, group).await.is_empty()
    })
    .await;
}

/// Waits until `n` messages are booked.
pub(super) async fn until_booked(pool: &PgPool, n: i64) {
    eventually(240, &format!("{n} booked"), || async move {
        booked_count(pool).await == n
    })
    .await;
}

/// One account's service is down: its first message fails three times in place and is parked,
/// and its four later messages park behind it, while 10,000 messages of 50 other accounts on the
/// same partition all settle (checked while the gate is still shut) and the committed offset
/// passes the failing message. With the service back, the account's five messages run in their
/// original order, each once.
async fn one_failing_key_is_parked_while_ten_thousand_others_flow_then_runs_in_order(
    broker: &Broker,
    pool: PgPool,
) {
    booked_table(&pool).await;
    let redis = RedisServer::start();
    let topic = unique("parked");
    broker.create_topic(&topic, 1).await;
    let group = unique("g");
    let mut events = vec![keyed("bad-1", "acct-bad")];
    for i in 0..10_000u32 {
        events.push(keyed(&format!("evt-{i}"), &format!("acct-{}", i % 50)));
        if i % 2000 == 1999 && i < 9000 {
            events.push(keyed(&format!("bad-{}", i / 2000 + 2), "acct-bad"));
        }
    }
    assert_eq!(events.len(), 10_005);
    produce(broker, &topic, &events).await;
    let switches = Arc::new(Switches::default());
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    let dedup = parking_engine(&pool, &redis, 1000);
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;

    until_booked(&pool, 10_000).await;
    // The gate is still shut: nothing of the account ran, all five wait parked, and the stream's
    // offsets were committed past them.
    assert!(booked_of(&pool, "acct-bad").await.is_empty());
    assert!(switches.calls("bad-1") >= 3, "bad-1 ran in place first");
    assert_eq!(switches.calls("bad-2"), 0, "parked behind, never run");
    eventually(30, "five messages parked", || {
        let (pool, group) = (pool.clone(), group.clone());
        async move { parked(&pool, &group).await == HashMap::from([("acct-bad".to_owned(), 5)]) }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;

    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 10_005).await;
    assert_eq!(
        booked_of(&pool, "acct-bad").await,
        ["bad-1", "bad-2", "bad-3", "bad-4", "bad-5"]
    );
    until_parked_empty(&pool, &group).await;
    let s = running.stop().await;
    assert_eq!(s.parked, 5);
    assert!(s.parked_retries >= 5);
    assert_booked_once(&pool, 10_005).await;
}

/// Messages of a parked key keep arriving in three waves; each parks behind the head, and once
/// the key recovers all of them run in offset order.
async fn a_parked_keys_new_messages_keep_parking_behind_it_and_run_in_offset_order(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-7".to_owned());
    let dedup = parking_engine(&pool, &redis, 1000);
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    let mut n = 0;
    let mut expected = Vec::new();
    for wave in 1..=3u64 {
        let mut events = Vec::new();
        for _ in 0..3 {
            n += 1;
            events.push(keyed(&format!("k7-{n}"), "acct-7"));
            expected.push(format!("k7-{n}"));
            events.push(keyed(&format!("other-{n}"), "acct-1"));
        }
        produce(broker, &topic, &events).await;
        eventually(60, "the wave parked", || {
            let (pool, group) = (pool.clone(), group.clone());
            async move { parked(&pool, &group).await.get("acct-7").copied() == Some(wave * 3) }
        })
        .await;
    }
    // Other keys flow while the key is parked (the gate is still shut).
    eventually(60, "the other key's nine messages booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-1").await.len() == 9 }
    })
    .await;
    assert!(booked_of(&pool, "acct-7").await.is_empty());
    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 18).await;
    assert_eq!(booked_of(&pool, "acct-7").await, expected);
    running.stop().await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    assert_booked_once(&pool, 18).await;
}

/// A message that never succeeds: three runs in place, then its attempts run out while parked; it is
/// dead-lettered with the reason and the attempts, and (the default policy) its key's later
/// messages run after it, in order.
async fn a_parked_head_out_of_attempts_is_dead_lettered_and_its_key_proceeds(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.always.lock().unwrap().insert("bad-1".to_owned());
    let events = vec![
        keyed("bad-1", "acct-bad"),
        keyed("ok-1", "acct-ok"),
        keyed("bad-2", "acct-bad"),
        keyed("bad-3", "acct-bad"),
        keyed("ok-2", "acct-ok"),
    ];
    produce(broker, &topic, &events).await;
    let dedup = parking_engine(&pool, &redis, 5);
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    until_booked(&pool, 4).await;
    assert_eq!(booked_of(&pool, "acct-bad").await, ["bad-2", "bad-3"]);
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    let (payload, headers) = &dead[0];
    assert!(payload.is_some());
    assert_eq!(headers["idempotency-key"], "bad-1");
    assert_eq!(headers[DLQ_ATTEMPTS], "5", "{headers:?}");
    assert!(
        headers[DLQ_REASON].contains("bad-1 is broken"),
        "{headers:?}"
    );
    assert_eq!(
        switches.calls("bad-1"),
        5,
        "one budget, in place and parked"
    );
    let s = running.stop().await;
    assert_eq!(s.parked_dead_lettered, 1);
    assert!(parked(&pool, &group).await.is_empty());
    committed_to_the_end(broker, &group, &topic, 1).await;
}

/// Under `AfterGiveUp::Hold` the key's later messages stay parked after its head is
/// dead-lettered, until an operator releases the key (`unpark`); then they run in order.
async fn under_the_hold_policy_a_keys_later_messages_wait_for_an_operator(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.always.lock().unwrap().insert("bad-1".to_owned());
    let events = vec![
        keyed("bad-1", "acct-bad"),
        keyed("bad-2", "acct-bad"),
        keyed("ok-1", "acct-ok"),
    ];
    produce(broker, &topic, &events).await;
    let dedup = parking_engine(&pool, &redis, 5);
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        AfterGiveUp::Hold,
    )
    .await;
    // The dead-lettered head stays as the key's held marker, with bad-2 behind it.
    eventually(60, "the key held", || {
        let pool = pool.clone();
        let group = group.clone();
        async move {
            ParkedQueue::new(&PgStore::new(pool))
                .parked_summary(&group, &ParkedFilter::all())
                .await
                .unwrap()
                .iter()
                .any(|s| s.held && s.messages == 2)
        }
    })
    .await;
    read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    // A new message of the held key parks behind it; nothing of the key runs.
    produce(broker, &topic, &[keyed("bad-3", "acct-bad")]).await;
    until_parked(&pool, &group, "acct-bad", 3).await;
    assert!(booked_of(&pool, "acct-bad").await.is_empty());
    eventually(60, "ok-1 booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-ok").await == ["ok-1"] }
    })
    .await;
    assert_eq!(
        ParkedQueue::new(&PgStore::new(pool.clone()))
            .unpark(&group, Some(b"acct-bad"), &ParkedFilter::all())
            .await
            .unwrap(),
        3
    );
    until_booked(&pool, 3).await;
    assert_eq!(booked_of(&pool, "acct-bad").await, ["bad-2", "bad-3"]);
    assert_eq!(switches.calls("bad-1"), 5, "the marker is not run again");
    until_parked_empty(&pool, &group).await;
    running.stop().await;
}

/// A member parks a key's messages and leaves; the partition goes to another member, whose
/// barrier loads the parked key: it keeps the key's new messages behind it, and once the key
/// recovers runs them all in order.
async fn a_partition_with_parked_keys_moved_to_another_member_resumes_them_in_order(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    produce(
        broker,
        &topic,
        &[
            keyed("bad-1", "acct-bad"),
            keyed("ok-1", "acct-ok"),
            keyed("bad-2", "acct-bad"),
        ],
    )
    .await;
    let first = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 1000),
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    until_parked(&pool, &group, "acct-bad", 2).await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    first.stop().await;

    let second = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 1000),
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    // A new message of the key reaches the new owner: it parks behind the others.
    produce(broker, &topic, &[keyed("bad-3", "acct-bad")]).await;
    until_parked(&pool, &group, "acct-bad", 3).await;
    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 4).await;
    assert_eq!(
        booked_of(&pool, "acct-bad").await,
        ["bad-1", "bad-2", "bad-3"]
    );
    let s = second.stop().await;
    assert!(s.parked_retries >= 3, "{s:?}");
    committed_to_the_end(broker, &group, &topic, 1).await;
}

/// Consumer processes with parking, killed with SIGKILL: the first after it parked a key's three
/// messages and before any offset commit (its interval is an hour); the second in the middle of
/// the parked head's run (its handler hangs on it, holding a 3 s lease). A third runs them all:
/// each message once, the key's in offset order, and the offsets at the end.
async fn sigkill_after_parking_and_during_a_parked_run_loses_and_doubles_nothing(
    broker: &Broker,
    pool: PgPool,
) {
    sqlx::query(
        "CREATE TABLE effects (key text NOT NULL, token bigint NOT NULL, worker text NOT NULL, \
         seq bigserial)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("CREATE TABLE fail_accounts (account text)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO fail_accounts VALUES ('acct-bad')")
        .execute(&pool)
        .await
        .unwrap();
    let redis = RedisServer::start();
    let topic = unique("parked");
    broker.create_topic(&topic, 1).await;
    let group = unique("g");
    let mut events = vec![keyed("bad-1", "acct-bad")];
    for i in 0..20 {
        events.push(keyed(&format!("ok-{i}"), &format!("acct-{i}")));
        if i % 10 == 9 {
            events.push(keyed(&format!("bad-{}", i / 10 + 2), "acct-bad"));
        }
    }
    produce(broker, &topic, &events).await;
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let spawn = |envs: &[(&str, &str)]| {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"));
        c.args(consumer_args(broker, &group, &topic, &pool, &redis))
            .env("DEDUP_PARK", "1")
            .env("DEDUP_FAIL_TABLE", "1")
            .env("DEDUP_LEASE_MS", "3000")
            .kill_on_drop(true);
        for (k, v) in envs {
            c.env(k, v);
        }
        c.spawn().unwrap()
    };

    let mut first = spawn(&[]);
    eventually(60, "20 effects and three parked", || async {
        count("SELECT count(*) FROM effects").await == 20
            && count("SELECT count(*) FROM dedup_parked").await == 3
    })
    .await;
    first.kill().await.unwrap();
    first.wait().await.unwrap();
    assert_eq!(committed(broker, &group, &topic, 1).await, vec![-1]);

    // The service is back; the second process's handler hangs on the head.
    sqlx::query("DELETE FROM fail_accounts")
        .execute(&pool)
        .await
        .unwrap();
    let since: i64 = sqlx::query_scalar("SELECT (EXTRACT(EPOCH FROM now()) * 1e6)::int8")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut second = spawn(&[("DEDUP_HANG_KEY", "bad-1")]);
    eventually(60, "the head running in the second process", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM dedup_records WHERE key = 'bad-1'::bytea \
                 AND state = 'in_progress' AND updated_at > to_timestamp($1::float8 / 1e6)",
            )
            .bind(since)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    })
    .await;
    second.kill().await.unwrap();
    second.wait().await.unwrap();
    assert_eq!(count("SELECT count(*) FROM effects").await, 20);

    let mut third = spawn(&[("DEDUP_COMMIT_MS", "200")]);
    eventually(90, "every message booked", || async {
        count("SELECT count(*) FROM effects").await == 23
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    third.kill().await.unwrap();
    let (rows, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((rows, keys), (23, 23), "each message once");
    let bad: Vec<String> =
        sqlx::query_scalar("SELECT key FROM effects WHERE key LIKE 'bad-%' ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(bad, ["bad-1", "bad-2", "bad-3"]);
    assert_eq!(count("SELECT count(*) FROM dedup_parked").await, 0);
}

/// The interleaving a count of parked messages must survive: a key's last parked message is
/// running its re-run (held inside the handler) when a new message of the key arrives. The new
/// one parks behind it (its key is not free yet), and when the head completes it becomes the
/// head and runs: never stranded, never ahead. After that the key is free and a later message
/// runs at once.
async fn a_message_parked_while_its_keys_last_parked_message_completes_is_not_stranded(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    produce(broker, &topic, &[keyed("bad-1", "acct-bad")]).await;
    let dedup = parking_engine(&pool, &redis, 1000);
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    until_parked(&pool, &group, "acct-bad", 1).await;
    *switches.stall.lock().unwrap() = Some("bad-1".to_owned());
    switches.open.store(true, Ordering::SeqCst);
    eventually(60, "bad-1's re-run inside the handler", || {
        let switches = switches.clone();
        async move { switches.stalled.load(Ordering::SeqCst) == 1 }
    })
    .await;
    produce(broker, &topic, &[keyed("bad-2", "acct-bad")]).await;
    until_parked(&pool, &group, "acct-bad", 2).await;
    assert_eq!(switches.calls("bad-2"), 0);
    switches.release.notify_one();
    until_booked(&pool, 2).await;
    assert_eq!(booked_of(&pool, "acct-bad").await, ["bad-1", "bad-2"]);
    until_parked_empty(&pool, &group).await;
    produce(broker, &topic, &[keyed("bad-3", "acct-bad")]).await;
    until_booked(&pool, 3).await;
    assert_eq!(
        booked_of(&pool, "acct-bad").await,
        ["bad-1", "bad-2", "bad-3"]
    );
    let s = running.stop().await;
    assert_eq!(s.parked, 2, "bad-3 ran without parking: {s:?}");
    committed_to_the_end(broker, &group, &topic, 1).await;
}

/// With at most two messages parked per key, a key's third message is not parked: it waits in
/// memory with its partition paused (so a later message of another key waits too), counted in
/// `park_full`; once the key drains it is let in, parked and run in order, and the partition
/// goes on.
async fn at_the_per_key_bound_the_partition_waits_and_goes_on_when_the_key_drains(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    produce(
        broker,
        &topic,
        &[
            keyed("bad-1", "acct-bad"),
            keyed("ok-1", "acct-ok"),
            keyed("bad-2", "acct-bad"),
            keyed("bad-3", "acct-bad"),
        ],
    )
    .await;
    let dedup = parking_engine(&pool, &redis, 1000);
    let running = spawn_parking(
        broker,
        &pool,
        &group,
        &topic,
        dedup,
        &switches,
        parking(AfterGiveUp::Proceed).with_bounds(2, 100),
    )
    .await;
    let stats = running.stats.clone();
    eventually(60, "the bound reached", || {
        let s = stats.snapshot();
        async move { s.park_full >= 1 }
    })
    .await;
    eventually(30, "two parked, the gauges refreshed", || {
        let (pool, group, s) = (pool.clone(), group.clone(), stats.snapshot());
        async move {
            parked(&pool, &group).await.get("acct-bad") == Some(&2)
                && s.parked_keys == 1
                && s.parked_messages == 2
        }
    })
    .await;
    eventually(60, "ok-1 booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-ok").await == ["ok-1"] }
    })
    .await;
    // The partition waits: a message of another key produced now is not run.
    produce(broker, &topic, &[keyed("ok-2", "acct-ok")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        booked_of(&pool, "acct-ok").await,
        ["ok-1"],
        "ok-2 waits behind bad-3"
    );
    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 5).await;
    assert_eq!(
        booked_of(&pool, "acct-bad").await,
        ["bad-1", "bad-2", "bad-3"]
    );
    assert_eq!(booked_of(&pool, "acct-ok").await, ["ok-1", "ok-2"]);
    running.stop().await;
    committed_to_the_end(broker, &group, &topic, 1).await;
}

/// Under the hold policy a message that fails in place for good (a permanent failure, not
/// parked first) is dead-lettered and its key held behind it: the key's later message parks
/// behind its held marker instead of running, other keys flow, and once an operator releases
/// the key the later message runs (the marker is not run again).
async fn under_the_hold_policy_a_message_failing_in_place_for_good_holds_its_key(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches
        .permanent
        .lock()
        .unwrap()
        .insert("bad-1".to_owned(), "bad-1 is malformed".to_owned());
    produce(
        broker,
        &topic,
        &[
            keyed("bad-1", "acct-bad"),
            keyed("bad-2", "acct-bad"),
            keyed("ok-1", "acct-ok"),
        ],
    )
    .await;
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 5),
        &switches,
        AfterGiveUp::Hold,
    )
    .await;
    until_parked(&pool, &group, "acct-bad", 2).await;
    let dead = read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    assert_eq!(dead.len(), 1);
    eventually(60, "ok-1 booked", || {
        let pool = pool.clone();
        async move { booked_of(&pool, "acct-ok").await == ["ok-1"] }
    })
    .await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    assert!(booked_of(&pool, "acct-bad").await.is_empty(), "bad-2 waits");
    assert_eq!(switches.calls("bad-2"), 0);
    assert_eq!(
        ParkedQueue::new(&PgStore::new(pool.clone()))
            .unpark(&group, Some(b"acct-bad"), &ParkedFilter::all())
            .await
            .unwrap(),
        2
    );
    until_booked(&pool, 2).await;
    assert_eq!(booked_of(&pool, "acct-bad").await, ["bad-2"]);
    assert_eq!(switches.calls("bad-1"), 1, "a permanent failure runs once");
    until_parked_empty(&pool, &group).await;
    running.stop().await;
}

/// A handler's permanent error whose text Postgres refuses (a NUL, as a payload echoed through
/// a lossy conversion carries): the failure is recorded (made safe), so the message runs once
/// and is dead-lettered, instead of counting as retryable and running up to `max_attempts`.
async fn a_permanent_failure_whose_text_postgres_refuses_runs_once_and_is_recorded(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.permanent.lock().unwrap().insert(
        "nul-1".to_owned(),
        "cannot parse \0\u{1} payload".to_owned(),
    );
    produce(
        broker,
        &topic,
        &[keyed("nul-1", "acct-1"), keyed("ok-1", "acct-1")],
    )
    .await;
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 5),
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    let stats = running.stats.clone();
    eventually(60, "nul-1 dead-lettered", || {
        let s = stats.snapshot();
        async move { s.dead_lettered == 1 }
    })
    .await;
    read_dead_letters(broker, &format!("{topic}.dlq"), 1).await;
    until_booked(&pool, 1).await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    assert_eq!(switches.calls("nul-1"), 1, "a permanent failure runs once");
    let (state, failure): (String, String) =
        sqlx::query_as("SELECT state, failure FROM dedup_records WHERE key = 'nul-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "failed");
    assert!(
        failure.contains('\u{FFFD}') && !failure.contains('\0'),
        "{failure:?}"
    );
    running.stop().await;
}

/// An ordering key far past what a btree entry holds (8,000 bytes that do not compress) parks
/// and runs in order like any other: it is indexed by its digest.
async fn an_ordering_key_past_a_btree_entrys_limit_parks_and_runs_in_order(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    let mut state = 0x2545_F491_4F6C_DD1D_u64;
    let account: String = (0..4000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            format!("{:02x}", (state >> 32) as u8)
        })
        .collect();
    switches.shut.lock().unwrap().insert(account.clone());
    produce(
        broker,
        &topic,
        &[
            keyed("long-1", &account),
            keyed("long-2", &account),
            keyed("ok-1", "acct-ok"),
        ],
    )
    .await;
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 1000),
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    until_parked(&pool, &group, &account, 2).await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 3).await;
    assert_eq!(booked_of(&pool, &account).await, ["long-1", "long-2"]);
    until_parked_empty(&pool, &group).await;
    running.stop().await;
}

/// The partition's parking epoch moves on while this consumer still owns the partition (a bump
/// that came late): a park refused by the fence is not left pending until the next rebalance,
/// nor lets the key's next message run ahead. The consumer takes the epoch again, parks the
/// message behind its key under it, and the committed offset moves to the end; the key then
/// runs in order.
async fn a_park_fenced_while_the_partition_is_still_ours_keeps_order_and_moves_the_offset(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-bad".to_owned());
    produce(broker, &topic, &[keyed("bad-1", "acct-bad")]).await;
    let running = spawn(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 1000),
        &switches,
        AfterGiveUp::Proceed,
    )
    .await;
    until_parked(&pool, &group, "acct-bad", 1).await;
    // A late bump from elsewhere: this consumer's epoch is stale from now.
    // (What a new owner's assignment does: `dedup_parked_owners`' epoch bumped.)
    let bumped = sqlx::query(
        "UPDATE dedup_parked_owners SET epoch = epoch + 1, owner = 'late-bump#1' \
         WHERE consumer_group = $1 AND topic = $2 AND partition = 0",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        bumped.rows_affected(),
        1,
        "the consumer owned the partition"
    );
    produce(
        broker,
        &topic,
        &[
            keyed("bad-2", "acct-bad"),
            keyed("ok-1", "acct-ok"),
            keyed("bad-3", "acct-bad"),
        ],
    )
    .await;
    until_parked(&pool, &group, "acct-bad", 3).await;
    committed_to_the_end(broker, &group, &topic, 1).await;
    assert!(
        booked_of(&pool, "acct-bad").await.is_empty(),
        "nothing ran ahead"
    );
    switches.open.store(true, Ordering::SeqCst);
    until_booked(&pool, 4).await;
    assert_eq!(
        booked_of(&pool, "acct-bad").await,
        ["bad-1", "bad-2", "bad-3"]
    );
    until_parked_empty(&pool, &group).await;
    running.stop().await;
}

/// Under the hold policy with the parked queue full, a message that fails in place for good is
/// not dead-lettered with nothing to hold its key: it waits for room (its key's next message
/// waits behind it), and once room comes back it is dead-lettered and holds its key.
async fn under_the_hold_policy_a_give_up_waits_for_parking_room_instead_of_letting_its_key_go_on(
    broker: &Broker,
    pool: PgPool,
) {
    let Scene {
        redis,
        topic,
        group,
        switches,
    } = scene(broker, &pool).await;
    switches.shut.lock().unwrap().insert("acct-a".to_owned());
    switches
        .permanent
        .lock()
        .unwrap()
        .insert("p-1".to_owned(), "p-1 is malformed".to_owned());
    produce(
        broker,
        &topic,
        &[keyed("a-1", "acct-a"), keyed("a-2", "acct-a")],
    )
    .await;
    let running = spawn_parking(
        broker,
        &pool,
        &group,
        &topic,
        parking_engine(&pool, &redis, 1000),
        &switches,
        parking(AfterGiveUp::Hold).with_bounds(10, 2),
    )
    .await;
    until_parked(&pool, &group, "acct-a", 2).await;
    produce(
        broker,
        &topic,
        &[keyed("p-1", "acct-p"), keyed("p-2", "acct-p")],
    )
    .await;
    let stats = running.stats.clone();
    eventually(60, "the give-up waits for room", || {
        let s = stats.snapshot();
        async move { s.park_full >= 1 }
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        stats.snapshot().dead_lettered,
        0,
        "not dead-lettered while full"
    );
    assert_eq!(switches.calls("p-2"), 0, "its key's next message waits");
    // Room comes back: acct-a runs and goes; p-1 is dead-lettered and holds its key.
    switches.open.store(true, Ordering::SeqCst);
    until_parked(&pool, &group, "acct-p", 2).await;
    eventually(60, "p-1 dead-lettered", || {
        let s = stats.snapshot();
        async move { s.dead_lettered == 1 }
    })
    .await;
    assert_eq!(booked_of(&pool, "acct-a").await, ["a-1", "a-2"]);
    assert!(booked_of(&pool, "acct-p").await.is_empty());
    assert_eq!(switches.calls("p-1"), 1);
    assert_eq!(switches.calls("p-2"), 0);
    running.stop().await;
}
