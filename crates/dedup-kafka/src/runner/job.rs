//! A message's task in the per-message runner: its claim, its handler, its retries, its dead
//! letter (and, with parking, its park: `park/run.rs`).
//!
//! A keyed message runs through `Dedup::try_process` (`run_keyed`). Handler panics come back as
//! `ProcessError::Panicked` (retryable; dead-lettered with "handler panicked: ..." past the
//! attempts); a panic anywhere else in the task is caught too and dead-letters its message, so a
//! partition's commit position never freezes behind a lost task. Passing store errors are retried
//! without limit and counted (`RunnerStats::store_errors`). Dead letters go through an idempotent
//! producer and are awaited before the offset moves. A handler's `HandlerError::Withdraw` counts
//! as retryable here (a message is retried until it settles, so an attempt-free failure would
//! retry it without end); only the kill switch withdraws, and only while it holds the runner back.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};

use dedup_core::{Dedup, Fingerprint, HandlerError, IdempotencyKey, ProcessError, Store};
use futures_util::FutureExt;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep};
use tracing::{Instrument, debug, info_span, warn};

use super::lanes::{Event, Job};
use super::park;
use crate::config::{MissingKey, RunnerConfig};
use crate::consumer::Settled;
use crate::dead_letter::DeadLetters;
use crate::delivery::KeyError;
use crate::handler::{Handler, attempts_of, last_attempt, no_withdraw, panic_message};
use crate::kill_switch::Breaker;
use crate::stats::Counters;

pub(in crate::runner) struct Inner<S, H> {
    pub(in crate::runner) config: RunnerConfig,
    pub(in crate::runner) dedup: Arc<Dedup<S>>,
    pub(in crate::runner) handler: H,
    pub(in crate::runner) dead_letters: DeadLetters,
    pub(in crate::runner) counters: Arc<Counters>,
    pub(in crate::runner) stopping: watch::Receiver<bool>,
    pub(in crate::runner) park: Option<Arc<park::ParkCtx>>,
    pub(in crate::runner) breaker: Arc<Breaker>,
}

