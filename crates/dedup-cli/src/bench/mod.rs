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
//! The Kafka runners themselves, through librdkafka's embedded mock cluster, beside the
//! contenders they run by hand: (ek) `TxRunner` beside (e), (fk) `LeaseRunner` beside (f).
//!
//! And the ceiling: the same Postgres taking 500-row INSERTs into a copy of `dedup_records`.
//!
//! The same events, the same concurrency (events in flight), the same servers; each contender in
//! its own key space, with a cold L1. Every contender's effects are counted and must equal the
//! unique keys.

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use dedup_core::{BatchConfig, IdempotencyKey, Scope};
use sqlx::PgPool;

use crate::PgArgs;
use crate::connect::{CliError, connect_pg};
use dedup_workload::Workload;

mod cpu;
mod engine;
mod report;
mod runners;
mod statements;
mod txmode;
mod usual;
mod window;

use engine::tiered;
use report::Report;
use usual::{usual_postgres, usual_redis};

/// Compare dedup with the usual Postgres and Redis patterns on one workload.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pg: PgArgs,
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: String,
    /// Events in the stream.
    #[arg(long, default_value_t = 200_000)]
    events: u64,
    /// The share of events that repeat an earlier key.
    #[arg(long, default_value_t = 0.3)]
    duplicates: f64,
    /// The Zipf exponent of the duplicates' keys (higher: hotter hot keys).
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    /// Events processed at once, the same for every contender.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Postgres connections, the same pool for every contender that uses Postgres.
    #[arg(long, default_value_t = 64)]
    pg_connections: u32,
    /// Contenders to run, among a, b, c, d, e, f, a', b', e', ek, fk (the Kafka runners), ceiling
    /// and claim (the claim statement alone on new keys, beside the ceiling).
    #[arg(
        long,
        default_value = "a,b,c,d,e,f,a',b',e',ek,fk,ceiling,claim",
        value_delimiter = ','
    )]
    only: Vec<String>,
    /// (e), (e'): batch transactions at once; the events in flight (`--concurrency`) are split
    /// among them.
    #[arg(long, default_value_t = 2)]
    tx_workers: usize,
    /// (d): the most requests in one batch call.
    #[arg(long, default_value_t = 512)]
    batch_max: usize,
    /// (d): batch calls of one kind in flight at once.
    #[arg(long, default_value_t = 2)]
    batch_flushes: usize,
    /// Run every contender this many times, interleaved (a, b, ... then a, b, ... again), each
    /// time in a key space of its own: the report gives each contender's median and its min-max,
    /// and the ratios of medians; the JSON carries every run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,
    /// The shape of the event ids: `uuid` (random, as producers make them, landing all over the
    /// primary key), `uuidv7` (time-ordered, as RFC 9562's version 7 makes them: new keys land at
    /// the primary key's right edge), `timed` (random ids, as `uuid`, keyed with their event's
    /// time by `IdempotencyKey::timed`: time-ordered keys again) or `sequential` (`e<n>`, one hot
    /// corner of it, which flatters every figure; the bench's keys before random ones became the
    /// default).
    #[arg(long, value_enum, default_value_t = Keys::Uuid)]
    keys: Keys,
    /// The window at size: top the window's scopes (`bench-<tag>-window` of the contenders that
    /// keep records, `bench-<tag>-window-v7` with `--keys uuidv7`) up to this many completed
    /// records in all, with keys of `--keys`'s shape, kept from one bench to the next; then each
    /// run also runs those contenders over the window, beside their run on an empty one. 0: no
    /// window.
    #[arg(long, default_value_t = 0)]
    prefill: u64,
    /// With the window: top its scopes up to this many records in all already past their
    /// retention (besides `--prefill`'s), for `--purge-during` to remove.
    #[arg(long, default_value_t = 0)]
    expired: u64,
    /// With the window: run the contenders over it a second time with the retention running
    /// (today's bounded DELETE, `dedup purge`), from their start until a statement finds less
    /// than a full batch; the expired records are topped up to `--expired` before each such run.
    #[arg(long)]
    purge_during: bool,
    /// The retention's records per statement (`dedup purge --batch`).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    purge_batch: u32,
    /// The retention's pause between two statements, in milliseconds (`dedup purge --every ..
    /// --pause-ms`, `RetentionConfig::pause`).
    #[arg(long, default_value_t = 0)]
    purge_pause_ms: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// The shape of the bench's event ids (`--keys`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Keys {
    /// Random UUID-shaped ids (`dedup_workload::event_id`).
    Uuid,
    /// Time-ordered UUIDv7-shaped ids (`dedup_workload::time_ordered_event_id`): the run's start
    /// in milliseconds, plus one for every 32 events, then random bits; a window of its own
    /// (`bench-<tag>-window-v7`) made the same way over the last 7 days.
    Uuidv7,
    /// Random UUID-shaped ids (as `Uuid`) keyed with their event's time
    /// (`IdempotencyKey::timed`; the time as `Uuidv7`'s): UUIDv7-shaped keys, whose window is
    /// `Uuidv7`'s.
    Timed,
    /// `e<n>`.
    Sequential,
}

