//! The kill switch: a handler that fails everything (a dropped table, a revoked credential, a bad
//! deploy) must not dead-letter the whole stream at full speed and leave every key FAILED.
//!
//! The switch watches handler outcomes (a run that returned, not a replay, not dedup's own store
//! being down). It is **suspect** once the last [`KillSwitch::suspect_after`] outcomes all
//! failed, and **open** once the last [`KillSwitch::window`] outcomes hold at least
//! [`KillSwitch::min_failures`] failures at [`KillSwitch::failure_rate`] or more. While it is
//! suspect or open (or probing), a failure is *withdrawn*: the key is given back with no attempt
//! spent ([`HandlerError::Withdraw`]) and the message is retried later, never recorded FAILED,
//! never parked, never dead-lettered. While it is open the runner takes no messages: every
//! partition is paused ([`PauseReason::KillSwitch`](crate::consumer::PauseReason)) while the
//! consumer keeps polling (so the group sees it alive), no handler starts, and after
//! [`KillSwitch::pause`] it **probes**: runs resume, the first success closes the switch, the
//! first failure opens it again for another pause.
//!
//! **Lease mode withdraws nothing.** A withdrawal gives the key back as if its run had not
//! happened, which is right where the effect rolled back with its transaction (transaction
//! mode), and wrong where the effect is outside (lease mode): a handler that charged a card and
//! then failed would charge again on every probe. So in lease mode a failure is recorded as it
//! is, its attempt counted, whatever the switch says ([`Breaker::judge_lease`]); a failure that
//! is final (`Permanent`, or a retryable one on the key's last attempt) while the switch is
//! suspect, open or probing is **held**: its task keeps the lease (heartbeating) and waits, the
//! failure neither recorded nor dead-lettered nor run again, until the switch is closed again
//! (a success elsewhere, or after a probe); then it is recorded as it is. It is recorded as it
//! is too when the runner stops, when the message's partition is revoked, and when nothing
//! else decided the switch for a whole pause while it was not open (a poison message alone on
//! its partition under per-partition order: no other work could close the switch, and holding
//! on would only stop the partition). The attempt limit holds across the switch opening and
//! closing.
//!
//! What it cannot tell apart: a run of consecutive poison messages in one ordering group looks
//! like an outage, and holds that group (and, while open, the runner) until a message succeeds;
//! use the activation threshold (`suspect_after`, `min_failures`) to say how long such a run may
//! be. A handler panic counts as a failure, and is recorded as a panic always is.
//!
//! `KillSwitch` is the setting (off unless the consumer builder's `kill_switch`); `Breaker` is the
//! state, which every runner's handler answers pass through (`judge`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::HandlerError;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::config::ConfigError;
use crate::stats::Counters;

/// When a runner stops taking messages because its handler fails everything (see the module
/// docs of the crate: *Failures*). Off unless set (the consumer builder's `kill_switch`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct KillSwitch {
    /// The share of failures, over the last `window` handler outcomes, that opens the switch.
    /// Default 0.5.
    pub failure_rate: f64,
    /// How many of the latest handler outcomes the rate is taken over. Default 50.
    pub window: u32,
    /// The activation threshold: the switch does not open with fewer failures than this in the
    /// window. Default 10.
    pub min_failures: u32,
    /// After this many consecutive failures further failures are withdrawn (not recorded,
    /// not dead-lettered) until a run succeeds. Default 3.
    pub suspect_after: u32,
    /// How long an open switch keeps the runner from taking messages before it probes. Default
    /// 30 s.
    pub pause: Duration,
}

impl Default for KillSwitch {
    fn default() -> Self {
        Self {
            failure_rate: 0.5,
            window: 50,
            min_failures: 10,
            suspect_after: 3,
            pause: Duration::from_secs(30),
        }
    }
}

impl KillSwitch {
    /// The defaults, with the opening rate and the pause given.
    pub fn new(failure_rate: f64, pause: Duration) -> Self {
        Self {
            failure_rate,
            pause,
            ..Self::default()
        }
    }

