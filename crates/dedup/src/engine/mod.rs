//! The engine: built once ([`Engine::builder`]), it holds Postgres (the authority: leases,
//! fencing tokens, records), the caches in front of it (L1 in process, Redis as L2), group commit,
//! the default policy, the dedup scope and the instance identity. Consumers and HTTP layers are
//! built from it and share all of that.

mod authority;
mod builder;
mod error;
#[cfg(feature = "redis")]
mod fast;
mod store;

use authority::Authority;
pub use authority::NoPostgres;
pub use builder::EngineBuilder;
pub use error::BuildError;
#[cfg(feature = "redis")]
use fast::Fast;
pub use store::EngineStore;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{BatchCounts, Dedup, InstanceId, Policy, Scope, TierStats, TieredStore};
use dedup_pg::PgStore;

use crate::running::Running;
#[cfg(feature = "kafka")]
use crate::running::{RunningGuard, Stopped};

/// The fast path behind L1: Redis or none (`redis` feature), none otherwise.
#[cfg(feature = "redis")]
pub(crate) type FastTier = Fast;
#[cfg(not(feature = "redis"))]
pub(crate) type FastTier = dedup_core::NoFastPath;

/// The engine's tiered store: L1, the fast path, the authority (Postgres).
pub(crate) type Tiers = TieredStore<Authority, FastTier>;

/// What [`Engine::shutdown`] left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Handler calls still running when it returned (past their consumers' drain timeout):
    /// each keeps its lease until it ends.
    pub left_running: usize,
    /// Whether the instance identity was released before it returned. False when none was held,
    /// or when a consumer's task was still running: the identity is then released when the
    /// last of them ends (or when the process exits).
    pub identity_released: bool,
}

/// dedup's engine. Cheap to clone: clones share everything.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` in an in-memory engine.
    pg: Option<PgStore>,
    /// Retention in the background, if asked for; taken out and stopped at shutdown.
    retention: Mutex<Option<dedup_pg::Retention>>,
    /// The outbox relay, if asked for; taken out and stopped at shutdown.
    #[cfg(feature = "kafka")]
    outbox: Mutex<Option<OutboxTask>>,
    tiers: Arc<Tiers>,
    store: EngineStore,
    dedup: Arc<Dedup<EngineStore>>,
    scope: Scope,
    instance: Option<InstanceId>,
    /// `<instance>/<incarnation>` (or the process's id and start): every member's owner ids are
    /// `<prefix>.<member>#<n>`.
    owner_prefix: String,
    policy: Policy,
    in_flight_wait: Duration,
    members: AtomicU64,
    /// Consumers per group, for their `group.instance.id`.
    groups: Mutex<HashMap<String, u32>>,
    /// The consumers built from the engine, for its stats and health.
    #[cfg(feature = "kafka")]
    consumers: Mutex<Vec<crate::health::Registered>>,
    running: Running,
    /// The HTTP layers built from the engine, drained at shutdown.
    #[cfg(feature = "http")]
    layers: Mutex<Vec<crate::layer::EngineLayer>>,
    /// `<scope>/http`, the HTTP layers' default scope (checked at build).
    #[cfg(feature = "http")]
    http_scope: Scope,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("scope", &self.inner.scope)
            .field("instance", &self.inner.instance)
            .field("owner_prefix", &self.inner.owner_prefix)
            .field("policy", &self.inner.policy)
            .field("fast_path", self.inner.tiers.fast_path())
            .finish_non_exhaustive()
    }
}

/// What a consumer or layer built from the engine is called by.
pub(crate) struct Member {
    pub(crate) owner_prefix: String,
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) group_instance_id: Option<String>,
}

impl Engine {
    /// A builder with the defaults: no Redis, L1 of 100,000 entries, group commit in batches
    /// of up to 512, the default [`Policy`], a 5 s in-flight wait, migrations applied.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// The dedup scope: every key of this engine lives in it.
    pub fn scope(&self) -> &Scope {
        &self.inner.scope
    }

    /// The instance identity, if one was given.
    pub fn instance(&self) -> Option<&InstanceId> {
        self.inner.instance.as_ref()
    }

    /// The default policy.
    pub fn policy(&self) -> Policy {
        self.inner.policy
    }

    /// The Postgres store (the authority): its pool is `postgres()?.pool()`.
    ///
    /// # Errors
    /// [`NoPostgres`] from an engine built [`in_memory`](EngineBuilder::in_memory).
    pub fn postgres(&self) -> Result<&PgStore, NoPostgres> {
        self.inner.pg.as_ref().ok_or(NoPostgres)
    }