/// The event ids of one run: their shape, and (for random ids) a salt that gives each run of a
/// contender over the same scope (the window's) keys of its own, with the stream's duplicates
/// where they were; for time-ordered ids, the time the run began.
#[derive(Clone, Copy, Debug)]
struct EventKeys {
    shape: Keys,
    salt: u64,
    unix_ms: u64,
}

impl EventKeys {
    /// The `unique` ids of a run, of `shape`, salted with `salt`, made now; time-ordered ones
    /// after every time-ordered id an earlier run of this bench made, even one that ended sooner
    /// than its ids' times (one millisecond every 32 ids).
    fn new(shape: Keys, salt: u64, unique: u64) -> Self {
        static NEXT_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let now = unix_ms_now();
        let span = unique / 32 + 1;
        let unix_ms = NEXT_MS
            .fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |next| Some(now.max(next).saturating_add(span)),
            )
            .map_or(now, |next| now.max(next));
        Self {
            shape,
            salt,
            unix_ms,
        }
    }

    /// Event `id`'s idempotency key.
    fn of(self, id: u64) -> String {
        match self.shape {
            Keys::Uuid => dedup_workload::event_id(id ^ self.salt),
            Keys::Uuidv7 => {
                dedup_workload::time_ordered_event_id(self.unix_ms + id / 32, id ^ self.salt)
            }
            Keys::Timed => {
                static SCOPE: std::sync::LazyLock<Scope> =
                    std::sync::LazyLock::new(|| Scope::new("bench").expect("a scope"));
                let event = dedup_workload::event_id(id ^ self.salt);
                let key = IdempotencyKey::timed(SCOPE.clone(), self.unix_ms + id / 32, event)
                    .expect("an event id and a time of this century make a key");
                String::from_utf8_lossy(key.key_bytes()).into_owned()
            }
            Keys::Sequential => format!("e{id}"),
        }
    }
}

impl Keys {
    /// The scopes of the window (`--prefill`) of these keys: `bench-<tag>-<this>`.
    fn window(self) -> &'static str {
        if self.time_ordered() {
            "window-v7"
        } else {
            "window"
        }
    }

    /// Whether the keys are UUIDv7s (a time-ordered window, made by `window.rs` in their shape).
    fn time_ordered(self) -> bool {
        matches!(self, Self::Uuidv7 | Self::Timed)
    }

    /// As `--keys` names it.
    fn name(self) -> &'static str {
        match self {
            Self::Uuid => "uuid",
            Self::Uuidv7 => "uuidv7",
            Self::Timed => "timed",
            Self::Sequential => "sequential",
        }
    }
}

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
}

