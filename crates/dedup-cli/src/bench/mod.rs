//! `dedup bench`: one stream of events, the ways of making its consumer idempotent, side by side.
//!
//! Effects outside the database: (a) the usual Postgres pattern (per message: BEGIN, SELECT ...
//! FOR UPDATE, INSERT, UPDATE, COMMIT); (b) the usual Redis pattern (per message: a Lua acquire
//! and a Lua complete; not durable); (c) dedup's tiered store, one call per message; (d) dedup's
//! tiered store behind `Batched` (group commit); (e) dedup in transaction mode by the batch; (f)
//! dedup in lease mode by the batch (`Dedup::process_batch`).
//!
//! Effects in the database (a ledger row per unique key in the same Postgres): (a') the usual
//! Postgres pattern with the ledger row in its transaction; (b') the usual Redis pattern and the
//! ledger row in a transaction of its own; (e') dedup in transaction mode, the batch's ledger rows
//! written in the batch's transaction.
//!
//! Kafka consumers built the way a user builds them (`engine.consumer()`, with the engine's caches
//! and group commit), through librdkafka's embedded mock cluster, beside the contenders that do
//! the same work by hand: (ek) a transaction-mode consumer beside (e), (fk) a batched lease-mode
//! consumer beside (f).
//!
//! HTTP routes on loopback behind dedup's Idempotency-Key layer, beside the route alone and the
//! hand-rolled `INSERT ... ON CONFLICT` (`web/`): (hn), (h0), (h0x), (h1), (h2), (h2l), (h3),
//! (h3r).
//!
//! And the ceiling: the same Postgres taking 500-row INSERTs into a copy of `dedup_records`.
//!
//! The same events, the same concurrency (events in flight), the same servers; each contender in
//! its own key space, with a cold L1. Every contender's effects are counted and must equal the
//! unique keys.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::BatchConfig;
use sqlx::PgPool;

use crate::connect::{CliError, connect_pg};
use dedup_workload::Workload;

mod args;
mod cleanup;
mod cpu;
mod drive;
mod engine;
mod outbox;
mod report;
mod runners;
mod statements;
mod txmode;
mod usual;
mod web;
mod window;

pub(crate) use args::BenchArgs;
use args::{EventKeys, Keys};
use cleanup::{cleanup, keys_floor, unix_ms_now};
use drive::{Latencies, drive, percentile_ms, result_of};
use engine::tiered;
use report::Report;
use usual::{usual_postgres, usual_redis};

/// What one contender did.
#[derive(Debug)]
struct Outcome {
    name: &'static str,
    label: &'static str,
    durable: bool,
    elapsed: Duration,
    latencies: Latencies,
    effects: u64,
    errors: u64,
    /// Postgres round trips, where Postgres is used.
    pg_trips: Option<u64>,
    /// Statements the server ran while it ran (`pg_stat_statements`, BEGIN and COMMIT
    /// included): all of them, the handler's own (the ledger rows), and whether that is all of
    /// them (false: the server evicted entries meanwhile, so these are lower bounds), where
    /// counted.
    server_statements: Option<(u64, u64, bool)>,
    /// Claims answered by L1, by L2, and by the authority.
    tiers: (u64, u64, u64),
    batches: Option<dedup_core::BatchCounts>,
    /// What the machine's processors did meanwhile (Linux).
    cpu: Option<cpu::CpuUse>,
    /// The server's WAL meanwhile: bytes, and full-page images where they were counted
    /// (`pg_stat_wal`, settled: with a window).
    wal: Option<(u64, Option<u64>)>,
    /// The average heap size of one of its records, where it keeps records.
    row_bytes: Option<f64>,
    /// An HTTP contender's own figures.
    http: Option<web::HttpFigures>,
    /// (g)'s own figures.
    outbox: Option<outbox::OutboxFigures>,
}

impl Outcome {
    /// The effects it must have made: one per unique key, unless it is an HTTP contender that
    /// says otherwise.
    fn expected_effects(&self, unique: u64) -> u64 {
        self.http.as_ref().map_or(unique, |h| h.expected_effects)
    }

