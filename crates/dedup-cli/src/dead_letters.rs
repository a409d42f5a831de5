//! `dedup dead-letters`: the dead letters a dead-letter topic refused for good (too large,
//! invalid), kept whole in Postgres (`dedup_dead_letters`) so that their partition could move
//! on. Lists them, writes one out whole, removes one an operator has dealt with, or purges those
//! kept longer than a given time.
//!
//! A letter is named `TOPIC:PARTITION:OFFSET`, and where more than one is kept at those
//! coordinates (a topic made again, whose offsets started at 0 again) `TOPIC:PARTITION:OFFSET@ID`,
//! its id being the start of its content's digest as the listing shows it (`-` for a letter kept
//! by a binary of generation 11 or older, which has none).

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use dedup_kafka::{KeptDeadLetters, RefusedDeadLetter};
use dedup_pg::PgStore;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};
use crate::parked::shown;

/// Hex digits of the digest the listing shows as a letter's id.
const ID_DIGITS: usize = 12;

#[derive(Args, Debug)]
pub(crate) struct DeadLettersArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The consumer group whose kept dead letters to list.
    #[arg(long)]
    group: String,
    /// Write the payload of the dead letter at TOPIC:PARTITION:OFFSET to standard output,
    /// byte for byte (`@ID` after it, as listed, where several are kept there).
    #[arg(
        long,
        value_name = "TOPIC:PARTITION:OFFSET[@ID]",
        conflicts_with = "remove"
    )]
    payload: Option<String>,
    /// Remove the dead letter at TOPIC:PARTITION:OFFSET (once it was re-driven or dealt with;
    /// `@ID` after it, as listed, where several are kept there).
    #[arg(long, value_name = "TOPIC:PARTITION:OFFSET[@ID]")]
    remove: Option<String>,
    /// Remove the group's dead letters kept longer ago than this: a number and a unit, `s`,
    /// `m`, `h` or `d` (`30d`, `12h`). Nothing else removes them.
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = duration,
        conflicts_with_all = ["payload", "remove"]
    )]
    purge_older_than: Option<Duration>,
}

/// A duration as a number and a unit: `90s`, `15m`, `12h`, `30d` (fractions allowed).
fn duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: give a number and a unit, s, m, h or d (e.g. 30d)");
    let unit = s.chars().last().ok_or_else(bad)?;
    let seconds = match unit {
        's' => 1.0,
        'm' => 60.0,
        'h' => 3_600.0,
        'd' => 86_400.0,
        _ => return Err(bad()),
    };
    let n: f64 = s[..s.len() - 1].parse().map_err(|_| bad())?;
    if !n.is_finite() || n < 0.0 {
        return Err(bad());
    }
    Duration::try_from_secs_f64(n * seconds).map_err(|e| format!("{s:?}: {e}"))
}

/// Where a letter is, and which of those kept there: `TOPIC:PARTITION:OFFSET[@ID]` (the topic
/// may hold colons; a Kafka topic name never holds `@`).
#[derive(Debug, PartialEq)]
struct At {
    topic: String,
    partition: i32,
    offset: i64,
    /// The id given (a start of the digest's hex, or `-`), if any.
    id: Option<String>,
}

fn at(s: &str) -> Result<At, CliError> {
    let bad = || CliError::Config(format!("expected TOPIC:PARTITION:OFFSET[@ID], got {s:?}"));
    let (place, id) = match s.rsplit_once('@') {
        Some((place, id)) if !id.is_empty() => (place, Some(id.to_ascii_lowercase())),
        Some(_) => return Err(bad()),
        None => (s, None),
    };
    let (rest, offset) = place.rsplit_once(':').ok_or_else(bad)?;
    let (topic, partition) = rest.rsplit_once(':').ok_or_else(bad)?;
    Ok(At {
        topic: topic.to_owned(),
        partition: partition.parse().map_err(|_| bad())?,
        offset: offset.parse().map_err(|_| bad())?,
        id,
    })
}

/// A letter's digest as hex (empty for a letter kept without one).
fn hex(digest: &[u8]) -> String {
    crate::hex::shown(digest)["hex:".len()..].to_owned()
}

/// The id the listing shows for a letter: the start of its digest's hex, or `-`.
fn id(d: &RefusedDeadLetter) -> String {
    if d.digest.is_empty() {
        return "-".to_owned();
    }
    let mut h = hex(&d.digest);
    h.truncate(ID_DIGITS);
    h
}

