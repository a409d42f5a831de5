//! The demo's report: what the run did, and the ledger check's verdict.

use std::process::ExitCode;

use dedup_core::InstanceId;
use dedup_kafka::RunnerStats;

use super::{DemoArgs, consume};
use crate::connect::CliError;

/// What the run did: the figures the report prints and the ledger check judges.
pub(super) struct Report<'a> {
    pub(super) args: &'a DemoArgs,
    pub(super) instance: Option<&'a InstanceId>,
    pub(super) topic: &'a str,
    pub(super) in_flight: usize,
    pub(super) unique: u64,
    pub(super) poison_keys: u64,
    pub(super) produce_secs: f64,
    pub(super) consume_secs: f64,
    pub(super) rows: i64,
    pub(super) keys: i64,
    /// What the report says about the engine.
    pub(super) engine: Vec<String>,
    pub(super) stats: RunnerStats,
}

impl Report<'_> {
    /// The ledger rows expected: one per unique key that is not poison.
    fn expected(&self) -> u64 {
        self.unique - self.poison_keys
    }

    /// The deliveries settled: executed, replayed or dead-lettered.
    fn settled(&self) -> u64 {
        let s = &self.stats;
        s.executed + s.replayed + s.dead_lettered
    }

    /// Prints the report's figures.
    pub(super) fn print(&self) {
        let (s, args) = (&self.stats, self.args);
        let (unique, poison_keys, rows, keys) =
            (self.unique, self.poison_keys, self.rows, self.keys);
        let expected = self.expected();
        let consume_secs = self.consume_secs;
        #[allow(clippy::cast_precision_loss)]
        let rate = self.settled() as f64 / consume_secs.max(1e-9);
        println!();
        println!(
            "events produced        {:>10}   ({:.1} s)",
            args.events, self.produce_secs
        );
        println!("unique keys            {unique:>10}   ({poison_keys} poison)");
        println!("ledger rows            {rows:>10}   (distinct keys {keys}; expected {expected})");
        if let Some(id) = self.instance {
            println!(
                "instance               {:>10}   (static group member; earlier runs' leases \
                 adopted at start)",
                id.as_str(),
            );
        }
        println!("handler executions     {:>10}", s.executed);
        println!("duplicates replayed    {:>10}", s.replayed);
        for line in &self.engine {
            println!("{line}");
        }
        let topic = self.topic;
        println!(
            "dead letters           {:>10}   (to {topic}.dlq)",
            s.dead_lettered
        );
        println!("retries                {:>10}", s.retries);
        println!(
            "throughput             {rate:>10.0}   deliveries/s over {consume_secs:.1} s ({})",
            match args.mode {
                consume::Mode::Tx => "transaction mode, batches of up to 500".to_owned(),
                consume::Mode::PerMessage => format!("one at a time, {} in flight", self.in_flight),
            }
        );
        println!(
            "decision latency       p50 {:.2} ms   p99 {:.2} ms",
            micros_to_ms(s.latency_p50_us),
            micros_to_ms(s.latency_p99_us)
        );
        println!(
            "offset commits         {:>10}   (failed {})",
            s.commits, s.commit_errors
        );
    }

    /// The exit: 130 when interrupted, success when the ledger checks out, an error otherwise.
    pub(super) fn verdict(&self, interrupted: bool) -> Result<ExitCode, CliError> {
        let (settled, events) = (self.settled(), self.args.events);
        let (rows, keys, expected) = (self.rows, self.keys, self.expected());
        if interrupted {
            println!(
                "interrupted: {settled} of {events} settled; in-flight work drained and offsets committed"
            );
            return Ok(ExitCode::from(130));
        }
        let ok = settled == events && rows == keys && u64::try_from(rows).ok() == Some(expected);
        if ok {
            println!("ledger check           OK: one row per key, no key doubled, none lost");
            Ok(ExitCode::SUCCESS)
        } else {
            Err(CliError::Failed(format!(
                "ledger check FAILED: {settled} of {events} settled, {rows} rows for {keys} keys, {expected} expected"
            )))
        }
    }
}

#[allow(clippy::cast_precision_loss)]
fn micros_to_ms(us: u64) -> f64 {
    us as f64 / 1000.0
}