    fn rate(&self, events: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let n = events as f64;
        n / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `p` percentile of the events' latencies; `None` where none were taken.
    fn percentile_ms(&self, p: f64) -> Option<f64> {
        percentile_ms(&self.latencies.all, p)
    }

    /// The `p` percentile of the latencies of the events that overlapped the drop of the ranges
    /// of days (`--purge-during`), and how many they were; `None` where none did.
    fn dropping_ms(&self, p: f64) -> Option<(f64, usize)> {
        percentile_ms(&self.latencies.dropping, p).map(|ms| (ms, self.latencies.dropping.len()))
    }

    fn trips_per_unique(&self, unique: u64) -> Option<f64> {
        #[allow(clippy::cast_precision_loss)]
        self.pg_trips.map(|t| t as f64 / unique.max(1) as f64)
    }

    fn tier_shares(&self) -> (f64, f64, f64) {
        let (l1, l2, auth) = self.tiers;
        #[allow(clippy::cast_precision_loss)]
        let total = (l1 + l2 + auth).max(1) as f64;
        #[allow(clippy::cast_precision_loss)]
        let shares = (l1 as f64 / total, l2 as f64 / total, auth as f64 / total);
        shares
    }
}

pub(crate) async fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    // Before any run's keys are made: they are all made at this time or later.
    let keys_from = keys_floor(unix_ms_now());
    if !(0.0..1.0).contains(&args.duplicates) || args.events == 0 || args.concurrency == 0 {
        return Err(CliError::Config(
            "--duplicates must be in [0, 1), --events and --concurrency above 0".into(),
        ));
    }
    if let Some(c) = args.only.iter().find(|c| !CONTENDERS.contains(&c.as_str())) {
        return Err(CliError::Config(format!(
            "--only: unknown contender {c:?} (one of {})",
            CONTENDERS.join(", ")
        )));
    }
    let pool = connect_pg(&args.pg.database_url, args.pg_connections.max(2)).await?;
    dedup_pg::migrate(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("migrations: {e}")))?;
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .map_err(|e| CliError::Failed(format!("reading synchronous_commit: {e}")))?;
    let generated = Workload::new(args.events)
        .with_duplicates(args.duplicates)
        .with_zipf(args.zipf)
        .with_seed(0xbe7c)
        .ids();
    let (stream, unique) = (generated.ids, generated.unique);
    let stream = Arc::new(stream);
    let base_id = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    txmode::ledger_table(&pool).await?;
    web::tables(&pool).await?;
    let counting = statements::enable(&pool).await;
    let windowed = args.prefill > 0 || args.expired > 0;
    let keepers: Vec<&str> = window::KEEPERS
        .iter()
        .filter(|(c, _)| args.only.iter().any(|o| o == c))
        .map(|(_, t)| *t)
        .collect();
    if windowed && (args.keys == Keys::Sequential || keepers.is_empty()) {
        return Err(CliError::Config(
            "--prefill and --expired need --keys uuid or uuidv7 and a contender that keeps \
             records (c, d, e, e', f, ek, fk)"
                .into(),
        ));
    }
    if !(0.0..1.0).contains(&args.paced_share)
        || (args.paced_share > 0.0 && args.keys == Keys::Sequential)
    {
        return Err(CliError::Config(
            "--paced-share must be in [0, 1), and needs --keys uuid, uuidv7 or timed".into(),
        ));
    }
    if args.purge_during && !windowed {
        return Err(CliError::Config(
            "--purge-during needs a window (--prefill, --expired)".into(),
        ));
    }
    let note = |what: &str| {
        if !args.json {
            eprintln!("[bench] {what}");
        }
    };
    // The window topped up to what was asked: before the first run, and before each later one
    // that purges.
    let fill = || {
        window::fill(
            &pool,
            &keepers,
            args.keys,
            args.prefill,
            args.expired,
            &note,
        )
    };
    let mut window = None;
    if windowed {
        let filled = fill().await?;
        let size = window::size(&pool).await?;
        window = Some(Window {
            filled,
            size,
            purges: Vec::new(),
        });
    }
    let window_only: Vec<String> = args
        .only
        .iter()
        .filter(|c| window::KEEPERS.iter().any(|(k, _)| k == c))
        .cloned()
        .collect();
    let salts = std::collections::hash_map::RandomState::new();
    let mut rounds = Vec::new();
    for round in 1..=args.repeat {
        // Each run of a contender in a key space of its own: a second run over the first's keys
        // would answer every event as a duplicate.
        let run_id = if args.repeat == 1 {
            base_id.clone()
        } else {
            format!("{base_id}-r{round}")
        };
        let ctx = Ctx {
            batch: BatchConfig::default()
                .with_max_batch(args.batch_max)
                .with_max_flushes(args.batch_flushes),
            stream: Arc::clone(&stream),
            concurrency: args.concurrency,
            tx_workers: args.tx_workers,
            scopes: run_id.clone(),
            run_id,
            quiet: args.json,
            keys: EventKeys::new(args.keys, 0, unique),
        };
        if args.purge_during && round > 1 {
            // The expired records the last run's retention removed, made again; before this
            // run's first contender, so that each run's passes follow the fill's checkpoint in
            // the same order as the first's.
            fill().await?;
        }
        if args.repeat > 1 || windowed {
            ctx.note(&format!(
                "run {round} of {}, on an empty window",
                args.repeat
            ));
        }
        rounds.push(
            run_round(
                &args,
                &args.only,
                &ctx,
                &pool,
                unique,
                counting,
                Pass::Empty,
            )
            .await?,
        );
        if let Some(w) = window.as_mut() {
            for pass in [Pass::Window, Pass::Purge] {
                if pass == Pass::Purge && !args.purge_during {
                    continue;
                }
                let ctx = Ctx {
                    run_id: format!("{}-{}", ctx.run_id, pass.tag()),
                    scopes: args.keys.window().to_owned(),
                    keys: EventKeys::new(
                        args.keys,
                        std::hash::BuildHasher::hash_one(&salts, (round, pass.tag())),
                        unique,
                    ),
                    ..ctx.clone()
                };
                ctx.note(&format!(
                    "run {round} of {}, {}",
                    args.repeat,
                    pass.describe()
                ));
                let purge = if pass == Pass::Purge {
                    Some(
                        window::Purge::start(
                            &args.pg.database_url,
                            &pool,
                            args.purge_batch,
                            Duration::from_millis(args.purge_pause_ms),
                        )
                        .await?,
                    )
                } else {
                    None
                };
                let done =
                    run_round(&args, &window_only, &ctx, &pool, unique, counting, pass).await;
                if let Some(p) = purge {
                    ctx.note("waiting for the retention to finish, then VACUUM");
                    w.purges.push(p.finish().await);
                }
                rounds.push(done?);
            }
        }
    }
    // Rows are deleted only now: deleting between contenders would set autovacuum to work
    // while the next one is timed.
    for round in &rounds {
        if !args.json {
            eprintln!("[bench] deleting the rows of run {}", round.run_id);
        }
        let cleaned = cleanup(&pool, &round.run_id, &keys_from).await;
        // On stderr, so that `--json` keeps stdout to the report.
        eprintln!("{}", cleaned.summary(&round.run_id));
    }
    let wrong: Vec<(usize, &Outcome)> = rounds
        .iter()
        .enumerate()
        .flat_map(|(i, r)| r.outcomes.iter().map(move |o| (i, o)))
        .filter(|(_, o)| o.effects != o.expected_effects(unique) || o.errors > 0)
        .collect();
    let report = Report::new(&args, unique, &sync, &rounds, window.as_ref());
    if args.json {
        println!("{}", report.json());
    } else {
        report.table();
    }
    if wrong.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        for (i, o) in wrong {
            eprintln!(
                "dedup bench: {} (run {}) ran {} effects where {} were due ({unique} unique \
                 keys), with {} errors",
                o.name,
                i + 1,
                o.effects,
                o.expected_effects(unique),
                o.errors
            );
        }
        Ok(ExitCode::from(1))
    }
}

