//! What an engine runs, and whether it is well: [`Engine::stats`] (every counter) and
//! [`Engine::health`] (an answer a readiness probe can serve).

use std::fmt;
#[cfg(feature = "kafka")]
use std::sync::Arc;
#[cfg(feature = "kafka")]
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::Duration;

use dedup_core::TierStats;
use serde::Serialize;

use dedup_core::BatchCounts;

use crate::engine::Engine;

/// A consumer as the engine keeps it: its group, its counters, whether its `run` is going.
#[cfg(feature = "kafka")]
#[derive(Clone, Debug)]
pub(crate) struct Registered {
    pub(crate) group: String,
    pub(crate) stats: dedup_kafka::StatsHandle,
    pub(crate) running: Arc<AtomicBool>,
}

/// Every counter of an engine ([`Engine::stats`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineStats {
    /// Each consumer built from the engine, by group, in the order they were built.
    #[cfg(feature = "kafka")]
    pub consumers: Vec<(String, dedup_kafka::RunnerStats)>,
    /// The caches (L1 and the fast path).
    pub tiers: TierStats,
    /// Group commit.
    pub group_commit: BatchCounts,
    /// Retention in the background, if the engine runs it.
    pub retention: Option<dedup_pg::RetentionStats>,
    /// The outbox relay's counters and what waits (`None` without
    /// [`outbox`](crate::EngineBuilder::outbox)).
    #[cfg(feature = "kafka")]
    pub outbox: Option<dedup_kafka::outbox::RelayStats>,
}

/// One consumer's health ([`Health::consumers`]).
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ConsumerHealth {
    /// The consumer group.
    pub group: String,
    /// Whether its `run` is going.
    pub running: bool,
    /// Partitions it owns now (0 is normal where a group has more members than partitions).
    pub partitions: u64,
    /// How long ago its loop last served its commit tick (once per commit interval while the
    /// loop runs); `None` before the first.
    pub last_turn_ago_ms: Option<u64>,
    /// Its kill switch is open: the handler failed nearly everything, no message is taken.
    pub kill_switch_open: bool,
    /// Dead letters whose write keeps failing: their partitions' offsets wait.
    pub dead_letters_failing: u64,
    /// Why it is not ready, if it is not (empty when it is).
    pub problems: Vec<String>,
}

/// Whether an engine is ready to serve ([`Engine::health`]): every consumer running, its loop
/// turning, its kill switch closed, its dead letters going out, and the engine not stopping.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// All of the below holds.
    pub ready: bool,
    /// The engine is shutting down.
    pub stopping: bool,
    /// Each consumer.
    pub consumers: Vec<ConsumerHealth>,
    /// What is wrong with the outbox, as this engine's relay last read it (empty without
    /// [`outbox`](crate::EngineBuilder::outbox)): no relay leads while messages wait, or the
    /// oldest has waited past the stall bound.
    pub outbox_problems: Vec<String>,
}

impl Health {
    /// The HTTP status a readiness probe answers: 200 when ready, 503 otherwise.
    pub fn status(&self) -> u16 {
        if self.ready { 200 } else { 503 }
    }

    /// The answer as JSON, for the probe's body.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!(r#"{{"error":"{e}"}}"#))
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", if self.ready { "ready" } else { "not ready" })?;
        if self.stopping {
            write!(f, " (stopping)")?;
        }
        for c in &self.consumers {
            write!(f, "; {}: {} partitions", c.group, c.partitions)?;
            for p in &c.problems {
                write!(f, ", {p}")?;
            }
        }
        for p in &self.outbox_problems {
            write!(f, "; {p}")?;
        }
        Ok(())
    }
}

impl Engine {
    /// Every counter: each consumer's, the caches', group commit's.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            #[cfg(feature = "kafka")]
            consumers: self
                .registered()
                .into_iter()
                .map(|r| (r.group, r.stats.snapshot()))
                .collect(),
            tiers: self.tier_stats(),
            group_commit: self.group_commit_stats(),
            retention: self.retention_stats(),
            #[cfg(feature = "kafka")]
            outbox: self.outbox_stats(),
        }
    }

    /// Whether the engine is ready; a consumer whose loop has not served its commit tick for
    /// `stall` counts as stalled (a few commit intervals: 30 s suits the default of 1 s).
    pub fn health(&self, stall: Duration) -> Health {
        let stopping = self.shutdown_handle().is_triggered();
        #[cfg(feature = "kafka")]
        let consumers: Vec<ConsumerHealth> = self
            .registered()
            .into_iter()
            .map(|r| consumer_health(&r, stall))
            .collect();
        #[cfg(not(feature = "kafka"))]
        let consumers: Vec<ConsumerHealth> = {
            let _ = stall;
            Vec::new()
        };
        #[cfg(feature = "kafka")]
        let outbox_problems = self
            .outbox_stats()
            .map(|o| outbox_problems(&o, stall))
            .unwrap_or_default();
        #[cfg(not(feature = "kafka"))]
        let outbox_problems = Vec::new();
        Health {
            ready: !stopping
                && consumers.iter().all(|c| c.problems.is_empty())
                && outbox_problems.is_empty(),
            outbox_problems,
            stopping,
            consumers,
        }
    }
}

/// What is wrong with the outbox, from a relay's counters.
#[cfg(feature = "kafka")]
fn outbox_problems(o: &dedup_kafka::outbox::RelayStats, stall: Duration) -> Vec<String> {
    let mut out = Vec::new();
    if o.unpublished > 0 && !o.someone_leads {
        out.push(format!(
            "outbox: {} messages wait and no relay leads",
            o.unpublished
        ));
    }
    if u64::try_from(o.oldest_ms).unwrap_or(0)
        > u64::try_from(stall.as_millis()).unwrap_or(u64::MAX)
    {
        out.push(format!(
            "outbox: the oldest of {} unpublished messages has waited {} ms",
            o.unpublished, o.oldest_ms
        ));
    }
    out
}

#[cfg(feature = "kafka")]
fn consumer_health(r: &Registered, stall: Duration) -> ConsumerHealth {
    let s = r.stats.snapshot();
    let running = r.running.load(AtomicOrdering::Acquire);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let last_turn_ago_ms = (s.last_turn_ms > 0).then(|| now.saturating_sub(s.last_turn_ms));
    let mut problems = Vec::new();
    if !running {
        problems.push("not running".to_owned());
    } else if last_turn_ago_ms
        .is_some_and(|ago| ago > u64::try_from(stall.as_millis()).unwrap_or(u64::MAX))
    {
        problems.push("its loop has stalled".to_owned());
    }
    if s.kill_switch_open > 0 {
        problems.push("kill switch open".to_owned());
    }
    if s.dead_letters_failing > 0 {
        problems.push(format!("{} dead letters failing", s.dead_letters_failing));
    }
    ConsumerHealth {
        group: r.group.clone(),
        running,
        partitions: s.partitions,
        last_turn_ago_ms,
        kill_switch_open: s.kill_switch_open > 0,
        dead_letters_failing: s.dead_letters_failing,
        problems,
    }
}
