//! Helpers shared by the test modules.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    AfterFailure, ClaimOutcome, ClaimRequest, IdempotencyKey, Lease, OwnerId, Policy, Record,
    Scope, Store, StoreError, Timestamp,
};

pub(crate) fn scope(name: &str) -> Scope {
    Scope::new(name).unwrap()
}

/// A key in `scope` (a runner's default scope is its group id).
pub(crate) fn key_in(scope_name: &str, name: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope(scope_name), name).unwrap()
}

pub(crate) fn key(name: impl AsRef<[u8]>) -> IdempotencyKey {
    IdempotencyKey::new(scope("test"), name).unwrap()
}

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A claim by `owner` with a 30 s lease unless `policy` says otherwise.
pub(crate) fn req(key: &IdempotencyKey, owner: &str) -> ClaimRequest {
    ClaimRequest::new(key.clone(), OwnerId::new(owner))
}

pub(crate) fn acquired(outcome: ClaimOutcome) -> Lease {
    match outcome {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

pub(crate) fn short_lease(ms_: u64) -> Policy {
    Policy::default().with_lease(ms(ms_))
}

/// A real store with injected faults. It never fakes an answer: the inner store's state is the
/// truth the caller must read back.
/// - a lost reply: a claim or completion that **was applied** by the inner store is reported as
///   [`StoreError::OutcomeUnknown`], as a dropped connection after COMMIT would be;
/// - a refusal: a read or a completion is refused as [`StoreError::Unavailable`] (not applied: a
///   server that is down) before it reaches the store;
/// - counters: the completions tried, and the InFlight answers claims gave (a test waits for one
///   instead of sleeping and hoping a duplicate has asked by then).
#[derive(Debug)]
pub(crate) struct Faults<S> {
    pub(crate) inner: S,
    pub(crate) lost_claims: AtomicU32,
    pub(crate) lost_completes: AtomicU32,
    pub(crate) refused_gets: AtomicU32,
    pub(crate) refused_completes: AtomicU32,
    pub(crate) complete_tries: AtomicU32,
    pub(crate) in_flight: AtomicU32,
    pub(crate) refused_extends: AtomicU32,
    /// The most leases one `extend_batch` call carried.
    pub(crate) extend_batch_max: AtomicU32,
}

impl<S> Faults<S> {
    /// No faults yet.
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            lost_claims: AtomicU32::new(0),
            lost_completes: AtomicU32::new(0),
            refused_gets: AtomicU32::new(0),
            refused_completes: AtomicU32::new(0),
            complete_tries: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            refused_extends: AtomicU32::new(0),
            extend_batch_max: AtomicU32::new(0),
        }
    }

    /// Refuses the next `n` lease extensions as unavailable (a heartbeat that cannot reach the
    /// store, so the lease runs out).
    pub(crate) fn refusing_extends(self, n: u32) -> Self {
        self.refused_extends.store(n, Ordering::SeqCst);
        self
    }

    /// Loses the replies of the next `n` claims (after they applied).
    pub(crate) fn losing_claims(self, n: u32) -> Self {
        self.lost_claims.store(n, Ordering::SeqCst);
        self
    }

    /// Loses the replies of the next `n` completions (after they applied).
    pub(crate) fn losing_completions(self, n: u32) -> Self {
        self.lost_completes.store(n, Ordering::SeqCst);
        self
    }

    /// Refuses the next `n` reads as unavailable.
    pub(crate) fn refusing_gets(self, n: u32) -> Self {
        self.refused_gets.store(n, Ordering::SeqCst);
        self
    }

    /// Refuses the next `n` completions as unavailable.
    pub(crate) fn refusing_completions(self, n: u32) -> Self {
        self.refused_completes.store(n, Ordering::SeqCst);
        self
    }
}

fn take(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

#[derive(Debug)]
struct ReplyLost;

impl std::fmt::Display for ReplyLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped before the reply (injected)")
    }
}

impl std::error::Error for ReplyLost {}