/// Which window a run ran over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// Scopes of its own, empty when it starts (every bench's runs).
    Empty,
    /// The window `--prefill` filled.
    Window,
    /// The same, with the retention running (`--purge-during`).
    Purge,
}

impl Pass {
    fn tag(self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::Window => "window",
            Self::Purge => "purge",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Empty => "on an empty window",
            Self::Window => "over the window",
            Self::Purge => "over the window, with the retention running",
        }
    }
}

/// The window of a bench with `--prefill` or `--expired`: what filling it did, what it takes on
/// disk, and what the retention did in each run beside it.
struct Window {
    filled: window::Filled,
    size: window::Size,
    purges: Vec<window::Purged>,
}

/// One run of every contender asked for, in order.
struct Round {
    pass: Pass,
    run_id: String,
    outcomes: Vec<Outcome>,
    /// The ceiling's rows per second, when it was measured.
    ceiling: Option<f64>,
    /// The claim statement's claims per second on new keys, when it was measured.
    claims: Option<f64>,
}

async fn run_round(
    args: &BenchArgs,
    only: &[String],
    ctx: &Ctx,
    pool: &PgPool,
    unique: u64,
    counting: bool,
    pass: Pass,
) -> Result<Round, CliError> {
    // Full-page images are counted late (see `window::wal_since`): waited for with a window.
    let settle = args.prefill > 0 || args.expired > 0;
    let mut round = Round {
        pass,
        run_id: ctx.run_id.clone(),
        outcomes: Vec::new(),
        ceiling: None,
        claims: None,
    };
    for c in CONTENDERS {
        if !only.iter().any(|o| o == c) {
            continue;
        }
        if web::CONTENDERS.contains(&c) {
            // Measured around their timed passes alone ((h3) completes its keys first).
            round
                .outcomes
                .extend(web::run(c, ctx, args, pool, counting).await?);
            continue;
        }
        let before = if counting {
            statements::count(pool).await
        } else {
            None
        };
        let ticks = cpu::now();
        let wal = window::wal(pool).await;
        let mut outcome = match c {
            "a" => usual_postgres(ctx, pool, false).await?,
            "b" => usual_redis(ctx, &args.redis_url, None).await?,
            "c" => tiered(ctx, pool, &args.redis_url, false).await?,
            "d" => tiered(ctx, pool, &args.redis_url, true).await?,
            "e" => txmode::transaction_mode(ctx, pool, false).await?,
            "f" => engine::lease_batches(ctx, pool, &args.redis_url).await?,
            "a'" => usual_postgres(ctx, pool, true).await?,
            "b'" => usual_redis(ctx, &args.redis_url, Some(pool)).await?,
            "e'" => txmode::transaction_mode(ctx, pool, true).await?,
            "g" => outbox::outbox(ctx, pool).await?,
            "ek" => runners::through_kafka(ctx, pool, &args.redis_url, runners::Which::Tx).await?,
            "fk" => {
                runners::through_kafka(ctx, pool, &args.redis_url, runners::Which::Lease).await?
            }
            "ceiling" => {
                round.ceiling = Some(txmode::ceiling(ctx, pool, unique).await?);
                continue;
            }
            _ => {
                round.claims = Some(txmode::claims(ctx, pool, unique).await?);
                continue;
            }
        };
        outcome.cpu = ticks.zip(cpu::now()).map(|(b, a)| a.since(b));
        // Counted before the bench's own reads below.
        if let (Some(b), Some(a)) = (before, statements::count(pool).await) {
            outcome.server_statements = Some(a.since(b));
        }
        if let Some(before) = wal {
            outcome.wal = window::wal_since(pool, before, settle).await;
        }
        // (g)'s paced pass and the relay alone, outside its counters.
        if c == "g" {
            outbox::beside(ctx, pool, &mut outcome).await?;
        }
        // A window's rows are mostly the fill's: only an empty one's are the contender's own.
        if pass == Pass::Empty
            && let Some(tag) = window::tag_of(outcome.name)
        {
            outcome.row_bytes = window::row_bytes(pool, &ctx.scope(tag)).await;
        }
        round.outcomes.push(outcome);
    }
    Ok(round)
}

