//! L1: the in-process cache of terminal outcomes, on `quick_cache` (a sharded hash table with
//! CLOCK-Pro eviction and no housekeeping of its own; an insert allocates the entry's `Arc`, the
//! tables only when they grow). It replaced moka, whose table rehashing, housekeeping and
//! per-entry allocations were a quarter of the engine's CPU in lease mode (docs/PERFORMANCE.md).
//!
//! Bounded by bytes and, through a per-entry floor (`max_bytes / max_entries`), by entries. An
//! entry carries its deadline (never past the record's retention nor `l1_ttl`) and is answered
//! only before it: a lookup that finds it past due removes it and misses. Expired entries that no
//! lookup meets are evicted by capacity like any other. An entry heavier than its shard's hot
//! share is not held; `Layout` cuts the table so that every entry up to 64 KiB is (in an L1 of
//! under ~1.3 MB, up to a twentieth of its bytes). Besides the entries, quick_cache remembers up
//! to half as many evicted keys (a hash and a slot each, about 80 bytes), outside the byte
//! bound.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quick_cache::sync::{Cache, DefaultLifecycle};
use quick_cache::{OptionsBuilder, Weighter};

use super::cache::Cached;
use super::config::{L1Policy, TieredConfig};
use crate::key::IdempotencyKey;

/// A terminal copy and the moment it stops being answered.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) copy: Cached,
    until: Instant,
}

/// An entry weighs its bytes, at least `floor`.
#[derive(Clone)]
struct Weigh {
    floor: u64,
}

impl Weighter<IdempotencyKey, Arc<Entry>> for Weigh {
    fn weight(&self, k: &IdempotencyKey, v: &Arc<Entry>) -> u64 {
        let size = k.key_bytes().len() + k.scope().as_str().len() + v.copy.size();
        u64::try_from(size).unwrap_or(u64::MAX).max(self.floor)
    }
}

/// Passes an `IdempotencyKey`'s digest through: the key is already hashed once, with a keyed
/// SipHash, when it is built (see `key/`), so hashing it again would only cost.
#[derive(Default)]
struct Digest(u64);

impl Hasher for Digest {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached by `IdempotencyKey` (it writes one u64); kept correct for any other input.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Table = Cache<
    IdempotencyKey,
    Arc<Entry>,
    Weigh,
    BuildHasherDefault<Digest>,
    DefaultLifecycle<IdempotencyKey, Arc<Entry>>,
>;

pub(super) struct L1 {
    table: Table,
}

impl L1 {
    pub(super) fn new(config: &TieredConfig) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_layout(&Layout::of(config, cores))
    }

    fn with_layout(l: &Layout) -> Self {
        let table = Cache::with_options(
            OptionsBuilder::new()
                .shards(usize::try_from(l.shards).unwrap_or(1))
                .estimated_items_capacity(usize::try_from(l.estimated).unwrap_or(usize::MAX))
                .weight_capacity(l.bytes)
                .hot_allocation(l.hot)
                .build()
                .expect("both capacities are set"),
            Weigh { floor: l.floor },
            BuildHasherDefault::default(),
            DefaultLifecycle::default(),
        );
        Self { table }
    }

    /// The entry for `key`, if it is still to be answered.
    pub(super) fn get(&self, key: &IdempotencyKey) -> Option<Arc<Entry>> {
        let entry = self.table.get(key)?;
        if Instant::now() < entry.until {
            return Some(entry);
        }
        self.forget(key, &entry);
        None
    }

    /// Removes `key`'s entry if it is still `seen`: a fresher copy another thread wrote after
    /// `seen` was read stays.
    fn forget(&self, key: &IdempotencyKey, seen: &Arc<Entry>) {
        self.table.remove_if(key, |e| Arc::ptr_eq(e, seen));
    }

