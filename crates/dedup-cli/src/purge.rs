//! `dedup purge`: deletes the records past their retention, in bounded batches. Once by default
//! (a cron job's step); with `--every`, a long-running sidecar in which one instance at a time
//! purges (`dedup_pg::Retention`: the retention lock of the database): run it beside every
//! consumer, and when the one that purges dies another takes over at its next round.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use dedup_core::Store;
use dedup_pg::{PgStore, RetentionConfig, RetentionState, RetentionStats};

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
    let store = PgStore::new(pool);
    let mut total = 0;
    loop {
        let n = store
            .purge(args.batch)
            .await
            .map_err(|e| CliError::Failed(format!("purge: {e}")))?;
        total += n;
        if n < u64::from(args.batch) {
            break;
        }
    }
    println!("purged {total} record(s) past retention");
    Ok(ExitCode::SUCCESS)
}

/// Prints a line when this instance starts or stops leading, and after each round that purged.
async fn watch(args: &PurgeArgs, every: Duration) -> Result<ExitCode, CliError> {
    let mut signals = Signals::install()?;
    let pool = connect_pg(&args.pg.database_url, 1).await?;
    let config = RetentionConfig::default()
        .with_every(every)
        .with_batch(args.batch)
        .with_pause(Duration::from_millis(args.pause_ms));
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
