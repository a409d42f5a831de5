//! `dedup purge`: deletes the records past their retention, in bounded batches (and on the table
//! partitioned by the key's time, first makes the ranges of days due and drops the expired ones
//! whole: `dedup_pg::maintain_ranges`). Once by default
//! (a cron job's step); with `--every`, a long-running sidecar in which one instance at a time
//! purges (`dedup_pg::Retention`: the retention lock of the database): run it beside every
//! consumer, and when the one that purges dies another takes over at its next round.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use dedup_pg::{
    PgStore, RangePolicy, RangeReport, RetentionConfig, RetentionState, RetentionStats,
};

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};
use crate::signals::Signals;

#[derive(Args, Debug)]
pub(crate) struct PurgeArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// Rows deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Keep running, and purge every this many seconds (fractions allowed) while this instance
    /// holds the retention lock; stop on SIGINT or SIGTERM.
    #[arg(long, value_parser = seconds)]
    every: Option<Duration>,
    /// With --every: milliseconds to wait between two statements of a round.
    #[arg(long, default_value_t = 0, requires = "every")]
    pause_ms: u64,
    /// The table partitioned by the key's time (`dedup migrate --partition-by-key-time`): days
    /// per range of days (each range is dropped whole).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=366))]
    range_days: u32,
    /// The partitioned table: make the ranges this many days ahead of now (at most 31).
    #[arg(long, default_value_t = 3.0, value_parser = ahead)]
    ahead_days: f64,
    /// The partitioned table: drop a range this many days after its last day, its live and
    /// parked records moved out first (at least the longest retention, plus the longest a
    /// key's first delivery lags its time).
    #[arg(long, default_value_t = 8.0, value_parser = days)]
    keep_days: f64,
    /// The partitioned table: freeze a range once (`VACUUM (FREEZE)`), from this many days after
    /// its last day, if half its `autovacuum_freeze_max_age` has passed before its drop (the
    /// anti-wraparound vacuum would come anyway); one range a round.
    #[arg(long, default_value_t = 1.0, value_parser = days)]
    freeze_after_days: f64,
    /// The partitioned table: never freeze a range.
    #[arg(long, conflicts_with = "freeze_after_days")]
    no_freeze: bool,
}

/// A finite, non-negative number of days.
fn days(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(n) if n.is_finite() && (0.0..=36_525.0).contains(&n) => Ok(n),
        _ => Err(format!("{s:?}: give a number of days from 0 to 36525")),
    }
}

/// A number of days from 0 to 31.
fn ahead(s: &str) -> Result<f64, String> {
    match days(s) {
        Ok(n) if n <= 31.0 => Ok(n),
        _ => Err(format!("{s:?}: give a number of days from 0 to 31")),
    }
}

impl PurgeArgs {
    fn config(&self) -> RetentionConfig {
        let day = |n: f64| Duration::from_secs_f64(n * 86_400.0);
        RetentionConfig::default()
            .with_batch(self.batch)
            .with_pause(Duration::from_millis(self.pause_ms))
            .with_ranges(
                RangePolicy::default()
                    .with_days(self.range_days)
                    .with_ahead(day(self.ahead_days))
                    .with_keep(day(self.keep_days))
                    .with_freeze_after((!self.no_freeze).then(|| day(self.freeze_after_days))),
            )
    }
}

/// A positive, finite number of seconds.
fn seconds(s: &str) -> Result<Duration, String> {
    let n: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if n.is_finite() && n > 0.0 {
        Duration::try_from_secs_f64(n).map_err(|e| e.to_string())
    } else {
        Err(format!("{s:?}: give a positive number of seconds"))
    }
}

pub(crate) async fn run(args: PurgeArgs) -> Result<ExitCode, CliError> {
    match args.every {
        None => once(&args).await,
        Some(every) => watch(&args, every).await,
    }
}

async fn once(args: &PurgeArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let round = PgStore::new(pool)
        .retention_round(&args.config())
        .await
        .map_err(|e| CliError::Failed(format!("purge: {e}")))?;
    print_ranges(&round.ranges);
    println!("purged {} record(s) past retention", round.purged);
    Ok(ExitCode::SUCCESS)
}

/// What the round did to the ranges of days of the partitioned table (nothing on one table).
fn print_ranges(r: &RangeReport) {
    if let Some(why) = &r.held_back {
        eprintln!("dedup purge: held back: {why}");
    }
    if !r.partitioned {
        return;
    }
    for name in &r.made {
        println!("made {name}");
    }
    for name in &r.dropped {
        println!("dropped {name}");
    }
    for name in &r.frozen {
        println!("froze {name}");
    }
    if r.moved > 0 {
        println!("moved {} record(s) under the table's lock", r.moved);
    }
    if let Some(margin) = r.margin_days {
        println!("ranges made {margin} day(s) ahead");
        if margin < 1 {
            eprintln!(
                "dedup purge: new keys land in dedup_records_future; run the retention \
                 (dedup purge --every) so that ranges are made ahead"
            );
        }
    }
}

/// Prints a line when this instance starts or stops leading, and after each round that purged.
async fn watch(args: &PurgeArgs, every: Duration) -> Result<ExitCode, CliError> {
    let mut signals = Signals::install()?;
    let pool = connect_pg(&args.pg.database_url, 1).await?;
    let config = args.config().with_every(every);
    let retention = PgStore::new(pool).spawn_retention(config);
    println!(
        "purging every {:.3} s while this instance holds the retention lock",
        every.as_secs_f64()
    );
    let mut seen = RetentionStats::default();
    let tick = every.min(Duration::from_millis(200));
    loop {
        tokio::select! {
            () = signals.recv() => break,
            () = tokio::time::sleep(tick) => {}
        }
        let now = retention.stats();
        if now.state != seen.state {
            match now.state {
                RetentionState::Leading => println!("leading: this instance purges"),
                RetentionState::StandingBy => {
                    println!("standing by: another instance holds the retention lock");
                }
                RetentionState::Failed => eprintln!(
                    "dedup purge: a round failed (trying again next round): {}",
                    now.last_error.as_deref().unwrap_or("?")
                ),
                _ => {}
            }
        }
        if now.ranges_made > seen.ranges_made
            || now.ranges_dropped > seen.ranges_dropped
            || now.ranges_frozen > seen.ranges_frozen
        {
            println!(
                "ranges of days: {} made, {} dropped, {} frozen, {} record(s) moved (in all)",
                now.ranges_made, now.ranges_dropped, now.ranges_frozen, now.moved
            );
        }
        if now.held_back.is_some() && now.held_back != seen.held_back {
            eprintln!(
                "dedup purge: held back: {}",
                now.held_back.as_deref().unwrap_or("?")
            );
        }
        if now.purged > seen.purged {
            println!(
                "purged {} record(s) past retention ({} in all)",
                now.purged - seen.purged,
                now.purged
            );
        }
        seen = now;
    }
    let last = retention.stop().await;
    println!(
        "stopped: {} round(s) led, {} record(s) purged",
        last.rounds, last.purged
    );
    Ok(ExitCode::SUCCESS)
}
