//! `dedup`: the demo (the project's main job), migrations, inspection and retention.
//!
//! Configuration comes from flags or the environment (`DATABASE_URL`, `REDIS_URL`,
//! `KAFKA_BROKERS`); `OTEL_EXPORTER_OTLP_ENDPOINT` sends spans over OTLP/HTTP (to Jaeger, say).
//!
//! Here: the subcommands, and `migrate` (`--mode apply|verify|off`) and `inspect`. The others
//! have a module each: `demo/`, `bench/`, `purge.rs` (once, or `--every` as a sidecar that one
//! instance at a time runs), `parked.rs` (`parked`, `unpark`, `drop`; keys that are not printable
//! text as `hex:...`, `hex.rs`), `forget.rs`, `dead_letters.rs`; `signals.rs` stops the
//! long-running ones.

#![allow(clippy::print_stdout)]

mod bench;
mod connect;
mod dead_letters;
mod demo;
mod forget;
mod hex;
mod outbox;
mod parked;
mod purge;
mod signals;
mod telemetry;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use dedup_core::{FastPath, IdempotencyKey, Scope, Store};

use crate::connect::{CliError, connect_pg, connect_redis};

/// Exactly-once effects for at-least-once consumers: an idempotency key per event, a fenced
/// lease while it runs, the stored result replayed to every duplicate.
#[derive(Parser, Debug)]
#[command(name = "dedup", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Produce a stream with duplicates, redeliveries and poison to Kafka, consume it through the
    /// full engine (L1, Redis, Postgres) into a ledger, and report what happened.
    Demo(demo::DemoArgs),
    Bench(bench::BenchArgs),
    /// Apply or verify dedup's migrations (its own table, `dedup_migrations`), and check that the
    /// schema's compatibility floor allows this binary (docs/MIGRATIONS.md).
    Migrate(MigrateArgs),
    /// Show one key's record in each tier.
    Inspect(InspectArgs),
    /// Delete records past their retention, in batches: once, or every `--every` seconds with
    /// one instance at a time purging.
    Purge(purge::PurgeArgs),
    /// List a consumer group's parked keys: messages, oldest, attempts, next run, last error.
    Parked(parked::ParkedArgs),
    /// Make a parked key's head due now (and lift a hold).
    Unpark(parked::KeyArgs),
    /// Dead-letter a parked key's queue (its partition's owner writes them, in order).
    Drop(parked::KeyArgs),
    /// Forget keys (given, or named by a range of dead letters or by the dead letters kept in
    /// Postgres) so that their next message runs again: the re-drive path for dead letters
    /// (docs/RECOVERY.md).
    Forget(forget::ForgetArgs),
    /// List the dead letters a dead-letter topic refused for good (too large, invalid), kept in
    /// Postgres so that their partition moved on; write one out, remove it, or purge the old.
    DeadLetters(dead_letters::DeadLettersArgs),
    /// The outbox: `status` (what waits, who leads the relay) and `relay` (publish it to Kafka,
    /// one relay leading, others standing by) (docs/OUTBOX.md).
    Outbox(outbox::OutboxArgs),
}

/// Where Postgres is.
#[derive(Args, Debug, Clone)]
pub(crate) struct PgArgs {
    /// Postgres, the source of truth: postgres://user:password@host:port/database
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
}

#[derive(Args, Debug)]
struct MigrateArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// apply: move dedup's versions out of `_sqlx_migrations`, apply what is missing (nothing on
    /// a schema newer than this binary), check the floor; verify: change nothing, check that
    /// every migration is applied and the floor; off: change nothing, check that dedup's schema
    /// is there (`dedup_schema`), that its floor allows this binary and that it is not older
    /// than this binary.
    #[arg(long, default_value = "apply")]
    mode: dedup_pg::MigrationMode,
    /// After the migrations, partition dedup_records by the key's own time (UUIDv7 keys made
    /// from now on by their day; every other key, and every record stored before, in the untimed
    /// partition). One-way; raises the compatibility floor (it prints the floor it leaves): stop
    /// every dedup binary older than that generation first. The first step of the partitioned window
    /// (docs/design/window-partitions.md): no partition is dropped yet, the retention still
    /// deletes, and the partitioned table costs 3 to 30% of the rate (docs/PERFORMANCE.md).
    #[arg(long)]
    partition_by_key_time: bool,
}

