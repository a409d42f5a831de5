//! The loop's side of parking, its tick and due heads: `park_tick`, what the parking tasks report
//! back (`on_park_event`), and a head's run (`drive`).
//!
//! Each tick (`park_tick`) follows the assignment (a barrier per partition newly owned; its
//! messages wait for it), asks for due heads and starts a run per key not already running (at
//! most 64 at once), and refreshes the gauges. A head whose row is removed after its run uncounts
//! (`ParkEvent::HeadDone`, under the epoch the run was started under). Each parked head's run is
//! a `dedup.kafka.parked_retry` span.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering as AtomicOrdering;

use dedup_core::Store;
use tracing::{Instrument, debug, info_span, warn};

use futures_util::FutureExt;

use super::super::{Event, Handler, Loop};
use super::{Head, HeadRun, ParkEvent};
use crate::consumer::lock;

/// Parked heads run at once at most, over the runner's partitions.
const MAX_RUNNING: usize = 64;

impl<S, H> Loop<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// Every `poll`: follows the assignment (a sync barrier for each partition newly owned; the
    /// parked keys of revoked ones are let go), looks for due heads, refreshes the gauges, and
    /// lets messages waiting for room in.
    pub(in crate::runner) fn park_tick(&mut self) {
        let Some(ctx) = self.park_ctx() else {
            return;
        };
        let owned: Vec<((String, i32), u64, bool)> = lock(&self.shared)
            .parts
            .iter()
            .map(|(tp, p)| {
                (
                    tp.clone(),
                    p.generation,
                    p.revoked.load(AtomicOrdering::Acquire),
                )
            })
            .collect();
        let live: HashSet<(String, i32)> = owned
            .iter()
            .filter(|(_, _, revoked)| !revoked)
            .map(|(tp, _, _)| tp.clone())
            .collect();
        let gone: Vec<(String, i32)> = self
            .parks
            .parts
            .keys()
            .filter(|tp| !live.contains(*tp))
            .cloned()
            .collect();
        for tp in gone {
            if let Some(p) = self.parks.parts.remove(&tp) {
                self.held -= p.waiting.len();
                self.inner.counters.abandoned.add(p.waiting.len() as u64);
            }
        }
        for (tp, generation, revoked) in owned {
            if !revoked {
                self.sync(&tp, generation);
            }
        }
        ctx.total.store(self.parks.total(), AtomicOrdering::Relaxed);
        self.let_waiting_in();
        let synced: Vec<(String, i32)> = self
            .parks
            .parts
            .iter()
            .filter(|(_, p)| p.epoch.is_some())
            .map(|(tp, _)| tp.clone())
            .collect();
        self.parks.ticks += 1;
        let Some(tx) = self.park_event() else {
            return;
        };
        // An open kill switch runs no parked head either.
        if !synced.is_empty() && !self.parks.heads_running && !self.inner.breaker.is_open() {
            self.parks.heads_running = true;
            let (ctx, tx, parts) = (ctx.clone(), tx.clone(), synced.clone());
            tokio::spawn(async move {
                let heads = ctx.store.due_heads(&ctx.group, &parts, 256).await;
                let _ = tx.send(Event::Park(ParkEvent::Heads(heads)));
            });
        }
        if self.parks.ticks.is_multiple_of(8) {
            tokio::spawn(async move {
                if let Ok(g) = ctx.store.gauges(&ctx.group, &synced).await {
                    let _ = tx.send(Event::Park(ParkEvent::Gauges(g)));
                }
            });
        }
    }

    pub(in crate::runner) fn on_park_event(&mut self, event: ParkEvent) {
        match event {
            ParkEvent::Synced {
                tp,
                generation,
                result,
            } => {
                let Some(p) = self.parks.parts.get_mut(&tp) else {
                    return;
                };
                if p.generation != generation {
                    return;
                }
                p.syncing = false;
                match result {
                    // Revoked before the bump: the next tick lets the partition go.
                    Ok(None) => {}
                    Ok(Some((epoch, keys))) => {
                        debug!(topic = %tp.0, partition = tp.1, epoch, parked_keys = keys.len(), "parked keys loaded");
                        p.epoch = Some(epoch);
                        p.keys = keys;
                        if p.stale {
                            // Fenced again while this barrier ran: its answer may be behind.
                            self.sync(&tp, generation);
                        } else {
                            self.let_waiting_in();
                        }
                    }
                    Err(e) => {
                        // Tried again on the next tick.
                        self.inner.counters.store_errors.add(1);
                        warn!(topic = %tp.0, partition = tp.1, error = %e, "loading parked keys failed; retrying");
                    }
                }
            }
            ParkEvent::Heads(heads) => {
                self.parks.heads_running = false;
                match heads {
                    Ok(heads) => {
                        for head in heads {
                            self.drive(head);
                        }
                    }
                    Err(e) => {
                        self.inner.counters.store_errors.add(1);
                        warn!(error = %e, "looking for due parked heads failed");
                    }
                }
            }
            ParkEvent::HeadDone {
                tp,
                generation,
                epoch,
                key,
                run,
            } => {
                self.parks
                    .driving
                    .remove(&(tp.0.clone(), tp.1, generation, key.clone()));
                // Under a newer epoch the barrier counted the rows afresh: a removal made
                // before it is in its count already.
                if run.removed
                    && let Some(p) = self.parks.parts.get_mut(&tp)
                    && p.generation == generation
                    && p.epoch == Some(epoch)
                    && let Some(n) = p.keys.get_mut(&key)
                {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        p.keys.remove(&key);
                    }
                }
                self.let_waiting_in();
            }
            ParkEvent::Resync(lane) => self.resync(&lane, Vec::new()),
            ParkEvent::Gauges((keys, messages, oldest)) => {
                let c = &self.inner.counters;
                c.parked_keys.set(keys);
                c.parked_messages.set(messages);
                c.parked_oldest_ms
                    .set(u64::try_from(oldest.as_millis()).unwrap_or(u64::MAX));
            }
        }
    }

    /// Starts a due head's run unless its key's head runs already (and not while stopping, nor
    /// past [`MAX_RUNNING`] runs at once).
    fn drive(&mut self, head: Head) {
        let Some(ctx) = self.park_ctx() else {
            return;
        };
        if *self.inner.stopping.borrow() || self.parks.driving.len() >= MAX_RUNNING {
            return;
        }
        let tp = (head.delivery.topic.clone(), head.delivery.partition);
        let Some(p) = self.parks.parts.get(&tp) else {
            return;
        };
        let Some(epoch) = p.epoch else {
            return;
        };
        let generation = p.generation;
        if !self
            .parks
            .driving
            .insert((tp.0.clone(), tp.1, generation, head.key.clone()))
        {
            return;
        }
        let Some(tx) = self.done_tx.clone() else {
            return;
        };
        let inner = self.inner.clone();
        let scope = self.scope.clone();
        tokio::spawn(async move {
            let key = head.key.clone();
            let span = info_span!(
                "dedup.kafka.parked_retry",
                "messaging.destination.name" = %tp.0,
                "messaging.kafka.partition" = tp.1,
                "messaging.kafka.offset" = head.delivery.offset,
                attempts = head.attempts,
                outcome = tracing::field::Empty,
            );
            // Whatever happens in the run, the loop hears of it, or the key would never be
            // driven again.
            let run = AssertUnwindSafe(inner.run_head(&ctx, &scope, epoch, head).instrument(span))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| {
                    inner.counters.panics.add(1);
                    warn!(
                        panic = super::super::panic_message(&*panic),
                        "a parked head's run panicked; it runs again"
                    );
                    HeadRun::KEPT
                });
            let _ = tx.send(Event::Park(ParkEvent::HeadDone {
                tp,
                generation,
                epoch,
                key,
                run,
            }));
        });
    }
}