    /// Sets the window, the activation threshold and the count of consecutive failures after
    /// which failures are withdrawn.
    #[must_use]
    pub fn with_thresholds(mut self, window: u32, min_failures: u32, suspect_after: u32) -> Self {
        self.window = window;
        self.min_failures = min_failures;
        self.suspect_after = suspect_after;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let bad = |problem: String| Err(ConfigError::new("kill_switch", problem));
        if !(self.failure_rate > 0.0 && self.failure_rate <= 1.0) {
            return bad(format!(
                "failure_rate {} is not in (0, 1]",
                self.failure_rate
            ));
        }
        if self.window == 0 || self.min_failures == 0 || self.suspect_after == 0 {
            return bad("window, min_failures and suspect_after must be at least 1".to_owned());
        }
        if self.min_failures > self.window {
            return bad(format!(
                "min_failures {} is more than the window of {} outcomes: it would never open",
                self.min_failures, self.window
            ));
        }
        if self.pause.is_zero() || self.pause > crate::config::MAX_SETTING_DURATION {
            return bad(format!(
                "the pause {:?} is not between 1 ns and {:?}",
                self.pause,
                crate::config::MAX_SETTING_DURATION
            ));
        }
        Ok(())
    }
}

/// Where a switch is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Phase {
    Closed,
    /// No handler runs and no message is taken until then.
    Open {
        until: Instant,
    },
    /// The pause is over: runs resume, and the first outcome decides.
    Probing,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    /// The latest outcomes, `true` for a failure.
    outcomes: VecDeque<bool>,
    failures: u32,
    consecutive: u32,
    /// When the last outcome was recorded, or the switch last began to probe, whichever is
    /// later: what a held failure measures the quiet from.
    decided: Instant,
}

/// How often a held failure looks whether the switch closed.
const HELD_LOOK: Duration = Duration::from_millis(100);

/// A runner's switch, shared by its loop and its messages' tasks.
#[derive(Debug)]
pub(crate) struct Breaker {
    cfg: Option<KillSwitch>,
    state: Mutex<State>,
    counters: Arc<Counters>,
    /// Told when the switch opens, so that the loop pauses at once.
    opened: Notify,
    /// The phase, for tasks waiting out an open switch.
    phase: watch::Sender<Phase>,
}

