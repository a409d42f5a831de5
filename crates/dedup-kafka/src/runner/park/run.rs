//! A message task's side of parking: parking a message, and one run of a parked head.
//!
//! `should_park`: handler failures after `in_place_attempts`, under `max_parked`. `park` (a
//! `dedup.kafka.park` span): a park Postgres refuses for good answers `Settled::ParkImpossible`,
//! and the head runs on in place; behind its key the message is dead-lettered, or under `Hold`
//! waits, loudly. `give_up` is every in-place give-up: dead-letter the message, and under `Hold`
//! write its key's held marker, waiting for room at a bound. `run_head` takes the head (only a
//! due, unheld one), runs it once through `Dedup::try_process` with the handler (a panicking run
//! is caught and reported), then removes it, defers it with jittered backoff, or dead-letters and
//! removes it (under `AfterGiveUp::Hold` keeps it as the key's held marker and holds the rest).
//! Settles are retried until their answer is definite.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Duration;

use dedup_core::{Fingerprint, IdempotencyKey, ProcessError, Scope, Store};
use tracing::{Instrument, debug, error, info_span, warn};

use super::super::{Handler, Inner, Job, Lane, Settled, attempts_of, last_attempt, no_withdraw};
use super::{AfterGiveUp, Head, HeadOutcome, HeadRun, ParkCtx, Parked, PartRef, Taken};
use crate::delivery::{Delivery, extract_key};

/// Where a parked head's row is, for this run of it.
struct HeadAt<'a> {
    ctx: &'a ParkCtx,
    part: PartRef,
    epoch: i64,
    offset: i64,
    /// The hold policy: a head given up on stays as its key's held marker.
    hold: bool,
}

/// What the claim and handler of a parked head came to.
enum HeadAnswer<E> {
    /// Executed (true) or replayed, its result checked.
    Settled(bool),
    /// Checking its result panicked: the reason to dead-letter it with.
    CheckPanicked(String),
    /// Failed (never withdrawn: lease mode withdraws nothing).
    Failed { err: ProcessError<E> },
}

fn part_ref(ctx: &ParkCtx, lane: &Lane) -> PartRef {
    PartRef {
        group: ctx.group.clone(),
        topic: lane.topic.clone(),
        partition: lane.partition,
    }
}

