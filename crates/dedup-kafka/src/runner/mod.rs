//! The per-message runner ([`Runner`]): its construction and its loop (receive, dispatch into
//! lanes, settle, commit what is durable, drain). The lanes and the loop's bookkeeping are in
//! `lanes.rs`, a message's task in `job.rs`, parking in `park/`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{Dedup, Scope, Store};
use rdkafka::consumer::{CommitMode, Consumer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::config::RunnerConfig;
use crate::consumer::{
    Backpressure, Contact, PauseReason, Shared, apply_pauses, clients, lock, refused_or,
    sleep_until_opt, until_refused,
};
use crate::kill_switch::Breaker;
use crate::start::{RunnerError, adopt_at_start, scope_of};
use crate::stats::{Counters, RunnerStats, StatsHandle};

mod job;
mod lanes;
mod park;
pub use park::{AfterGiveUp, Parking};

// What `park` reaches through `super::super`.
use crate::handler::{Handler, attempts_of, no_withdraw, panic_message};
use job::Inner;
use lanes::{Done, Event, Job, Lane, Loop, Report, Settled, count_blocked};

/// An idempotent consumer: runs every message through [`Dedup::process`] and commits an offset
/// only once every message before it is settled (completed, replayed, or dead-lettered).
#[derive(Debug)]
pub struct Runner<S, H> {
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
    pub fn new(
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
    #[cfg(feature = "pg")]
    #[must_use]
    pub fn with_dead_letter_table(mut self, store: dedup_pg::PgStore) -> Self {
        self.refused = Some(Arc::new(store));
        self
    }

    /// A handle to the runner's counters, readable while it runs.
    pub fn stats(&self) -> StatsHandle {
        StatsHandle(self.counters.clone())
    }

    /// Consumes until `shutdown` completes, then drains, commits and leaves the group.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<RunnerStats, RunnerError> {
        let scope = self.scope.clone();
        let shared = Arc::new(Mutex::new(Shared::default()));
        adopt_at_start(&self.dedup).await;
        let contact = Arc::new(Contact::default());
        let (source, dead_letters) = clients(
            &self.config,
            &shared,
            &self.counters,
            None,
            &contact,
            self.refused,
        )?;
        let (shutdown, refused) = until_refused(shutdown, &contact);

        let (stop_tx, stop_rx) = watch::channel(false);
        let breaker = Breaker::new(self.config.kill_switch, self.counters.clone());
        let inner = Arc::new(Inner {
            config: self.config,
            dedup: self.dedup,
            handler: self.handler,
            dead_letters,
            counters: self.counters.clone(),
            stopping: stop_rx,
            park: self.park,
            breaker,
        });
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
            done_tx: None,
            parks: park::Parks::default(),
        };
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        lp.done_tx = Some(done_tx);

        let mut commit_tick = tokio::time::interval(inner.config.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let parking = inner.park.is_some();
        let mut park_tick = tokio::time::interval(
            inner
                .park
                .as_ref()
                .map_or(Duration::from_secs(3600), |p| p.cfg.poll),
        );
        park_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(event) = done_rx.recv() => lp.on_event(event),
                _ = commit_tick.tick() => lp.commit(CommitMode::Async),
                _ = park_tick.tick(), if parking => lp.park_tick(),
                () = sleep_until_opt(lp.pressure.stall_deadline()), if lp.pressure.stall_deadline().is_some() => {
                    lp.pressure.set_paused(true, &lp.shared, &inner.counters);
                }
                // The kill switch opened, or its pause is over: the pause reason follows it.
                () = inner.breaker.opened() => {}
                () = sleep_until_opt(inner.breaker.open_until()), if inner.breaker.is_open() => {}
                d = lp.source.recv(&inner.counters), if lp.pressure.taking() => {
                    if let Some(d) = d {
                        lp.receive(d);
                    }
                }
            }
            lp.pressure.update(
                lp.held,
                inner.config.max_in_flight,
                &lp.shared,
                &inner.counters,
            );
            lp.pause_blocked();
            lock(&lp.shared)
                .pauses
                .set_all(PauseReason::KillSwitch, inner.breaker.is_open());
            apply_pauses(&*lp.source.consumer, &lp.shared);
            lp.source
                .share(&lp.shared, inner.config.max_in_flight, &lp.blocked_by);
        }

        // Shutdown: running messages finish (their retries stop), queued ones are left to
        // redelivery, settled offsets are committed.
        info!(held = lp.held, blocked = lp.blocked, "runner draining");
        let _ = stop_tx.send(true);
        lp.source.stop();
        for lane in lp.lanes.values_mut() {
            let dropped = std::mem::take(&mut lane.queue).len();
            if lane.blocked {
                lp.blocked -= dropped;
                // Not read again: the loop stops sharing.
            } else {
                lp.held -= dropped;
            }
            inner.counters.abandoned.add(dropped as u64);
        }
        lp.drop_waiting();
        let deadline = Instant::now() + inner.config.drain_timeout;
        while lp.held + lp.blocked > 0 {
            tokio::select! {
                Some(event) = done_rx.recv() => lp.on_event(event),
                // Keep serving rebalance callbacks; new messages are not taken.
                _ = lp.source.consumer.recv() => {}
                () = tokio::time::sleep_until(deadline) => {
                    warn!(held = lp.held, blocked = lp.blocked, "drain timed out; the rest will be redelivered");
                    break;
                }
            }
        }
        lp.commit(CommitMode::Sync);
        lp.source.stop();
        lp.source.consumer.unsubscribe();
        if let Err(e) = inner.dead_letters.flush(Duration::from_secs(10)) {
            warn!(error = %e, "dead-letter producer flush");
        }
        info!("runner stopped");
        refused_or(refused, StatsHandle(inner.counters.clone()).snapshot())
    }
}
