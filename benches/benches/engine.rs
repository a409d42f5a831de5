//! Criterion benches of dedup's decisions. `cargo bench -p dedup-benches` for figures (with
//! `DATABASE_URL` and `REDIS_URL` from `scripts/services.sh`); `scripts/test` runs each once
//! (`cargo test --benches`) so they cannot rot.
//!
//! Against the real Redis and Postgres: the L1 hit decision (`answer_cached`, and through the
//! async `claim` beside a `block_on` baseline), a Redis lookup, Postgres claims (duplicate and new
//! key), batch claim-and-complete at 1, 10, 100 and 1000 keys (Postgres alone and tiered), the
//! tiered decision on a duplicate-heavy stream, and L1's hit ratio against its capacity on two
//! streams (CSV and SVG under `target/criterion/`). Figures: docs/PERFORMANCE.md.

#![allow(
    clippy::unwrap_used,
    missing_docs,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dedup_core::{
    ClaimOutcome, ClaimRequest, FastPath, IdempotencyKey, Lease, MemoryStore, NoFastPath, OwnerId,
    Scope, Store, TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use dedup_redis::RedisFastPath;
use dedup_workload::Workload;
use tokio::runtime::Runtime;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn key(scope: &str, name: &str) -> IdempotencyKey {
    IdempotencyKey::new(Scope::new(scope).unwrap(), name).unwrap()
}

fn req(key: &IdempotencyKey) -> ClaimRequest {
    ClaimRequest::new(key.clone(), OwnerId::new("bench"))
}

/// Claims and completes `key` in `store`, so that its next claim is a duplicate.
async fn complete<S: Store>(store: &S, key: &IdempotencyKey) {
    match store.claim(&req(key)).await.unwrap() {
        ClaimOutcome::Acquired(lease) => store.complete(&lease, b"done").await.unwrap(),
        other => panic!("expected to acquire {key}, got {other:?}"),
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by scripts/services.sh"))
}

/// The Postgres store of `DATABASE_URL`, migrated.
fn pg_store(rt: &Runtime) -> PgStore {
    let pool = rt
        .block_on(sqlx::PgPool::connect(&env("DATABASE_URL")))
        .unwrap();
    rt.block_on(dedup_pg::migrate(&pool)).unwrap();
    PgStore::new(pool)
}

/// The Redis fast path of `REDIS_URL`, under `prefix`.
fn redis(rt: &Runtime, prefix: &str) -> RedisFastPath {
    rt.block_on(RedisFastPath::connect(&env("REDIS_URL")))
        .unwrap()
        .with_prefix(prefix)
}

/// A duplicate answered by L1: the hot path of a consumer that sees its own duplicates.
fn l1_hit(c: &mut Criterion) {
    let rt = runtime();
    let store = TieredStore::new(MemoryStore::new(), NoFastPath, TieredConfig::default());
    let k = key("bench", "l1-hot");
    rt.block_on(complete(&store, &k));
    let r = req(&k);
    // The decision itself: what `Store::claim` and `Batched` run first, with no I/O.
    c.bench_function("l1_hit_decision", |b| {
        b.iter(|| {
            let out = store.answer_cached(black_box(&r));
            assert!(matches!(out, Some(ClaimOutcome::Completed { .. })));
        });
    });
    // The same through the async `claim` (a tracing span, the timer), driven by `block_on`.
    c.bench_function("l1_hit_claim_block_on", |b| {
        b.iter(|| {
            let out = rt.block_on(store.claim(black_box(&r))).unwrap();
            assert!(matches!(out, ClaimOutcome::Completed { .. }));
        });
        assert!(store.stats().l1_hits > 0);
    });
    // What `block_on` alone costs, to read the figure above against.
    c.bench_function("runtime_block_on_baseline", |b| {
        b.iter(|| rt.block_on(async { black_box(1) }));
    });
}

/// One Redis lookup of a completed copy (a pipeline of HGETALL and PTTL).
fn redis_lookup(c: &mut Criterion) {
    let rt = runtime();
    let prefix = format!("bench-{}", std::process::id());
    let store = TieredStore::new(
        MemoryStore::new(),
        redis(&rt, &prefix),
        TieredConfig::default(),
    );
    let k = key("bench", "redis-hot");
    rt.block_on(complete(&store, &k));
    let fast = store.fast_path();
    c.bench_function("redis_lookup", |b| {
        b.iter(|| {
            let got = rt.block_on(fast.lookup(black_box(&k))).unwrap();
            assert!(got.is_some());
        });
    });
}

/// Postgres claims: a duplicate (a plain read in one statement) and a new key (an insert and a
/// WAL flush, synchronous_commit on).
fn pg_claim(c: &mut Criterion) {
    let rt = runtime();
    let store = pg_store(&rt);
    let scope = format!("bench-{}", std::process::id());
    let dup = key(&scope, "pg-dup");
    rt.block_on(complete(&store, &dup));
    let r = req(&dup);
    let mut g = c.benchmark_group("pg_claim");
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("duplicate", |b| {
        b.iter(|| {
            let out = rt.block_on(store.claim(black_box(&r))).unwrap();
            assert!(matches!(out, ClaimOutcome::Completed { .. }));
        });
    });
    let mut n = 0u64;
    g.bench_function("new_key", |b| {
        b.iter(|| {
            n += 1;
            let k = key(&scope, &format!("pg-new-{n}"));
            let out = rt.block_on(store.claim(&req(&k))).unwrap();
            assert!(matches!(out, ClaimOutcome::Acquired(_)));
        });
    });
    g.finish();
}

/// The tiered store (Redis, Postgres) claiming a batch of new keys and completing it: one Redis
/// pipeline to look up, one statement to claim, one pipeline to backfill the markers; one
/// statement to complete and one pipeline to backfill the results. Throughput is per key.
fn batch_claim(c: &mut Criterion) {
    let rt = runtime();
    let prefix = format!("bench-batch-{}", std::process::id());
    let fast = redis(&rt, &prefix);
    let pg = pg_store(&rt);
    let tiered = TieredStore::new(pg.clone(), fast, TieredConfig::default());
    batch_group(c, &rt, "batch_claim_and_complete/postgres", &pg, &prefix);
    batch_group(c, &rt, "batch_claim_and_complete/tiered", &tiered, &prefix);
}

fn batch_group<S: Store>(c: &mut Criterion, rt: &Runtime, name: &str, store: &S, prefix: &str) {
    let mut g = c.benchmark_group(name);
    g.measurement_time(Duration::from_secs(4));
    g.sample_size(20);
    let mut n = 0u64;
    for size in [1usize, 10, 100, 1000] {
        g.throughput(Throughput::Elements(size as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| {
                let reqs: Vec<ClaimRequest> = (0..size)
                    .map(|_| {
                        n += 1;
                        req(&key(prefix, &format!("{name}-{n}")))
                    })
                    .collect();
                let out = rt.block_on(store.claim_batch(black_box(&reqs)));
                let items: Vec<(Lease, Bytes)> = out
                    .into_iter()
                    .map(|o| match o.unwrap() {
                        ClaimOutcome::Acquired(lease) => (lease, Bytes::from_static(b"done")),
                        other => panic!("expected to acquire, got {other:?}"),
                    })
                    .collect();
                let done = rt.block_on(store.complete_batch(&items));
                assert!(done.iter().all(Result::is_ok));
            });
        });
    }
    g.finish();
}

/// Event ids from the shared workload generator: a share `dup` of them repeat an earlier id,
/// picked Zipf-skewed (exponent 1.1) over the ids seen so far; the rest are new.
fn stream(events: usize, dup: f64, seed: u64) -> Vec<u64> {
    Workload::new(events as u64)
        .with_duplicates(dup)
        .with_zipf(1.1)
        .with_seed(seed)
        .ids()
        .ids
}

/// Claims `id` in `store` and completes it when acquired; says whether it was a duplicate.
async fn decide<S: Store>(store: &S, scope: &str, id: u64) -> bool {
    let k = key(scope, &format!("e{id}"));
    match store.claim(&req(&k)).await.unwrap() {
        ClaimOutcome::Acquired(lease) => {
            store.complete(&lease, b"done").await.unwrap();
            false
        }
        _ => true,
    }
}

/// The tiered decision (L1, Redis, Postgres) on a duplicate-heavy stream: 90% duplicates,
/// Zipf-skewed, so most decisions end in L1 and the rest pay a Redis lookup, a Postgres claim
/// and completion, and the backfills. The figure is the mean cost of one event.
fn tiered_stream(c: &mut Criterion) {
    let rt = runtime();
    let scope = format!("bench-stream-{}", std::process::id());
    let store = TieredStore::new(pg_store(&rt), redis(&rt, &scope), TieredConfig::default());
    let events = stream(1_000_000, 0.9, 11);
    let mut i = 0;
    let mut g = c.benchmark_group("tiered_decision");
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("duplicate_heavy_stream", |b| {
        b.iter(|| {
            let id = events[i % events.len()];
            i += 1;
            rt.block_on(decide(&store, &scope, id))
        });
    });
    g.finish();
}

/// L1's hit ratio against its capacity, on the bench's Zipf stream (30% duplicates) and on a
/// mostly-new stream (5% duplicates): the share of duplicates L1 answered. Written to
/// `target/criterion/l1_hit_ratio.csv` and drawn in `target/criterion/l1_hit_ratio.svg`. The
/// timed part is one L1 decision at each capacity.
fn l1_hit_ratio(c: &mut Criterion) {
    let rt = runtime();
    // Full size under `cargo bench`; small when `cargo test --benches` runs each bench once.
    let events = if std::env::args().any(|a| a == "--bench") {
        200_000
    } else {
        20_000
    };
    let capacities = [100u64, 1_000, 10_000, 100_000];
    let mut rows = Vec::new();
    for (name, dup) in [
        ("zipf_30pct_duplicates", 0.3),
        ("mostly_new_5pct_duplicates", 0.05),
    ] {
        let ids = stream(events, dup, 5);
        for &cap in &capacities {
            let config = TieredConfig::default().with_l1_capacity(cap, 1 << 30);
            let store = TieredStore::new(MemoryStore::new(), NoFastPath, config);
            let mut dups = 0u64;
            for &id in &ids {
                dups += u64::from(rt.block_on(decide(&store, name, id)));
            }
            let hits = store.stats().l1_hits;
            rows.push((name, cap, hits as f64 / dups.max(1) as f64));
        }
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/criterion");
    std::fs::create_dir_all(&dir).unwrap();
    let mut csv = String::from("stream,l1_capacity,hit_ratio\n");
    for (name, cap, ratio) in &rows {
        csv.push_str(&format!("{name},{cap},{ratio:.4}\n"));
    }
    std::fs::write(dir.join("l1_hit_ratio.csv"), &csv).unwrap();
    std::fs::write(dir.join("l1_hit_ratio.svg"), chart(&rows, &capacities)).unwrap();
    eprint!("{csv}");

    let mut g = c.benchmark_group("l1_decision_by_capacity");
    for &cap in &capacities {
        let config = TieredConfig::default().with_l1_capacity(cap, 1 << 30);
        let store = TieredStore::new(MemoryStore::new(), NoFastPath, config);
        let ids = stream(10_000, 0.3, 9);
        for &id in &ids {
            rt.block_on(decide(&store, "cap", id));
        }
        let mut i = 0;
        g.bench_with_input(BenchmarkId::from_parameter(cap), &cap, |b, _| {
            b.iter(|| {
                let r = req(&key("cap", &format!("e{}", ids[i % ids.len()])));
                i += 1;
                black_box(store.answer_cached(&r))
            });
        });
    }
    g.finish();
}

/// A line chart (SVG) of hit ratio against log10(capacity), one line per stream.
fn chart(rows: &[(&str, u64, f64)], capacities: &[u64]) -> String {
    let (w, h, left, bottom) = (640.0, 360.0, 60.0, 40.0);
    let lo = (capacities[0] as f64).log10();
    let hi = (capacities[capacities.len() - 1] as f64).log10();
    let x = |cap: u64| left + ((cap as f64).log10() - lo) / (hi - lo) * (w - left - 20.0);
    let y = |r: f64| (h - bottom) - r * (h - bottom - 20.0);
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n\
         <text x='{left}' y='14'>L1 hit ratio (share of duplicates answered in L1) by L1 capacity</text>\n"
    );
    for tick in [0.0, 0.25, 0.5, 0.75, 1.0] {
        svg.push_str(&format!(
            "<line x1='{left}' x2='{}' y1='{y0}' y2='{y0}' stroke='#ddd'/><text x='20' y='{}'>{tick:.2}</text>\n",
            w - 20.0,
            y(tick) + 4.0,
            y0 = y(tick)
        ));
    }
    for &cap in capacities {
        svg.push_str(&format!(
            "<text x='{}' y='{}' text-anchor='middle'>{cap}</text>\n",
            x(cap),
            h - bottom + 18.0
        ));
    }
    for (stream, colour) in [
        ("zipf_30pct_duplicates", "#1f77b4"),
        ("mostly_new_5pct_duplicates", "#d62728"),
    ] {
        let points: Vec<String> = rows
            .iter()
            .filter(|(n, _, _)| *n == stream)
            .map(|(_, cap, r)| format!("{:.1},{:.1}", x(*cap), y(*r)))
            .collect();
        svg.push_str(&format!(
            "<polyline fill='none' stroke='{colour}' stroke-width='2' points='{}'/>\n",
            points.join(" ")
        ));
        let last = rows
            .iter()
            .rfind(|(n, _, _)| *n == stream)
            .map_or(0.0, |(_, _, r)| *r);
        svg.push_str(&format!(
            "<text x='{}' y='{}' fill='{colour}' text-anchor='end'>{stream}</text>\n",
            w - 24.0,
            y(last) - 6.0
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

criterion_group!(
    benches,
    l1_hit,
    redis_lookup,
    pg_claim,
    batch_claim,
    tiered_stream,
    l1_hit_ratio
);
criterion_main!(benches);
