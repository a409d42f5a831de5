//! [`EngineBuilder`]: every engine setting in one place, checked once by `build()`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{
    Adoption, BatchConfig, Batched, Dedup, InstanceId, MAX_WAIT, Policy, Scope, Store,
    TieredConfig, TieredStore, Timestamp,
};
use dedup_pg::{MigrationMode, PgStore, RetentionConfig};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tracing::{info, warn};

use super::{Authority, BuildError, Engine, FastTier, Inner};
use crate::running::Running;

/// Where Postgres is.
#[derive(Debug)]
enum Postgres {
    Pool(PgPool),
    Url {
        url: String,
        max_connections: u32,
    },
    /// No Postgres: the in-memory reference store.
    Memory,
}

/// Where Redis is.
#[cfg(feature = "redis")]
#[derive(Debug)]
enum Redis {
    One(String),
    Cluster(Vec<String>),
}

/// Builds an [`Engine`], in the style of sqlx's `PgPoolOptions`: setters that cannot fail, and
/// one [`build`](Self::build) that checks everything and names a bad setting by its method.
///
/// ```no_run
/// # async fn run() -> Result<(), dedup::BuildError> {
/// let engine = dedup::Engine::builder()
///     .postgres_url("postgres://dedup@db/payments")
///     .scope("payments")
///     .instance("payments-7f9c") // a pod name: stable across restarts
///     .build()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "an engine builder does nothing until `build` is awaited"]
pub struct EngineBuilder {
    postgres: Option<Postgres>,
    #[cfg(feature = "redis")]
    redis: Option<Redis>,
    #[cfg(feature = "redis")]
    redis_prefix: String,
    #[cfg(feature = "redis")]
    redis_batched_copies: bool,
    tiers: TieredConfig,
    group_commit: BatchConfig,
    policy: Policy,
    in_flight_wait: Duration,
    instance: Option<String>,
    scope: Option<String>,
    migrations: MigrationMode,
    retention: Option<RetentionConfig>,
    #[cfg(feature = "kafka")]
    outbox: Option<(rdkafka::ClientConfig, dedup_kafka::outbox::RelayConfig)>,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        Self {
            postgres: None,
            #[cfg(feature = "redis")]
            redis: None,
            #[cfg(feature = "redis")]
            redis_prefix: "dedup".to_owned(),
            #[cfg(feature = "redis")]
            redis_batched_copies: true,
            tiers: TieredConfig::default(),
            group_commit: BatchConfig::default(),
            policy: Policy::default(),
            in_flight_wait: Duration::from_secs(5),
            instance: None,
            scope: None,
            migrations: MigrationMode::Apply,
            retention: None,
            #[cfg(feature = "kafka")]
            outbox: None,
        }
    }
}

impl EngineBuilder {
    /// Postgres, as a pool you built (its size bounds the engine's concurrency; give it at least
    /// a few connections more than the consumers' batches in flight).
    pub fn postgres(mut self, pool: PgPool) -> Self {
        self.postgres = Some(Postgres::Pool(pool));
        self
    }

    /// Postgres at `url` (`postgres://user:password@host/db?sslmode=...`), on a pool of 16
    /// connections.
    pub fn postgres_url(self, url: impl Into<String>) -> Self {
        self.postgres_url_with(url, 16)
    }

    /// Postgres at `url`, on a pool of `max_connections`.
    pub fn postgres_url_with(mut self, url: impl Into<String>, max_connections: u32) -> Self {
        self.postgres = Some(Postgres::Url {
            url: url.into(),
            max_connections,
        });
        self
    }