    /// Holds `copy` for `ttl` (not at all when `ttl` is zero).
    pub(super) fn insert(&self, key: &IdempotencyKey, copy: Cached, ttl: Duration) {
        if ttl.is_zero() {
            return;
        }
        // An L1 copy is at most a cache's guess: a century stands in for "forever".
        let until = Instant::now() + ttl.min(Duration::from_secs(100 * 365 * 86_400));
        self.table
            .insert(key.clone(), Arc::new(Entry { copy, until }));
    }

    pub(super) fn clear(&self) {
        self.table.clear();
    }

    pub(super) fn len(&self) -> u64 {
        u64::try_from(self.table.len()).unwrap_or(u64::MAX)
    }
}

/// The largest entry every L1 holds, where its bytes allow (a fraction of them otherwise).
const HELD: u64 = 64 << 10;

/// How L1's table is cut, from the settings and the cores.
#[derive(Debug, PartialEq)]
struct Layout {
    /// The byte bound, at most 2^60 (quick_cache sums weights in a u64).
    bytes: u64,
    /// Every entry weighs at least this (`bytes / entries`, rounded up), so the byte bound is
    /// also the entry bound.
    floor: u64,
    /// A power of two, at most four per core (quick_cache's default), each of at least 64
    /// entries, and few enough that each shard's hot share holds an entry of [`HELD`] bytes (or
    /// of the whole hot share of `bytes`, when that is less): quick_cache does not hold an
    /// entry heavier than its shard's hot share.
    shards: u64,
    hot: f64,
    /// What quick_cache sizes its memory of evicted keys by (half of this): the entries L1 can
    /// hold at the lightest a copy weighs (96 bytes), not more.
    estimated: u64,
}

impl Layout {
    fn of(config: &TieredConfig, cores: usize) -> Self {
        let bytes = config.l1_max_bytes.clamp(1, 1 << 60);
        let entries = config.l1_max_entries.clamp(1, bytes);
        let floor = bytes.div_ceil(entries);
        let share = hot_share(config.l1_policy);
        let held = (HELD as f64).min(share * bytes as f64);
        let mut shards = u64::try_from(cores.max(1) * 4)
            .unwrap_or(1 << 10)
            .min(1 << 10)
            .next_power_of_two();
        while shards > 1 && (entries / shards < 64 || share * ((bytes / shards) as f64) < held) {
            shards /= 2;
        }
        let shard_bytes = bytes.div_ceil(shards);
        // A few entries of the floor's weight always fit the hot share, however small L1 is.
        let hot = share.max(4.0 * floor as f64 / shard_bytes as f64).min(1.0);
        Self {
            bytes,
            floor,
            shards,
            hot,
            estimated: entries.min(bytes / 96).max(1),
        }
    }

    /// The heaviest entry every shard holds.
    #[cfg(test)]
    fn held(&self) -> u64 {
        (self.hot * self.bytes.div_ceil(self.shards) as f64) as u64
    }
}

/// The share of L1 kept for entries read since they came in ("hot"); new entries wait in the
/// rest, first in first out, and one read there moves them to the hot share. Measured with
/// `dedup-core`'s `l1_policy` example: 5% keeps a replay of the keys seen up to 85% of the
/// capacity back (moka's LRU did too), 50% lost most of it.
fn hot_share(policy: L1Policy) -> f64 {
    match policy {
        L1Policy::Lru => 0.05,
        L1Policy::TinyLfu => 0.97,
    }
}

#[cfg(test)]
mod tests {
    use std::thread::sleep;

    use bytes::Bytes;

    use super::*;
    use crate::key::Scope;
    use crate::record::{FencingToken, State};

    fn key(n: u64) -> IdempotencyKey {
        IdempotencyKey::new(Scope::new("l1").expect("scope"), n.to_be_bytes()).expect("key")
    }

    fn done(result: usize) -> Cached {
        let mut c = Cached::new(State::Completed, FencingToken::new(1));
        c.result = Some(Bytes::from(vec![7u8; result]));
        c
    }

