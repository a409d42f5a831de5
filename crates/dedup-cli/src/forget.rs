//! `dedup forget`: deletes chosen keys' records, so that their next message runs the handler as
//! for a new key. The re-drive path for dead letters (docs/RECOVERY.md, "Re-driving dead
//! letters"): fix the handler, forget the dead letters' keys, replay the dead letters to the
//! source topic.
//!
//! Keys are given by hand (`--scope S --key K`, `--hex-key HEX` for binary keys), or read from a
//! range of a dead-letter topic (`--dead-letters TOPIC --partition P --from A --to B`): each dead
//! letter names its key in its `dedup-scope` and `dedup-key` headers; or from the dead letters a
//! group kept in Postgres because their topic refused them (`--kept-dead-letters GROUP`), each
//! row naming its key (the rows stay: `dedup dead-letters` removes them). A key under a live lease
//! (a holder runs it) and a key a parked message carries are kept. With `REDIS_URL`, the fast
//! path's copies of the forgotten keys are dropped too.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{ArgGroup, Args};
use dedup_core::{IdempotencyKey, Scope, State};
use dedup_pg::{ForgetReport, PgStore};
use dedup_redis::redis::{self, Script};
use rdkafka::Message;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Headers;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::PgArgs;
use crate::connect::{CliError, connect_pg, connect_redis, redact};

/// The dead-letter header naming the idempotency key's scope (`dedup_kafka`'s `DLQ_SCOPE`).
const DLQ_SCOPE: &str = "dedup-scope";
/// The dead-letter header holding the idempotency key's bytes (`dedup_kafka`'s `DLQ_KEY`).
const DLQ_KEY: &str = "dedup-key";

/// Keys per statement.
const CHUNK: usize = 1000;

/// Drops one key's copy in Redis, whatever it holds (the key's Postgres record is gone, or was
/// never there: any copy is stale).
const DROP_LUA: &str = "return redis.call('DEL', KEYS[1])";

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("letters").args(["dead_letters", "kept_dead_letters"])))]
pub(crate) struct ForgetArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// The keys' scope (for the Kafka runners, the consumer group unless configured otherwise).
    #[arg(long, conflicts_with = "letters")]
    scope: Option<String>,
    /// An idempotency key, as UTF-8 text (repeatable).
    #[arg(long = "key", value_name = "KEY", requires = "scope")]
    keys: Vec<String>,
    /// An idempotency key as hex digits, for binary keys (repeatable).
    #[arg(long = "hex-key", value_name = "HEX", requires = "scope")]
    hex_keys: Vec<String>,
    /// A dead-letter topic: forget the keys its messages in `--partition`, `--from`..`--to`
    /// name in their `dedup-scope` and `dedup-key` headers.
    #[arg(long, value_name = "TOPIC", requires_all = ["partition", "from", "to"])]
    dead_letters: Option<String>,
    /// The dead-letter topic's partition.
    #[arg(long, requires = "dead_letters")]
    partition: Option<i32>,
    /// The first offset read (inclusive).
    #[arg(long, value_name = "OFFSET", requires = "dead_letters")]
    from: Option<i64>,
    /// The last offset read (inclusive); a range past the partition's end stops at its end.
    #[arg(long, value_name = "OFFSET", requires = "dead_letters")]
    to: Option<i64>,
    /// A consumer group: forget the keys its dead letters kept in Postgres name (those the
    /// dead-letter topic refused for good, `dedup dead-letters --group GROUP`). The kept letters
    /// stay, for the re-drive.
    #[arg(long, value_name = "GROUP")]
    kept_dead_letters: Option<String>,
    /// Kafka bootstrap servers (with `--dead-letters`).
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: Option<String>,
    /// Extra librdkafka properties, as key=value (repeatable): TLS, SASL.
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    kafka_properties: Vec<String>,
    /// Give up reading the dead letters when none arrives for this many seconds.
    #[arg(long, default_value_t = 30)]
    timeout_secs: u64,
    /// Redis (the fast path), whose copies of the forgotten keys are dropped:
    /// redis://[user:password@]host:port[/db]. Without it, a tiered store's Redis keeps
    /// answering a forgotten FAILED key until its copy expires.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// The key prefix in Redis (the consumers' `RedisFastPath::with_prefix`).
    #[arg(long, default_value = "dedup")]
    redis_prefix: String,
    /// With `--dead-letters` or `--kept-dead-letters`: forget a key whose record is COMPLETED
    /// too. By default such a key is kept: its effect ran (a dead letter whose stored result did
    /// not decode, or whose payload did not match the key's), so a re-drive would run it a
    /// second time.
    #[arg(long, requires = "letters")]
    include_completed: bool,
    /// Print what would be forgotten; change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// A dead letter read, and the key it names (or why it names none).