impl Outcome {
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
        .filter(|(_, o)| o.effects != unique || o.errors > 0)
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
                "dedup bench: {} (run {}) ran {} effects for {unique} unique keys, with {} errors",
                o.name,
                i + 1,
                o.effects,
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
const CONTENDERS: [&str; 13] = [
    "a", "b", "c", "d", "e", "f", "a'", "b'", "e'", "ek", "fk", "ceiling", "claim",
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
    /// The scope of the contender tagged `tag` (one of [`SCOPE_TAGS`]) in this run.
    fn scope(&self, tag: &str) -> String {
        format!("bench-{tag}-{}", self.scopes)
    }

    fn note(&self, what: &str) {
        if !self.quiet {
            eprintln!("[bench] {what}");
        }
    }
}

/// The `p` percentile of `sorted` (µs) in milliseconds; `None` where it is empty.
fn percentile_ms(sorted: &[u64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = (((sorted.len() - 1) as f64) * p).round() as usize;
    #[allow(clippy::cast_precision_loss)]
    let ms = sorted[i] as f64 / 1000.0;
    Some(ms)
}

/// The events' latencies (µs): all of them, and those of the events that overlapped the drop of
/// the ranges of days in a `--purge-during` pass ([`window::drop_phase`]); sorted once the
/// contender is done.
#[derive(Debug, Default)]
struct Latencies {
    all: Vec<u64>,
    dropping: Vec<u64>,
}

impl Latencies {
    /// `n` events that took `us` each, started when the drop stood at `phase`.
    fn record(&mut self, us: u64, n: usize, phase: u64) {
        self.all.extend(std::iter::repeat_n(us, n));
        if window::overlapped(phase) {
            self.dropping.extend(std::iter::repeat_n(us, n));
        }
    }

    /// Another task's.
    fn merge(&mut self, other: Self) {
        self.all.extend(other.all);
        self.dropping.extend(other.dropping);
    }

    fn sorted(mut self) -> Self {
        self.all.sort_unstable();
        self.dropping.sort_unstable();
        self
    }
}

/// Runs `one` on every event of the stream from `concurrency` tasks; answers the time taken, each
/// event's latency and the number of errors.
async fn drive<F, Fut>(ctx: &Ctx, one: F) -> (Duration, Latencies, u64)
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ctx.concurrency {
        let (stream, next, errors, one) = (
            Arc::clone(&ctx.stream),
            Arc::clone(&next),
            Arc::clone(&errors),
            one.clone(),
        );
        tasks.spawn(async move {
            let mut latencies = Latencies::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&id) = stream.get(i) else { break };
                let (t, phase) = (Instant::now(), window::drop_phase());
                if let Err(e) = one(id).await
                    && errors.fetch_add(1, Ordering::Relaxed) < 5
                {
                    eprintln!("[bench] event {id}: {e}");
                }
                let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                latencies.record(us, 1, phase);
            }
            latencies
        });
    }
    let mut latencies = Latencies::default();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(l) => latencies.merge(l),
            Err(_) => {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let elapsed = started.elapsed();
    (elapsed, latencies.sorted(), errors.load(Ordering::Relaxed))
}

fn result_of(id: u64) -> String {
    format!("done:{id}")
}

/// The tags of the scopes a run's dedup contenders write records under (`bench-<tag>-<run>`):
/// (c), (d), (e), (e'), (f), (ek), (fk) and the claim statement alone.
const SCOPE_TAGS: [&str; 8] = ["c", "d", "e", "e2", "f", "ek", "fk", "claim"];

/// Rows deleted per statement when cleaning up.
const CLEANUP_BATCH: i64 = 10_000;

/// What [`cleanup`] deleted, and what it could not.
#[derive(Debug, Default)]
struct Cleaned {
    records: u64,
    ledger: u64,
    usual: u64,
    /// The first error, per table: rows of the run are left there.
    errors: Vec<String>,
}