    /// No Postgres: the engine keeps its records in this process's memory (dedup's reference
    /// store, which the conformance suite holds every store to). For tests of code built on
    /// dedup: lease-mode handlers (with `dedup::kafka::testing::MockKafka`), HTTP routes,
    /// `engine.dedup().process(..)`. Nothing is durable and nothing is shared, between processes
    /// or between two engines built this way (each has a store of its own). Transaction mode,
    /// parking, the transactional HTTP path and a fast path (Redis) are refused by name, and
    /// `pool()` answers [`NoPostgres`](crate::NoPostgres). Dead letters go to the dead-letter
    /// topic only: there is no table to keep one the topic refuses (the partition then waits on
    /// it, counted in `dead_letter_stalls`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use dedup::{Completion, HandlerError, IdempotencyKey};
    ///
    /// let engine = dedup::Engine::builder().in_memory().scope("test").build().await?;
    /// let key = IdempotencyKey::new(engine.scope().clone(), "order-1")?;
    /// for delivery in 0..2 {
    ///     let done = engine
    ///         .dedup()
    ///         .process(&key, None, |_lease| async {
    ///             Ok::<_, HandlerError<std::io::Error>>(Completion::store("done"))
    ///         })
    ///         .await?;
    ///     assert_eq!(done.executed(), delivery == 0);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn in_memory(mut self) -> Self {
        self.postgres = Some(Postgres::Memory);
        self
    }

    /// Redis at `url` as the fast path (L2) in front of Postgres. Without it, Postgres answers
    /// what the in-process L1 does not hold.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis_url(mut self, url: impl Into<String>) -> Self {
        self.redis = Some(Redis::One(url.into()));
        self
    }

    /// A Redis Cluster, by some of its nodes' URLs, as the fast path.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis_cluster(mut self, urls: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.redis = Some(Redis::Cluster(urls.into_iter().map(Into::into).collect()));
        self
    }

    /// The prefix of dedup's Redis keys (default `dedup`).
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.redis_prefix = prefix.into();
        self
    }

    /// Whether a backfill to one Redis server sends many copies per script call (default: yes,
    /// up to 128 copies or about 1 MiB a call). Turn it off behind a proxy that routes a call by
    /// its first key (twemproxy): each copy then goes in a call of its own. A server that
    /// enforces hash slots behind one address answers CROSSSLOT and turns it off by itself; a
    /// Redis Cluster (`redis_cluster`) always sends one copy per call.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), dedup::BuildError> {
    /// let engine = dedup::Engine::builder()
    ///     .postgres_url("postgres://dedup@db/payments")
    ///     .scope("payments")
    ///     .redis_url("redis://twemproxy.internal:22121")
    ///     .redis_batched_copies(false) // the proxy routes a script call by its first key
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn redis_batched_copies(mut self, on: bool) -> Self {
        self.redis_batched_copies = on;
        self
    }

    /// The caches' settings (L1 size and policy, the fast path's timeout).
    pub fn tiers(mut self, config: TieredConfig) -> Self {
        self.tiers = config;
        self
    }

    /// Group commit: concurrent claims and completions go to Postgres as batches of up to
    /// `max_batch`.
    pub fn group_commit(mut self, config: BatchConfig) -> Self {
        self.group_commit = config;
        self
    }

    /// The default claim policy (lease, attempts, retention); a consumer or layer may override it.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// How long a duplicate waits for another holder's live lease before it is answered "in
    /// flight" (default 5 s).
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.in_flight_wait = wait;
        self
    }

    /// The instance identity: a pod or host name, the same after a restart, unique among live
    /// processes. With it, the engine ends the leases its previous incarnation left (a process
    /// killed mid-effect: its messages are taken over at once, not after the lease), holds the
    /// identity while it lives, and gives each consumer a stable `group.instance.id`.
    pub fn instance(mut self, id: impl Into<String>) -> Self {
        self.instance = Some(id.into());
        self
    }

    /// The dedup scope: the namespace of every key (required). It is never derived from a
    /// consumer group: renaming a group, or a blue/green deploy under a new group id, must still
    /// find every key done.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// What `build` does with dedup's migrations: apply them (the default), verify that a
    /// deploy step applied them, or only check the schema's generation.
    pub fn migrations(mut self, mode: MigrationMode) -> Self {
        self.migrations = mode;
        self
    }

    /// Retention in the background (off by default): every engine built with it runs a task,
    /// and the one that holds the retention lock of the database deletes the records past their
    /// retention, `config.batch` a statement, every `config.every`; when its process dies,
    /// another engine's task takes over at its next round. Without it, run `dedup purge` (once,
    /// or `--every` as a sidecar). [`Engine::shutdown`] stops it; [`Engine::stats`] counts it.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), dedup::BuildError> {
    /// use std::time::Duration;
    ///
    /// let engine = dedup::Engine::builder()
    ///     .postgres_url("postgres://dedup@db/payments")
    ///     .scope("payments")
    ///     .retention(dedup::RetentionConfig::default().with_every(Duration::from_secs(300)))
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn retention(mut self, config: RetentionConfig) -> Self {
        self.retention = Some(config);
        self
    }

    /// Runs the outbox relay in the background (docs/OUTBOX.md): what handlers queue on the
    /// outbox (`Acquired::publish`) is published to the brokers of `client` (its
    /// `bootstrap.servers` and any security settings) once their transactions commit. Every
    /// engine built with it runs a relay; one leads at a time and the others stand by, taking
    /// over within `config.lease` of its death. Woken by this engine's own commits, polling
    /// every `config.poll` for the others'. [`Engine::shutdown`] stops it (after the consumers),
    /// letting its lease go; [`Engine::stats`] and [`Engine::health`] report it.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), dedup::BuildError> {
    /// let mut kafka = dedup::rdkafka::ClientConfig::new();
    /// kafka.set("bootstrap.servers", "kafka:9092");
    /// let engine = dedup::Engine::builder()
    ///     .postgres_url("postgres://dedup@db/payments")
    ///     .scope("payments")
    ///     .outbox(kafka, dedup::outbox::RelayConfig::default())
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn outbox(
        mut self,
        client: rdkafka::ClientConfig,
        config: dedup_kafka::outbox::RelayConfig,
    ) -> Self {
        self.outbox = Some((client, config));
        self
    }

    /// Checks every setting, connects, migrates (as [`migrations`](Self::migrations) says) and,
    /// with an instance identity, adopts the leases of its earlier incarnations.
    ///
    /// # Errors
    /// A bad setting, named; Postgres or Redis unreachable; a schema this binary cannot use;
    /// an instance identity another live process holds.
    pub async fn build(self) -> Result<Engine, BuildError> {
        let scope = match &self.scope {
            Some(s) => Scope::new(s).map_err(|e| BuildError::setting("scope", e))?,
            None => {
                return Err(BuildError::setting(
                    "scope",
                    "no dedup scope: set one (it is never derived from a consumer group)",
                ));
            }
        };
        // The HTTP layers' keys live in `<scope>/http`: a scope too long for that is refused
        // now, not at the first `http_layer`.
        #[cfg(feature = "http")]
        let http_scope = Scope::new(format!("{}/http", scope.as_str())).map_err(|e| {
            BuildError::setting(
                "scope",
                format!("its HTTP layers' scope, <scope>/http: {e}"),
            )
        })?;
        let instance = self
            .instance
            .as_deref()
            .map(InstanceId::new)
            .transpose()
            .map_err(|e| BuildError::setting("instance", e))?;
        self.policy
            .validate()
            .map_err(|e| BuildError::setting("policy", e))?;
        if self.in_flight_wait > MAX_WAIT {
            return Err(BuildError::setting(
                "in_flight_wait",
                "longer than a week (MAX_WAIT)",
            ));
        }
        let pool = match self.postgres {
            None => return Err(BuildError::setting("postgres", "no Postgres given")),
            Some(Postgres::Memory) => {
                #[cfg(feature = "redis")]
                if self.redis.is_some() {
                    return Err(BuildError::setting(
                        "in_memory",
                        "an in-memory engine takes no fast path: Redis would keep results the \
                         memory does not",
                    ));
                }
                if self.retention.is_some() {
                    return Err(BuildError::setting(
                        "retention",
                        "an in-memory engine has no Postgres to purge",
                    ));
                }
                #[cfg(feature = "kafka")]
                if self.outbox.is_some() {
                    return Err(BuildError::setting(
                        "outbox",
                        "an in-memory engine has no Postgres to keep an outbox in",
                    ));
                }
                None
            }
            Some(Postgres::Pool(pool)) => Some(pool),
            Some(Postgres::Url {
                url,
                max_connections,
            }) => {
                if max_connections == 0 {
                    return Err(BuildError::setting(
                        "postgres_url_with",
                        "a pool of no connections",
                    ));
                }
                let options = PgPoolOptions::new()
                    .max_connections(max_connections)
                    .acquire_timeout(Duration::from_secs(5));
                Some(dedup_pg::connect(&url, options).await?)
            }
        };
        if let Some(pool) = &pool {
            let status = dedup_pg::prepare(pool, self.migrations).await?;
            info!(?status, "dedup schema ready");
        }
        let fast = fast_path(
            #[cfg(feature = "redis")]
            self.redis,
            #[cfg(feature = "redis")]
            &self.redis_prefix,
            #[cfg(feature = "redis")]
            self.redis_batched_copies,
        )
        .await?;
        let pg = pool.map(PgStore::new);
        let authority = pg
            .clone()
            .map_or_else(Authority::memory, Authority::postgres);
        let tiers =
            Arc::new(TieredStore::new(authority, fast, self.tiers).with_background_backfill());
        let store = super::EngineStore(Arc::new(Batched::new(tiers.clone(), self.group_commit)));
        let owner_prefix = match &instance {
            Some(id) => format!("{}{}", id.owner_prefix(), incarnation()),
            None => format!("pid{}", incarnation()),
        };
        if let (Some(id), Some(_)) = (&instance, &pg) {
            // Every owner id of this incarnation starts with `<prefix>.`: the others are earlier
            // incarnations', whose live leases end now.
            match tiers.adopt(id, &format!("{owner_prefix}.")).await {
                Ok(Adoption::HeldElsewhere) => {
                    return Err(BuildError::setting(
                        "instance",
                        format!(
                            "another live process holds the instance identity {id}: two \
                             processes with one identity would fence each other's consumers"
                        ),
                    ));
                }
                Ok(adoption) => {
                    info!(instance = %id, adopted = adoption.adopted(), "instance identity held");
                }
                Err(e) => {
                    return Err(BuildError::Store {
                        what: "holding the instance identity",
                        source: e,
                    });
                }
            }
        } else if pg.is_some() {
            warn!(
                "no instance identity: a process killed mid-effect leaves its keys held until \
                 their leases end"
            );
        }
        let dedup = Dedup::new(store.clone())
            .with_owner_prefix(format!("{owner_prefix}.0"))
            .with_policy(self.policy)
            .map_err(|e| BuildError::setting("policy", e))?
            .with_in_flight_wait(self.in_flight_wait)
            .map_err(|e| BuildError::setting("in_flight_wait", e))?;
        // Started last (the relay, which can fail, first): an engine that failed to build
        // leaves no task behind.
        #[cfg(feature = "kafka")]
        let outbox = pg
            .as_ref()
            .zip(self.outbox)
            .map(|(pg, (client, config))| super::OutboxTask::spawn(pg, client, config))
            .transpose()
            .map_err(|e| BuildError::setting("outbox", e))?;
        let retention = pg
            .as_ref()
            .zip(self.retention)
            .map(|(pg, config)| pg.spawn_retention(config));
        Ok(Engine {
            inner: Arc::new(Inner {
                retention: Mutex::new(retention),
                #[cfg(feature = "kafka")]
                outbox: Mutex::new(outbox),
                pg,
                tiers,
                store,
                dedup: Arc::new(dedup),
                scope,
                instance,
                owner_prefix,
                policy: self.policy,
                in_flight_wait: self.in_flight_wait,
                members: AtomicU64::new(0),
                groups: Mutex::new(HashMap::new()),
                #[cfg(feature = "kafka")]
                consumers: Mutex::new(Vec::new()),
                running: Running::default(),
                #[cfg(feature = "http")]
                layers: Mutex::new(Vec::new()),
                #[cfg(feature = "http")]
                http_scope,
            }),
        })
    }
}