impl<S, H> Inner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    pub(in crate::runner) fn abandoned(&self, job: &Job) -> bool {
        job.revoked.load(AtomicOrdering::Acquire) || *self.stopping.borrow()
    }

    /// Waits while the kill switch is open; false if the job should be abandoned instead.
    pub(in crate::runner) async fn wait_while_open(&self, job: &Job) -> bool {
        if self.breaker.is_open() {
            let mut stopping = self.stopping.clone();
            tokio::select! {
                () = self.breaker.wait_until_shut() => {}
                _ = stopping.wait_for(|s| *s) => {}
            }
        }
        !self.abandoned(job)
    }

    /// Waits before retry `n`; false if the job should be abandoned instead.
    pub(in crate::runner) async fn wait_retry(&self, job: &Job, n: u32) -> bool {
        self.counters.retries.add(1);
        let mut stopping = self.stopping.clone();
        tokio::select! {
            () = sleep(self.config.backoff.delay(n)) => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
        !self.abandoned(job)
    }

    pub(in crate::runner) async fn run_job(
        &self,
        job: &Job,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Settled {
        let d = &job.delivery;
        let span = info_span!(
            "dedup.kafka.message",
            "messaging.system" = "kafka",
            "messaging.destination.name" = %d.topic,
            "messaging.kafka.partition" = d.partition,
            "messaging.kafka.offset" = d.offset,
            outcome = tracing::field::Empty,
        );
        crate::trace::set_parent(&span, d);
        let started = Instant::now();
        let settled = async {
            match &job.key {
                Ok(key) => self.run_keyed(job, key, events).await,
                Err(KeyError::Missing(why)) => {
                    self.counters.missing_key.add(1);
                    match self.config.missing_key {
                        MissingKey::DeadLetter => {
                            warn!(topic = %d.topic, partition = d.partition, offset = d.offset, why, "message without an idempotency key: dead-lettered");
                            self.give_up(job, &format!("no idempotency key: {why}"), 0, events)
                                .await
                        }
                        MissingKey::ProcessWithoutDedup => {
                            warn!(topic = %d.topic, partition = d.partition, offset = d.offset, why, "message without an idempotency key: processed without dedup");
                            self.run_unkeyed(job).await
                        }
                    }
                }
                Err(e) => {
                    self.counters.bad_key.add(1);
                    warn!(topic = %d.topic, partition = d.partition, offset = d.offset, error = %e, "bad idempotency key: dead-lettered");
                    self.give_up(job, &e.to_string(), 0, events).await
                }
            }
        }
        .instrument(span.clone())
        .await;
        span.record("outcome", format!("{settled:?}").to_lowercase());
        if settled != Settled::Abandoned {
            self.counters
                .latency
                .record(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        }
        settled
    }

    /// Runs a keyed message until it settles. A key another holder runs is not waited for
    /// inside the claim: the message tells the loop it is blocked (its lane leaves the in-flight
    /// bound for the blocked one) and tries again with backoff; it tells the loop again when its
    /// claim is granted, before its handler starts.
    pub(in crate::runner) async fn run_keyed(
        &self,
        job: &Job,
        key: &IdempotencyKey,
        events: &mpsc::UnboundedSender<Event>,
    ) -> Settled {
        let fingerprint = self
            .config
            .check_payload
            .then(|| Fingerprint::of(job.delivery.payload_bytes()));
        let mut retry = 0;
        let mut failed_runs = 0;
        let mut blocked = false;
        // Postgres refused to park it for good: it runs on in place.
        let mut unparkable = false;
        loop {
            // An open kill switch starts no handler until its pause is over.
            if !self.wait_while_open(job).await {
                return Settled::Abandoned;
            }
            let delivery = job.delivery.clone();
            let handler = &self.handler;
            let breaker = &self.breaker;
            let granted = AtomicBool::new(false);
            let granted_ref = &granted;
            let unblock = blocked.then(|| (events.clone(), job.lane.clone()));
            let stopping = &self.stopping;
            let (lane, revoked) = (&job.lane, &job.revoked);
            let out = self
                .dedup
                .try_process(key, fingerprint, move |lease| {
                    granted_ref.store(true, AtomicOrdering::Relaxed);
                    if let Some((events, lane)) = unblock {
                        let _ = events.send(Event::Unblocked(lane));
                    }
                    let last = last_attempt(&lease);
                    async move {
                        let r = no_withdraw(handler.handle(delivery, Some(lease)).await);
                        // Lease mode withdraws nothing; a final failure while the switch is
                        // wary is held, its lane out of the in-flight bound meanwhile (as a
                        // blocked one), so that other messages can still close the switch.
                        breaker
                            .judge_lease(
                                r,
                                last,
                                stopping,
                                || revoked.load(AtomicOrdering::Acquire),
                                || drop(events.send(Event::Blocked(lane.clone()))),
                                || drop(events.send(Event::Unblocked(lane.clone()))),
                            )
                            .await
                    }
                })
                .await;
            if matches!(out, Err(ProcessError::Panicked { .. })) {
                self.breaker.failure();
            }
            if granted.load(AtomicOrdering::Relaxed) {
                blocked = false;
            }
            if let Err(ProcessError::InFlight { owner, .. }) = &out
                && !blocked
            {
                blocked = true;
                self.counters.blocked.add(1);
                debug!(key = %key, owner = ?owner, "held by another holder: blocked");
                let _ = events.send(Event::Blocked(job.lane.clone()));
            }
            let err = match out {
                Ok(processed) => {
                    // A panicking check is the user's code failing on this result: given up
                    // with the reason, as the parked-head path does (never a loop of panics).
                    let check = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        self.handler.check_result(&job.delivery, &processed)
                    }));
                    match check {
                        Ok(Ok(())) if processed.executed() => return Settled::Executed,
                        Ok(Ok(())) => return Settled::Replayed,
                        Ok(Err(source)) => ProcessError::Undecodable {
                            key: key.clone(),
                            source,
                        },
                        Err(panic) => {
                            self.counters.panics.add(1);
                            let reason =
                                format!("checking the result panicked: {}", panic_message(&*panic));
                            warn!(key = %key, reason, "dead-lettering");
                            return self.give_up(job, &reason, retry + 1, events).await;
                        }
                    }
                }
                Err(e) => e,
            };
            if matches!(err, ProcessError::Panicked { .. }) {
                self.counters.panics.add(1);
            }
            if err.is_retryable() {
                retry += 1;
                // Runs that failed: not a wait for another holder, nor a store that is down.
                if !matches!(err, ProcessError::InFlight { .. } | ProcessError::Store(_)) {
                    failed_runs += 1;
                }
                if !unparkable && self.should_park(&err, failed_runs) {
                    let attempts = attempts_of(&err, retry);
                    let _ = events.send(Event::Parking(job.lane.clone(), job.park_epoch));
                    match self.park(job, &err.to_string(), attempts, false).await {
                        Settled::ParkImpossible => {
                            // The key's head: it keeps its place and retries in place, as
                            // without parking, until its attempts are spent.
                            unparkable = true;
                            let _ =
                                events.send(Event::ParkUndone(job.lane.clone(), job.park_epoch));
                        }
                        settled => return settled,
                    }
                }
                if let ProcessError::Store(e) = &err {
                    self.counters.store_errors.add(1);
                    warn!(key = %key, error = %e, retry, "store unavailable; retrying");
                } else {
                    debug!(key = %key, error = %err, retry, "retrying");
                }
                if !self.wait_retry(job, retry).await {
                    return Settled::Abandoned;
                }
                continue;
            }
            let attempts = attempts_of(&err, retry + 1);
            warn!(key = %key, error = %err, attempts, "dead-lettering");
            return self.give_up(job, &err.to_string(), attempts, events).await;
        }
    }

    pub(in crate::runner) async fn run_unkeyed(&self, job: &Job) -> Settled {
        let max = self.dedup.policy().max_attempts;
        let mut attempt = 0;
        loop {
            if !self.wait_while_open(job).await {
                return Settled::Abandoned;
            }
            attempt += 1;
            let call = AssertUnwindSafe(
                self.handler
                    .handle(job.delivery.clone(), None)
                    .map(no_withdraw),
            );
            let out = call.catch_unwind().await;
            // Judged by the kill switch: a failure it withdraws spends no attempt.
            if matches!(out, Ok(Ok(_))) {
                self.breaker.success();
            } else if self.breaker.failure() {
                attempt -= 1;
                if !self.wait_retry(job, attempt.max(1)).await {
                    return Settled::Abandoned;
                }
                continue;
            }
            let out = match out {
                Ok(out) => out,
                Err(panic) => {
                    self.counters.panics.add(1);
                    let msg = format!("handler panicked: {}", panic_message(&*panic));
                    if attempt >= max {
                        return self.dead_letter(job, &msg, attempt).await;
                    }
                    warn!(attempt, msg, "retrying a keyless message");
                    if !self.wait_retry(job, attempt).await {
                        return Settled::Abandoned;
                    }
                    continue;
                }
            };
            let reason = match out {
                Ok(_) => return Settled::ProcessedWithoutDedup,
                Err(HandlerError::Permanent(e)) => format!("the handler failed permanently: {e}"),
                Err(HandlerError::Retryable(e)) if attempt >= max => {
                    format!("the handler failed {attempt} time(s); last: {e}")
                }
                Err(HandlerError::Store(e)) if !e.is_retryable() || attempt >= max => {
                    format!("the handler's store call failed: {e}")
                }
                Err(e) => {
                    debug!(attempt, error = %e, "retrying a keyless message");
                    if !self.wait_retry(job, attempt).await {
                        return Settled::Abandoned;
                    }
                    continue;
                }
            };
            return self.dead_letter(job, &reason, attempt).await;
        }
    }

    /// Gives the message up to the dead-letter topic (or, refused there for good, to Postgres)
    /// and waits until it is there: the offset must not move past a message that is nowhere.
    pub(in crate::runner) async fn dead_letter(
        &self,
        job: &Job,
        reason: &str,
        attempts: u32,
    ) -> Settled {
        self.dead_letters
            .settle(
                &job.delivery,
                reason,
                attempts,
                job.key.as_ref().ok(),
                &|| self.abandoned(job),
            )
            .await
    }
}
