//! What the machine's processors did while a contender ran, from Linux's `/proc/stat` (the whole
//! machine) and `/proc/self/stat` (the bench process), in ticks of 1/100 s: how much CPU time
//! an event cost the bench process and everything else (Postgres, Redis), and how much of the
//! machine's time was idle, waiting on I/O, or stolen by the hypervisor. A slow run whose events
//! cost more CPU time ran on slower processors; one whose events cost the same ran slower for
//! waiting. `None` off Linux.

/// The counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ticks {
    busy: u64,
    idle: u64,
    iowait: u64,
    steal: u64,
    own: u64,
}

/// The ticks between two moments.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CpuUse {
    busy: u64,
    idle: u64,
    iowait: u64,
    steal: u64,
    own: u64,
}

/// The seconds one tick stands for (`USER_HZ`, 100 on every Linux this runs on).
const TICK_S: f64 = 0.01;

/// Reads the counters now.
pub(super) fn now() -> Option<Ticks> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| cpu.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal (guest time is within user).
    let own = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces), from field 3: utime is 14, stime 15.
    let rest: Vec<u64> = own
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    Some(Ticks {
        busy: at(0) + at(1) + at(2) + at(5) + at(6),
        idle: at(3),
        iowait: at(4),
        steal: at(7),
        own: rest.get(11).copied().unwrap_or(0) + rest.get(12).copied().unwrap_or(0),
    })
}

impl Ticks {
    /// What happened between `before` and `self`.
    pub(super) fn since(self, before: Ticks) -> CpuUse {
        CpuUse {
            busy: self.busy.saturating_sub(before.busy),
            idle: self.idle.saturating_sub(before.idle),
            iowait: self.iowait.saturating_sub(before.iowait),
            steal: self.steal.saturating_sub(before.steal),
            own: self.own.saturating_sub(before.own),
        }
    }
}

impl CpuUse {
    #[allow(clippy::cast_precision_loss)]
    fn share(&self, n: u64) -> f64 {
        let total = (self.busy + self.idle + self.iowait + self.steal).max(1);
        n as f64 / total as f64
    }

    /// Milliseconds of CPU time per 1,000 events: the bench process's, and everything else's.
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn ms_per_1k(&self, events: u64) -> (f64, f64) {
        let per = |ticks: u64| ticks as f64 * TICK_S * 1000.0 * 1000.0 / events.max(1) as f64;
        (per(self.own), per(self.busy.saturating_sub(self.own)))
    }

    /// The machine's busy, I/O-wait and stolen shares of its time.
    pub(super) fn shares(&self) -> (f64, f64, f64) {
        (
            self.share(self.busy),
            self.share(self.iowait),
            self.share(self.steal),
        )
    }

    pub(super) fn json(&self, events: u64) -> serde_json::Value {
        let (own, others) = self.ms_per_1k(events);
        let (busy, iowait, steal) = self.shares();
        serde_json::json!({
            "bench_process_ms_per_1k_events": own,
            "others_ms_per_1k_events": others,
            "machine_busy": busy,
            "machine_iowait": iowait,
            "machine_steal": steal,
        })
    }
}