/// This start of the process: its pid and the time, in hex.
fn incarnation() -> String {
    format!("{:x}{:x}", std::process::id(), Timestamp::now().as_micros())
}

#[cfg(feature = "redis")]
async fn fast_path(
    redis: Option<Redis>,
    prefix: &str,
    batched_copies: bool,
) -> Result<FastTier, BuildError> {
    use dedup_redis::RedisFastPath;

    let store_error = |source| BuildError::Store {
        what: "connecting to Redis",
        source,
    };
    Ok(match redis {
        None => super::Fast::Off(dedup_core::NoFastPath),
        Some(Redis::One(url)) => {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                return Err(BuildError::setting(
                    "redis_url",
                    format!(
                        "{} must start with redis:// or rediss://",
                        dedup_pg::redact_url(&url)
                    ),
                ));
            }
            super::Fast::Redis(
                RedisFastPath::connect(&url)
                    .await
                    .map_err(store_error)?
                    .with_prefix(prefix)
                    .with_batched_copies(batched_copies),
            )
        }
        Some(Redis::Cluster(urls)) => {
            if urls.is_empty() {
                return Err(BuildError::setting("redis_cluster", "no node given"));
            }
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            super::Fast::Cluster(
                RedisFastPath::connect_cluster(&urls)
                    .await
                    .map_err(store_error)?
                    .with_prefix(prefix),
            )
        }
    })
}

#[cfg(not(feature = "redis"))]
async fn fast_path() -> Result<FastTier, BuildError> {
    Ok(dedup_core::NoFastPath)
}
