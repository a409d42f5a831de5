//! The workloads dedup is measured and shown on: one seeded generator, shared by `dedup bench`,
//! `dedup demo`, the criterion benches and the examples, so that every figure comes from the same
//! kind of stream and a change to it is made once.
//!
//! A stream has an exact number of distinct event ids (`0..unique`, in order of first
//! appearance); each duplicate repeats an id already seen: a *recent* one (a redelivery after a
//! rebalance or a crash replays the last events) or a *hot* one (a Zipf-skewed pick, the oldest
//! ids the most frequent: a producer retrying, a popular entity).
//!
//! ```
//! let w = dedup_workload::Workload::new(1000).with_duplicates(0.3);
//! let s = w.ids();
//! assert_eq!((s.ids.len(), s.unique), (1000, 700));
//! assert_eq!(s.ids, w.ids().ids, "the same seed, the same stream");
//! ```

/// Event `id`'s event id as producers make them: a random-looking UUID (version 4 shape,
/// 36 characters), the same for the same `id` and different for different ones. Keys shaped
/// like this land all over a B-tree index, as a live stream's do; `e<id>` keys land in one hot
/// corner of it and flatter every figure.
///
/// ```
/// let a = dedup_workload::event_id(7);
/// assert_eq!(a.len(), 36);
/// assert_eq!(a, dedup_workload::event_id(7));
/// assert_ne!(a, dedup_workload::event_id(8));
/// assert_eq!(&a[14..15], "4");
/// ```
pub fn event_id(id: u64) -> String {
    // splitmix64's finaliser: 122 of the two mixes' bits are shown (the version and variant take
    // the rest), so two ids meet with odds of about 2^-122 per pair.
    let hi = mix(id ^ 0x005e_ed0f_e7e4_7d5a);
    let lo = mix(hi ^ id.rotate_left(17));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0x0fff,
        0x8000 | ((lo >> 48) & 0x3fff),
        lo & 0xffff_ffff_ffff
    )
}

/// Event `id`'s event id as a producer that makes time-ordered ids (UUIDv7, RFC 9562) makes it:
/// the first 48 bits are `unix_ms`, the milliseconds since the Unix epoch when it was made, the
/// rest random-looking (the same for the same `id`). Ids made later sort later, byte by byte as
/// text too, so a stream's new keys land at the right edge of a B-tree index instead of all over
/// it.
///
/// ```
/// let a = dedup_workload::time_ordered_event_id(1_764_000_000_000, 7);
/// assert_eq!(a.len(), 36);
/// assert_eq!(&a[14..15], "7");
/// assert_eq!(&a[..13], "019ab697-e800", "the time, in milliseconds");
/// assert!(a < dedup_workload::time_ordered_event_id(1_764_000_000_001, 6));
/// assert_ne!(a, dedup_workload::time_ordered_event_id(1_764_000_000_000, 8));
/// ```
pub fn time_ordered_event_id(unix_ms: u64, id: u64) -> String {
    let hi = mix(id ^ 0x7e7e_0d3e_5a17_c0de);
    let lo = mix(hi ^ id.rotate_left(29));
    let ms = unix_ms & 0xffff_ffff_ffff;
    format!(
        "{:08x}-{:04x}-7{:03x}-{:04x}-{:012x}",
        ms >> 16,
        ms & 0xffff,
        hi & 0x0fff,
        0x8000 | ((lo >> 48) & 0x3fff),
        lo & 0xffff_ffff_ffff
    )
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A 64-bit linear congruential generator (Knuth's MMIX constants): fast, seeded, reproducible.
/// For workloads only.
#[derive(Clone, Debug)]
pub struct Lcg(u64);

impl Lcg {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 53 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let x = (self.next_u64() >> 11) as f64 / (1u64 << 42) as f64;
        x
    }

    /// A Zipf-distributed rank in `1..=n` with exponent `s` (rank 1 the most frequent), by
    /// inverting the continuous power law's CDF: close to the discrete law, and O(1).
    pub fn zipf(&mut self, n: u64, s: f64) -> u64 {
        if n <= 1 {
            return 1;
        }
        #[allow(clippy::cast_precision_loss)]
        let top = (n + 1) as f64;
        let u = self.unit();
        let x = if (s - 1.0).abs() < 1e-9 {
            top.powf(u)
        } else {
            let a = 1.0 - s;
            (u * (top.powf(a) - 1.0) + 1.0).powf(1.0 / a)
        };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = x as u64;
        rank.clamp(1, n)
    }
}

/// The shape of a stream. [`Workload::new`] gives 30% duplicates, all hot picks with Zipf
/// exponent 1.1 over every id seen, and a fixed seed.
#[derive(Clone, Debug)]
pub struct Workload {
    events: u64,
    duplicates: f64,
    zipf: f64,
    hot: Option<u64>,
    recent: f64,
    window: u64,
    seed: u64,
}

/// A generated stream.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stream {
    /// Event ids in delivery order.
    pub ids: Vec<u64>,
    /// How many distinct ids it holds (`0..unique`).
    pub unique: u64,
}

impl Workload {
    /// `events` deliveries.
    pub fn new(events: u64) -> Self {
        Self {
            events,
            duplicates: 0.3,
            zipf: 1.1,
            hot: None,
            recent: 0.0,
            window: 1000,
            seed: 0x5eed,
        }
    }