impl<S: Store> Store for Faults<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let out = self.inner.claim(req).await?;
        if take(&self.lost_claims) {
            return Err(StoreError::outcome_unknown(ReplyLost));
        }
        if let ClaimOutcome::InFlight { .. } = &out {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
        }
        Ok(out)
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        self.complete_tries.fetch_add(1, Ordering::SeqCst);
        if take(&self.refused_completes) {
            return Err(StoreError::unavailable(ReplyLost));
        }
        self.inner.complete(lease, result).await?;
        if take(&self.lost_completes) {
            return Err(StoreError::outcome_unknown(ReplyLost));
        }
        Ok(())
    }
    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        self.inner.fail_retryable(lease, error).await
    }
    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        self.inner.fail_permanent(lease, reason).await
    }
    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        self.inner.withdraw(lease).await
    }
    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        if take(&self.refused_extends) {
            return Err(StoreError::unavailable(ReplyLost));
        }
        self.inner.extend(lease).await
    }
    async fn extend_batch(&self, leases: &[Lease]) -> Vec<Result<Timestamp, StoreError>> {
        self.extend_batch_max.fetch_max(
            u32::try_from(leases.len()).unwrap_or(u32::MAX),
            Ordering::SeqCst,
        );
        if self.refused_extends.load(Ordering::SeqCst) > 0 {
            let mut out = Vec::with_capacity(leases.len());
            for lease in leases {
                out.push(self.extend(lease).await);
            }
            return out;
        }
        self.inner.extend_batch(leases).await
    }
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        if take(&self.refused_gets) {
            return Err(StoreError::unavailable(ReplyLost));
        }
        self.inner.get(key).await
    }
    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        self.inner.purge(limit).await
    }
}