impl Cleaned {
    fn summary(&self, run_id: &str) -> String {
        let scopes = SCOPE_TAGS
            .iter()
            .map(|t| format!("bench-{t}-{run_id}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut out = format!(
            "[bench] cleaned up: deleted {} record(s) under the run's scopes ({scopes}), {} ledger \
             row(s), {} row(s) of the usual patterns",
            self.records, self.ledger, self.usual
        );
        for e in &self.errors {
            out.push_str(&format!("\n[bench] cleanup incomplete: {e}"));
        }
        out
    }
}

/// Deletes a run's rows (records under its scopes, rows of (a) and (a'), ledger rows) in
/// bounded batches (`CLEANUP_BATCH` rows a statement), and says how many. `keys_from` is the
/// first UUIDv7 text a key of this bench can have ([`keys_floor`]).
async fn cleanup(pool: &PgPool, run_id: &str, keys_from: &str) -> Cleaned {
    let scopes: Vec<String> = SCOPE_TAGS
        .iter()
        .map(|t| format!("bench-{t}-{run_id}"))
        .collect();
    let mut cleaned = Cleaned::default();
    // The time-ordered records first, in the ranges of days, whose primary key leads with the
    // key (layout/ranges.rs): found from the first key this bench can have made, page after
    // page in the order of the keys (a range's rows are not found by their scope alone but by
    // reading all of it, and without the pages each statement would read again past the rows
    // the last one deleted and the other scopes' keys since the bench began).
    match cleanup_time_ordered(pool, &scopes, keys_from).await {
        Ok(n) => cleaned.records += n,
        Err(e) => cleaned.errors.push(format!("dedup_records: {e}")),
    }
    for (sql, arg, what) in [
        // A ctid is a row's place in its own table: on the partitioned table, with the
        // partition's oid beside it. Then the keys without a time (every key of the single
        // table, whose `kt` is `-infinity`; the untimed partition), found by the scope that
        // leads its primary key.
        (
            "DELETE FROM dedup_records WHERE (tableoid, ctid) IN (SELECT tableoid, ctid \
             FROM dedup_records WHERE scope = ANY($1::text[]) AND kt < date '1970-01-01' \
             LIMIT $2)",
            scopes,
            "dedup_records",
        ),
        (
            "DELETE FROM dedup_bench_ledger WHERE ctid IN (SELECT ctid FROM dedup_bench_ledger \
             WHERE run = ANY($1::text[]) LIMIT $2)",
            vec![run_id.to_owned()],
            "dedup_bench_ledger",
        ),
        (
            "DELETE FROM dedup_bench_usual WHERE ctid IN (SELECT ctid FROM dedup_bench_usual \
             WHERE starts_with(key, ($1::text[])[1]) LIMIT $2)",
            vec![format!("{run_id}:")],
            "dedup_bench_usual",
        ),
    ] {
        let mut deleted = 0;
        let error = loop {
            match sqlx::query(sql)
                .bind(arg.clone())
                .bind(CLEANUP_BATCH)
                .execute(pool)
                .await
            {
                Ok(d) if d.rows_affected() > 0 => deleted += d.rows_affected(),
                Ok(_) => break None,
                // (a) and (a') did not run, ever: no table, no rows.
                Err(e)
                    if e.as_database_error()
                        .and_then(|d| d.code())
                        .is_some_and(|c| c == "42P01") =>
                {
                    break None;
                }
                Err(e) => break Some(e),
            }
        };
        match what {
            "dedup_records" => cleaned.records += deleted,
            "dedup_bench_ledger" => cleaned.ledger = deleted,
            _ => cleaned.usual = deleted,
        }
        if let Some(e) = error {
            cleaned.errors.push(format!("{what}: {e}"));
        }
    }
    cleaned
}

/// Deletes the records of `scopes` in the ranges of days (`kt` from 1970 on) whose key sorts
/// at or after `keys_from`, `CLEANUP_BATCH` a statement in the order of the keys, each statement
/// going on from the last key the one before it deleted. Says how many.
async fn cleanup_time_ordered(
    pool: &PgPool,
    scopes: &[String],
    keys_from: &str,
) -> Result<u64, sqlx::Error> {
    let mut from = keys_from.as_bytes().to_vec();
    let mut deleted = 0_u64;
    loop {
        let (gone, last): (i64, Option<Vec<u8>>) = sqlx::query_as(
            "WITH doomed AS MATERIALIZED (SELECT tableoid, ctid, key FROM dedup_records \
               WHERE scope = ANY($1::text[]) AND key >= $3 AND kt >= date '1970-01-01' \
               ORDER BY key LIMIT $2), \
             gone AS (DELETE FROM dedup_records \
               WHERE (tableoid, ctid) IN (SELECT tableoid, ctid FROM doomed) RETURNING 1) \
             SELECT (SELECT count(*) FROM gone), \
               (SELECT key FROM doomed ORDER BY key DESC LIMIT 1)",
        )
        .bind(scopes)
        .bind(CLEANUP_BATCH)
        .bind(&from)
        .fetch_one(pool)
        .await?;
        deleted += u64::try_from(gone).unwrap_or(0);
        match last {
            Some(last) if gone > 0 => from = last,
            _ => return Ok(deleted),
        }
    }
}

/// The wall clock in milliseconds since the Unix epoch: the time of the bench's time-ordered
/// keys, and of the floor its cleanup finds them from.
fn unix_ms_now() -> u64 {
    u64::try_from(dedup_core::Timestamp::now().as_micros() / 1000).unwrap_or(0)
}

/// The text every UUIDv7 made at `unix_ms` or later sorts at or after: its first 48 bits, as
/// the key's text writes them (`tttttttt-tttt`). Every time-ordered key of this bench is made
/// at its start or later ([`EventKeys::new`]).
fn keys_floor(unix_ms: u64) -> String {
    format!("{:08x}-{:04x}", unix_ms >> 16, unix_ms & 0xffff)
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