#[derive(Debug)]
struct Read {
    offset: i64,
    key: Result<IdempotencyKey, String>,
}

/// Dead letters that name no key: where each is, and why.
type Skipped = Vec<(String, String)>;

pub(crate) async fn run(args: ForgetArgs) -> Result<ExitCode, CliError> {
    let mut store = None;
    let (keys, skipped) = match (&args.scope, &args.dead_letters, &args.kept_dead_letters) {
        (Some(scope), None, None) => (given_keys(scope, &args.keys, &args.hex_keys)?, Vec::new()),
        (None, Some(topic), None) => dead_letter_keys(&args, topic).await?,
        (None, None, Some(group)) => {
            let s = PgStore::new(connect_pg(&args.pg.database_url, 2).await?);
            kept_keys(store.insert(s), group).await?
        }
        _ => {
            return Err(CliError::Config(
                "name the keys: --scope S --key K [--key K2 ...], \
                 --dead-letters TOPIC --partition P --from OFFSET --to OFFSET, or \
                 --kept-dead-letters GROUP"
                    .into(),
            ));
        }
    };
    let keys = distinct(keys);
    let store = match store {
        Some(s) => s,
        None => PgStore::new(connect_pg(&args.pg.database_url, 2).await?),
    };

    // A dead letter's key whose effect ran (COMPLETED) is not reset unless asked: keys given by
    // hand are the operator's explicit choice.
    let from_letters = args.dead_letters.is_some() || args.kept_dead_letters.is_some();
    let (completed, keys) = if from_letters && !args.include_completed {
        split_completed(&store, keys).await?
    } else {
        (Vec::new(), keys)
    };
    let report = forget_in_chunks(&store, &keys, args.dry_run).await?;

    // The fast path's copies: a forgotten key's, and an absent key's (a copy outliving its
    // record). Never a busy or parked key's.
    let mut dropped = None;
    if !args.dry_run
        && let Some(url) = &args.redis_url
    {
        dropped = Some(drop_copies(url, &args.redis_prefix, &report).await?);
    }

    print_keys(&report, &completed, &skipped, args.dry_run);
    print_totals(
        &report,
        completed.len(),
        skipped.len(),
        args.dry_run,
        dropped,
    );
    let kept = report.busy.len() + report.parked.len();
    if kept > 0 && !args.dry_run {
        // A script that re-drives after this must not replay keys that still answer as before.
        eprintln!("dedup forget: {kept} key(s) were kept (busy or parked): see above");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// The keys `group`'s kept dead letters name, and the letters naming none.
async fn kept_keys(
    store: &PgStore,
    group: &str,
) -> Result<(Vec<IdempotencyKey>, Skipped), CliError> {
    let kept = dedup_kafka::KeptDeadLetters::new(store)
        .list(group)
        .await
        .map_err(|e| CliError::Failed(format!("reading kept dead letters: {e}")))?;
    println!(
        "read {} dead letter(s) of group {group} kept in Postgres",
        kept.len()
    );
    let mut keys = Vec::with_capacity(kept.len());
    let mut skipped = Vec::new();
    for d in kept {
        match d.idempotency_key {
            Some(k) => keys.push(k),
            None => skipped.push((
                format!("{}:{}:{}", d.topic, d.partition, d.offset),
                "no idempotency key (a message without a usable one, or kept by a binary of \
                 generation 11 or older)"
                    .to_owned(),
            )),
        }
    }
    Ok((keys, skipped))
}

/// The keys a range of a dead-letter topic names, and the dead letters naming none.
async fn dead_letter_keys(
    args: &ForgetArgs,
    topic: &str,
) -> Result<(Vec<IdempotencyKey>, Skipped), CliError> {
    let (Some(partition), Some(from), Some(to)) = (args.partition, args.from, args.to) else {
        return Err(CliError::Config(
            "--dead-letters needs --partition, --from and --to".into(),
        ));
    };
    if from < 0 || to < from {
        return Err(CliError::Config(format!(
            "--from {from} --to {to}: offsets from 0, --to at least --from"
        )));
    }
    let Some(brokers) = args.brokers.clone() else {
        return Err(CliError::Config(
            "--dead-letters needs --brokers (or KAFKA_BROKERS)".into(),
        ));
    };
    let extra = properties(&args.kafka_properties)?;
    let reads = read_range(
        brokers,
        extra,
        topic.to_owned(),
        partition,
        (from, to),
        Duration::from_secs(args.timeout_secs.max(1)),
    )
    .await?;
    println!(
        "read {} dead letter(s) from {topic} partition {partition}, offsets {from} to {to}",
        reads.len()
    );
    let mut keys = Vec::with_capacity(reads.len());
    let mut skipped = Vec::new();
    for r in reads {
        match r.key {
            Ok(k) => keys.push(k),
            Err(why) => skipped.push((format!("offset {}", r.offset), why)),
        }
    }
    Ok((keys, skipped))
}

/// The keys without repeats, each in the place it first came.
fn distinct(keys: Vec<IdempotencyKey>) -> Vec<IdempotencyKey> {
    let mut seen = HashSet::with_capacity(keys.len());
    keys.into_iter()
        .filter(|k| seen.insert(k.clone()))
        .collect()
}

/// Splits the keys into those whose record is COMPLETED and the rest.
async fn split_completed(
    store: &PgStore,
    keys: Vec<IdempotencyKey>,
) -> Result<(Vec<IdempotencyKey>, Vec<IdempotencyKey>), CliError> {
    let mut done = HashSet::new();
    for chunk in keys.chunks(CHUNK) {
        let records = store
            .get_many(chunk)
            .await
            .map_err(|e| CliError::Failed(format!("reading the keys' records: {e}")))?;
        done.extend(
            records
                .into_iter()
                .filter(|(_, r)| r.state == State::Completed)
                .map(|(k, _)| k),
        );
    }
    Ok(keys.into_iter().partition(|k| done.contains(k)))
}

/// Forgets the keys, a chunk at a time (with `dry_run`, only says what would be forgotten).
async fn forget_in_chunks(
    store: &PgStore,
    keys: &[IdempotencyKey],
    dry_run: bool,
) -> Result<ForgetReport, CliError> {
    let mut report = ForgetReport::default();
    for chunk in keys.chunks(CHUNK) {
        let part = if dry_run {
            store.forget_keys_preview(chunk).await
        } else {
            store.forget_keys(chunk).await
        }
        .map_err(|e| CliError::Failed(format!("forgetting keys: {e}")))?;
        report.forgotten.extend(part.forgotten);
        report.busy.extend(part.busy);
        report.parked.extend(part.parked);
        report.absent.extend(part.absent);
    }
    Ok(report)
}

/// Drops the Redis copies of the forgotten and absent keys; returns how many were there.
async fn drop_copies(url: &str, prefix: &str, report: &ForgetReport) -> Result<u64, CliError> {
    let fast = connect_redis(url, prefix).await?;
    let mut conn = fast.connection().clone();
    let script = Script::new(DROP_LUA);
    let mut n = 0u64;
    for key in report.forgotten.iter().chain(&report.absent) {
        let gone: i64 = script
            .key(fast.redis_key(key))
            .invoke_async(&mut conn)
            .await
            .map_err(|e: redis::RedisError| {
                CliError::Failed(format!(
                    "dropping {key}'s copy in Redis at {}: {e} (its Postgres record is \
                     forgotten; run this again to drop the copies)",
                    redact(url)
                ))
            })?;
        n += u64::try_from(gone).unwrap_or(0);
    }
    Ok(n)
}

/// Prints each key with what became of it, then each dead letter skipped.
fn print_keys(
    report: &ForgetReport,
    completed: &[IdempotencyKey],
    skipped: &[(String, String)],
    dry_run: bool,
) {
    let verb = if dry_run { "would forget" } else { "forgotten" };
    for k in &report.forgotten {
        println!("{verb:<13} {k}");
    }
    for k in &report.busy {
        println!("{:<13} {k}", "busy");
    }
    for k in &report.parked {
        println!("{:<13} {k}", "parked");
    }
    for k in &report.absent {
        println!("{:<13} {k}", "absent");
    }
    for k in completed {
        println!("{:<13} {k}", "completed");
    }
    for (at, why) in skipped {
        println!("{:<13} {at}: {why}", "skipped");
    }
}

/// Prints the counts, and what became of the copies in Redis.
fn print_totals(
    report: &ForgetReport,
    completed: usize,
    skipped: usize,
    dry_run: bool,
    dropped: Option<u64>,
) {
    println!(
        "{}{} key(s) {}, {} busy (a holder runs it under a live lease: ask again once it \
         ended), {} parked (a parked message carries it: `dedup unpark` or `dedup drop` first), \
         {} absent (no record), {} completed (kept: its effect ran; --include-completed \
         resets it), {} dead letter(s) skipped (no usable key)",
        if dry_run { "dry run: " } else { "" },
        report.forgotten.len(),
        if dry_run { "to forget" } else { "forgotten" },
        report.busy.len(),
        report.parked.len(),
        report.absent.len(),
        completed,
        skipped
    );
    match (dry_run, dropped) {
        (true, _) => println!("dry run: nothing was changed"),
        (false, Some(n)) => println!("{n} copy(ies) dropped from Redis"),
        (false, None) => {
            println!("no REDIS_URL: copies in a tiered store's Redis, if any, were not dropped")
        }
    }
}

/// The keys given by hand, in one scope.
fn given_keys(
    scope: &str,
    text: &[String],
    hex: &[String],
) -> Result<Vec<IdempotencyKey>, CliError> {
    if text.is_empty() && hex.is_empty() {
        return Err(CliError::Config(
            "--scope needs at least one --key or --hex-key".into(),
        ));
    }
    let scope = Scope::new(scope).map_err(|e| CliError::Config(format!("--scope: {e}")))?;
    let mut out = Vec::with_capacity(text.len() + hex.len());
    for k in text {
        out.push(
            IdempotencyKey::new(scope.clone(), k.as_bytes())
                .map_err(|e| CliError::Config(format!("--key {k:?}: {e}")))?,
        );
    }
    for h in hex {
        let bytes =
            crate::hex::parse(h).map_err(|e| CliError::Config(format!("--hex-key {h:?}: {e}")))?;
        out.push(
            IdempotencyKey::new(scope.clone(), bytes)
                .map_err(|e| CliError::Config(format!("--hex-key {h:?}: {e}")))?,
        );
    }
    Ok(out)
}

pub(crate) fn properties(props: &[String]) -> Result<Vec<(String, String)>, CliError> {
    props
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| CliError::Config(format!("--kafka-property {p:?} is not key=value")))
        })
        .collect()
}