#[derive(Args, Debug)]
struct InspectArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// Redis (the fast path): redis://[user:password@]host:port[/db]
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// The key prefix in Redis.
    #[arg(long, default_value = "dedup")]
    redis_prefix: String,
    /// The key's scope (a service, a consumer group, a tenant).
    scope: String,
    /// The idempotency key (as UTF-8 text); with `--event-time`, the event's id.
    key: String,
    /// The event's own time, in milliseconds since the Unix epoch or as RFC 3339 text (read as
    /// `KeySource::timed` reads it): inspect the key that `IdempotencyKey::timed` makes of this
    /// time and the id given as the key.
    #[arg(long, visible_alias = "event-ms", value_name = "MS_OR_RFC3339", value_parser = event_time)]
    event_time: Option<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = match telemetry::Telemetry::init() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("dedup: cannot set up telemetry: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dedup: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let code = runtime.block_on(async {
        match run(cli.command).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("dedup: {e}");
                e.exit_code()
            }
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(5));
    telemetry.shutdown();
    code
}

async fn run(command: Command) -> Result<ExitCode, CliError> {
    match command {
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Migrate(args) => migrate(args).await,
        Command::Inspect(args) => inspect(args).await,
        Command::Parked(args) => parked::list(args).await,
        Command::Unpark(args) => parked::unpark(args).await,
        Command::Drop(args) => parked::drop(args).await,
        Command::Forget(args) => forget::run(args).await,
        Command::DeadLetters(args) => dead_letters::run(args).await,
        Command::Purge(args) => purge::run(args).await,
        Command::Outbox(args) => outbox::run(args).await,
    }
}