/// Every contender, in the order they run.
const CONTENDERS: [&str; 21] = [
    "a", "b", "c", "d", "e", "f", "a'", "b'", "e'", "ek", "fk", "g", "hn", "h0", "h0x", "h1", "h2",
    "h2l", "h3", "ceiling", "claim",
];

#[derive(Clone)]
struct Ctx {
    batch: BatchConfig,
    stream: Arc<Vec<u64>>,
    concurrency: usize,
    tx_workers: usize,
    run_id: String,
    /// Where the run's records go: `bench-<tag>-<this>` (the run id, or `window` for a run over
    /// the window `--prefill` filled).
    scopes: String,
    quiet: bool,
    keys: EventKeys,
}

impl Ctx {
    /// The scope of the contender tagged `tag` (one of [`SCOPE_TAGS`](cleanup::SCOPE_TAGS)) in this run.
    fn scope(&self, tag: &str) -> String {
        format!("bench-{tag}-{}", self.scopes)
    }

    fn note(&self, what: &str) {
        if !self.quiet {
            eprintln!("[bench] {what}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{EventKeys, Keys, keys_floor};
    use dedup_core::{IdempotencyKey, Scope};

    /// `--keys timed`: the random ids of `--keys uuid`, each keyed with its event's time as
    /// `IdempotencyKey::timed` keys it (a UUIDv7 whose time is `uuidv7`'s), sharing the
    /// time-ordered window.
    #[test]
    fn timed_keys_are_the_random_ids_keyed_with_their_time() {
        let keys = EventKeys {
            shape: Keys::Timed,
            salt: 0x5a17,
            unix_ms: 1_795_000_000_000,
        };
        let scope = Scope::new("s").expect("a scope");
        for id in [0, 1, 31, 32, 1_000] {
            let text = keys.of(id);
            let key = IdempotencyKey::new(scope.clone(), &text).expect("a key");
            assert_eq!(key.uuid7_millis(), Some(keys.unix_ms + id / 32), "{text}");
            let event = dedup_workload::event_id(id ^ keys.salt);
            let want = IdempotencyKey::timed(scope.clone(), keys.unix_ms + id / 32, event);
            assert_eq!(want.expect("timed").key_bytes(), text.as_bytes());
        }
        let other = EventKeys {
            salt: 0x5a18,
            ..keys
        };
        assert_ne!(keys.of(7), other.of(7), "each run's keys are its own");
        assert_eq!(Keys::Timed.window(), Keys::Uuidv7.window());
        assert!(Keys::Timed.time_ordered() && !Keys::Uuid.time_ordered());
    }

    /// The cleanup finds a run's time-ordered keys from the floor of the bench's start: every
    /// key made then or later sorts at or after it, and one made a millisecond before, before.
    #[test]
    fn time_ordered_keys_sort_after_the_floor_of_their_time() {
        let ms = 1_795_000_000_123_u64;
        let floor = keys_floor(ms);
        assert_eq!(floor.len(), 13);
        for shape in [Keys::Uuidv7, Keys::Timed] {
            for (at, id) in [(ms, 0), (ms, 31), (ms + 1, 5), (ms + 86_400_000, 9)] {
                let keys = EventKeys {
                    shape,
                    salt: 0x77,
                    unix_ms: at,
                };
                assert!(keys.of(id).as_str() >= floor.as_str(), "{shape:?} {at}");
            }
            let before = EventKeys {
                shape,
                salt: 0x77,
                unix_ms: ms - 1,
            };
            assert!(before.of(0).as_str() < floor.as_str(), "{shape:?}");
        }
    }
}
