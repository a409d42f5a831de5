//! Criterion benches of dedup's decisions. `cargo bench -p dedup-benches` for figures (with
//! `DATABASE_URL` and `REDIS_URL` from `scripts/services.sh`); `scripts/test` runs each once
//! (`cargo test --benches`) so they cannot rot.

#![allow(clippy::unwrap_used, missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use dedup_core::{
    ClaimOutcome, ClaimRequest, FastPath, IdempotencyKey, MemoryStore, NoFastPath, OwnerId, Scope,
    Store, TieredConfig, TieredStore,
};
use dedup_pg::PgStore;
use dedup_redis::RedisFastPath;
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

/// A duplicate answered by L1: the hot path of a consumer that sees its own duplicates.
fn l1_hit(c: &mut Criterion) {
    let rt = runtime();
    let store = TieredStore::new(MemoryStore::new(), NoFastPath, TieredConfig::default());
    let k = key("bench", "l1-hot");
    rt.block_on(complete(&store, &k));
    let r = req(&k);
    c.bench_function("l1_hit_decision", |b| {
        b.iter(|| {
            let out = rt.block_on(store.claim(black_box(&r))).unwrap();
            assert!(matches!(out, ClaimOutcome::Completed { .. }));
        });
    });
    assert!(store.stats().l1_hits > 0);
    // What `block_on` alone costs, to read the figure above against.
    c.bench_function("runtime_block_on_baseline", |b| {
        b.iter(|| rt.block_on(async { black_box(1) }));
    });
}

/// One Redis lookup of a completed copy (a pipeline of HGETALL and PTTL).
fn redis_lookup(c: &mut Criterion) {
    let rt = runtime();
    let prefix = format!("bench-{}", std::process::id());
    let fast = rt
        .block_on(RedisFastPath::connect(&env("REDIS_URL")))
        .unwrap()
        .with_prefix(prefix);
    let store = TieredStore::new(MemoryStore::new(), fast, TieredConfig::default());
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
    let pool = rt
        .block_on(sqlx::PgPool::connect(&env("DATABASE_URL")))
        .unwrap();
    rt.block_on(dedup_pg::migrate(&pool)).unwrap();
    let store = PgStore::new(pool);
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

criterion_group!(benches, l1_hit, redis_lookup, pg_claim);
criterion_main!(benches);
