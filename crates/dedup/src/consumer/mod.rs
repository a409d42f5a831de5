//! Kafka consumers built from an [`Engine`]: [`Engine::consumer`] gives a
//! [`ConsumerBuilder`](crate::kafka::ConsumerBuilder) on the engine's Postgres, caches, policy,
//! scope and identity; its `build(handler)` picks the mode by the handler's trait
//! (`dedup_kafka`'s module docs have the table). The engine is the consumers' [`Host`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};

use dedup_core::{BatchCache, Dedup, Policy, Scope};
use dedup_kafka::{ConfigError, Host, Liveness, Member, Started, StatsHandle};
use dedup_pg::PgStore;

use crate::engine::{Engine, EngineStore};
use crate::health::Registered;

/// The consumer builder of an [`Engine`].
pub type ConsumerBuilder = dedup_kafka::ConsumerBuilder<Engine>;

impl Engine {
    /// A Kafka consumer on this engine: set at least
    /// [`brokers`](dedup_kafka::ConsumerBuilder::brokers),
    /// [`group_id`](dedup_kafka::ConsumerBuilder::group_id) and
    /// [`topics`](dedup_kafka::ConsumerBuilder::topics).
    pub fn consumer(&self) -> ConsumerBuilder {
        Host::consumer(self)
    }
}

impl Host for Engine {
    type Store = EngineStore;

    fn scope(&self) -> &Scope {
        Engine::scope(self)
    }

    fn policy(&self) -> Policy {
        Engine::policy(self)
    }

    fn postgres(&self) -> Option<&PgStore> {
        Engine::postgres(self).ok()
    }

    fn caches(&self) -> Arc<dyn BatchCache> {
        Engine::caches(self)
    }

    fn member(&self, group: &str) -> Member {
        let m = Engine::member(self, Some(group));
        Member::new(m.owner_prefix, m.group_instance_id)
    }

    fn dedup(
        &self,
        policy: Policy,
        owner_prefix: String,
    ) -> Result<Dedup<EngineStore>, ConfigError> {
        self.member_dedup(policy, owner_prefix)
            .map_err(|e| match e {
                crate::BuildError::Setting { setting, problem } => {
                    ConfigError::new(setting, problem)
                }
                other => ConfigError::new("policy", other.to_string()),
            })
    }

    fn liveness(&self) -> Arc<dyn Liveness> {
        Arc::new(self.alive())
    }

    fn started(&self, group: &str, stats: &StatsHandle) -> Started {
        let counted = self.running();
        // In the engine's stats and health from now on; not running once `run` ends, however
        // it ends (an error, a panic, the future dropped).
        let running = Arc::new(AtomicBool::new(true));
        self.register(Registered {
            group: group.to_owned(),
            stats: stats.clone(),
            running: running.clone(),
        });
        let engine = self.clone();
        let flag = running.clone();
        Started::new(self.stopped(), (counted, Down(running))).on_own_stop(move || {
            // Stopped on its own signal: no longer one of the engine's consumers (its health
            // does not count a consumer that was meant to stop).
            engine.deregister(&flag);
        })
    }
}

/// Marks a consumer not running when dropped.
struct Down(Arc<AtomicBool>);

impl Drop for Down {
    fn drop(&mut self) {
        self.0.store(false, AtomicOrdering::Release);
    }
}