    /// The pool the engine uses: the one to write effects with in transaction mode.
    ///
    /// # Errors
    /// [`NoPostgres`] from an engine built [`in_memory`](EngineBuilder::in_memory).
    pub fn pool(&self) -> Result<&sqlx::PgPool, NoPostgres> {
        self.postgres().map(PgStore::pool)
    }

    /// Whether the engine keeps its records in this process's memory (built
    /// [`in_memory`](EngineBuilder::in_memory), for tests) rather than in Postgres.
    pub fn is_in_memory(&self) -> bool {
        self.inner.pg.is_none()
    }

    /// The engine's own `Dedup`, for work that is neither a consumer nor a request
    /// (`engine.dedup().process(&key, fingerprint, handler)`), under the default policy.
    pub fn dedup(&self) -> &Dedup<EngineStore> {
        &self.inner.dedup
    }

    /// A `Dedup` of its own on the engine's store, under `policy` (for work under another
    /// policy than the engine's default; it claims under owner ids of its own).
    ///
    /// # Errors
    /// A policy that cannot work.
    pub fn dedup_with(&self, policy: Policy) -> Result<Dedup<EngineStore>, BuildError> {
        self.member_dedup(policy, self.member(None).owner_prefix)
    }

    /// The caches' counters (L1 and fast-path hits, misses, errors).
    pub fn tier_stats(&self) -> TierStats {
        self.inner.tiers.stats()
    }

    /// Group commit's counters: how many batch calls carried how many claims and completions.
    pub fn group_commit_stats(&self) -> BatchCounts {
        self.inner.store.0.batch_counts()
    }

