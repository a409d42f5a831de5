//! Measures L1 hit ratios for the two L1 policies (`L1Policy::TinyLfu`, `L1Policy::Lru`), through
//! the real `TieredStore`
//! (in-memory authority, no fast path), on two streams:
//!
//! - **zipf**: keys drawn from a Zipf(1.0) law over 1,000,000 keys (a skewed duplicate stream);
//! - **mostly-new**: 90% never-seen keys, 10% duplicates, half of them of 100 hot keys and half
//!   of a recent key;
//! - **replay**: never-seen keys, and after every 9,000 of them a replay, in order, of the 1,000
//!   keys seen 7,500 to 8,500 new keys before (a partition redelivered after a rebalance).
//!
//! For each stream, L1 capacity (entries) and policy, it prints the L1 hit ratio and the share of
//! events that could have hit at all (a repeat of a completed key). `cargo run --release -p
//! dedup-core --example l1_policy [-- --events N]`.

#![allow(clippy::print_stdout)]

use std::collections::HashSet;

use dedup_core::{
    ClaimOutcome, ClaimRequest, IdempotencyKey, L1Policy, MemoryStore, NoFastPath, OwnerId, Scope,
    Store, TieredConfig, TieredStore,
};

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }
    fn unit(&mut self) -> f64 {
        (self.next() as f64) / ((1u64 << 53) as f64)
    }
}

fn zipf(events: usize, universe: usize, rng: &mut Lcg) -> Vec<u64> {
    let mut cdf = Vec::with_capacity(universe);
    let mut acc = 0.0;
    for i in 1..=universe {
        acc += 1.0 / i as f64;
        cdf.push(acc);
    }
    (0..events)
        .map(|_| {
            let u = rng.unit() * acc;
            cdf.partition_point(|&c| c < u) as u64
        })
        .collect()
}

fn mostly_new(events: usize, rng: &mut Lcg) -> Vec<u64> {
    let mut out = Vec::with_capacity(events);
    let mut next_new = 1_000u64;
    for i in 0..events {
        let r = rng.next() % 100;
        let k = if r < 90 || i == 0 {
            next_new += 1;
            next_new
        } else if r < 95 {
            rng.next() % 100
        } else {
            out[i - 1 - (rng.next() as usize % i.min(50))]
        };
        out.push(k);
    }
    out
}

const REPLAY_FROM: u64 = 8_500;

fn replay(events: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(events);
    let mut next_new = 10_000_000u64;
    while out.len() < events {
        for _ in 0..9_000 {
            next_new += 1;
            out.push(next_new);
        }
        out.extend(next_new - REPLAY_FROM..next_new - REPLAY_FROM + 1_000);
    }
    out.truncate(events);
    out
}

async fn run(stream: &[u64], capacity: u64, policy: L1Policy) -> (f64, f64) {
    let config = TieredConfig::default()
        .with_l1_capacity(capacity, capacity * 4096)
        .with_l1_policy(policy);
    let store = TieredStore::new(MemoryStore::new(), NoFastPath, config);
    let scope = Scope::new("measure").expect("scope");
    let mut done = HashSet::new();
    let mut possible = 0u64;
    for (i, k) in stream.iter().enumerate() {
        let key = IdempotencyKey::new(scope.clone(), k.to_be_bytes()).expect("key");
        let req = ClaimRequest::new(key, OwnerId::new(format!("o{i}")));
        if done.contains(k) {
            possible += 1;
        }
        if let ClaimOutcome::Acquired(lease) = store.claim(&req).await.expect("claim") {
            store.complete(&lease, b"r").await.expect("complete");
            done.insert(*k);
        }
    }
    let st = store.stats();
    let n = stream.len() as f64;
    (st.l1_hits as f64 / n, possible as f64 / n)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let events = args
        .iter()
        .position(|a| a == "--events")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000usize);
    let mut rng = Lcg(7);
    let streams = [
        ("zipf", zipf(events, 1_000_000, &mut rng)),
        ("mostly-new", mostly_new(events, &mut rng)),
        ("replay", replay(events)),
    ];
    println!("L1 hit ratio by policy ({events} events per stream)");
    println!(
        "{:<11} {:>9} {:>10} {:>9} {:>9}",
        "stream", "capacity", "hittable", "tinylfu", "lru"
    );
    for (name, stream) in &streams {
        for capacity in [1_000u64, 10_000, 100_000] {
            let (tiny, possible) = run(stream, capacity, L1Policy::TinyLfu).await;
            let (lru, _) = run(stream, capacity, L1Policy::Lru).await;
            println!(
                "{name:<11} {capacity:>9} {:>9.1}% {:>8.1}% {:>8.1}%",
                possible * 100.0,
                tiny * 100.0,
                lru * 100.0
            );
        }
    }
}
