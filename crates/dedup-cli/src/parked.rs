//! `dedup parked`, `dedup unpark` and `dedup drop`: operating a group's parked keys (per-key
//! ordered retries, docs/PARKING.md). The consumer that owns a key's partition does the work:
//! these commands only change what it will find.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use dedup_kafka::{ParkedFilter, ParkedQueue};
use dedup_pg::PgStore;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};

/// Which partitions a command looks at (every one of the group by default).
#[derive(Args, Debug)]
pub(crate) struct WhereArgs {
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only this partition.
    #[arg(long)]
    partition: Option<i32>,
}

impl WhereArgs {
    fn filter(&self) -> ParkedFilter {
        let mut f = ParkedFilter::all();
        if let Some(t) = &self.topic {
            f = f.topic(t.clone());
        }
        if let Some(p) = self.partition {
            f = f.partition(p);
        }
        f
    }

    /// " in topic T partition P", or nothing.
    fn said(&self) -> String {
        let mut out = String::new();
        if let Some(t) = &self.topic {
            out.push_str(&format!(" in topic {t}"));
        }
        if let Some(p) = self.partition {
            out.push_str(&format!(" partition {p}"));
        }
        out
    }
}

#[derive(Args, Debug)]
pub(crate) struct ParkedArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group whose parked keys to list.
    #[arg(long)]
    group: String,
    #[command(flatten)]
    at: WhereArgs,
}

#[derive(Args, Debug)]
pub(crate) struct KeyArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group.
    #[arg(long)]
    group: String,
    /// The ordering key (the Kafka message key) as UTF-8 text. A key that `dedup parked` shows
    /// as `hex:...` is given with `--hex-key`.
    #[arg(required_unless_present_any = ["keyless", "hex_key"], conflicts_with_all = ["keyless", "hex_key"])]
    key: Option<String>,
    /// The ordering key as hex (as `dedup parked` shows a key that is not printable text; a
    /// leading `hex:` is accepted).
    #[arg(long, value_parser = crate::hex::parse, conflicts_with = "keyless")]
    hex_key: Option<Vec<u8>>,
    /// The queue of the messages that had no ordering key.
    #[arg(long)]
    keyless: bool,
    #[command(flatten)]
    at: WhereArgs,
}

impl KeyArgs {
    fn key(&self) -> Option<&[u8]> {
        self.hex_key
            .as_deref()
            .or_else(|| self.key.as_deref().map(str::as_bytes))
    }
}

/// A key as it can be given back without loss: printable UTF-8 as it is, anything else (a
/// control character, bytes that are not UTF-8, a key that could be read as hex) as
/// `hex:<digits>`; `(no key)` for the keyless queue.
pub(crate) fn shown(key: Option<&[u8]>) -> String {
    let Some(k) = key else {
        return "(no key)".to_owned();
    };
    match std::str::from_utf8(k) {
        Ok(t)
            if !t.is_empty()
                && !t.starts_with("hex:")
                && t != "(no key)"
                && t.chars()
                    .all(|c| !c.is_control() && (c == ' ' || !c.is_whitespace())) =>
        {
            t.to_owned()
        }
        _ => crate::hex::shown(k),
    }
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
    let store = PgStore::new(pool);
    let keys = ParkedQueue::new(&store)
        .parked_summary(&args.group, &args.at.filter())
        .await
        .map_err(|e| CliError::Failed(format!("reading parked keys: {e}")))?;
    if keys.is_empty() {
        println!("no parked keys in group {}{}", args.group, args.at.said());
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
    let filter = args.at.filter();
    let n = match op {
        Op::Unpark => {
            ParkedQueue::new(&store)
                .unpark(&args.group, args.key(), &filter)
                .await
        }
        Op::Drop => {
            ParkedQueue::new(&store)
                .drop_parked(&args.group, args.key(), &filter)
                .await
        }
    }
    .map_err(|e| CliError::Failed(format!("changing parked messages: {e}")))?;
    if n == 0 {
        return Err(CliError::Failed(format!(
            "nothing is parked under {} in group {}{}",
            shown(args.key()),
            args.group,
            args.at.said()
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

#[cfg(test)]
mod tests {
    use super::shown;
    use crate::hex;

    #[test]
    fn every_key_is_shown_so_that_it_can_be_given_back() {
        for key in [
            b"acct-17".to_vec(),
            vec![0, 159, 146, 150, 255],
            b"tab\there".to_vec(),
            b"hex:00".to_vec(),
            "cl\u{e9}".as_bytes().to_vec(),
        ] {
            let s = shown(Some(&key));
            let back = match s.strip_prefix("hex:") {
                Some(_) => hex::parse(&s),
                None => Ok(s.into_bytes()),
            };
            assert_eq!(back, Ok(key));
        }
        assert_eq!(shown(Some(&[0xff, 0x00])), "hex:ff00");
        assert_eq!(shown(None), "(no key)");
    }
}
