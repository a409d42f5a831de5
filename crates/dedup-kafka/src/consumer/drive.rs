//! The one event loop every runner runs: receive, hear from running work, commit on a tick,
//! pause on a stall or an open kill switch, share the in-flight bound; then drain, commit, leave
//! the group. What differs between the runners (lanes of single messages, queues of batches) is
//! behind [`Work`].
//!
//! `Drive::run` is the loop. `Work` is implemented by the lanes of `runner/` and the queues of
//! `batch/`: it receives, hears its tasks' events, takes a turn of its own (a batch due, a parking
//! tick), starts what is due after each turn, says what is held and running, and drains.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use super::{PauseReason, Shared, Source, apply_pauses, commit, lock, sleep_until_opt};
use crate::consumer::Backpressure;
use crate::dead_letter::DeadLetters;
use crate::delivery::Delivery;
use crate::kill_switch::Breaker;
use crate::stats::Counters;

/// A runner's own way of holding and running messages.
pub(crate) trait Work {
    /// What the runner's tasks tell the loop.
    type Event: Send + 'static;

    /// Where messages come from.
    fn source(&mut self) -> &mut Source;
    /// The partitions owned and their settled offsets.
    fn shared(&self) -> &Arc<Mutex<Shared>>;
    /// The loop's backpressure.
    fn pressure(&mut self) -> &mut Backpressure;

    /// A message received.
    fn receive(&mut self, delivery: Delivery);
    /// A task's news.
    fn on_event(&mut self, event: Self::Event);
    /// When the runner wants a turn of its own (a batch due, a parking tick), if it does.
    fn wake_at(&self) -> Option<Instant>;
    /// That turn.
    fn on_wake(&mut self);
    /// After every turn: start what is due, and set the runner's own pause reasons.
    fn after_turn(&mut self);
    /// After each periodic commit.
    fn on_commit(&mut self) {}
    /// Messages held against `max_in_flight`.
    fn held(&self) -> usize;
    /// Messages held per partition and ownership that do not count against its share.
    fn not_shared(&self) -> &HashMap<(String, i32, u64), usize>;
    /// Shutdown begins: what waits is left to redelivery.
    fn drain_start(&mut self);
    /// What the drain waits for.
    fn running(&self) -> usize;
    /// After the last commit, before leaving the group.
    fn finish(&mut self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// What the loop needs besides the work.
pub(crate) struct Drive<'a> {
    pub(crate) counters: &'a Counters,
    pub(crate) breaker: &'a Breaker,
    pub(crate) dead_letters: &'a DeadLetters,
    pub(crate) max_in_flight: usize,
    pub(crate) commit_interval: Duration,
    pub(crate) drain_timeout: Duration,
}

impl Drive<'_> {
    /// Runs `work` until `shutdown` completes, then drains (telling the tasks through `stop`),
    /// commits and leaves the group.
    pub(crate) async fn run<W: Work>(
        &self,
        work: &mut W,
        events: &mut mpsc::UnboundedReceiver<W::Event>,
        stop: &watch::Sender<bool>,
        shutdown: impl Future<Output = ()>,
    ) {
        let c = self.counters;
        let mut commit_tick = tokio::time::interval(self.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            let wake = work.wake_at();
            let stall = work.pressure().stall_deadline();
            let taking = work.pressure().taking();
            let room = work.held() < self.max_in_flight;
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(event) = events.recv() => work.on_event(event),
                _ = commit_tick.tick() => {
                    // Health's sign of life: once per tick, not per message (no clock read on
                    // the message path).
                    c.last_turn_ms.set(now_ms());
                    let shared = work.shared().clone();
                    commit(&work.source().consumer, &shared, c, CommitMode::Async);
                    work.on_commit();
                }
                () = sleep_until_opt(stall), if stall.is_some() => {
                    let shared = work.shared().clone();
                    work.pressure().set_paused(true, &shared, c);
                }
                () = sleep_until_opt(wake), if wake.is_some() => work.on_wake(),
                // The kill switch opened, or its pause is over: the pause reason follows it.
                () = self.breaker.opened() => {}
                () = sleep_until_opt(self.breaker.open_until()), if self.breaker.is_open() => {}
                d = work.source().recv(c, taking, room), if taking || room => {
                    if let Some(d) = d {
                        work.receive(d);
                    }
                }
            }
            work.after_turn();
            let (held, shared) = (work.held(), work.shared().clone());
            work.pressure().update(held, self.max_in_flight, &shared, c);
            lock(&shared)
                .pauses
                .set_all(PauseReason::KillSwitch, self.breaker.is_open());
            apply_pauses(&*work.source().consumer, &shared);
            let fetch = work.source().fetch.clone();
            fetch.share(&shared, self.max_in_flight, work.not_shared());
        }

        // Shutdown: running work finishes (its retries stop), what waits is left to redelivery,
        // settled offsets are committed.
        info!(
            held = work.held(),
            running = work.running(),
            "runner draining"
        );
        let _ = stop.send(true);
        work.source().stop();
        work.drain_start();
        let deadline = Instant::now() + self.drain_timeout;
        while work.running() > 0 {
            tokio::select! {
                Some(event) = events.recv() => work.on_event(event),
                // Keep serving rebalance callbacks; new messages are not taken.
                _ = work.source().consumer.recv() => {}
                () = tokio::time::sleep_until(deadline) => {
                    warn!(running = work.running(), "drain timed out; the rest will be redelivered");
                    break;
                }
            }
        }
        let shared = work.shared().clone();
        commit(&work.source().consumer, &shared, c, CommitMode::Sync);
        work.finish().await;
        work.source().stop();
        work.source().consumer.unsubscribe();
        if let Err(e) = self.dead_letters.flush(Duration::from_secs(10)) {
            warn!(error = %e, "dead-letter producer flush");
        }
        info!("runner stopped");
    }
}

/// Now, in milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
