//! Kafka consumers built on a [`Host`] (the `dedup` crate's `Engine`: `engine.consumer()` gives a
//! [`ConsumerBuilder`]); its `build(handler)` picks the mode by the handler's trait.
//!
//! | handler | mode | how messages run |
//! |---|---|---|
//! | [`TxHandler`] | transaction mode | in batches per partition (up to [`Batching`]'s size or wait), each batch one Postgres transaction |
//! | [`LeaseHandler`] | lease mode, per message | each message on its own as soon as it arrives (lowest latency) |
//! | [`LeaseHandler`] + [`ConsumerBuilder::batching`] | lease mode by the batch | claims and completions of a batch in one round trip each (highest throughput) |
//!
//! **Order.** Under [`Ordering::PerPartition`] (the default) a partition's messages settle in
//! offset order, one at a time. Under [`Ordering::PerKey`] only the messages of one ordering key
//! (an account, an order) keep their order, and distinct keys run concurrently: in a batch, a
//! message whose predecessor of the same key did not settle waits for it. **Latency.** Batched
//! modes add up to the batching wait (5 ms by default) to a message that arrives alone; under load
//! batches fill before the wait ends. Offsets are committed only up to the first message not
//! settled, whatever the mode.

mod consumer;
mod handler;
mod host;
pub mod testing;
mod typed;

pub use consumer::IdempotentConsumer;
pub use handler::{Answer, LeaseHandler, TxHandler};
pub(crate) use host::Call;
pub use host::{Host, Liveness, Member, Started};
pub use typed::{Ignore, OnResult, Typed};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Completion, Policy};

use crate::{
    Backoff, Batching, ConfigError, KeySource, KillSwitch, LeaseRunner, MissingKey, Ordering,
    OrderingKey, Parking, Runner, RunnerConfig, RunnerError, TxRunner,
};
use handler::{Leased, Transactional};

/// Builds a consumer on an engine's Postgres, caches, policy, scope and identity. Setters cannot
/// fail; [`build`](Self::build) checks everything at once and names a bad setting by its method.
#[must_use = "a consumer builder does nothing until `build` is called"]
pub struct ConsumerBuilder<H: Host> {
    host: H,
    config: RunnerConfig,
    dead_letter_topic: Option<String>,
    batching: Option<Batching>,
    parking: Option<Parking>,
    policy: Option<Policy>,
    offsets_in_transaction: Option<Duration>,
    static_membership: bool,
}

impl<H: Host> fmt::Debug for ConsumerBuilder<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("config", &self.config)
            .field("batching", &self.batching)
            .field("parking", &self.parking)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<H: Host> ConsumerBuilder<H> {
    /// A consumer on `host` ([`Host::consumer`]).
    pub(crate) fn new(host: H) -> Self {
        Self {
            host,
            config: RunnerConfig::new("", "", Vec::<String>::new()),
            dead_letter_topic: None,
            batching: None,
            parking: None,
            policy: None,
            offsets_in_transaction: None,
            static_membership: true,
        }
    }
}