    fn l1(entries: u64, bytes: u64, policy: L1Policy) -> L1 {
        L1::new(
            &TieredConfig::default()
                .with_l1_capacity(entries, bytes)
                .with_l1_policy(policy),
        )
    }

    #[test]
    fn an_entry_is_answered_until_its_deadline_then_dropped() {
        let l1 = l1(100, 1 << 20, L1Policy::Lru);
        l1.insert(&key(1), done(1), Duration::from_millis(300));
        l1.insert(&key(2), done(1), Duration::from_secs(60));
        l1.insert(&key(3), done(1), Duration::ZERO);
        assert!(l1.get(&key(1)).is_some());
        assert!(l1.get(&key(3)).is_none(), "a zero time to live is not held");
        assert_eq!(l1.len(), 2);
        sleep(Duration::from_millis(400));
        assert!(l1.get(&key(1)).is_none(), "past its deadline");
        assert_eq!(l1.len(), 1, "the lookup removed it");
        assert_eq!(l1.get(&key(2)).expect("still live").copy, done(1));
        // A copy written again replaces the old one and its deadline.
        l1.insert(&key(1), done(2), Duration::from_secs(60));
        assert_eq!(l1.get(&key(1)).expect("fresh").copy, done(2));
        l1.clear();
        assert_eq!(l1.len(), 0);
    }

    /// A lookup that meets an entry past due removes that entry only: a fresher copy written
    /// between its read and its removal (another thread's completion) stays. The interleaving is
    /// played step by step: read the stale entry, write the fresh one, then remove.
    #[test]
    fn an_expired_lookup_never_removes_a_fresher_copy() {
        let l1 = l1(100, 1 << 20, L1Policy::Lru);
        let k = key(1);
        l1.insert(&k, done(1), Duration::from_nanos(1));
        let stale = l1.table.get(&k).expect("held until a lookup meets it");
        sleep(Duration::from_millis(1));
        assert!(Instant::now() >= stale.until);
        l1.insert(&k, done(2), Duration::from_secs(60));
        l1.forget(&k, &stale);
        assert_eq!(l1.get(&k).expect("the fresh copy stays").copy, done(2));
        // The entry it read is the one there: removed.
        let fresh = l1.table.get(&k).expect("fresh");
        l1.forget(&k, &fresh);
        assert!(l1.get(&k).is_none());
    }

    #[test]
    fn both_bounds_hold() {
        for policy in [L1Policy::Lru, L1Policy::TinyLfu] {
            // Entries: 1,000 at most, each small.
            let by_entries = l1(1_000, 64 << 20, policy);
            for n in 0..20_000 {
                by_entries.insert(&key(n), done(16), Duration::from_secs(60));
            }
            assert!(
                by_entries.len() <= 1_000,
                "{policy:?}: {}",
                by_entries.len()
            );
            assert!(by_entries.len() >= 500, "{policy:?}: {}", by_entries.len());
            // Bytes: 1 MiB holds at most 256 results of 4 KiB.
            let by_bytes = l1(100_000, 1 << 20, policy);
            for n in 0..20_000 {
                by_bytes.insert(&key(n), done(4096), Duration::from_secs(60));
            }
            assert!(by_bytes.len() <= 256, "{policy:?}: {}", by_bytes.len());
            assert!(by_bytes.len() >= 128, "{policy:?}: {}", by_bytes.len());
        }
    }

