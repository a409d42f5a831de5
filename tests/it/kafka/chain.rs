//! The chain A → outbox → topic → B under kill loops, on a nisshi broker process and a Postgres of
//! the test's own: A (a transaction-mode consumer, offsets in its transaction, publishing one
//! message per booked event on the outbox), the relay and B (a transaction-mode consumer of the
//! published topic with the default key source) are each SIGKILLed twenty times at seeded random
//! moments, while a second relay runs throughout and is once SIGSTOPped past its lease (resumed
//! after another took over); Postgres is crashed in immediate mode once and the broker stopped
//! once. Then: A's ledger holds one row per event; every event A booked is published, and every
//! published copy carries the fencing token of the attempt that committed (nothing a rolled-back
//! attempt queued); B's ledger holds exactly one row per published message.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use super::{Broker, Event, consumer_args_for, event, produce, unique};
use crate::support::{PgServer, RedisServer, effects_table};

/// Seeded moments (the same run every time).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

const KILLS: u32 = 20;

/// Starts, lets live a random while and SIGKILLs `spawn`'s processes, `KILLS` times.
async fn kill_loop(seed: u64, spawn: impl Fn() -> Child) -> u32 {
    let mut rng = Lcg(seed);
    let mut kills = 0;
    for _ in 0..KILLS {
        let mut child = spawn();
        sleep(Duration::from_millis(300 + rng.below(1200))).await;
        if child.try_wait().unwrap().is_none() {
            child.kill().await.unwrap(); // SIGKILL
            kills += 1;
        }
        child.wait().await.unwrap();
    }
    kills
}