/// The one kept letter `at` names, or why there is none.
fn pick<'a>(
    kept: &'a [RefusedDeadLetter],
    at: &At,
    given: &str,
    group: &str,
) -> Result<&'a RefusedDeadLetter, CliError> {
    let there: Vec<&RefusedDeadLetter> = kept
        .iter()
        .filter(|d| d.topic == at.topic && d.partition == at.partition && d.offset == at.offset)
        .filter(|d| match &at.id {
            None => true,
            Some(id) if id == "-" => d.digest.is_empty(),
            Some(id) => !d.digest.is_empty() && hex(&d.digest).starts_with(id.as_str()),
        })
        .collect();
    match there[..] {
        [one] => Ok(one),
        [] => Err(CliError::Failed(format!(
            "no kept dead letter at {given} in group {group}"
        ))),
        _ => Err(CliError::Failed(format!(
            "{} kept dead letters at {given} in group {group}: name one, {}",
            there.len(),
            there
                .iter()
                .map(|d| format!("{}:{}:{}@{}", d.topic, d.partition, d.offset, id(d)))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

pub(crate) async fn run(args: DeadLettersArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let pg = PgStore::new(pool);
    let store = KeptDeadLetters::new(&pg);
    if let Some(age) = args.purge_older_than {
        let n = store
            .purge(&args.group, age)
            .await
            .map_err(|e| CliError::Failed(format!("purging kept dead letters: {e}")))?;
        println!(
            "purged {n} kept dead letter(s) of group {} kept more than {}s ago",
            args.group,
            age.as_secs()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let kept = store
        .list(&args.group)
        .await
        .map_err(|e| CliError::Failed(format!("reading kept dead letters: {e}")))?;
    if let Some(given) = &args.remove {
        let d = pick(&kept, &at(given)?, given, &args.group)?;
        let removed = store
            .remove(&args.group, &d.topic, d.partition, d.offset, &d.digest)
            .await
            .map_err(|e| CliError::Failed(format!("removing a kept dead letter: {e}")))?;
        if !removed {
            return Err(CliError::Failed(format!(
                "no kept dead letter at {given} in group {} (removed meanwhile)",
                args.group
            )));
        }
        println!(
            "removed the kept dead letter at {}:{}:{}@{}",
            d.topic,
            d.partition,
            d.offset,
            id(d)
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(given) = &args.payload {
        let d = pick(&kept, &at(given)?, given, &args.group)?;
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
        "{:<32} {:>9} {:>10}  {:<12}  {:<20} {:<24} {:>10}  {:<10} reason / refusal",
        "topic", "partition", "offset", "id", "key", "idempotency key", "bytes", "kept"
    );
    for d in &kept {
        let ago = d
            .stored_at
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or_else(String::new, |a| format!("{}s ago", a.as_secs()));
        let idem = d.idempotency_key.as_ref().map_or_else(
            || "(none)".to_owned(),
            |k| format!("{}/{}", k.scope().as_str(), shown(Some(k.key_bytes()))),
        );
        println!(
            "{:<32} {:>9} {:>10}  {:<12}  {:<20} {:<24} {:>10}  {:<10} {} / {}",
            d.topic,
            d.partition,
            d.offset,
            id(d),
            shown(d.message_key.as_deref()),
            idem,
            d.payload.as_ref().map_or(0, Vec::len),
            ago,
            d.reason.escape_debug(),
            d.refusal.escape_debug()
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_letter_is_named_by_its_coordinates_and_an_optional_id() {
        let got = at("orders:v2:3:17@AB12").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            got,
            At {
                topic: "orders:v2".into(),
                partition: 3,
                offset: 17,
                id: Some("ab12".into()),
            }
        );
        assert_eq!(at("t:0:0").map(|a| a.id).ok(), Some(None));
        assert_eq!(at("t:0:0@-").map(|a| a.id).ok(), Some(Some("-".into())));
        for bad in ["t:0", "t:x:0", "t:0:0@", "t"] {
            assert!(at(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(duration("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(duration("1.5h"), Ok(Duration::from_secs(5_400)));
        assert_eq!(duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("0m"), Ok(Duration::ZERO));
        for bad in ["30", "d", "-1d", "NaNd", "3w", ""] {
            assert!(duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_letter_is_picked_by_the_start_of_its_digest_or_dash() {
        let letter = |digest: &[u8]| {
            let mut d = RefusedDeadLetter::new("g", "t", 0, 0);
            d.digest = digest.to_vec();
            d
        };
        let kept = vec![letter(&[]), letter(&[0xab; 32]), letter(&[0xac; 32])];
        let pick_at = |s: &str| pick(&kept, &at(s).unwrap_or_else(|e| panic!("{e}")), s, "g");
        let err = pick_at("t:0:0")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("3 kept dead letters") && err.contains("t:0:0@-"),
            "{err}"
        );
        assert!(pick_at("t:0:0@-").is_ok_and(|d| d.digest.is_empty()));
        assert!(pick_at("t:0:0@ab").is_ok_and(|d| d.digest[0] == 0xab));
        assert!(pick_at("t:0:0@a").is_err(), "two start with a");
        assert!(pick_at("t:0:0@ff").is_err());
        assert!(pick_at("t:0:1").is_err());
    }
}
