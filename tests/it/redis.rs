//! The tiered store with a real Redis: caches answer, Postgres decides, and nothing that happens
//! to Redis causes a second effect.
//!
//! With redis-server processes of the test's own (one per test, `support::RedisServer`): answers
//! without the authority, FLUSHALL, kill and restart, a slow Redis (CLIENT PAUSE), stale markers,
//! zombie backfills, foreign and corrupted data, the 3-master cluster, ACL credentials, TLS.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Cached, ClaimOutcome, Dedup, FastPath, Processed, State, Store, TierStats};
use dedup_redis::redis::AsyncCommands;
use sqlx::PgPool;
use tokio::time::sleep;

use crate::support::{
    RedisServer, Tiered, acquired, effect_in_tx, effect_rows, effects_table, key, ms, req,
    short_lease, tiered, tiered_with,
};

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn duplicates_are_answered_without_the_authority(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let k = key("k");
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    // A concurrent duplicate: the Redis marker answers InFlight.
    assert!(matches!(
        s.claim(&req(&k, "b")).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!((s.stats().l2_hits, s.stats().authority_claims), (1, 1));

    s.complete(&lease, b"done").await.unwrap();
    for _ in 0..10 {
        assert!(matches!(
            s.claim(&req(&k, "c")).await.unwrap(),
            ClaimOutcome::Completed { .. }
        ));
    }
    let st = s.stats();
    assert_eq!((st.l1_hits, st.authority_claims), (10, 1), "{st:?}");
    // Without L1, Redis answers, and refills L1.
    s.clear_l1();
    s.claim(&req(&k, "d")).await.unwrap();
    s.claim(&req(&k, "e")).await.unwrap();
    let st = s.stats();
    assert_eq!(
        (st.l2_hits, st.l1_hits, st.authority_claims),
        (2, 11, 1),
        "{st:?}"
    );
}

/// Lets a storm's chaos happen while handlers are certainly in flight, whatever the machine's
/// speed: after `hold_after` effects, handlers wait at the gate until the chaos opens it.
struct StormGate {
    executed: AtomicU32,
    hold_after: u32,
    open: tokio::sync::watch::Sender<bool>,
}

impl StormGate {
    fn new(hold_after: u32) -> Arc<Self> {
        Arc::new(Self {
            executed: AtomicU32::new(0),
            hold_after,
            open: tokio::sync::watch::channel(false).0,
        })
    }

    /// A gate that holds nobody.
    fn open() -> Arc<Self> {
        Self::new(u32::MAX)
    }

    /// Waits until the storm has run `hold_after` effects (the rest are held).
    async fn held(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.executed.load(Ordering::SeqCst) < self.hold_after {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the storm never got going"
            );
            sleep(ms(5)).await;
        }
    }

    fn release(&self) {
        self.open.send_replace(true);
    }

    async fn pass(&self) {
        if self.executed.fetch_add(1, Ordering::SeqCst) >= self.hold_after {
            let _ = self.open.subscribe().wait_for(|o| *o).await;
        }
    }
}

/// A storm through `Dedup` on the tiered store, with effect rows written in the completion's
/// transaction, while `chaos` runs against Redis (holding handlers at `gate` as it chooses).
/// Returns the stats.
async fn storm_with(
    pool: &PgPool,
    s: Arc<Tiered>,
    gate: Arc<StormGate>,
    chaos: impl std::future::Future<Output = ()>,
) -> TierStats {
    effects_table(pool).await;
    let dedup = Arc::new(
        Dedup::new(Arc::clone(&s))
            .with_in_flight_wait(Duration::from_secs(60))
            .unwrap(),
    );
    let mut tasks = Vec::new();
    for t in 0..16u32 {
        let (dedup, store) = (Arc::clone(&dedup), dedup_pg::PgStore::new(pool.clone()));
        let gate = Arc::clone(&gate);
        tasks.push(tokio::spawn(async move {
            for d in (t..1600).step_by(16) {
                let name = format!("storm-{}", (d * 7919) % 200);
                let done = dedup
                    .process(&key(&name), None, |ctx| {
                        let (store, name, gate) = (store.clone(), name.clone(), Arc::clone(&gate));
                        async move {
                            gate.pass().await;
                            let result = Bytes::from(format!("r-{name}"));
                            effect_in_tx(&store, &ctx, name, format!("t{t}"), result).await
                        }
                    })
                    .await
                    .unwrap();
                assert_eq!(done.result(), format!("r-{name}").as_bytes());
                if let Processed::Executed { .. } = done {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::join!(all, chaos);
    let rows = effect_rows(pool).await;
    assert_eq!(rows.len(), 200, "exactly one effect per key");
    let mut keys: Vec<_> = rows.iter().map(|r| &r.0).collect();
    keys.dedup();
    assert_eq!(keys.len(), 200);
    s.stats()
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn flushall_in_the_middle_of_a_run_causes_no_duplicate_effect(pool: PgPool) {
    let redis = RedisServer::start();
    let s = Arc::new(tiered(pool.clone(), &redis).await);
    let mut conn = redis.client().await;
    let done = AtomicBool::new(false);
    let chaos = async {
        for _ in 0..40 {
            sleep(ms(15)).await;
            let _: () = dedup_redis::redis::cmd("FLUSHALL")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        done.store(true, Ordering::SeqCst);
    };
    let st = storm_with(&pool, Arc::clone(&s), StormGate::open(), chaos).await;
    assert!(done.load(Ordering::SeqCst));
    assert!(st.l2_hits + st.l1_hits > 0, "{st:?}");
    eprintln!("flushall storm: {st:?}");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn redis_killed_and_restarted_mid_run_causes_no_duplicate_effect(pool: PgPool) {
    let mut redis = RedisServer::start();
    let config = dedup_core::TieredConfig::default();
    let s = Arc::new(tiered_with(pool.clone(), &redis, config).await);
    let redis_ref = &mut redis;
    let gate = StormGate::new(50);
    let chaos = {
        let (gate, s) = (Arc::clone(&gate), Arc::clone(&s));
        async move {
            // Redis dies while handlers are in flight (held at the gate), and a claim of our own
            // meets the dead fast path, so the outage is felt however fast the storm would be.
            gate.held().await;
            redis_ref.kill();
            s.claim(&req(&key("probe-while-down"), "probe"))
                .await
                .unwrap();
            gate.release();
            sleep(ms(400)).await;
            redis_ref.restart();
        }
    };
    let during = storm_with(&pool, Arc::clone(&s), gate, chaos).await;
    assert!(
        during.l2_errors + during.l2_timeouts > 0,
        "the outage must be felt: {during:?}"
    );

    // Recovery without restarting the caller: the same store writes to and reads from the new
    // Redis. Every key's copy is backfilled on its next claim, then answered by Redis.
    s.clear_l1();
    let mut recovered = false;
    for _ in 0..50 {
        for n in 0..200 {
            s.claim(&req(&key(format!("storm-{n}")), "late"))
                .await
                .unwrap();
        }
        s.clear_l1();
        let before = s.stats().l2_hits;
        s.claim(&req(&key("storm-0"), "probe")).await.unwrap();
        if s.stats().l2_hits > before {
            recovered = true;
            break;
        }
        sleep(ms(100)).await;
    }
    assert!(recovered, "the fast path never came back: {:?}", s.stats());
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_stale_marker_holds_no_longer_than_its_ttl(pool: PgPool) {
    // The holder died; its Postgres lease ran out, but Redis still holds its marker (written with
    // a longer TTL than the lease, as clock trouble could). Duplicates are told InFlight until the
    // marker expires, then the authority lets one take over.
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let k = key("k");
    let dead = acquired(
        s.claim(&req(&k, "dead").with_policy(short_lease(100)))
            .await
            .unwrap(),
    );
    // The marker outlives the lease (a minute): while it is there, a duplicate is told InFlight
    // by Redis, however slow the machine is.
    s.fast_path()
        .store(&k, &Cached::in_progress(&dead), Duration::from_secs(60))
        .await
        .unwrap();
    sleep(ms(200)).await;
    assert!(matches!(
        s.claim(&req(&k, "early")).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    // Then it runs out (rewritten with a short TTL), and the authority decides.
    s.fast_path()
        .store(&k, &Cached::in_progress(&dead), ms(300))
        .await
        .unwrap();

    let dedup = Dedup::new(&s)
        .with_in_flight_wait(Duration::from_secs(5))
        .unwrap();
    let done = dedup
        .process(&k, None, |_| async {
            Ok::<_, dedup_core::HandlerError<std::io::Error>>(dedup_core::Completion::store(
                "taken over",
            ))
        })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 2, .. }),
        "{done:?}"
    );
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_zombie_backfill_cannot_overwrite_a_newer_record(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let fast = s.fast_path();
    let k = key("k");
    let zombie = acquired(
        s.claim(&req(&k, "zombie").with_policy(short_lease(100)))
            .await
            .unwrap(),
    );
    sleep(ms(200)).await;
    let fresh = acquired(s.claim(&req(&k, "fresh")).await.unwrap());
    s.complete(&fresh, b"fresh result").await.unwrap();

    // The zombie's late writes, straight at Redis, are refused.
    assert!(
        !fast
            .store(
                &k,
                &Cached::completed(&zombie, Bytes::from_static(b"zombie")),
                ms(60_000)
            )
            .await
            .unwrap()
    );
    assert!(
        !fast
            .store(&k, &Cached::in_progress(&zombie), ms(60_000))
            .await
            .unwrap()
    );
    assert!(!fast.release(&zombie).await.unwrap());
    // A marker never replaces the terminal copy of its own token either.
    assert!(
        !fast
            .store(&k, &Cached::in_progress(&fresh), ms(60_000))
            .await
            .unwrap()
    );

    let copy = fast.lookup(&k).await.unwrap().unwrap();
    assert_eq!((copy.state, copy.token), (State::Completed, fresh.token));
    assert_eq!(copy.result.as_deref(), Some(&b"fresh result"[..]));
    assert!(
        s.complete(&zombie, b"late")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn foreign_or_corrupted_redis_data_is_a_miss_never_an_answer(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let mut conn = redis.client().await;

    // A string where a hash should be: left alone, and the authority decides.
    let wrong_type = key("wrong-type");
    let rk = s.fast_path().redis_key(&wrong_type);
    let _: () = conn.set(&rk, "not ours").await.unwrap();
    acquired(s.claim(&req(&wrong_type, "a")).await.unwrap());
    assert!(s.stats().l2_errors >= 1);
    let still: String = conn.get(&rk).await.unwrap();
    assert_eq!(still, "not ours");

    // A hash with garbage fields claiming COMPLETED: a miss, then overwritten by the truth.
    let garbage = key("garbage");
    let rk = s.fast_path().redis_key(&garbage);
    let _: () = conn
        .hset_multiple(&rk, &[("s", "completed"), ("t", "nonsense"), ("r", "fake")])
        .await
        .unwrap();
    let lease = acquired(s.claim(&req(&garbage, "a")).await.unwrap());
    let copy = s.fast_path().lookup(&garbage).await.unwrap().unwrap();
    assert_eq!((copy.state, copy.token), (State::InProgress, lease.token));

    // Another key's copy at this key's name (a collision, or a copy-paste): a miss.
    let victim = key("victim");
    let other = key("other");
    let rk_victim = s.fast_path().redis_key(&victim);
    let rk_other = s.fast_path().redis_key(&other);
    let other_lease = acquired(s.claim(&req(&other, "a")).await.unwrap());
    s.complete(&other_lease, b"other's result").await.unwrap();
    let _: () = dedup_redis::redis::cmd("COPY")
        .arg(&rk_other)
        .arg(&rk_victim)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(s.fast_path().lookup(&victim).await.is_err());
    let errors = s.stats().l2_errors;
    acquired(s.claim(&req(&victim, "a")).await.unwrap());
    assert!(s.stats().l2_errors > errors);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_slow_redis_times_out_into_the_authority(pool: PgPool) {
    // Redis stops answering (CLIENT PAUSE) for 300 ms at a time: each fast-path call gives up
    // after its timeout and the authority decides. Slower, never a second effect.
    let redis = RedisServer::start();
    let config = dedup_core::TieredConfig::default();
    assert_eq!(
        config.l2_timeout,
        ms(50),
        "the production default times out here"
    );
    let s = Arc::new(tiered_with(pool.clone(), &redis, config).await);
    let mut conn = redis.client().await;
    let gate = StormGate::new(50);
    let chaos = {
        let (gate, s) = (Arc::clone(&gate), Arc::clone(&s));
        async move {
            gate.held().await;
            for round in 0..3 {
                let _: () = dedup_redis::redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg(300)
                    .arg("ALL")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                if round == 0 {
                    // A claim of our own inside the pause times out (50 ms against 300 ms),
                    // however fast the storm is; then the held handlers go on.
                    s.claim(&req(&key("probe-while-paused"), "probe"))
                        .await
                        .unwrap();
                    gate.release();
                }
                sleep(ms(300)).await;
            }
        }
    };
    let st = storm_with(&pool, Arc::clone(&s), gate, chaos).await;
    assert!(st.l2_timeouts > 0, "the pause must be felt: {st:?}");
    eprintln!("slow redis storm: {st:?}");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_scripts_run_on_a_three_master_cluster(pool: PgPool) {
    let s = crate::support::tiered_cluster(pool).await;
    let mut leases = Vec::new();
    for n in 0..60 {
        let k = key(format!("spread-{n}"));
        let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
        s.extend(&lease).await.unwrap();
        leases.push(lease);
    }
    for (n, lease) in leases.iter().enumerate() {
        if n % 2 == 0 {
            s.complete(lease, b"done").await.unwrap();
        } else {
            s.fail_retryable(lease, "later").await.unwrap();
        }
    }
    for (n, lease) in leases.iter().enumerate() {
        let copy = s.fast_path().lookup(&lease.key).await.unwrap();
        if n % 2 == 0 {
            assert_eq!(
                copy.map(|c| (c.state, c.token)),
                Some((State::Completed, lease.token))
            );
        } else {
            assert_eq!(copy, None, "the released key's marker is dropped");
        }
    }
    // The copies are spread over all three masters.
    let prefix = s.fast_path().redis_key(&key("x"));
    let prefix = prefix.split(':').next().unwrap().to_owned();
    let urls = std::env::var("REDIS_CLUSTER_URLS").unwrap();
    for url in urls.split(',') {
        let mut node = dedup_redis::redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let (_, found): (u64, Vec<String>) = dedup_redis::redis::cmd("SCAN")
            .arg(0)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(100_000)
            .query_async(&mut node)
            .await
            .unwrap();
        assert!(!found.is_empty(), "no copy landed on {url}");
    }
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn acl_credentials_come_from_the_url_and_never_show(pool: PgPool) {
    let secret = "s3cret-Pa55";
    let acl_user = format!(">{secret}");
    let redis = RedisServer::start_with(&[
        "--user", "default", "off", "--user", "dedup", "on", &acl_user, "~*", "&*", "+@all",
    ]);
    let url = format!("redis://dedup:{secret}@127.0.0.1:{}", redis.port());
    let fast = dedup_redis::RedisFastPath::connect(&url).await.unwrap();
    assert!(!format!("{fast:?}").contains(secret));
    let s = dedup_core::TieredStore::new(
        dedup_pg::PgStore::new(pool),
        fast,
        crate::support::test_config(),
    );
    let lease = acquired(s.claim(&req(&key("k"), "a")).await.unwrap());
    s.complete(&lease, b"ok").await.unwrap();
    assert_eq!(
        s.stats().backfills,
        2,
        "marker and completion reached the ACL-protected Redis"
    );
    assert!(!format!("{s:?}").contains(secret));

    // Wrong password: a clear error that does not repeat the password.
    let wrong = format!("redis://dedup:not-{secret}@127.0.0.1:{}", redis.port());
    let err = dedup_redis::RedisFastPath::connect(&wrong)
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains(secret), "{shown}");
    assert!(
        shown.to_lowercase().contains("wrongpass") || shown.contains("auth"),
        "{shown}"
    );
    // A URL that is not one names what to fix.
    let err = dedup_redis::RedisFastPath::connect("rediss//nope")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("redis://"), "{err}");
}

/// A CA and a server certificate for 127.0.0.1, made with the openssl command.
fn test_certificates(dir: &std::path::Path) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=dedup test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn tls_connections_carry_the_fast_path(pool: PgPool) {
    let certs = std::env::temp_dir().join(format!("dedup-test-tls-{}", std::process::id()));
    std::fs::create_dir_all(&certs).unwrap();
    test_certificates(&certs);
    let path = |f: &str| certs.join(f).to_string_lossy().into_owned();
    let redis = RedisServer::start_on(|port| {
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-auth-clients",
            "no",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain([
            "--tls-cert-file".into(),
            path("server.crt"),
            "--tls-key-file".into(),
            path("server.key"),
        ])
        .chain(["--tls-ca-cert-file".into(), path("ca.crt")])
        .collect()
    });
    let url = format!("rediss://127.0.0.1:{}", redis.port());
    let ca = std::fs::read(certs.join("ca.crt")).unwrap();

    // Without our CA the server is not trusted: a clear error, no connection.
    assert!(dedup_redis::RedisFastPath::connect(&url).await.is_err());

    let fast = dedup_redis::RedisFastPath::connect_tls(&url, Some(&ca))
        .await
        .unwrap();
    let s = dedup_core::TieredStore::new(
        dedup_pg::PgStore::new(pool),
        fast,
        crate::support::test_config(),
    );
    let k = key("k");
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    s.complete(&lease, b"over tls").await.unwrap();
    s.clear_l1();
    assert!(matches!(
        s.claim(&req(&k, "b")).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));
    let st = s.stats();
    assert_eq!(
        (st.backfills, st.l2_hits, st.l2_errors),
        (2, 1, 0),
        "{st:?}"
    );
    let _ = std::fs::remove_dir_all(&certs);
}

/// With background backfill, a batch answers once Postgres has, and Redis learns the outcome
/// soon after: the result after the completion, never before Postgres has it. A batch claim
/// writes no IN_PROGRESS marker (a concurrent duplicate asks Postgres, in its own batch). L1 is
/// filled at once.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn background_backfill_reaches_redis_after_the_authority(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await.with_background_backfill();
    let keys: Vec<_> = (0..50).map(|i| key(format!("k{i}"))).collect();
    let reqs: Vec<_> = keys.iter().map(|k| req(k, "a")).collect();
    let leases: Vec<_> = s
        .claim_batch(&reqs)
        .await
        .into_iter()
        .map(|o| acquired(o.unwrap()))
        .collect();
    for k in &keys {
        assert_eq!(
            s.fast_path().lookup(k).await.unwrap(),
            None,
            "no marker for {k}"
        );
    }
    let items: Vec<(dedup_core::Lease, Bytes)> = leases
        .iter()
        .map(|l| (l.clone(), Bytes::from_static(b"done")))
        .collect();
    assert!(s.complete_batch(&items).await.iter().all(Result::is_ok));
    // L1 answers at once, without waiting for Redis.
    assert!(matches!(
        s.claim(&req(&keys[0], "b")).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));
    assert_eq!(s.stats().l1_hits, 1);
    eventually(&s, &keys, State::Completed).await;
    assert_eq!(s.stats().backfills, 50, "{:?}", s.stats());
}

/// Waits until Redis holds a copy in state `want` of every key.
async fn eventually(s: &Tiered, keys: &[dedup_core::IdempotencyKey], want: State) {
    for _ in 0..100 {
        let mut all = true;
        for k in keys {
            let copy = s.fast_path().lookup(k).await.unwrap();
            all &= copy.is_some_and(|c| c.state == want);
        }
        if all {
            return;
        }
        sleep(ms(20)).await;
    }
    panic!("Redis never held {want:?} copies of every key");
}

/// How many times Redis ran `name` since its stats were last reset (`INFO commandstats`), with
/// the whole section for a failure message.
async fn command_calls(
    conn: &mut dedup_redis::redis::aio::MultiplexedConnection,
    name: &str,
) -> (u64, String) {
    let info: String = dedup_redis::redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    let calls = info
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap());
    (calls, info)
}

/// A pipeline of backfills on a Redis that lacks the store script (just restarted, or its
/// scripts flushed) loads the script once and sends the pipeline again: it does not fall back to
/// one call per copy, each loading the script for itself.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_pipeline_of_backfills_loads_a_missing_script_once(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let mut conn = redis.client().await;
    let keys: Vec<_> = (0..20).map(|i| key(format!("p{i}"))).collect();
    let mut items = Vec::new();
    for k in &keys {
        let lease = acquired(s.claim(&req(k, "a")).await.unwrap());
        s.complete(&lease, b"done").await.unwrap();
        items.push((
            k.clone(),
            Cached::completed(&lease, Bytes::from_static(b"done")),
            ms(60_000),
        ));
    }
    let _: () = conn
        .del(
            keys.iter()
                .map(|k| s.fast_path().redis_key(k))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    let _: () = dedup_redis::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = dedup_redis::redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();

    let written = s.fast_path().store_many(&items).await;
    assert!(written.iter().all(|w| matches!(w, Ok(true))), "{written:?}");
    let (loads, info) = command_calls(&mut conn, "script|load").await;
    assert_eq!(loads, 1, "{info}");
    let (evalsha, info) = command_calls(&mut conn, "evalsha").await;
    assert!(
        evalsha <= 2,
        "one script call carries the 20 copies: at most one refused, then one that wrote: {info}"
    );
    for k in &keys {
        let copy = s.fast_path().lookup(k).await.unwrap().unwrap();
        assert_eq!(copy.state, State::Completed);
    }
}

/// A backfill on one server is one store script call per 128 copies: each copy is still answered
/// on its own. A newer copy already held refuses the older one beside it; foreign data (a string
/// where a hash should be) fails its call, and only that call's copies are then written one by
/// one, the foreign value left alone.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_backfill_of_many_copies_answers_each_and_leaves_foreign_data_alone(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let mut conn = redis.client().await;
    let keys: Vec<_> = (0..300).map(|i| key(format!("m{i}"))).collect();
    let mut items = Vec::new();
    let mut newer = None;
    for (i, k) in keys.iter().enumerate() {
        let result = Bytes::from(format!("r{i}"));
        if i == 7 {
            // A zombie: its lease ran out and another holder completed the key.
            let old = acquired(
                s.claim(&req(k, "a").with_policy(short_lease(100)))
                    .await
                    .unwrap(),
            );
            sleep(ms(200)).await;
            let lease = acquired(s.claim(&req(k, "b")).await.unwrap());
            s.complete(&lease, b"newer").await.unwrap();
            newer = Some(lease);
            items.push((k.clone(), Cached::completed(&old, result), ms(60_000)));
            continue;
        }
        let lease = acquired(s.claim(&req(k, "a")).await.unwrap());
        s.complete(&lease, &result).await.unwrap();
        items.push((k.clone(), Cached::completed(&lease, result), ms(60_000)));
    }
    let newer_lease = newer.unwrap();
    let rkeys: Vec<String> = keys.iter().map(|k| s.fast_path().redis_key(k)).collect();
    let _: () = conn.del(&rkeys).await.unwrap();
    // Key 7 holds the newer holder's copy; keys 130 and 260, in the second and third calls, hold
    // foreign strings.
    let zombie = &keys[7];
    let copy = Cached::completed(&newer_lease, Bytes::from_static(b"newer"));
    assert!(
        s.fast_path()
            .store(zombie, &copy, ms(60_000))
            .await
            .unwrap()
    );
    for i in [130, 260] {
        let _: () = conn.set(&rkeys[i], "not ours").await.unwrap();
    }
    let _: () = dedup_redis::redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();

    let written = s.fast_path().store_many(&items).await;
    for (i, w) in written.iter().enumerate() {
        match i {
            7 => assert!(matches!(w, Ok(false)), "{i}: {w:?}"),
            130 | 260 => assert!(w.is_err(), "{i}: {w:?}"),
            _ => assert!(matches!(w, Ok(true)), "{i}: {w:?}"),
        }
    }
    for i in [130, 260] {
        let still: String = conn.get(&rkeys[i]).await.unwrap();
        assert_eq!(still, "not ours");
    }
    let held = s.fast_path().lookup(zombie).await.unwrap().unwrap();
    assert_eq!(
        (held.token, held.result.as_deref()),
        (newer_lease.token, Some(&b"newer"[..]))
    );
    for (i, k) in keys.iter().enumerate() {
        if ![7, 130, 260].contains(&i) {
            let copy = s.fast_path().lookup(k).await.unwrap().unwrap();
            assert_eq!(copy.result.as_deref(), Some(format!("r{i}").as_bytes()));
        }
    }
    // Three calls of up to 128 copies; the two that met foreign data fail, and each copy of those
    // two calls (128 and 44) is then written on its own.
    let (evalsha, info) = command_calls(&mut conn, "evalsha").await;
    assert_eq!(evalsha, 3 + 128 + 44, "{info}");
}

/// A server that enforces hash slots behind one address (here: one master of the test cluster,
/// reached as if it were a lone server) refuses a script call of several keys with CROSSSLOT. The
/// backfill then writes each copy on its own (those of this master's slots land), and every later
/// backfill sends one copy per call.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_slot_enforcing_server_behind_one_address_gets_one_copy_per_call(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let urls =
        std::env::var("REDIS_CLUSTER_URLS").expect("REDIS_CLUSTER_URLS is set by scripts/test");
    let node_url = urls.split(',').next().unwrap();
    let node = dedup_redis::RedisFastPath::connect(node_url)
        .await
        .unwrap()
        .with_prefix(format!("slots-{}", std::process::id()));
    assert!(node.batched_copies());
    let mut items = Vec::new();
    for i in 0..30 {
        let k = key(format!("slot{i}"));
        let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
        s.complete(&lease, b"done").await.unwrap();
        items.push((
            k,
            Cached::completed(&lease, Bytes::from_static(b"done")),
            ms(60_000),
        ));
    }
    let written = node.store_many(&items).await;
    assert!(!node.batched_copies(), "CROSSSLOT turns batched copies off");
    // The copies of this master's slots are written; the others are refused (MOVED), each on
    // its own, and no answer is missing.
    assert_eq!(written.len(), 30);
    let landed = written.iter().filter(|w| matches!(w, Ok(true))).count();
    assert!((1..30).contains(&landed), "{written:?}");
    for ((k, _, _), w) in items.iter().zip(&written) {
        if matches!(w, Ok(true)) {
            assert_eq!(
                node.lookup(k).await.unwrap().unwrap().state,
                State::Completed
            );
        } else {
            assert!(w.is_err(), "{w:?}");
        }
    }
}

/// The engine's setting reaches its fast path: on by default, off when asked.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_engine_sends_one_copy_per_call_when_asked(pool: PgPool) {
    let redis = RedisServer::start();
    for (asked, want) in [(None, true), (Some(false), false)] {
        let mut builder = dedup::Engine::builder()
            .postgres(pool.clone())
            .scope("copies")
            .redis_url(redis.url());
        if let Some(on) = asked {
            builder = builder.redis_batched_copies(on);
        }
        let engine = builder.build().await.unwrap();
        // The engine's Debug shows its fast path's settings (never the URL).
        let shown = format!("{engine:?}");
        assert!(
            shown.contains(&format!(
                "Redis(RedisFastPath {{ prefix: \"dedup\", pipelined: true, batched_copies: {want}"
            )),
            "{shown}"
        );
    }
}

/// A batch claim stops asking a fast path that answers almost none of its keys (a stream of new
/// keys: each lookup a Redis round trip for nothing), but for one batch in 16, and asks it again
/// as soon as that probe finds it answering: a replay of completed keys (here after L1 was
/// emptied, as on an instance that took the partition over) is answered by Redis again within
/// 16 batches, not by Postgres for good.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn batch_claims_skip_a_fast_path_that_answers_nothing_and_return_for_a_replay(pool: PgPool) {
    let redis = RedisServer::start();
    let s = tiered(pool, &redis).await;
    let batch = |b: usize| -> Vec<dedup_core::ClaimRequest> {
        (0..64)
            .map(|i| req(&key(format!("n{b}-{i}")), "a"))
            .collect()
    };
    let mut leases = Vec::new();
    for b in 0..40 {
        for o in s.claim_batch(&batch(b)).await {
            leases.push(acquired(o.unwrap()));
        }
    }
    let st = s.stats();
    // 1,024 keys warm the gate up (16 batches asked); of the other 24 batches, one in 16 asks.
    assert_eq!(st.l2_hits, 0, "{st:?}");
    assert_eq!(st.l2_misses + st.l2_bypassed, 40 * 64, "{st:?}");
    assert!(st.l2_bypassed >= 22 * 64, "{st:?}");
    assert_eq!(st.authority_claims, 40 * 64, "{st:?}");

    // The last 20 batches complete; Redis holds their copies (backfilled in the foreground).
    let items: Vec<(dedup_core::Lease, Bytes)> = leases[20 * 64..]
        .iter()
        .map(|l| (l.clone(), Bytes::from_static(b"done")))
        .collect();
    assert!(s.complete_batch(&items).await.iter().all(Result::is_ok));
    s.clear_l1();

    // Their replay: the first probe finds Redis answering, and every batch after it asks.
    let before = s.stats();
    let mut from_authority = Vec::new();
    for b in 20..40 {
        let asked = s.stats().authority_claims;
        for o in s.claim_batch(&batch(b)).await {
            assert!(
                matches!(o.unwrap(), ClaimOutcome::Completed { .. }),
                "batch {b}"
            );
        }
        from_authority.push(s.stats().authority_claims - asked);
    }
    let after = s.stats();
    let first_answered = from_authority.iter().position(|&n| n == 0).unwrap();
    assert!(first_answered < 16, "{from_authority:?}");
    assert!(
        from_authority[first_answered..].iter().all(|&n| n == 0),
        "{from_authority:?}"
    );
    assert!(
        after.l2_hits - before.l2_hits >= (20 - 16) * 64,
        "{before:?} {after:?}"
    );
}