impl Breaker {
    pub(crate) fn new(cfg: Option<KillSwitch>, counters: Arc<Counters>) -> Self {
        Self {
            cfg,
            state: Mutex::new(State {
                phase: Phase::Closed,
                outcomes: VecDeque::new(),
                failures: 0,
                consecutive: 0,
                decided: Instant::now(),
            }),
            counters,
            opened: Notify::new(),
            phase: watch::channel(Phase::Closed).0,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The switch's phase now (an open switch whose pause is over is probing).
    pub(crate) fn phase(&self) -> Phase {
        if self.cfg.is_none() {
            return Phase::Closed;
        }
        let mut s = self.state();
        if let Phase::Open { until } = s.phase
            && Instant::now() >= until
        {
            s.phase = Phase::Probing;
            s.decided = Instant::now();
            self.counters.kill_switch_open.set(0);
            self.phase.send_replace(Phase::Probing);
            info!("kill switch: the pause is over; probing");
        }
        s.phase
    }

    /// Whether the switch is open now.
    pub(crate) fn is_open(&self) -> bool {
        matches!(self.phase(), Phase::Open { .. })
    }

    /// Until when it is open, if it is.
    pub(crate) fn open_until(&self) -> Option<Instant> {
        match self.phase() {
            Phase::Open { until } => Some(until),
            _ => None,
        }
    }

    /// Completes when the switch opens (for the loop's select).
    pub(crate) async fn opened(&self) {
        self.opened.notified().await;
    }

    /// Waits while the switch is open: no handler starts then.
    pub(crate) async fn wait_until_shut(&self) {
        let mut rx = self.phase.subscribe();
        while let Some(until) = self.open_until() {
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                _ = rx.changed() => {}
            }
        }
    }

    /// Whether a failure now would be withdrawn.
    pub(crate) fn wary(&self) -> bool {
        let Some(cfg) = self.cfg else {
            return false;
        };
        let phase = self.phase();
        phase != Phase::Closed || self.state().consecutive >= cfg.suspect_after
    }

    /// A handler run succeeded.
    pub(crate) fn success(&self) {
        let Some(cfg) = self.cfg else {
            return;
        };
        let _ = self.phase();
        let mut s = self.state();
        if s.phase == Phase::Probing {
            info!("kill switch: a run succeeded; closed");
            s.phase = Phase::Closed;
            s.outcomes.clear();
            s.failures = 0;
            self.phase.send_replace(Phase::Closed);
        }
        s.consecutive = 0;
        s.decided = Instant::now();
        push(&mut s, cfg.window, false);
    }

    /// A handler run failed: answers whether its failure is to be withdrawn (the switch was
    /// suspect, open or probing, or is now).
    pub(crate) fn failure(&self) -> bool {
        let wary = self.failed();
        if wary {
            self.counters.kill_switch_withdrawn.add(1);
        }
        wary
    }

    /// A handler run failed: counts it, and answers whether the switch was suspect, open or
    /// probing, or is now.
    fn failed(&self) -> bool {
        let Some(cfg) = self.cfg else {
            return false;
        };
        let _ = self.phase();
        let mut s = self.state();
        s.consecutive = s.consecutive.saturating_add(1);
        s.decided = Instant::now();
        match s.phase {
            Phase::Open { .. } => true,
            Phase::Probing => {
                self.open(&mut s, cfg, "a probe failed");
                true
            }
            Phase::Closed => {
                push(&mut s, cfg.window, true);
                #[allow(clippy::cast_precision_loss)]
                let rate = f64::from(s.failures) / s.outcomes.len() as f64;
                if s.failures >= cfg.min_failures && rate >= cfg.failure_rate {
                    warn!(
                        failures = s.failures,
                        outcomes = s.outcomes.len(),
                        rate,
                        pause = ?cfg.pause,
                        "kill switch: the handler fails too often; no messages are taken for the pause"
                    );
                    self.open(&mut s, cfg, "the failure rate passed the threshold");
                }
                s.consecutive >= cfg.suspect_after || s.phase != Phase::Closed
            }
        }
    }

    /// Lease mode's judgement of a handler's answer (module docs, *Lease mode withdraws
    /// nothing*): the answer is given back as it is, never withdrawn; but a final failure
    /// (`Permanent`, or a retryable one when `last_attempt`) while the switch is wary is first
    /// held here, its lease kept, until the switch is closed, `stopping` is set, `gone` says the
    /// message's partition went, or nothing else decided the switch for a whole pause (no other
    /// outcome while it is suspect or probing: no other work can close it, so holding on would
    /// only stop the partition). `held` is called when the hold starts and `freed` when it ends.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn judge_lease<T, E>(
        &self,
        r: Result<T, HandlerError<E>>,
        last_attempt: bool,
        stopping: &watch::Receiver<bool>,
        gone: impl Fn() -> bool,
        held: impl FnOnce(),
        freed: impl FnOnce(),
    ) -> Result<T, HandlerError<E>> {
        let Some(cfg) = self.cfg else {
            return r;
        };
        let final_failure = match &r {
            Ok(_) => {
                self.success();
                return r;
            }
            Err(HandlerError::Permanent(_)) => true,
            Err(HandlerError::Retryable(_) | HandlerError::Withdraw(_)) => last_attempt,
            Err(_) => false,
        };
        if !self.failed() || !final_failure {
            return r;
        }
        self.counters.kill_switch_held.add(1);
        warn!("kill switch: a final failure held, its lease kept, until the switch closes");
        held();
        self.until_decided(cfg.pause, stopping, gone).await;
        freed();
        r
    }

    /// Waits until the switch is neither open, probing nor suspect, `stopping` is set, `gone`
    /// answers true, or the switch is not open and nothing decided it for `pause`.
    async fn until_decided(
        &self,
        pause: Duration,
        stopping: &watch::Receiver<bool>,
        gone: impl Fn() -> bool,
    ) {
        let mut stopping = stopping.clone();
        let mut phase = self.phase.subscribe();
        loop {
            if !self.wary() || *stopping.borrow() || gone() {
                return;
            }
            let quiet = self.state().decided.elapsed();
            if !self.is_open() && quiet >= pause {
                warn!(
                    ?quiet,
                    "kill switch: nothing else decided it for a whole pause; the held failure \
                     is recorded as it is"
                );
                return;
            }
            // A success that ends a suspicion changes no phase: looked at again now and then.
            tokio::select! {
                _ = phase.changed() => {}
                _ = stopping.changed() => {}
                () = tokio::time::sleep(HELD_LOOK) => {}
            }
        }
    }

    fn open(&self, s: &mut State, cfg: KillSwitch, why: &'static str) {
        let until = Instant::now() + cfg.pause;
        s.phase = Phase::Open { until };
        self.counters.kill_switch_trips.add(1);
        self.counters.kill_switch_open.set(1);
        self.phase.send_replace(s.phase);
        self.opened.notify_one();
        warn!(why, pause = ?cfg.pause, "kill switch open");
    }