impl<S, H> Inner<S, H>
where
    S: Store + Send + Sync + 'static,
    H: Handler,
{
    /// Whether a message whose handler failed `failed_runs` times in place should be parked now.
    pub(in crate::runner) fn should_park(
        &self,
        err: &ProcessError<H::Error>,
        failed_runs: u32,
    ) -> bool {
        let Some(ctx) = &self.park else {
            return false;
        };
        // A kill switch that suspects an outage parks nothing: the message retries in place (a
        // final failure held until the switch closes).
        if failed_runs < ctx.cfg.in_place_attempts
            || matches!(err, ProcessError::InFlight { .. } | ProcessError::Store(_))
            || self.breaker.wary()
        {
            return false;
        }
        if ctx.total.load(AtomicOrdering::Relaxed) >= ctx.cfg.max_parked {
            self.counters.park_full.add(1);
            return false;
        }
        true
    }

    /// Writes `job` to the parked queue (at most once per offset), retrying a store that is
    /// down. Fenced (another owner has the partition), it is left to redelivery.
    pub(in crate::runner) async fn park(
        &self,
        job: &Job,
        error: &str,
        attempts: u32,
        behind: bool,
    ) -> Settled {
        self.park_as(job, error, attempts, behind, false).await
    }

    /// [`park`](Self::park), or with `marker` a held marker of a message dead-lettered in place
    /// under the hold policy (its row holds its key's later messages back; it never runs again).
    pub(in crate::runner) async fn park_as(
        &self,
        job: &Job,
        error: &str,
        attempts: u32,
        behind: bool,
        marker: bool,
    ) -> Settled {
        let Some(ctx) = &self.park else {
            return Settled::ParkRefused;
        };
        let Some(epoch) = job.park_epoch else {
            return Settled::ParkRefused;
        };
        let part = part_ref(ctx, &job.lane);
        let due_in = if behind {
            Duration::ZERO
        } else {
            ctx.cfg.delay(1, job.delivery.offset.unsigned_abs())
        };
        let dedup_key = job
            .key
            .as_ref()
            .ok()
            .map(|k| (k.scope().as_str().to_owned(), k.key_bytes().to_vec()));
        let span = info_span!(
            "dedup.kafka.park",
            "messaging.destination.name" = %job.delivery.topic,
            "messaging.kafka.partition" = job.delivery.partition,
            "messaging.kafka.offset" = job.delivery.offset,
            behind,
            outcome = tracing::field::Empty,
        );
        let mut retry = 0;
        // An attempt that failed after it was sent may have written the row: finding it then is
        // finding our own, not a replay's.
        let mut maybe_written = false;
        loop {
            let out = ctx
                .store
                .park(
                    &part,
                    epoch,
                    &job.delivery,
                    job.lane.key.clone(),
                    dedup_key.clone(),
                    error,
                    attempts,
                    due_in,
                    marker,
                )
                .instrument(span.clone())
                .await;
            let out = match out {
                Ok(Parked::Already) if maybe_written => Ok(Parked::Written),
                other => other,
            };
            match out {
                Ok(Parked::Written) => {
                    span.record("outcome", if marker { "held" } else { "parked" });
                    if !marker {
                        self.counters.parked.add(1);
                    }
                    if !behind {
                        warn!(topic = %job.delivery.topic, partition = job.delivery.partition, offset = job.delivery.offset, error, attempts, "parked");
                    }
                    return if marker {
                        Settled::DeadLetteredHeld
                    } else if behind {
                        Settled::ParkedBehind
                    } else {
                        Settled::Parked
                    };
                }
                Ok(Parked::Already) => {
                    // A replay of a message parked before (and counted by the barrier).
                    span.record("outcome", "already");
                    return if marker {
                        Settled::DeadLetteredHeldAgain
                    } else {
                        Settled::ParkedAlready
                    };
                }
                Ok(Parked::Fenced) => {
                    // The partition's epoch moved on. Revoked, the message is the next owner's
                    // to read again; still ours, the loop takes the epoch again and the message
                    // goes through its key's order once more (it never runs ahead of its key).
                    span.record("outcome", "fenced");
                    debug!(
                        offset = job.delivery.offset,
                        "the partition's parking epoch moved on: not parked"
                    );
                    return if self.abandoned(job) {
                        Settled::ParkRefused
                    } else {
                        Settled::ParkFenced
                    };
                }
                Ok(Parked::Refused(e)) => {
                    // Postgres refuses this message's data for good (a data exception, a
                    // program limit): parking it can never succeed.
                    self.counters.park_errors.add(1);
                    if behind && ctx.cfg.after_give_up == AfterGiveUp::Hold {
                        // It must not run ahead of its key's head, nor be given up: the key
                        // stalls, loudly, until an operator acts (or the data is fixed).
                        error!(topic = %job.delivery.topic, partition = job.delivery.partition, offset = job.delivery.offset, error = %e, "a message behind a held key cannot be parked (Postgres refuses its data) and must not run ahead: its partition's commit waits (RunnerStats::park_errors)");
                        retry += 1;
                        if !self.wait_retry(job, retry).await {
                            return Settled::ParkRefused;
                        }
                        continue;
                    }
                    span.record("outcome", "impossible");
                    error!(topic = %job.delivery.topic, partition = job.delivery.partition, offset = job.delivery.offset, error = %e, behind, "the message cannot be parked");
                    return Settled::ParkImpossible;
                }
                Err(e) => {
                    maybe_written |= e.is_outcome_unknown();
                    self.counters.store_errors.add(1);
                    warn!(error = %e, "parking failed; retrying");
                    retry += 1;
                    if !self.wait_retry(job, retry).await {
                        return Settled::ParkRefused;
                    }
                }
            }
        }
    }

    /// Gives a message up in place: dead-letters it, and under the hold policy (with parking)
    /// keeps its key held behind it: its row is written as the key's held marker (counted
    /// before, so the key's next message cannot start meanwhile), and the key's later messages
    /// park behind it until an operator releases the key. At a parking bound it waits for room
    /// first rather than dead-letter a message whose key could then not be held.
    pub(in crate::runner) async fn give_up(
        &self,
        job: &Job,
        reason: &str,
        attempts: u32,
        events: &tokio::sync::mpsc::UnboundedSender<super::super::Event>,
    ) -> Settled {
        use super::super::Event;
        let Some(ctx) = self
            .park
            .as_ref()
            .filter(|c| c.cfg.after_give_up == AfterGiveUp::Hold)
        else {
            return self.dead_letter(job, reason, attempts).await;
        };
        if job.park_epoch.is_none() {
            // Parking cannot hold this partition's keys yet (no epoch): as without parking.
            return self.dead_letter(job, reason, attempts).await;
        }
        let mut waits = 0;
        while ctx.total.load(AtomicOrdering::Relaxed) >= ctx.cfg.max_parked {
            if waits == 0 {
                self.counters.park_full.add(1);
                warn!(topic = %job.delivery.topic, partition = job.delivery.partition, offset = job.delivery.offset, "parked queue full: a message to give up under the hold policy waits for room");
            }
            waits += 1;
            if !self.wait_retry(job, waits).await {
                return Settled::Abandoned;
            }
        }
        let _ = events.send(Event::Parking(job.lane.clone(), job.park_epoch));
        let settled = self.dead_letter(job, reason, attempts).await;
        if settled != Settled::DeadLettered {
            let _ = events.send(Event::ParkUndone(job.lane.clone(), job.park_epoch));
            return settled;
        }
        let mut retry = 0;
        loop {
            match self.park_as(job, reason, attempts, false, true).await {
                Settled::ParkImpossible => {
                    // A marker carries no payload and no headers: nothing left to refuse, but
                    // never let the key go on without it.
                    retry += 1;
                    if !self.wait_retry(job, retry).await {
                        return Settled::ParkRefused;
                    }
                }
                settled => return settled,
            }
        }
    }

    /// Runs a parked head once through the claim: whether its row went.
    pub(super) async fn run_head(
        &self,
        ctx: &ParkCtx,
        scope: &Scope,
        epoch: i64,
        head: Head,
    ) -> HeadRun {
        let d = Arc::new(head.delivery.clone());
        let at = HeadAt {
            ctx,
            part: PartRef {
                group: ctx.group.clone(),
                topic: d.topic.clone(),
                partition: d.partition,
            },
            epoch,
            offset: d.offset,
            hold: ctx.cfg.after_give_up == AfterGiveUp::Hold,
        };
        let span = tracing::Span::current();
        match ctx
            .store
            .take(&at.part, epoch, d.offset, ctx.cfg.run_bound)
            .await
        {
            Ok(Taken::Run) => {}
            Ok(Taken::Gone | Taken::Fenced) => return HeadRun::KEPT,
            Err(e) => {
                self.counters.store_errors.add(1);
                warn!(error = %e, "taking a parked head failed");
                return HeadRun::KEPT;
            }
        }
        if head.gave_up {
            // Dead-lettered before under the hold policy; an operator released its key.
            span.record("outcome", "released");
            return self.settle_head(&at, false).await;
        }
        if head.dropped {
            span.record("outcome", "dropped");
            let reason = format!(
                "dropped by an operator while parked; last failure: {}",
                head.error
            );
            let key = extract_key(&self.config.key, scope, &d).ok();
            return self
                .letter_head(&at, false, &d, &reason, head.attempts, key.as_ref())
                .await;
        }
        self.counters.parked_retries.add(1);
        let key = match extract_key(&self.config.key, scope, &d) {
            Ok(k) => k,
            Err(e) => {
                span.record("outcome", "dead_lettered");
                return self
                    .letter_head(&at, at.hold, &d, &e.to_string(), head.attempts, None)
                    .await;
            }
        };
        let err = match self.process_head(&key, &d).await {
            HeadAnswer::Settled(executed) => {
                span.record("outcome", if executed { "executed" } else { "replayed" });
                if executed {
                    self.counters.executed.add(1);
                } else {
                    self.counters.replayed.add(1);
                }
                return self.settle_head(&at, false).await;
            }
            HeadAnswer::CheckPanicked(reason) => {
                span.record("outcome", "dead_lettered");
                return self
                    .letter_head(&at, at.hold, &d, &reason, head.attempts, Some(&key))
                    .await;
            }
            HeadAnswer::Failed { err } => err,
        };
        if err.is_retryable() {
            return self.defer_head(&at, &head, &key, err).await;
        }
        let attempts = attempts_of(&err, head.attempts + 1);
        span.record("outcome", "dead_lettered");
        warn!(key = %key, error = %err, attempts, "parked head dead-lettered");
        self.letter_head(&at, at.hold, &d, &err.to_string(), attempts, Some(&key))
            .await
    }

    /// The head's claim and handler (judged by the kill switch, a withdrawal noted), then the
    /// check of its result.
    async fn process_head(&self, key: &IdempotencyKey, d: &Arc<Delivery>) -> HeadAnswer<H::Error> {
        let fingerprint = self
            .config
            .check_payload
            .then(|| Fingerprint::of(d.payload_bytes()));
        let handler = &self.handler;
        let delivery = d.clone();
        let breaker = &self.breaker;
        let stopping = &self.stopping;
        let out = self
            .dedup
            .try_process(key, fingerprint, move |lease| {
                let last = last_attempt(&lease);
                async move {
                    let r = no_withdraw(handler.handle(delivery, Some(lease)).await);
                    // Lease mode withdraws nothing (a final failure while the switch is wary
                    // is held until it closes).
                    breaker
                        .judge_lease(r, last, stopping, || false, || {}, || {})
                        .await
                }
            })
            .await;
        if matches!(out, Err(ProcessError::Panicked { .. })) {
            self.breaker.failure();
        }
        let processed = match out {
            Ok(p) => p,
            Err(err) => {
                return HeadAnswer::Failed { err };
            }
        };
        let check = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.handler.check_result(d, &processed)
        }));
        match check {
            Ok(Ok(())) => HeadAnswer::Settled(processed.executed()),
            Ok(Err(source)) => HeadAnswer::Failed {
                err: ProcessError::Undecodable {
                    key: key.clone(),
                    source,
                },
            },
            Err(panic) => {
                self.counters.panics.add(1);
                HeadAnswer::CheckPanicked(format!(
                    "checking the result panicked: {}",
                    super::super::panic_message(&*panic)
                ))
            }
        }
    }

    /// A head that may still succeed waits in its row until its next run: an attempt spent
    /// only if its handler ran and failed (not for a key held elsewhere or a store error).
    async fn defer_head(
        &self,
        at: &HeadAt<'_>,
        head: &Head,
        key: &IdempotencyKey,
        err: ProcessError<H::Error>,
    ) -> HeadRun {
        let (spent, what) = match &err {
            ProcessError::InFlight { .. } | ProcessError::Store(_) => (head.attempts, "waiting"),
            _ => (head.attempts + 1, "failed"),
        };
        tracing::Span::current().record("outcome", what);
        let cfg = &at.ctx.cfg;
        let parked_runs = spent.saturating_sub(cfg.in_place_attempts).max(1);
        let due = cfg.delay(parked_runs, at.offset.unsigned_abs() ^ u64::from(spent));
        debug!(key = %key, error = %err, attempts = spent, due_in = ?due, "parked head failed again");
        match at
            .ctx
            .store
            .defer(&at.part, at.epoch, at.offset, &err.to_string(), spent, due)
            .await
        {
            // Deferred; or gone or fenced: the next look, or the next owner, sees to it.
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "deferring a parked head failed; it runs again when seen");
            }
        }
        HeadRun::KEPT
    }

    /// Settles a head's row (removed, or kept as its key's held marker with `hold`), retried
    /// while the store answers nothing definite: a settle that committed and lost its reply
    /// answers Gone the next time (the head was taken by this run, so only this run removes it).
    async fn settle_head(&self, at: &HeadAt<'_>, hold: bool) -> HeadRun {
        let mut n = 0u32;
        loop {
            match at
                .ctx
                .store
                .settle(&at.part, at.epoch, at.offset, hold)
                .await
            {
                Ok(HeadOutcome::Removed | HeadOutcome::Gone) => return HeadRun::REMOVED,
                Ok(HeadOutcome::Held | HeadOutcome::Fenced) => return HeadRun::KEPT,
                Err(e) => {
                    // Until the answer is definite, or the runner stops: its row is the next
                    // owner's then.
                    if *self.stopping.borrow() {
                        return HeadRun::KEPT;
                    }
                    warn!(error = %e, "settling a parked head failed; retrying");
                    n = n.saturating_add(1);
                    tokio::time::sleep(self.config.backoff.delay(n)).await;
                }
            }
        }
    }

    /// Dead-letters a head, then settles its row (`hold`: kept as its key's held marker); kept
    /// as it is if the runner stops first.
    async fn letter_head(
        &self,
        at: &HeadAt<'_>,
        hold: bool,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&IdempotencyKey>,
    ) -> HeadRun {
        if !self.head_dead_letter(d, reason, attempts, key).await {
            return HeadRun::KEPT;
        }
        self.settle_head(at, hold).await
    }

    /// Dead-letters a parked head through the runner's one dead-letter path (a refusal for good
    /// kept in Postgres, a dead producer made anew); false if the runner stops first (it runs
    /// again when seen).
    async fn head_dead_letter(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&dedup_core::IdempotencyKey>,
    ) -> bool {
        let stopping = || *self.stopping.borrow();
        let delivered = self
            .dead_letters
            .deliver(d, reason, attempts, key, &stopping)
            .await;
        if delivered.is_none() {
            return false;
        }
        self.counters.dead_lettered.add(1);
        self.counters.parked_dead_lettered.add(1);
        true
    }
}