    /// What the outbox relay has done and what waits (`None` without
    /// [`outbox`](EngineBuilder::outbox), or after shutdown).
    #[cfg(feature = "kafka")]
    #[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
    pub fn outbox_stats(&self) -> Option<dedup_kafka::outbox::RelayStats> {
        self.inner
            .outbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|o| o.stats.snapshot())
    }

    /// What retention in the background has done (`None` without
    /// [`retention`](EngineBuilder::retention), or after shutdown).
    pub fn retention_stats(&self) -> Option<dedup_pg::RetentionStats> {
        self.inner
            .retention
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(dedup_pg::Retention::stats)
    }

    /// A handle that stops everything built from this engine ([`Shutdown`](crate::Shutdown)).
    pub fn shutdown_handle(&self) -> crate::Shutdown {
        self.inner.running.handle()
    }

    /// Shuts down everything built from this engine: consumers stop taking messages, let the
    /// running ones finish (each up to its drain timeout), commit and leave their groups; then,
    /// once every consumer's `run` has returned and every HTTP layer has drained, retention in
    /// the background stops (its lock goes to another engine's task) and the instance
    /// identity is released so that a successor takes it at once. Call it once; stop the HTTP
    /// server from taking requests first (or give it [`Shutdown::stopped`](crate::Shutdown::stopped)
    /// as its graceful-shutdown signal).
    ///
    /// A handler still running past its consumer's drain timeout is not aborted (that would
    /// undo no effect it already made): it keeps its lease, and the identity stays held until
    /// the last such task ends (or the process exits), so that no successor with the same
    /// identity adopts a lease whose effect is still being made. The report says how many
    /// handler calls were left running and whether the identity was released now.
    pub async fn shutdown(&self) -> ShutdownReport {
        let running = &self.inner.running;
        running.stop();
        running.finished().await;
        #[cfg(feature = "http")]
        {
            let layers = self
                .inner
                .layers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            for layer in layers {
                layer.drain().await;
            }
        }
        let retention = self
            .inner
            .retention
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(retention) = retention {
            let _ = retention.stop().await;
        }
        // After the consumers and layers: what they committed last is woken for at once, and
        // another engine's relay takes what is left.
        #[cfg(feature = "kafka")]
        {
            let outbox = self
                .inner
                .outbox
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(outbox) = outbox {
                outbox.stop().await;
            }
        }
        let left_running = running.calls();
        let Some(pg) = &self.inner.pg else {
            return ShutdownReport {
                left_running,
                identity_released: false,
            };
        };
        if running.held() {
            tracing::warn!(
                left_running,
                "engine shut down with handlers still running past the drain timeout: the \
                 instance identity stays held until the last of them ends"
            );
            let (pg, released) = (pg.clone(), running.released());
            tokio::spawn(async move {
                released.await;
                if pg.release_identity().await {
                    tracing::info!("the last handler ended; instance identity released");
                }
            });
            return ShutdownReport {
                left_running,
                identity_released: false,
            };
        }
        let identity_released = pg.release_identity().await;
        if identity_released {
            tracing::info!("engine shut down; instance identity released");
        }
        ShutdownReport {
            left_running,
            identity_released,
        }
    }

    /// A token for a consumer's handler: the identity is not released while it lives.
    #[cfg(feature = "kafka")]
    pub(crate) fn alive(&self) -> crate::running::Alive {
        self.inner.running.alive()
    }

    #[cfg(feature = "http")]
    pub(crate) fn http_scope(&self) -> &Scope {
        &self.inner.http_scope
    }

    #[cfg(feature = "http")]
    pub(crate) fn keep_layer(&self, layer: crate::layer::EngineLayer) {
        self.inner
            .layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(layer);
    }

    #[cfg(feature = "kafka")]
    pub(crate) fn register(&self, consumer: crate::health::Registered) {
        self.inner
            .consumers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(consumer);
    }

    /// Forgets a consumer that stopped on its own signal (by its running flag).
    #[cfg(feature = "kafka")]
    pub(crate) fn deregister(&self, running: &Arc<std::sync::atomic::AtomicBool>) {
        self.inner
            .consumers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|c| !Arc::ptr_eq(&c.running, running));
    }

    #[cfg(feature = "kafka")]
    pub(crate) fn registered(&self) -> Vec<crate::health::Registered> {
        self.inner
            .consumers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    #[cfg(feature = "kafka")]
    pub(crate) fn running(&self) -> RunningGuard {
        self.inner.running.guard()
    }

    #[cfg(feature = "kafka")]
    pub(crate) fn stopped(&self) -> Stopped {
        self.inner.running.handle().stopped()
    }

    /// The caches transaction mode answers settled keys from and copies its commits to.
    #[cfg(any(feature = "kafka", feature = "http"))]
    pub(crate) fn caches(&self) -> Arc<dyn dedup_core::BatchCache> {
        self.inner.tiers.clone()
    }

    /// The engine's store (its caches, group commit and Postgres).
    #[cfg(feature = "http")]
    pub(crate) fn store(&self) -> &EngineStore {
        &self.inner.store
    }

    /// A new member's owner ids, and its `group.instance.id` in `group` (the instance, the group,
    /// and a count past the first consumer of the group: unique per group member, the same after
    /// a restart that builds the consumers in the same order).
    pub(crate) fn member(&self, group: Option<&str>) -> Member {
        let n = self.inner.members.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        let instance = self.inner.instance.as_ref().zip(group);
        let group_instance_id = instance.map(|(id, group)| {
            let mut groups = self
                .inner
                .groups
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let count = groups.entry(group.to_owned()).or_insert(0);
            *count += 1;
            match *count {
                1 => format!("{id}-{group}"),
                k => format!("{id}-{group}-{k}"),
            }
        });
        Member {
            owner_prefix: format!("{}.{n}", self.inner.owner_prefix),
            group_instance_id,
        }
    }

    /// A `Dedup` on the engine's store, under `policy`, claiming under `owner_prefix`.
    pub(crate) fn member_dedup(
        &self,
        policy: Policy,
        owner_prefix: String,
    ) -> Result<Dedup<EngineStore>, BuildError> {
        Dedup::new(self.inner.store.clone())
            .with_owner_prefix(owner_prefix)
            .with_policy(policy)
            .map_err(|e| BuildError::setting("policy", e))?
            .with_in_flight_wait(self.inner.in_flight_wait)
            .map_err(|e| BuildError::setting("in_flight_wait", e))
    }
}

/// The outbox relay an engine runs ([`EngineBuilder::outbox`]).
#[cfg(feature = "kafka")]
pub(crate) struct OutboxTask {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), dedup_kafka::outbox::RelayError>>,
    stats: dedup_kafka::outbox::RelayStatsHandle,
}

#[cfg(feature = "kafka")]
impl OutboxTask {
    pub(crate) fn spawn(
        pg: &PgStore,
        client: rdkafka::ClientConfig,
        config: dedup_kafka::outbox::RelayConfig,
    ) -> Result<Self, dedup_kafka::outbox::RelayError> {
        let relay = dedup_kafka::outbox::OutboxRelay::new(pg, client, config)?;
        let stats = relay.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        Ok(Self { stop, task, stats })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the outbox relay stopped with an error"),
            Err(e) => tracing::warn!(error = %e, "the outbox relay's task failed"),
        }
    }
}
