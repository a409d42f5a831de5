//! `dedup parked`, `dedup unpark` and `dedup drop`: operating a group's parked keys (per-key
//! ordered retries, docs/PARKING.md). The consumer that owns a key's partition does the work:
//! these commands only change what it will find.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use dedup_pg::PgStore;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};

#[derive(Args, Debug)]
pub(crate) struct ParkedArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group whose parked keys to list.
    #[arg(long)]
    group: String,
}

#[derive(Args, Debug)]
pub(crate) struct KeyArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group.
    #[arg(long)]
    group: String,
    /// The ordering key (the Kafka message key, as UTF-8 text).
    #[arg(required_unless_present = "keyless", conflicts_with = "keyless")]
    key: Option<String>,
    /// The queue of the messages that had no ordering key.
    #[arg(long)]
    keyless: bool,
}

impl KeyArgs {
    fn key(&self) -> Option<&[u8]> {
        self.key.as_deref().map(str::as_bytes)
    }
}

/// A key as text: escaped where it is not printable, `(no key)` for the keyless queue.
fn shown(key: Option<&[u8]>) -> String {
    key.map_or_else(
        || "(no key)".to_owned(),
        |k| String::from_utf8_lossy(k).escape_debug().to_string(),
    )
}

/// `t` against now: "3m 12s ago" or "in 40s".
fn relative(t: SystemTime) -> String {
    let now = SystemTime::now();
    let (d, ago) = match now.duration_since(t) {
        Ok(d) => (d, true),
        Err(e) => (e.duration(), false),
    };
    let d = Duration::from_secs(d.as_secs());
    let text = if d.as_secs() >= 3600 {
        format!("{}h {}m", d.as_secs() / 3600, d.as_secs() % 3600 / 60)
    } else if d.as_secs() >= 60 {
        format!("{}m {}s", d.as_secs() / 60, d.as_secs() % 60)
    } else {
        format!("{}s", d.as_secs())
    };
    if ago {
        format!("{text} ago")
    } else {
        format!("in {text}")
    }
}

pub(crate) async fn list(args: ParkedArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let keys = PgStore::new(pool)
        .parked_summary(&args.group)
        .await
        .map_err(|e| CliError::Failed(format!("reading parked keys: {e}")))?;
    if keys.is_empty() {
        println!("no parked keys in group {}", args.group);
        return Ok(ExitCode::SUCCESS);
    }
    let messages: u64 = keys.iter().map(|k| k.messages).sum();
    println!(
        "{} parked key(s), {messages} message(s) in group {}",
        keys.len(),
        args.group
    );
    println!(
        "{:<24} {:>9}  {:<24} {:>8}  {:<14} {:>8}  {:<12} last error",
        "topic", "partition", "key", "messages", "oldest", "attempts", "next run"
    );
    for k in keys {
        let next = if k.dropped {
            "dropping".to_owned()
        } else if k.held {
            "held".to_owned()
        } else {
            relative(k.head_due)
        };
        println!(
            "{:<24} {:>9}  {:<24} {:>8}  {:<14} {:>8}  {:<12} {}",
            k.topic,
            k.partition,
            shown(k.ordering_key.as_deref()),
            k.messages,
            relative(k.oldest),
            k.head_attempts,
            next,
            k.head_error.escape_debug()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What an operator does to a parked key.
#[derive(Clone, Copy)]
enum Op {
    Unpark,
    Drop,
}

pub(crate) async fn unpark(args: KeyArgs) -> Result<ExitCode, CliError> {
    on_key(&args, Op::Unpark).await
}

pub(crate) async fn drop(args: KeyArgs) -> Result<ExitCode, CliError> {
    on_key(&args, Op::Drop).await
}

/// Runs `op` on one key. Nothing parked under the key is a failed run.
async fn on_key(args: &KeyArgs, op: Op) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let store = PgStore::new(pool);
    let n = match op {
        Op::Unpark => store.unpark(&args.group, args.key()).await,
        Op::Drop => store.drop_parked(&args.group, args.key()).await,
    }
    .map_err(|e| CliError::Failed(format!("changing parked messages: {e}")))?;
    if n == 0 {
        return Err(CliError::Failed(format!(
            "nothing is parked under {} in group {}",
            shown(args.key()),
            args.group
        )));
    }
    let done = match op {
        Op::Unpark => format!(
            "its head is due now ({n} message(s) parked, hold lifted); the partition's owner runs it"
        ),
        Op::Drop => {
            format!("{n} message(s) marked; the partition's owner dead-letters them, in order")
        }
    };
    println!("{}: {done}", shown(args.key()));
    Ok(ExitCode::SUCCESS)
}