/// Polls `done` every 10 ms until it holds; fails the test after 30 s.
pub(crate) async fn until<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The handler error type tests use.
#[derive(Debug)]
pub(crate) struct Boom(pub(crate) &'static str);

impl std::fmt::Display for Boom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Boom {}

pub(crate) fn bytes(s: &'static str) -> Bytes {
    Bytes::from_static(s.as_bytes())
}

/// A table of business effects: one row per time a handler's effect ran and committed.
pub(crate) async fn effects_table(pool: &sqlx::PgPool) {
    sqlx::query(
        "CREATE TABLE effects (key text NOT NULL, token bigint NOT NULL, worker text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Writes one effect row on `conn` (usually inside the handler's transaction).
pub(crate) async fn insert_effect(
    conn: &mut sqlx::PgConnection,
    key: &str,
    token: dedup_core::FencingToken,
    worker: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects VALUES ($1, $2, $3)")
        .bind(key)
        .bind(i64::try_from(token.get()).unwrap())
        .bind(worker)
        .execute(conn)
        .await
        .map(drop)
}

/// All effect rows: (key, token, worker), ordered.
pub(crate) async fn effect_rows(pool: &sqlx::PgPool) -> Vec<(String, i64, String)> {
    sqlx::query_as("SELECT key, token, worker FROM effects ORDER BY key, token")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A transactional handler body: the effect row and the fenced completion commit together.
pub(crate) async fn effect_in_tx(
    store: &dedup_pg::PgStore,
    ctx: &dedup_core::LeaseContext,
    key: String,
    worker: String,
    result: Bytes,
) -> Result<dedup_core::Completion, dedup_core::HandlerError<sqlx::Error>> {
    let token = ctx.lease().token;
    store
        .transact(ctx, move |tx| {
            Box::pin(async move {
                insert_effect(tx, &key, token, &worker)
                    .await
                    .map_err(dedup_core::HandlerError::Retryable)?;
                Ok(result)
            })
        })
        .await
}

/// A redis-server of the test's own, on a free loopback port, killed on drop (as redis-rs's own
/// tests do). The binary comes from `REDIS_SERVER_BIN` (set by `scripts/test`) or the PATH.
#[derive(Debug)]
pub(crate) struct RedisServer {
    port: u16,
    dir: std::path::PathBuf,
    extra: Vec<String>,
    child: Option<std::process::Child>,
}

impl RedisServer {
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (ACL users, say).
    pub(crate) fn start_with(extra: &[&str]) -> Self {
        Self::start_on(|_| extra.iter().map(|s| (*s).to_owned()).collect())
    }

    /// Starts with extra arguments made from the chosen port (for `--tls-port`, say).
    pub(crate) fn start_on(extra: impl FnOnce(u16) -> Vec<String>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("dedup-test-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            port,
            dir,
            extra: extra(port),
            child: None,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let child = std::process::Command::new(&bin)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin} (scripts/test installs it): {e}"));
        self.child = Some(child);
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server did not listen on {}", self.port);
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// SIGKILL: no goodbye to the clients.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port (empty: nothing is persisted).
    pub(crate) fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A plain client for poking at the server directly.
    pub(crate) async fn client(&self) -> dedup_redis::redis::aio::MultiplexedConnection {
        dedup_redis::redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The tiered store the tests use: Postgres behind L1 and this Redis.
pub(crate) type Tiered = dedup_core::TieredStore<dedup_pg::PgStore, dedup_redis::RedisFastPath>;

pub(crate) async fn tiered(pool: sqlx::PgPool, redis: &RedisServer) -> Tiered {
    tiered_with(pool, redis, test_config()).await
}

/// The tiered store with `config` (the production default's 50 ms fast-path timeout, say, for a
/// test of what a slow Redis does).
pub(crate) async fn tiered_with(
    pool: sqlx::PgPool,
    redis: &RedisServer,
    config: dedup_core::TieredConfig,
) -> Tiered {
    let fast = dedup_redis::RedisFastPath::connect(&redis.url())
        .await
        .unwrap();
    dedup_core::TieredStore::new(dedup_pg::PgStore::new(pool), fast, config)
}

/// The tests' tier configuration: the defaults, but a fast-path timeout of 2 s instead of 50 ms,
/// so that a test counting which tier answered does not depend on Redis answering within 50 ms
/// on a loaded machine (one core, under `taskset`). Tests of timeouts use `tiered_with`.
pub(crate) fn test_config() -> dedup_core::TieredConfig {
    dedup_core::TieredConfig::default().with_l2_timeout(Duration::from_secs(2))
}

/// The tiered store on the 3-master cluster `scripts/test` starts (`REDIS_CLUSTER_URLS`), under a
/// key prefix of the test's own.
pub(crate) type TieredCluster = dedup_core::TieredStore<
    dedup_pg::PgStore,
    dedup_redis::RedisFastPath<dedup_redis::redis::cluster_async::ClusterConnection>,
>;

pub(crate) async fn tiered_cluster(pool: sqlx::PgPool) -> TieredCluster {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let urls =
        std::env::var("REDIS_CLUSTER_URLS").expect("REDIS_CLUSTER_URLS is set by scripts/test");
    let urls: Vec<&str> = urls.split(',').collect();
    let prefix = format!(
        "t{}-{}-{}",
        std::process::id(),
        Timestamp::now().as_micros(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let fast = dedup_redis::RedisFastPath::connect_cluster(&urls)
        .await
        .unwrap()
        .with_prefix(prefix);
    dedup_core::TieredStore::new(dedup_pg::PgStore::new(pool), fast, test_config())
}

/// The URL of the test's own database: `DATABASE_URL` with the database name swapped.
pub(crate) fn url_of(pool: &sqlx::PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set by scripts/test");
    let db = pool
        .connect_options()
        .get_database()
        .expect("sqlx::test names its database")
        .to_owned();
    let (server, _) = base
        .rsplit_once('/')
        .expect("DATABASE_URL has a database path");
    format!("{server}/{db}")
}

mod nisshi;
mod partitioned;
mod pg_server;
pub(crate) mod tls;

pub(crate) use nisshi::NisshiServer;
pub(crate) use partitioned::{misplaced_records, partition_records, records_by_partition};
pub(crate) use pg_server::PgServer;
