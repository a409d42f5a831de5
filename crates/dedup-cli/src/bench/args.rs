//! `dedup bench`'s arguments and the keys its events are given.

use clap::Args;
use dedup_core::{IdempotencyKey, Scope};

use super::cleanup::unix_ms_now;
use crate::PgArgs;

/// Compare dedup with the usual Postgres and Redis patterns on one workload.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub(super) pg: PgArgs,
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub(super) redis_url: String,
    /// Events in the stream.
    #[arg(long, default_value_t = 200_000)]
    pub(super) events: u64,
    /// The share of events that repeat an earlier key.
    #[arg(long, default_value_t = 0.3)]
    pub(super) duplicates: f64,
    /// The Zipf exponent of the duplicates' keys (higher: hotter hot keys).
    #[arg(long, default_value_t = 1.1)]
    pub(super) zipf: f64,
    /// Events processed at once, the same for every contender.
    #[arg(long, default_value_t = 256)]
    pub(super) concurrency: usize,
    /// Postgres connections, the same pool for every contender that uses Postgres.
    #[arg(long, default_value_t = 64)]
    pub(super) pg_connections: u32,
    /// Contenders to run, among a, b, c, d, e, f, a', b', e', ek, fk (the Kafka runners), g ((e)
    /// publishing one message per event through the outbox: docs/OUTBOX.md), hn, h0, h0x, h1,
    /// h2, h2l, h3 (HTTP: docs/HTTP.md), ceiling and claim (the claim statement alone on new keys,
    /// beside the ceiling).
    #[arg(
        long,
        default_value = "a,b,c,d,e,f,a',b',e',ek,fk,g,hn,h0,h0x,h1,h2,h2l,h3,ceiling,claim",
        value_delimiter = ','
    )]
    pub(super) only: Vec<String>,
    /// (e), (e'): batch transactions at once; the events in flight (`--concurrency`) are split
    /// among them.
    #[arg(long, default_value_t = 2)]
    pub(super) tx_workers: usize,
    /// (d): the most requests in one batch call.
    #[arg(long, default_value_t = 512)]
    pub(super) batch_max: usize,
    /// (d): batch calls of one kind in flight at once.
    #[arg(long, default_value_t = 2)]
    pub(super) batch_flushes: usize,
    /// Run every contender this many times, interleaved (a, b, ... then a, b, ... again), each
    /// time in a key space of its own: the report gives each contender's median and its min-max,
    /// and the ratios of medians; the JSON carries every run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(super) repeat: u32,
    /// The shape of the event ids: `uuid` (random, as producers make them, landing all over the
    /// primary key), `uuidv7` (time-ordered, as RFC 9562's version 7 makes them: new keys land at
    /// the primary key's right edge), `timed` (random ids, as `uuid`, keyed with their event's
    /// time by `IdempotencyKey::timed`: time-ordered keys again) or `sequential` (`e<n>`, one hot
    /// corner of it, which flatters every figure; the bench's keys before random ones became the
    /// default).
    #[arg(long, value_enum, default_value_t = Keys::Uuid)]
    pub(super) keys: Keys,
    /// The window at size: top the window's scopes (`bench-<tag>-window` of the contenders that
    /// keep records, `bench-<tag>-window-v7` with `--keys uuidv7`) up to this many completed
    /// records in all, with keys of `--keys`'s shape, kept from one bench to the next; then each
    /// run also runs those contenders over the window, beside their run on an empty one. 0: no
    /// window.
    #[arg(long, default_value_t = 0)]
    pub(super) prefill: u64,
    /// With the window: top its scopes up to this many records in all already past their
    /// retention (besides `--prefill`'s), for `--purge-during` to remove.
    #[arg(long, default_value_t = 0)]
    pub(super) expired: u64,
    /// With the window: run the contenders over it a second time with the retention running
    /// (today's bounded DELETE, `dedup purge`), from their start until a statement finds less
    /// than a full batch; the expired records are topped up to `--expired` before each such run.
    #[arg(long)]
    pub(super) purge_during: bool,
    /// The retention's records per statement (`dedup purge --batch`).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub(super) purge_batch: u32,
    /// The retention's pause between two statements, in milliseconds (`dedup purge --every ..
    /// --pause-ms`, `RetentionConfig::pause`).
    #[arg(long, default_value_t = 0)]
    pub(super) purge_pause_ms: u64,
    /// The HTTP contenders: also run each again, on keys of its own, paced (open loop) at this
    /// share of the rate it just reached, and report that pass's latency (measured from each
    /// request's scheduled start, so a stall is not hidden by the requests it held back). 0: no
    /// paced pass ((h3) has none: its keys are done). Needs random or time-ordered keys (not
    /// `--keys sequential`).
    #[arg(long, default_value_t = 0.0)]
    pub(super) paced_share: f64,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub(super) json: bool,
}

/// The shape of the bench's event ids (`--keys`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Keys {
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
pub(super) struct EventKeys {
    pub(super) shape: Keys,
    pub(super) salt: u64,
    pub(super) unix_ms: u64,
}

impl EventKeys {
    /// The `unique` ids of a run, of `shape`, salted with `salt`, made now; time-ordered ones
    /// after every time-ordered id an earlier run of this bench made, even one that ended sooner
    /// than its ids' times (one millisecond every 32 ids).
    pub(super) fn new(shape: Keys, salt: u64, unique: u64) -> Self {
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
    pub(super) fn of(self, id: u64) -> String {
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
    pub(super) fn window(self) -> &'static str {
        if self.time_ordered() {
            "window-v7"
        } else {
            "window"
        }
    }

    /// Whether the keys are UUIDv7s (a time-ordered window, made by `window/` in their shape).
    pub(super) fn time_ordered(self) -> bool {
        matches!(self, Self::Uuidv7 | Self::Timed)
    }

    /// As `--keys` names it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Uuid => "uuid",
            Self::Uuidv7 => "uuidv7",
            Self::Timed => "timed",
            Self::Sequential => "sequential",
        }
    }
}