    #[test]
    fn every_layout_holds_an_entry_of_64_kib_where_its_bytes_allow() {
        for cores in [1, 2, 4, 16, 64, 512] {
            for policy in [L1Policy::Lru, L1Policy::TinyLfu] {
                for (entries, bytes) in [
                    (100_000, 64 << 20),
                    (100_000, 1 << 20),
                    (10_000_000, 64 << 20),
                    (1_000, 4 << 20),
                    (1, 1),
                    (u64::MAX, u64::MAX),
                    (100, u64::MAX),
                ] {
                    let config = TieredConfig::default()
                        .with_l1_capacity(entries, bytes)
                        .with_l1_policy(policy);
                    let l = Layout::of(&config, cores);
                    let want = HELD.min((hot_share(policy) * l.bytes as f64) as u64);
                    let at = format!("{cores} cores, {policy:?}, {entries}/{bytes}: {l:?}");
                    assert!(l.held() >= want.max(l.floor), "{at}");
                    assert!(
                        l.shards.is_power_of_two() && l.shards <= 4 * cores as u64,
                        "{at}"
                    );
                    assert!(
                        l.bytes <= 1 << 60 && l.estimated <= l.bytes / 96 + 1,
                        "{at}"
                    );
                }
            }
        }
    }

    /// 4 KiB results in an L1 of 1 MiB on a machine of 64 cores are held (with a shard count
    /// from the cores alone, each shard's hot share was 3 KiB and nothing was held).
    #[test]
    fn many_cores_still_hold_ordinary_results() {
        let config = TieredConfig::default().with_l1_capacity(100_000, 1 << 20);
        let l1 = L1::with_layout(&Layout::of(&config, 64));
        for n in 0..1_000 {
            l1.insert(&key(n), done(4096), Duration::from_secs(60));
        }
        assert!(l1.len() >= 128 && l1.len() <= 256, "{}", l1.len());
        assert!(l1.get(&key(999)).is_some());
    }

    /// A byte bound of u64::MAX is taken as 2^60: inserts past the entry bound evict instead
    /// of overflowing the table's weight sum.
    #[test]
    fn an_unbounded_byte_setting_still_bounds_entries() {
        let l1 = l1(100, u64::MAX, L1Policy::Lru);
        for n in 0..1_000 {
            l1.insert(&key(n), done(16), Duration::from_secs(60));
        }
        assert!(l1.len() <= 100 && l1.len() >= 50, "{}", l1.len());
    }

    /// With the defaults, a result of 100 KB is held (an entry heavier than a shard's hot share,
    /// about 400 KB on two cores, is not: L2 and the authority still answer it).
    #[test]
    fn the_default_l1_holds_a_large_result() {
        let l1 = L1::new(&TieredConfig::default());
        l1.insert(&key(1), done(100_000), Duration::from_secs(60));
        assert_eq!(l1.get(&key(1)).expect("held").copy, done(100_000));
    }

    #[test]
    fn a_tiny_l1_still_holds_entries() {
        for policy in [L1Policy::Lru, L1Policy::TinyLfu] {
            for entries in [1u64, 2, 10, 100] {
                let l1 = l1(entries, entries * 4096, policy);
                for n in 0..3 * entries {
                    l1.insert(&key(n), done(16), Duration::from_secs(60));
                }
                assert!(
                    l1.len() >= 1 && l1.len() <= entries,
                    "{policy:?} {entries}: {}",
                    l1.len()
                );
                let last = 3 * entries - 1;
                assert!(
                    l1.get(&key(last)).is_some(),
                    "{policy:?} {entries}: the last key"
                );
            }
        }
    }

    /// The default policy keeps what came in recently, read or not: a replay of the keys seen
    /// 8,000 to 9,000 new keys ago (a partition redelivered after a rebalance) finds them in an
    /// L1 of 10,000 entries, after 30,000 keys of which a tenth were read once.
    #[test]
    fn lru_keeps_the_recent_keys_for_a_replay() {
        let l1 = l1(10_000, 10_000 * 1024, L1Policy::Lru);
        for n in 0..30_000u64 {
            l1.insert(&key(n), done(16), Duration::from_secs(60));
            if n % 10 == 0 && n > 100 {
                assert!(l1.get(&key(n - 50)).is_some(), "a read of a recent key");
            }
        }
        let hits = (21_000..22_000)
            .filter(|n| l1.get(&key(*n)).is_some())
            .count();
        assert!(hits >= 950, "{hits} of 1,000");
    }
}