impl<H: Host> ConsumerBuilder<H> {
    /// `bootstrap.servers`.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.config.brokers = brokers.into();
        self
    }

    /// The consumer group (`group.id`). It is not the dedup scope (the engine's): a renamed
    /// group, or a blue/green deploy under a new one, still finds every key done.
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.config.group_id = group.into();
        self
    }

    /// The topics to consume.
    pub fn topics(mut self, topics: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.config.topics = topics.into_iter().map(Into::into).collect();
        self
    }

    /// Where poison messages, permanent failures and keyless messages go (default: `<first
    /// topic>.dlq`).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Where the idempotency key comes from (default: the `idempotency-key` header).
    pub fn key(mut self, key: KeySource) -> Self {
        self.config.key = key;
        self
    }

    /// What happens to a message without a key: [`MissingKey::DeadLetter`] (the default), with
    /// the reason; `ProcessWithoutDedup` (at least once) only for a per-message [`LeaseHandler`]
    /// that implements `handle_keyless` (`RUNS_KEYLESS`).
    pub fn missing_key(mut self, policy: MissingKey) -> Self {
        self.config.missing_key = policy;
        self
    }

    /// Whether a key reused with another payload is dead-lettered as a mismatch (default on).
    pub fn payload_check(mut self, on: bool) -> Self {
        self.config.check_payload = on;
        self
    }

    /// Which messages may run at the same time (default: one at a time per partition).
    pub fn ordering(mut self, ordering: Ordering) -> Self {
        self.config.ordering = ordering;
        self
    }

    /// What [`Ordering::PerKey`] keeps in order (default: the Kafka message key).
    pub fn ordering_key(mut self, key: OrderingKey) -> Self {
        self.config.ordering_key = key;
        self
    }

    /// The most messages held at once, shared fairly between busy partitions (default 1,024).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.config.max_in_flight = n;
        self
    }

    /// The most messages held in blocked lanes (a key another holder's live lease covers, and
    /// the messages queued behind it; default 4,096): per-message lease mode.
    pub fn max_blocked(mut self, n: usize) -> Self {
        self.config.max_blocked = n;
        self
    }

    /// Static group membership: with an engine instance identity (the default then), the
    /// consumer's `group.instance.id` is derived from it, so that a restart within the session
    /// timeout gets its partitions back without a rebalance. Off: a dynamic member, whose
    /// partitions move at once when it stops (a scale-down does not leave them idle for the
    /// session timeout).
    pub fn static_membership(mut self, on: bool) -> Self {
        self.static_membership = on;
        self
    }

    /// Waits between retries of a failed message.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.config.backoff = backoff;
        self
    }

    /// How often settled offsets are committed (default 1 s).
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.config.commit_interval = interval;
        self
    }

    /// How long shutdown waits for running messages (default 30 s). A handler still running
    /// then is not aborted: it keeps its lease, and the engine keeps its identity until the
    /// handler ends (`Engine::shutdown`).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.config.drain_timeout = timeout;
        self
    }

    /// Stops taking messages while the handler fails nearly everything (see [`KillSwitch`]).
    pub fn kill_switch(mut self, kill_switch: KillSwitch) -> Self {
        self.config.kill_switch = Some(kill_switch);
        self
    }

    /// A librdkafka property for the consumer and its dead-letter producer
    /// (`auto.offset.reset`, `security.protocol`, ...), as rdkafka's `ClientConfig::set`.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.client.push((key.into(), value.into()));
        self
    }

    /// Takes messages in batches: lease mode by the batch for a [`LeaseHandler`] (the size and
    /// wait of transaction mode's batches for a [`TxHandler`], which always batches).
    pub fn batching(mut self, batching: Batching) -> Self {
        self.batching = Some(batching);
        self
    }

    /// Parks a key whose message keeps failing, so that the key's later messages wait in
    /// Postgres (the engine's) and the partition goes on (see [`Parking`]). Per-message lease
    /// mode under [`Ordering::PerKey`] only.
    pub fn parking(mut self, parking: Parking) -> Self {
        self.parking = Some(parking);
        self
    }

    /// This consumer's claim policy (lease, attempts, retention) instead of the engine's.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Transaction mode only: each batch stores its partition's position in its own
    /// transaction, and a partition starts from it on assignment, read within `wait`.
    pub fn offsets_in_transaction(mut self, wait: Duration) -> Self {
        self.offsets_in_transaction = Some(wait);
        self
    }

    /// Builds the consumer that runs `handler`: transaction mode for a [`TxHandler`], lease mode
    /// for a [`LeaseHandler`].
    ///
    /// # Errors
    /// A setting that cannot work, or a combination this mode cannot honour, named.
    pub fn build<F, M>(self, handler: F) -> Result<IdempotentConsumer, ConfigError>
    where
        F: Mode<H, M>,
    {
        let parts = self.parts()?;
        handler.consumer(parts, sealed::Token)
    }

    /// The settings every mode shares, checked.
    fn parts(mut self) -> Result<Parts<H>, ConfigError> {
        let engine = self.host;
        self.config.scope = Some(engine.scope().as_str().to_owned());
        self.config.dead_letter_topic = match self.dead_letter_topic {
            Some(t) => t,
            None => format!(
                "{}.dlq",
                self.config.topics.first().map_or("dedup", String::as_str)
            ),
        };
        let member = engine.member(&self.config.group_id);
        if let Some(id) = member
            .group_instance_id
            .as_ref()
            .filter(|_| self.static_membership)
        {
            self.config
                .client
                .push(("group.instance.id".into(), id.clone()));
        }
        self.config
            .validate()
            .map_err(|e| ConfigError::new(method_of(e.setting), e.problem))?;
        let policy = match self.policy {
            Some(p) => {
                p.validate()
                    .map_err(|e| ConfigError::new("policy", e.to_string()))?;
                p
            }
            None => engine.policy(),
        };
        Ok(Parts {
            engine,
            config: self.config,
            batching: self.batching,
            parking: self.parking,
            policy,
            offsets_in_transaction: self.offsets_in_transaction,
            owner_prefix: member.owner_prefix,
        })
    }
}

