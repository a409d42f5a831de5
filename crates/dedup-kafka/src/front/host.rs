//! What a consumer takes from the engine that builds it: [`Host`], and what goes with it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use dedup_core::{BatchCache, Dedup, Policy, Scope, Store};
use dedup_pg::PgStore;

use crate::{ConfigError, ConsumerBuilder, StatsHandle};

/// A stop signal.
pub(crate) type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a consumer takes from the engine that builds it: the scope, the default policy, the
/// Postgres store and the caches, the member's identity, a `Dedup` on the engine's store, and
/// the engine's accounting of what runs. The `dedup` crate's `Engine` is one; a host of your own
/// builds consumers on a `Dedup` of your own.
pub trait Host: Clone + Send + Sync + 'static {
    /// The store lease-mode consumers claim through.
    type Store: Store + 'static;

    /// The dedup scope every key of the host lives in.
    fn scope(&self) -> &Scope;

    /// The default policy.
    fn policy(&self) -> Policy;

    /// The Postgres store (transaction mode, parking, kept dead letters); `None` for a host
    /// without one (an in-memory engine), which runs lease-mode handlers only.
    fn postgres(&self) -> Option<&PgStore>;

    /// The caches transaction mode answers settled keys from and copies its commits to.
    fn caches(&self) -> Arc<dyn BatchCache>;

    /// A new member of `group`: its owner ids' prefix and its static `group.instance.id`.
    fn member(&self, group: &str) -> Member;

    /// A `Dedup` on the host's store under `policy`, claiming under `owner_prefix`.
    ///
    /// # Errors
    /// A policy the host cannot use, named.
    fn dedup(
        &self,
        policy: Policy,
        owner_prefix: String,
    ) -> Result<Dedup<Self::Store>, ConfigError>;

    /// The token a consumer's handler holds while it may hold a lease.
    fn liveness(&self) -> Arc<dyn Liveness>;

    /// A consumer of `group` starts running: the host's stop signal (its shutdown), and what the
    /// host keeps while the consumer runs (dropped when `run` ends, however it ends).
    fn started(&self, group: &str, stats: &StatsHandle) -> Started;

    /// A consumer on this host: set at least [`brokers`](ConsumerBuilder::brokers),
    /// [`group_id`](ConsumerBuilder::group_id) and [`topics`](ConsumerBuilder::topics), then
    /// [`build`](ConsumerBuilder::build) it with a handler. (The `dedup` crate's
    /// `Engine::consumer` is this.)
    fn consumer(&self) -> ConsumerBuilder<Self> {
        ConsumerBuilder::new(self.clone())
    }
}

/// A member of a consumer group, as its [`Host`] names it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Member {
    /// The prefix of the member's owner ids.
    pub owner_prefix: String,
    /// Its static `group.instance.id`, if the host has an instance identity.
    pub group_instance_id: Option<String>,
}

impl Member {
    /// A member claiming under `owner_prefix`, with `group_instance_id` if any.
    pub fn new(owner_prefix: impl Into<String>, group_instance_id: Option<String>) -> Self {
        Self {
            owner_prefix: owner_prefix.into(),
            group_instance_id,
        }
    }
}

/// A consumer's handler's hold on its host: counted as alive from [`arm`](Self::arm) until the
/// value drops, and each handler call counted while it runs.
pub trait Liveness: Send + Sync + fmt::Debug + 'static {
    /// The handler is alive from now until this value drops (once, however often called).
    fn arm(&self);
    /// A handler call starts.
    fn enter(&self);
    /// A handler call ends.
    fn exit(&self);
}

/// One handler call, counted by its consumer's [`Liveness`] until it drops.
pub(crate) struct Call<'a>(&'a dyn Liveness);

impl<'a> Call<'a> {
    pub(crate) fn new(liveness: &'a dyn Liveness) -> Self {
        liveness.enter();
        Self(liveness)
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// What [`Host::started`] gives a consumer that starts running.
pub struct Started {
    pub(super) stop: Stop,
    pub(super) running: Box<dyn Send>,
    pub(super) own_stop: Option<Box<dyn FnOnce() + Send>>,
}

impl Started {
    /// A consumer that stops when `stop` (the host's shutdown) completes, with `running` kept
    /// while it runs (dropped when `run` ends, however it ends).
    pub fn new(
        stop: impl Future<Output = ()> + Send + 'static,
        running: impl Send + 'static,
    ) -> Self {
        Self {
            stop: Box::pin(stop),
            running: Box::new(running),
            own_stop: None,
        }
    }

    /// Calls `f` once the consumer has stopped cleanly on its own signal
    /// ([`IdempotentConsumer::run_until`](super::IdempotentConsumer::run_until)) rather than the host's.
    #[must_use]
    pub fn on_own_stop(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.own_stop = Some(Box::new(f));
        self
    }
}

impl fmt::Debug for Started {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Started")
    }
}