/// The key a dead letter names: its last `dedup-scope` and `dedup-key` headers (dedup writes
/// them last).
fn key_of(headers: &[(String, Option<Vec<u8>>)]) -> Result<IdempotencyKey, String> {
    let last = |name: &str| {
        headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
    };
    let (Some(scope), Some(key)) = (last(DLQ_SCOPE), last(DLQ_KEY)) else {
        return Err(format!(
            "no {DLQ_SCOPE}/{DLQ_KEY} headers (a message without a usable idempotency key, or \
             dead-lettered by a version that did not name it)"
        ));
    };
    let scope = std::str::from_utf8(scope).map_err(|_| format!("{DLQ_SCOPE} is not UTF-8"))?;
    let scope = Scope::new(scope).map_err(|e| format!("{DLQ_SCOPE}: {e}"))?;
    IdempotencyKey::new(scope, key).map_err(|e| format!("{DLQ_KEY}: {e}"))
}

/// Reads `partition` of `topic` from `range.0` to `range.1` (inclusive), or to the partition's
/// end if it comes first: assigned at the offset, outside any group's commits.
async fn read_range(
    brokers: String,
    extra: Vec<(String, String)>,
    topic: String,
    partition: i32,
    range: (i64, i64),
    idle: Duration,
) -> Result<Vec<Read>, CliError> {
    tokio::task::spawn_blocking(move || {
        read_range_blocking(&brokers, &extra, &topic, partition, range, idle)
    })
    .await
    .map_err(|e| CliError::Failed(format!("reading the dead letters: {e}")))?
}