/// The builder method behind a [`RunnerConfig`] field's name.
fn method_of(field: &'static str) -> &'static str {
    match field {
        "client" => "set",
        "check_payload" => "payload_check",
        other => other,
    }
}

fn runner_error(e: RunnerError) -> ConfigError {
    match e {
        RunnerError::Config(c) => ConfigError::new(method_of(c.setting), c.problem),
        other => ConfigError::new("consumer", other.to_string()),
    }
}

/// A consumer's checked settings.
#[derive(Debug)]
pub struct Parts<H: Host> {
    engine: H,
    config: RunnerConfig,
    batching: Option<Batching>,
    parking: Option<Parking>,
    policy: Policy,
    offsets_in_transaction: Option<Duration>,
    owner_prefix: String,
}

mod sealed {
    /// Only this crate calls [`Mode::consumer`](super::Mode::consumer).
    #[derive(Debug)]
    pub struct Token;
}

/// The mode a handler's trait picks: implemented for every [`TxHandler`] (marker
/// [`Transaction`]) and every [`LeaseHandler`] (marker [`Lease`]). Not implemented by hand.
pub trait Mode<H: Host, M>: Sized {
    #[doc(hidden)]
    fn consumer(
        self,
        parts: Parts<H>,
        token: sealed::Token,
    ) -> Result<IdempotentConsumer, ConfigError>;
}

/// [`Mode`]'s marker for a [`TxHandler`].
#[derive(Debug)]
pub enum Transaction {}

/// [`Mode`]'s marker for a [`LeaseHandler`].
#[derive(Debug)]
pub enum Lease {}

impl<E: Host, H: TxHandler<Output: Into<Bytes>>> Mode<E, Transaction> for H {
    fn consumer(self, p: Parts<E>, _: sealed::Token) -> Result<IdempotentConsumer, ConfigError> {
        let who = (p.engine.clone(), p.config.group_id.clone());
        if p.parking.is_some() {
            return Err(ConfigError::new(
                "parking",
                "transaction mode does not park (a failing message is retried in its batch, then \
                 dead-lettered); parking needs a LeaseHandler without batching",
            ));
        }
        let Some(pg) = p.engine.postgres() else {
            return Err(ConfigError::new(
                "in_memory",
                "transaction mode writes its effects in Postgres: an in-memory engine runs \
                 LeaseHandlers only",
            ));
        };
        let alive = p.engine.liveness();
        let mut runner = TxRunner::new(
            p.config,
            p.batching.unwrap_or_default(),
            pg.clone(),
            Transactional(self, alive.clone()),
        )
        .map_err(runner_error)?
        .with_policy(p.policy)
        .map_err(runner_error)?
        .with_caches(p.engine.caches())
        .with_owner_prefix(p.owner_prefix);
        if let Some(wait) = p.offsets_in_transaction {
            runner = runner
                .with_offsets_in_transaction(wait)
                .map_err(runner_error)?;
        }
        let stats = runner.stats();
        Ok(IdempotentConsumer::new(who, stats, alive, move |stop| {
            Box::pin(async move { runner.run(stop).await })
        }))
    }
}

impl<E: Host, H: LeaseHandler<Output: Into<Completion>>> Mode<E, Lease> for H {
    fn consumer(self, p: Parts<E>, _: sealed::Token) -> Result<IdempotentConsumer, ConfigError> {
        let who = (p.engine.clone(), p.config.group_id.clone());
        if p.offsets_in_transaction.is_some() {
            return Err(ConfigError::new(
                "offsets_in_transaction",
                "only transaction mode (a TxHandler) stores offsets in its transaction",
            ));
        }
        if p.config.missing_key == MissingKey::ProcessWithoutDedup && !H::RUNS_KEYLESS {
            return Err(ConfigError::new(
                "missing_key",
                "ProcessWithoutDedup needs a handler that runs keyless messages (RUNS_KEYLESS and \
                 handle_keyless); or give them a key (KeySource::Fields), or let them be \
                 dead-lettered",
            ));
        }
        let dedup = Arc::new(p.engine.dedup(p.policy, p.owner_prefix)?);
        // An in-memory engine has no table for dead letters: they go to the topic only.
        let pg = p.engine.postgres().cloned();
        if pg.is_none() && p.parking.is_some() {
            return Err(ConfigError::new(
                "parking",
                "parked keys are kept in Postgres: an in-memory engine does not park",
            ));
        }
        let alive = p.engine.liveness();
        let handler = Leased(self, alive.clone());
        match (p.batching, p.parking) {
            (Some(_), Some(_)) => Err(ConfigError::new(
                "parking",
                "parking runs in per-message lease mode: drop `batching` or `parking`",
            )),
            (Some(batching), None) => {
                let mut runner =
                    LeaseRunner::new(p.config, batching, dedup, handler).map_err(runner_error)?;
                if let Some(pg) = pg {
                    runner = runner.with_dead_letter_table(pg);
                }
                let stats = runner.stats();
                Ok(IdempotentConsumer::new(who, stats, alive, move |stop| {
                    Box::pin(async move { runner.run(stop).await })
                }))
            }
            (None, parking) => {
                let mut runner = Runner::new(p.config, dedup, handler).map_err(runner_error)?;
                if let Some(pg) = pg.clone() {
                    runner = runner.with_dead_letter_table(pg);
                }
                if let (Some(parking), Some(pg)) = (parking, pg) {
                    runner = runner
                        .with_parking(pg, parking)
                        .map_err(|e| ConfigError::new("parking", e.to_string()))?;
                }
                let stats = runner.stats();
                Ok(IdempotentConsumer::new(who, stats, alive, move |stop| {
                    Box::pin(async move { runner.run(stop).await })
                }))
            }
        }
    }
}
