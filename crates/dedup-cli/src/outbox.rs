//! `dedup outbox`: the outbox's state (`status`: what waits and since when, who leads, what was
//! published and dead-lettered), and the relay as a process of its own (`relay`: one leads, any
//! others stand by; SIGINT or SIGTERM lets its lease go so a stand-by takes over at once).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use dedup_kafka::outbox::{OutboxRelay, RelayConfig};
use dedup_pg::PgStore;
use dedup_pg::outbox::RelayStore;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};
use crate::forget::properties;
use crate::signals::Signals;

#[derive(Args, Debug)]
pub(crate) struct OutboxArgs {
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Subcommand, Debug)]
enum OutboxCommand {
    /// What waits to be published and since when, who leads the relay, what it published and
    /// what the broker refused for good.
    Status(StatusArgs),
    /// Publish the outbox to Kafka until SIGINT or SIGTERM: one relay leads, others stand by.
    Relay(RelayArgs),
}

#[derive(Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// Print one line of JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct RelayArgs {
    #[command(flatten)]
    pg: PgArgs,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: String,
    /// Extra librdkafka properties, as key=value (repeatable): TLS, SASL.
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    kafka_properties: Vec<String>,
    /// The lease, in milliseconds: a stand-by takes over within this of the leader's death.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(300..))]
    lease_ms: u64,
    /// The poll, in milliseconds (this process has no local commits to wake it).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..))]
    poll_ms: u64,
    /// Rows sent per page.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    page: u64,
    /// The name it leads under (default relay-pid<pid>-...).
    #[arg(long)]
    name: Option<String>,
}

pub(crate) async fn run(args: OutboxArgs) -> Result<ExitCode, CliError> {
    match args.command {
        OutboxCommand::Status(a) => status(a).await,
        OutboxCommand::Relay(a) => relay(a).await,
    }
}

async fn status(args: StatusArgs) -> Result<ExitCode, CliError> {
    let pool = connect_pg(&args.pg.database_url, 1).await?;
    let s = RelayStore::new(PgStore::new(pool))
        .status()
        .await
        .map_err(|e| CliError::Failed(format!("reading the outbox's status: {e}")))?;
    if args.json {
        println!(
            "{{\"leader\":{},\"epoch\":{},\"unpublished\":{},\"oldest_ms\":{},\"published\":{},\
             \"moved_ms_ago\":{},\"dead_letters\":{},\"ring\":{}}}",
            s.leader
                .as_deref()
                .map_or_else(|| "null".to_owned(), |l| format!("{l:?}")),
            s.epoch,
            s.unpublished,
            s.oldest_ms,
            s.published,
            s.moved_ms_ago,
            s.dead_letters,
            s.ring
        );
    } else {
        println!(
            "leader: {} (epoch {})",
            s.leader.as_deref().unwrap_or("none"),
            s.epoch
        );
        println!(
            "unpublished: {} (oldest waited {} ms)",
            s.unpublished, s.oldest_ms
        );
        println!(
            "published: {} (position moved {} ms ago)",
            s.published, s.moved_ms_ago
        );
        println!("dead letters: {} (dedup_outbox_dead)", s.dead_letters);
        println!("ring: dedup_outbox_{} takes the writes", s.ring);
    }
    Ok(ExitCode::SUCCESS)
}

async fn relay(args: RelayArgs) -> Result<ExitCode, CliError> {
    let mut signals = Signals::install()?;
    let pool = connect_pg(&args.pg.database_url, 4).await?;
    let mut client = rdkafka::ClientConfig::new();
    client.set("bootstrap.servers", &args.brokers);
    for (k, v) in properties(&args.kafka_properties)? {
        client.set(k, v);
    }
    let config = RelayConfig::default()
        .with_lease(Duration::from_millis(args.lease_ms))
        .with_poll(Duration::from_millis(args.poll_ms))
        .with_page(usize::try_from(args.page).unwrap_or(1000));
    let mut relay = OutboxRelay::new(&PgStore::new(pool), client, config)
        .map_err(|e| CliError::Config(e.to_string()))?;
    if let Some(name) = args.name {
        relay = relay.named(name);
    }
    let stats = relay.stats();
    relay
        .run(async move { signals.recv().await })
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    let s = stats.snapshot();
    println!(
        "relay stopped: published {}, dead-lettered {}, rounds {}, failed rounds {}",
        s.published, s.dead_lettered, s.rounds, s.failed_rounds
    );
    Ok(ExitCode::SUCCESS)
}