    /// The share of deliveries that repeat an earlier id (clamped to `0..=0.99`).
    pub fn with_duplicates(mut self, share: f64) -> Self {
        self.duplicates = share.clamp(0.0, 0.99);
        self
    }

    /// The Zipf exponent of hot picks (higher: hotter hot keys).
    pub fn with_zipf(mut self, exponent: f64) -> Self {
        self.zipf = exponent;
        self
    }

    /// Hot picks fall among the first `n` ids only.
    pub fn with_hot_keys(mut self, n: u64) -> Self {
        self.hot = Some(n.max(1));
        self
    }

    /// The share of duplicates that redeliver one of the last `window` ids instead of a hot one.
    pub fn with_recent(mut self, share: f64, window: u64) -> Self {
        self.recent = share.clamp(0.0, 1.0);
        self.window = window.max(1);
        self
    }

    /// The seed: the same seed and shape give the same stream.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Distinct ids: `round(events * (1 - duplicates))`, at least 1 (for a non-empty stream).
    pub fn unique(&self) -> u64 {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let unique = ((self.events as f64) * (1.0 - self.duplicates)).round() as u64;
        unique.clamp(1, self.events.max(1))
    }

    /// The stream.
    pub fn ids(&self) -> Stream {
        let unique = self.unique();
        let mut rng = Lcg::new(self.seed);
        let mut ids = Vec::with_capacity(usize::try_from(self.events).unwrap_or(0));
        let (mut next_new, mut dups_left) = (0u64, self.events.saturating_sub(unique));
        for i in 0..self.events {
            let left = self.events - i;
            if next_new > 0 && (next_new == unique || rng.below(left) < dups_left) {
                dups_left -= 1;
                // No draw for the choice when every duplicate is hot: the bench's stream stays
                // the one its published figures were measured on.
                let recent = self.recent > 0.0 && rng.unit() < self.recent;
                ids.push(if recent {
                    next_new - 1 - rng.below(next_new.min(self.window))
                } else {
                    rng.zipf(self.hot.map_or(next_new, |h| h.min(next_new)), self.zipf) - 1
                });
            } else {
                ids.push(next_new);
                next_new += 1;
            }
        }
        Stream { ids, unique }
    }
}

/// The ledger event of an id: an account (one of 97) and an amount (1 to 1000). Every
/// `poison_every`-th id (ids `poison_every - 1`, `2 * poison_every - 1`, ...) carries amount -1,
/// which a ledger refuses (poison, for the dead-letter path).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerEvent {
    /// The event id.
    pub id: u64,
    /// The account it books to.
    pub account: u64,
    /// The amount; negative for poison.
    pub amount: i64,
}

impl LedgerEvent {
    /// The event of `id`.
    pub fn new(id: u64, poison_every: u64) -> Self {
        let amount = if poison_every > 0 && id % poison_every == poison_every - 1 {
            -1
        } else {
            i64::try_from(id % 1000).unwrap_or(0) + 1
        };
        Self {
            id,
            account: 1000 + id % 97,
            amount,
        }
    }

    /// Its JSON: `{"id":..,"account":..,"amount":..}`.
    pub fn payload(&self) -> String {
        format!(
            r#"{{"id":{},"account":{},"amount":{}}}"#,
            self.id, self.account, self.amount
        )
    }
}

/// [`LedgerEvent::new`]`(id, poison_every)`'s JSON.
pub fn ledger_payload(id: u64, poison_every: u64) -> String {
    LedgerEvent::new(id, poison_every).payload()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_below_unique_appears_first_in_order() {
        let s = Workload::new(10_000).with_recent(0.5, 100).ids();
        assert_eq!(s.unique, 7000);
        let mut next = 0;
        for &id in &s.ids {
            assert!(id <= next, "{id} before {next}");
            if id == next {
                next += 1;
            }
        }
        assert_eq!(next, s.unique);
    }

    #[test]
    fn hot_picks_are_skewed_and_bounded() {
        let s = Workload::new(100_000)
            .with_duplicates(0.5)
            .with_hot_keys(50)
            .ids();
        let mut seen = std::collections::HashSet::new();
        let mut hot = 0;
        for &id in &s.ids {
            if !seen.insert(id) {
                assert!(id < 50, "a hot pick among the first 50 ids");
                hot += u64::from(id < 5);
            }
        }
        assert!(hot > 10_000, "the first 5 ids take a large share: {hot}");
    }

    #[test]
    fn event_ids_are_unique_and_spread() {
        let ids: std::collections::HashSet<String> = (0..200_000).map(event_id).collect();
        assert_eq!(ids.len(), 200_000);
        // Consecutive ids do not share a prefix: they land all over an index.
        let firsts: std::collections::HashSet<char> =
            (0..64).filter_map(|i| event_id(i).chars().next()).collect();
        assert!(firsts.len() > 10, "{firsts:?}");
    }

    #[test]
    fn poison_is_periodic() {
        assert!(ledger_payload(996, 997).contains("\"amount\":-1"));
        assert!(ledger_payload(995, 997).contains("\"amount\":996"));
        assert_eq!(
            ledger_payload(3, 997),
            r#"{"id":3,"account":1003,"amount":4}"#
        );
    }
}
