//! The per-message runner ([`Runner`]): its construction and its loop (receive, dispatch into
//! lanes, settle, commit what is durable, drain). The lanes and the loop's bookkeeping are in
//! `lanes.rs`, a message's task in `job.rs`, parking in `park/`.
//!
//! One task owns all state: it receives, extracts the key, puts each message in a *lane* (its
//! partition, or with `Ordering::PerKey` its partition and *ordering key*: by default the Kafka
//! message key, or a header or JSON pointer per `OrderingKey`; never the idempotency key, which is
//! unique per event; messages without one share the partition's lane) and spawns the lane's head;
//! a finished message starts the next in its lane. Per partition it tracks the offsets received
//! and not settled (`pending`) and the next offset; the commit position is the first pending
//! offset, or the next one. Assignments bump a generation so that late results of an earlier
//! ownership are ignored. `TxRunner` and `LeaseRunner` work by the batch and do not use it.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use dedup_core::{Dedup, Scope, Store};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::RunnerConfig;
use crate::consumer::{Backpressure, Drive, refused_or};
use crate::start::{RunnerError, Started, adopt_at_start, scope_of, start};
use crate::stats::{Counters, RunnerStats, StatsHandle};

mod job;
mod lanes;
mod park;
pub use park::store::{ParkedFilter, ParkedKey, ParkedKeySummary, ParkedQueue};
pub use park::{AfterGiveUp, Parking};

// What `park` reaches through `super::super`.
use crate::consumer::Settled;
use crate::handler::{Handler, attempts_of, last_attempt, no_withdraw, panic_message};
use job::Inner;
use lanes::{Done, Event, Job, Lane, Loop, Report, count_blocked};

/// An idempotent consumer: runs every message through [`Dedup::process`] and commits an offset
/// only once every message before it is settled (completed, replayed, or dead-lettered).
#[derive(Debug)]
pub(crate) struct Runner<S, H> {
    config: RunnerConfig,
    scope: Scope,
    dedup: Arc<Dedup<S>>,
    handler: H,
    counters: Arc<Counters>,
    park: Option<Arc<park::ParkCtx>>,
    /// Where dead letters the dead-letter topic refuses for good are kept.
    refused: Option<Arc<dyn crate::dead_letter::RefusedTable>>,
}

impl<S, H> Runner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// A runner over `dedup` calling `handler`. Every setting is checked here
    /// ([`RunnerConfig::validate`]), so a configuration that could fail at run time is refused
    /// now, with the setting named.
    pub(crate) fn new(
        config: RunnerConfig,
        dedup: Arc<Dedup<S>>,
        handler: H,
    ) -> Result<Self, RunnerError> {
        config.validate()?;
        let scope = scope_of(&config)?;
        Ok(Self {
            config,
            scope,
            dedup,
            handler,
            counters: Arc::new(Counters::default()),
            park: None,
            refused: None,
        })
    }

    /// Keeps the dead letters that the dead-letter topic refuses for good (larger than it
    /// accepts, invalid) in `store`'s `dedup_dead_letters` table (`dedup dead-letters`), instead
    /// of stalling their partition. With parking, its Postgres store keeps them already.
    #[must_use]
    pub(crate) fn with_dead_letter_table(mut self, store: dedup_pg::PgStore) -> Self {
        self.refused = Some(Arc::new(store));
        self
    }

    /// A handle to the runner's counters, readable while it runs.
    pub(crate) fn stats(&self) -> StatsHandle {
        StatsHandle(self.counters.clone())
    }

    /// Consumes until `shutdown` completes, then drains, commits and leaves the group.
    pub(crate) async fn run(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RunnerStats, RunnerError> {
        let scope = self.scope.clone();
        adopt_at_start(&self.dedup).await;
        let Started {
            shared,
            source,
            dead_letters,
            shutdown,
            refused,
            stop_tx,
            stopping,
            breaker,
        } = start(&self.config, &self.counters, None, self.refused, shutdown)?;
        let inner = Arc::new(Inner {
            config: self.config,
            dedup: self.dedup,
            handler: self.handler,
            dead_letters,
            counters: self.counters.clone(),
            stopping,
            park: self.park,
            breaker,
        });
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let mut lp = Loop {
            inner: inner.clone(),
            source,
            shared,
            scope,
            lanes: HashMap::new(),
            held: 0,
            blocked: 0,
            blocked_by: HashMap::new(),
            blocked_paused: HashSet::new(),
            pressure: Backpressure::default(),
            done_tx: Some(done_tx),
            parks: park::Parks::default(),
            next_park: inner.park.as_ref().map(|_| Instant::now()),
        };
        Drive {
            counters: &inner.counters,
            breaker: &inner.breaker,
            dead_letters: &inner.dead_letters,
            max_in_flight: inner.config.max_in_flight,
            commit_interval: inner.config.commit_interval,
            drain_timeout: inner.config.drain_timeout,
        }
        .run(&mut lp, &mut done_rx, &stop_tx, shutdown)
        .await;
        refused_or(refused, StatsHandle(inner.counters.clone()).snapshot())
    }
}