fn read_range_blocking(
    brokers: &str,
    extra: &[(String, String)],
    topic: &str,
    partition: i32,
    (from, to): (i64, i64),
    idle: Duration,
) -> Result<Vec<Read>, CliError> {
    let name = redact(brokers);
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        // Assigned, never subscribed: the id names no group that joins or commits.
        .set("group.id", format!("dedup-forget-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        // An offset before the log's start (removed by retention) reads from its start.
        .set("auto.offset.reset", "earliest");
    for (k, v) in extra {
        c.set(k, v);
    }
    let consumer: BaseConsumer = c
        .create()
        .map_err(|e| CliError::Config(format!("Kafka consumer ({name}): {e}")))?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(from))
        .map_err(|e| CliError::Config(format!("{topic} partition {partition}: {e}")))?;
    consumer
        .assign(&tpl)
        .map_err(|e| CliError::Failed(format!("assigning {topic} partition {partition}: {e}")))?;
    let mut out = Vec::new();
    let mut last_seen = Instant::now();
    loop {
        match consumer.poll(Duration::from_millis(200)) {
            None => {
                if last_seen.elapsed() > idle {
                    return Err(CliError::Unreachable(format!(
                        "no dead letter arrived from {topic} partition {partition} on {name} \
                         (KAFKA_BROKERS) within {}s, after {} read; is the broker up, and the \
                         range right?",
                        idle.as_secs(),
                        out.len()
                    )));
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) => {
                // The partition's end, before `to`: the range is read.
                return Ok(out);
            }
            Some(Err(e)) => {
                return Err(CliError::Failed(format!(
                    "reading {topic} partition {partition} on {name}: {e}"
                )));
            }
            Some(Ok(m)) => {
                last_seen = Instant::now();
                let offset = m.offset();
                if offset < from {
                    continue;
                }
                if offset > to {
                    return Ok(out);
                }
                let headers: Vec<(String, Option<Vec<u8>>)> = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(Read {
                    offset,
                    key: key_of(&headers),
                });
                if offset >= to {
                    return Ok(out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letters_key_is_its_last_scope_and_key_headers() {
        let h = |k: &str, v: &[u8]| (k.to_owned(), Some(v.to_vec()));
        let k = key_of(&[
            h("idempotency-key", b"evt-1"),
            h(DLQ_SCOPE, b"old"),
            h(DLQ_KEY, b"old"),
            h(DLQ_SCOPE, b"payments"),
            h(DLQ_KEY, b"evt-1"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(k.scope().as_str(), "payments");
        assert_eq!(k.key_bytes(), b"evt-1");
        assert!(key_of(&[h("idempotency-key", b"evt-1")]).is_err());
        assert!(key_of(&[h(DLQ_SCOPE, b"payments"), h(DLQ_KEY, b"")]).is_err());
    }
}
