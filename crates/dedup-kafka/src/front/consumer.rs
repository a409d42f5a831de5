//! [`IdempotentConsumer`]: a consumer, built, and how it runs and stops.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::host::{Host, Liveness, Started, Stop};
use crate::{RunnerError, RunnerStats, StatsHandle};

type RunFuture = Pin<Box<dyn Future<Output = Result<RunnerStats, RunnerError>> + Send>>;
type Start = Box<dyn FnOnce(Stop) -> RunFuture + Send>;
type Begin = Box<dyn FnOnce(&StatsHandle) -> Started + Send>;

/// A consumer, built: [`run`](Self::run) it until its host (the engine) shuts down, or
/// [`run_until`](Self::run_until) its own stop signal.
#[must_use = "a consumer does nothing until it is run"]
pub struct IdempotentConsumer {
    stats: StatsHandle,
    /// The handler's hold on its host, armed when `run` starts.
    alive: Arc<dyn Liveness>,
    begin: Begin,
    start: Start,
}

impl fmt::Debug for IdempotentConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentConsumer")
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl IdempotentConsumer {
    pub(super) fn new<H: Host>(
        (host, group): (H, String),
        stats: StatsHandle,
        alive: Arc<dyn Liveness>,
        start: impl FnOnce(Stop) -> RunFuture + Send + 'static,
    ) -> Self {
        Self {
            stats,
            alive,
            begin: Box::new(move |stats| host.started(&group, stats)),
            start: Box::new(start),
        }
    }

    /// A handle to the consumer's counters, readable while it runs.
    pub fn stats(&self) -> StatsHandle {
        self.stats.clone()
    }

    /// Consumes until the engine shuts down (`Engine::shutdown`), then lets running messages
    /// finish (up to the drain timeout), commits and leaves the group. From its start it counts
    /// in the engine's stats and health (a consumer whose `run` ended is not ready). To stop
    /// this consumer alone, use [`run_until`](Self::run_until).
    ///
    /// # Errors
    /// The Kafka client could not start or subscribe, or the cluster refused it.
    pub async fn run(self) -> Result<RunnerStats, RunnerError> {
        self.start_with(None).await
    }

    /// Consumes until `stop` completes or the engine shuts down, whichever comes first, then
    /// stops as [`run`](Self::run) does: running messages finish (up to the drain timeout), the
    /// offsets are committed and the consumer leaves its group. The engine and its other
    /// consumers go on, and the engine's health no longer counts this one. `stop` can be any
    /// future (its output is ignored, so a oneshot receiver whose sender is dropped stops the
    /// consumer too): `tokio::signal::ctrl_c()`, a `CancellationToken`'s `cancelled_owned()`.
    ///
    /// A static member (an engine with an instance identity, unless
    /// [`static_membership(false)`](super::ConsumerBuilder::static_membership)) sends no LeaveGroup:
    /// its partitions wait for the session timeout, as on a restart. Turn static membership off
    /// for a consumer stopped for good while its group goes on.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_until<F>(self, stop: F) -> Result<RunnerStats, RunnerError>
    where
        F: Future + Send + 'static,
    {
        self.start_with(Some(Box::pin(async move {
            let _ = stop.await;
        })))
        .await
    }

    async fn start_with(self, own: Option<Stop>) -> Result<RunnerStats, RunnerError> {
        // In the host's stats and health, and counted as running, from now until `run` ends,
        // however it ends (an error, a panic, the future dropped).
        let Started {
            stop,
            running,
            own_stop,
        } = (self.begin)(&self.stats);
        let _running = running;
        // From now until the last task holding the handler ends (after `run` returns, where a
        // handler outlived the drain), the host keeps its identity.
        self.alive.arm();
        drop(self.alive);
        let by_own = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop: Stop = match own {
            None => stop,
            Some(own) => {
                let by_own = by_own.clone();
                Box::pin(async move {
                    tokio::select! {
                        () = stop => {}
                        () = own => by_own.store(true, std::sync::atomic::Ordering::Release),
                    }
                })
            }
        };
        let ended = (self.start)(stop).await;
        if ended.is_ok()
            && by_own.load(std::sync::atomic::Ordering::Acquire)
            && let Some(f) = own_stop
        {
            f();
        }
        ended
    }
}