async fn migrate(args: MigrateArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let status = dedup_pg::prepare(&pool, args.mode).await.map_err(|e| {
        let message = format!("migrations ({}): {e}", args.mode);
        if e.is_retryable() {
            CliError::Unreachable(message)
        } else {
            CliError::Failed(message)
        }
    })?;
    let versions = |v: &[i64]| {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !status.moved.is_empty() {
        println!(
            "moved {} dedup migration(s) from _sqlx_migrations to {}: {}",
            status.moved.len(),
            dedup_pg::MIGRATIONS_TABLE,
            versions(&status.moved)
        );
    }
    match args.mode {
        dedup_pg::MigrationMode::Apply if status.applied.is_empty() => {
            println!("migrations applied (none was missing)");
        }
        dedup_pg::MigrationMode::Apply => println!(
            "migrations applied: {} ({})",
            status.applied.len(),
            versions(&status.applied)
        ),
        dedup_pg::MigrationMode::Verify => println!(
            "migrations verified: all {} recorded in {} with their checksums",
            status.verified.len(),
            dedup_pg::MIGRATIONS_TABLE
        ),
        _ => println!("migrations off: nothing applied or verified"),
    }
    match status.schema {
        Some(s) => println!(
            "schema generation {}, compatibility floor {}; this binary is generation {}{}",
            s.generation,
            s.compat_floor,
            dedup_pg::SCHEMA_GENERATION,
            if status.newer_than_binary() {
                " (the schema is newer and still compatible)"
            } else {
                ""
            }
        ),
        None => println!("no dedup_schema table"),
    }
    if args.partition_by_key_time {
        let layout = dedup_pg::partition_by_key_time(&pool).await.map_err(|e| {
            let message = format!("partitioning dedup_records by the key's time: {e}");
            if e.is_retryable() {
                CliError::Unreachable(message)
            } else {
                CliError::Failed(message)
            }
        })?;
        match layout {
            dedup_pg::KeyTimeLayout::Switched {
                t0_ms,
                moved,
                compat_floor,
                ..
            } => println!(
                "dedup_records partitioned by the key's time: UUIDv7 keys made from {t0_ms} ms \
                 after the Unix epoch on go to the partition of their day; {moved} stored \
                 record(s) moved there; compatibility floor {compat_floor}: stop every dedup \
                 binary older than generation {compat_floor}"
            ),
            _ => println!("dedup_records was partitioned by the key's time already"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `--event-time`: milliseconds or RFC 3339, as the Kafka runners read an event's time.
fn event_time(text: &str) -> Result<u64, String> {
    dedup_kafka::event_time_ms(text).ok_or_else(|| {
        format!(
            "{text:?} is neither milliseconds since the Unix epoch nor an RFC 3339 timestamp at or after it"
        )
    })
}

async fn inspect(args: InspectArgs) -> Result<ExitCode, CliError> {
    let scope = Scope::new(&args.scope).map_err(|e| CliError::Config(format!("scope: {e}")))?;
    let key = match args.event_time {
        None => IdempotencyKey::new(scope, args.key.as_bytes()),
        Some(ms) => IdempotencyKey::timed(scope, ms, args.key.as_bytes()),
    }
    .map_err(|e| CliError::Config(format!("key: {e}")))?;
    if args.event_time.is_some() {
        println!("event id: {} (keyed with its time)", args.key);
    }
    println!("key: {key}");
    match key.uuid7_millis() {
        Some(ms) => {
            let now = u64::try_from(dedup_core::Timestamp::now().as_micros() / 1000).unwrap_or(0);
            let days = ms.abs_diff(now) / 86_400_000;
            let side = if ms > now { "after" } else { "before" };
            println!(
                "key time: parses as a UUIDv7 made at {ms} ms after the Unix epoch, {days} day(s) {side} now \
                 (time-ordered keys keep a large window cheap)"
            );
        }
        None => println!(
            "key time: none (not a UUIDv7; a large window of random keys costs more, docs/PERFORMANCE.md \"Time-ordered event ids\"; IdempotencyKey::timed keys a random id with its event's time)"
        ),
    }
    println!("L1: in-process only; each consumer holds its own, so this process has none");
    match &args.redis_url {
        None => println!("L2 (Redis): not asked (no REDIS_URL)"),
        Some(url) => {
            let fast = connect_redis(url, &args.redis_prefix).await?;
            match fast.lookup(&key).await {
                Ok(Some(c)) => println!(
                    "L2 (Redis): {:?} token={} attempts={} owner={:?} lease_until={:?} result={} bytes failure={:?} expires_in={:?}",
                    c.state,
                    c.token,
                    c.attempts,
                    c.owner.as_ref().map(|o| o.as_str()),
                    c.lease_until,
                    c.result.as_ref().map_or(0, |r| r.len()),
                    c.failure,
                    c.expires_in,
                ),
                Ok(None) => println!("L2 (Redis): nothing held"),
                Err(e) => println!("L2 (Redis): error: {e}"),
            }
        }
    }
    let pool = connect_pg(&args.pg.database_url, 2).await?;
    let store = dedup_pg::PgStore::new(pool.clone());
    let record = store
        .get(&key)
        .await
        .map_err(|e| CliError::Failed(format!("postgres: {e}")))?;
    match &record {
        Some(r) => println!(
            "L3 (Postgres): {:?} token={} attempts={} owner={:?} lease_until={:?} result={} bytes failure={:?} created={:?} updated={:?} expires={:?}",
            r.state,
            r.token,
            r.attempts,
            r.owner.as_ref().map(|o| o.as_str()),
            r.lease_until,
            r.result.as_ref().map_or(0, |r| r.len()),
            r.failure,
            r.created_at,
            r.updated_at,
            r.expires_at,
        ),
        None => println!("L3 (Postgres): no record"),
    }
    // On the table partitioned by the key's time: which partition, and how it goes.
    let partition: Option<String> = if record.is_some() {
        sqlx::query_scalar(
            "SELECT tableoid::regclass::text FROM dedup_records \
             WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2)",
        )
        .bind(key.scope().as_str())
        .bind(key.key_bytes())
        .fetch_optional(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("postgres: {e}")))?
    } else {
        None
    };
    let ranged = partition.as_deref().is_some_and(|p| {
        p.starts_with("dedup_records_") && p[14..].starts_with(|c: char| c.is_ascii_digit())
    });
    if let Some(p) = partition.as_deref().filter(|p| *p != "dedup_records") {
        println!(
            "partition: {p}{}",
            if ranged {
                " (a range of days: dropped whole by the retention once its last day is \
                 --keep-days past, what is live in it then moved to dedup_records_late; until \
                 then its expired records count as absent and still take their space)"
            } else {
                ""
            }
        );
    }
    if let Some(r) = &record
        && dedup_core::machine::purgeable(r, dedup_core::Timestamp::now())
    {
        println!(
            "past its retention: it counts as absent (the key's next message runs again), and {}",
            if ranged {
                "it goes when the retention drops its range (`dedup purge`)"
            } else {
                "the next purge deletes it (`dedup purge`)"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}
