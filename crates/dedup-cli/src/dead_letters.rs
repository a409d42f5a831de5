//! `dedup dead-letters`: the dead letters a dead-letter topic refused for good (too large,
//! invalid), kept whole in Postgres (`dedup_dead_letters`) so that their partition could move
//! on. Lists them, writes one out whole, or removes one an operator has dealt with.

use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use dedup_pg::PgStore;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};
use crate::parked::shown;

#[derive(Args, Debug)]
pub(crate) struct DeadLettersArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group whose kept dead letters to list.
    #[arg(long)]
    group: String,
    /// Write the payload of the dead letter at TOPIC:PARTITION:OFFSET to standard output,
    /// byte for byte.
    #[arg(long, value_name = "TOPIC:PARTITION:OFFSET", conflicts_with = "remove")]
    payload: Option<String>,
    /// Remove the dead letter at TOPIC:PARTITION:OFFSET (once it was re-driven or dealt with).
    #[arg(long, value_name = "TOPIC:PARTITION:OFFSET")]
    remove: Option<String>,
}

/// `TOPIC:PARTITION:OFFSET` (the topic may hold colons).
fn coordinates(s: &str) -> Result<(String, i32, i64), CliError> {
    let bad = || CliError::Config(format!("expected TOPIC:PARTITION:OFFSET, got {s:?}"));
    let (rest, offset) = s.rsplit_once(':').ok_or_else(bad)?;
    let (topic, partition) = rest.rsplit_once(':').ok_or_else(bad)?;
    Ok((
        topic.to_owned(),
        partition.parse().map_err(|_| bad())?,
        offset.parse().map_err(|_| bad())?,
    ))
}

pub(crate) async fn run(args: DeadLettersArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let store = PgStore::new(pool);
    if let Some(at) = &args.remove {
        let (topic, partition, offset) = coordinates(at)?;
        let removed = store
            .remove_refused_dead_letter(&args.group, &topic, partition, offset)
            .await
            .map_err(|e| CliError::Failed(format!("removing a kept dead letter: {e}")))?;
        if !removed {
            return Err(CliError::Failed(format!(
                "no kept dead letter at {at} in group {}",
                args.group
            )));
        }
        println!("removed the kept dead letter at {at}");
        return Ok(ExitCode::SUCCESS);
    }
    let kept = store
        .refused_dead_letters(&args.group)
        .await
        .map_err(|e| CliError::Failed(format!("reading kept dead letters: {e}")))?;
    if let Some(at) = &args.payload {
        let (topic, partition, offset) = coordinates(at)?;
        let d = kept
            .iter()
            .find(|d| d.topic == topic && d.partition == partition && d.offset == offset)
            .ok_or_else(|| {
                CliError::Failed(format!(
                    "no kept dead letter at {at} in group {}",
                    args.group
                ))
            })?;
        use std::io::Write;
        std::io::stdout()
            .write_all(d.payload.as_deref().unwrap_or_default())
            .map_err(|e| CliError::Failed(format!("writing the payload: {e}")))?;
        return Ok(ExitCode::SUCCESS);
    }
    if kept.is_empty() {
        println!("no kept dead letters in group {}", args.group);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} dead letter(s) of group {} refused by their dead-letter topic, kept in Postgres",
        kept.len(),
        args.group
    );
    println!(
        "{:<32} {:>9} {:>10}  {:<20} {:>10}  {:<10} reason / refusal",
        "topic", "partition", "offset", "key", "bytes", "kept"
    );
    for d in kept {
        let ago = d
            .stored_at
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or_else(String::new, |a| format!("{}s ago", a.as_secs()));
        println!(
            "{:<32} {:>9} {:>10}  {:<20} {:>10}  {:<10} {} / {}",
            d.topic,
            d.partition,
            d.offset,
            shown(d.message_key.as_deref()),
            d.payload.as_ref().map_or(0, Vec::len),
            ago,
            d.reason.escape_debug(),
            d.refusal.escape_debug()
        );
    }
    Ok(ExitCode::SUCCESS)
}