    /// Records a handler's answer; a failure while the switch is wary becomes a withdrawal (the
    /// key given back, no attempt spent), whatever kind it was. Transaction mode's (its effect
    /// rolls back with the transaction); lease mode's is [`Breaker::judge_lease`].
    pub(crate) fn judge<T, E>(&self, r: Result<T, HandlerError<E>>) -> Result<T, HandlerError<E>> {
        if self.cfg.is_none() {
            return r;
        }
        match r {
            Ok(v) => {
                self.success();
                Ok(v)
            }
            Err(e) => {
                if !self.failure() {
                    return Err(e);
                }
                match e {
                    HandlerError::Retryable(e)
                    | HandlerError::Permanent(e)
                    | HandlerError::Withdraw(e) => Err(HandlerError::Withdraw(e)),
                    // The handler's own store call: a passing one is given back unspent
                    // already; one that can never succeed is recorded as it says.
                    other => Err(other),
                }
            }
        }
    }
}

fn push(s: &mut State, window: u32, failure: bool) {
    s.outcomes.push_back(failure);
    if failure {
        s.failures += 1;
    }
    while s.outcomes.len() > window as usize {
        if s.outcomes.pop_front() == Some(true) {
            s.failures -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(cfg: KillSwitch) -> Breaker {
        Breaker::new(Some(cfg), Arc::new(Counters::default()))
    }

    #[test]
    fn it_suspects_then_opens_then_probes_then_closes() {
        let pause = Duration::from_millis(40);
        let b = breaker(KillSwitch::new(0.5, pause).with_thresholds(10, 4, 2));
        for _ in 0..6 {
            b.success();
        }
        assert!(!b.failure(), "one failure among successes is recorded");
        assert!(b.failure(), "the second in a row is withdrawn");
        assert!(!b.is_open());
        b.failure();
        b.failure();
        // 4 failures in the last 10 outcomes: 0.4, below the rate.
        assert!(!b.is_open());
        b.failure();
        // 5 of 10.
        assert!(b.is_open());
        assert!(b.wary());
        std::thread::sleep(pause + Duration::from_millis(20));
        assert_eq!(b.phase(), Phase::Probing);
        assert!(b.failure(), "a failed probe is withdrawn");
        assert!(b.is_open(), "and opens it again");
        std::thread::sleep(pause + Duration::from_millis(20));
        b.success();
        assert_eq!(b.phase(), Phase::Closed);
        assert!(!b.wary());
        assert!(!b.failure(), "closed afresh: a failure is recorded again");
    }

    #[test]
    fn off_it_never_withdraws() {
        let b = Breaker::new(None, Arc::new(Counters::default()));
        for _ in 0..100 {
            assert!(!b.failure());
        }
        assert!(!b.wary() && !b.is_open());
        let r: Result<(), HandlerError<&str>> = Err(HandlerError::Permanent("x"));
        assert!(matches!(b.judge(r), Err(HandlerError::Permanent("x"))));
    }

    #[test]
    fn a_wary_switch_withdraws_permanent_and_retryable_failures() {
        let b = breaker(KillSwitch::default().with_thresholds(50, 10, 1));
        let r: Result<(), HandlerError<&str>> = Err(HandlerError::Permanent("x"));
        assert!(matches!(b.judge(r), Err(HandlerError::Withdraw("x"))));
        let r: Result<(), HandlerError<&str>> = Err(HandlerError::Retryable("y"));
        assert!(matches!(b.judge(r), Err(HandlerError::Withdraw("y"))));
        assert!(b.judge::<(), &str>(Ok(())).is_ok());
        assert!(!b.wary());
    }

    #[test]
    fn bad_settings_are_named() {
        for ks in [
            KillSwitch::new(0.0, Duration::from_secs(1)),
            KillSwitch::new(1.5, Duration::from_secs(1)),
            KillSwitch::new(0.5, Duration::ZERO),
            KillSwitch::default().with_thresholds(5, 6, 1),
            KillSwitch::default().with_thresholds(5, 1, 0),
        ] {
            let e = ks.validate().expect_err("refused");
            assert_eq!(e.setting, "kill_switch", "{ks:?}");
        }
        assert!(KillSwitch::default().validate().is_ok());
    }
}