fn signal(child: &Child, sig: &str) {
    let pid = child.id().unwrap().to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A count, or None while Postgres is down (it is crashed on purpose).
async fn count(pool: &PgPool, sql: &'static str) -> Option<i64> {
    sqlx::query_scalar(sql).fetch_one(pool).await.ok()
}

/// Every message of `topic`, read whole from its start until none arrives for 5 s; answers
/// (payload, the derived-key header) of each.
async fn read_all(broker: &Broker, topic: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut c = broker.client_config();
    c.set("group.id", unique("all"))
        .set("auto.offset.reset", "earliest");
    let consumer: StreamConsumer = c.create().unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut out = Vec::new();
    let first = Duration::from_secs(30);
    loop {
        let wait = if out.is_empty() {
            first
        } else {
            Duration::from_secs(5)
        };
        let Ok(m) = tokio::time::timeout(wait, consumer.recv()).await else {
            break;
        };
        let m = m.unwrap();
        let key = m
            .headers()
            .and_then(|hs| {
                hs.iter()
                    .find(|h| h.key == dedup::outbox::OUTBOX_KEY)
                    .and_then(|h| h.value.map(<[u8]>::to_vec))
            })
            .unwrap();
        out.push((m.payload().unwrap().to_vec(), key));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chain_through_the_outbox_under_kill_loops_books_each_event_once_downstream() {
    const PARTS: u32 = 4;
    const PART: u32 = 200;
    let pg = PgServer::start();
    let pool = pg.migrated_pool().await;
    effects_table(&pool).await;
    let redis = RedisServer::start();
    let broker = Broker::nisshi();
    let (input, output) = (unique("in"), unique("out"));
    broker.create_topic(&input, 4).await;
    broker.create_topic(&output, 4).await;
    let (ga, gb) = (unique("a"), unique("b"));
    let mut rng = Lcg(0x5eed_0059);
    let parts: Vec<Vec<Event>> = (0..PARTS)
        .map(|p| {
            let mut part: Vec<Event> = (p * PART..(p + 1) * PART).map(|i| event(i, 4)).collect();
            for _ in 0..50 {
                let upto = u64::from((p + 1) * PART);
                part.push(event(u32::try_from(rng.below(upto)).unwrap(), 4));
            }
            part
        })
        .collect();
    let keys: BTreeSet<String> = (0..PARTS * PART).map(|i| format!("evt-{i}")).collect();

    let consumer = |group: &str, topic: &str, worker: &str, publish: Option<&str>| -> Child {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dedup-consume-and-die"));
        c.args(consumer_args_for(&broker, group, topic, &pg.url(), &redis))
            .env("DEDUP_TX_DELAY_MS", "10")
            .env("DEDUP_TX_OFFSETS", "1")
            .env("DEDUP_COMMIT_MS", "300")
            .env("DEDUP_WORKER", worker)
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(t) = publish {
            c.env("DEDUP_OUTBOX_TOPIC", t);
        }
        c.spawn().unwrap()
    };
    let relay = || -> Child {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dedup-outbox-relay"));
        c.arg(broker.bootstrap())
            .arg(pg.url())
            .args(broker.client().iter().map(|(k, v)| format!("{k}={v}")))
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true);
        c.spawn().unwrap()
    };
    let spawn_a = || consumer(&ga, &input, "a", Some(&output));
    let spawn_b = || consumer(&gb, &output, "b", None);

    // A second relay runs throughout (one of the two leads at a time).
    let steady = relay();
    let producing = async {
        for part in &parts {
            produce(&broker, &input, part).await;
            sleep(Duration::from_secs(4)).await;
        }
    };
    let faults = async {
        sleep(Duration::from_secs(6)).await;
        // The steady relay paused past its lease (1 s): the killed one's next life takes over;
        // resumed, it holds a stale epoch.
        signal(&steady, "-STOP");
        sleep(Duration::from_secs(3)).await;
        signal(&steady, "-CONT");
        sleep(Duration::from_secs(4)).await;
        pg.crash();
        sleep(Duration::from_millis(500)).await;
        pg.start_again();
        sleep(Duration::from_secs(4)).await;
        if let Broker::Nisshi(n) = &broker {
            n.stop_for(Duration::from_secs(2)).await;
        }
    };
    let (ka, kr, kb, (), ()) = tokio::join!(
        kill_loop(0xa, spawn_a),
        kill_loop(0xb, relay),
        kill_loop(0xc, spawn_b),
        producing,
        faults,
    );
    assert!(ka >= 15 && kr >= 15 && kb >= 15, "kills: {ka} {kr} {kb}");

    // The last of each runs to the end.
    let (mut a, mut r, mut b) = (spawn_a(), relay(), spawn_b());
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let booked_a = count(
            &pool,
            "SELECT count(DISTINCT key) FROM effects WHERE worker = 'a'",
        );
        let booked_b = count(
            &pool,
            "SELECT count(DISTINCT key) FROM effects WHERE worker = 'b'",
        );
        let waiting = count(
            &pool,
            "SELECT count(*) FROM dedup_outbox o, dedup_outbox_relay r \
             WHERE o.xid8 >= pg_snapshot_xmin(r.position::pg_snapshot) \
               AND NOT pg_visible_in_snapshot(o.xid8, r.position::pg_snapshot)",
        );
        let n = i64::try_from(keys.len()).unwrap();
        if let (Some(x), Some(y), Some(0)) = (booked_a.await, booked_b.await, waiting.await)
            && x == n
            && y == n
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the chain did not settle in 240 s"
        );
        sleep(Duration::from_millis(200)).await;
    }
    // B settles what is in flight (the relay's last copies) before the ledger is read.
    sleep(Duration::from_secs(3)).await;
    for c in [&mut a, &mut r, &mut b] {
        c.kill().await.unwrap();
        c.wait().await.unwrap();
    }
    let mut steady = steady;
    steady.kill().await.unwrap();
    steady.wait().await.unwrap();

    let rows: Vec<(String, i64, String)> = sqlx::query_as("SELECT key, token, worker FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut by_worker: BTreeMap<&str, BTreeMap<&str, Vec<i64>>> = BTreeMap::new();
    for (k, t, w) in &rows {
        by_worker
            .entry(w.as_str())
            .or_default()
            .entry(k.as_str())
            .or_default()
            .push(*t);
    }
    let a_rows = &by_worker["a"];
    let doubled: Vec<_> = a_rows.iter().filter(|(_, t)| t.len() > 1).collect();
    assert!(doubled.is_empty(), "A booked twice: {doubled:?}");
    assert_eq!(
        a_rows
            .keys()
            .map(|k| (*k).to_owned())
            .collect::<BTreeSet<_>>(),
        keys,
        "A booked every event"
    );
    let b_rows = &by_worker["b"];
    let doubled: Vec<_> = b_rows.iter().filter(|(_, t)| t.len() > 1).collect();
    assert!(doubled.is_empty(), "B booked twice: {doubled:?}");
    assert_eq!(
        b_rows.len(),
        keys.len(),
        "B booked one row per published message"
    );

    // Every copy published: the event A booked, under the token A's booking committed with.
    let letters = read_all(&broker, &output).await;
    let mut derived: BTreeMap<Vec<u8>, BTreeSet<String>> = BTreeMap::new();
    for (payload, key) in &letters {
        let payload: serde_json::Value = serde_json::from_slice(payload).unwrap();
        let cause = payload["charged"].as_str().unwrap();
        let token = payload["token"].as_i64().unwrap();
        assert_eq!(
            a_rows.get(cause).map(|t| t[0]),
            Some(token),
            "{cause}: a copy from an attempt that did not commit"
        );
        derived
            .entry(key.clone())
            .or_default()
            .insert(cause.to_owned());
    }
    assert_eq!(derived.len(), keys.len(), "one derived key per event");
    assert!(derived.values().all(|c| c.len() == 1));
    let causes: BTreeSet<String> = derived.into_values().flatten().collect();
    assert_eq!(causes, keys, "every event A booked was published");
    assert!(
        letters.len() >= keys.len(),
        "{} copies of {} messages",
        letters.len(),
        keys.len()
    );
}
