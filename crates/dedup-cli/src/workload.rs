//! Deterministic workloads for the demo and the bench: a small generator and Zipf-skewed picks.

/// A 64-bit linear congruential generator (Knuth's MMIX constants): fast, seeded, reproducible.
/// Not for anything but workloads.
#[derive(Debug)]
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let x = (self.next() >> 11) as f64 / (1u64 << 42) as f64;
        x
    }

    /// A Zipf-distributed rank in `1..=n` with exponent `s` (rank 1 the most frequent), by
    /// inverting the continuous power law's CDF: close to the discrete law, and O(1).
    pub(crate) fn zipf(&mut self, n: u64, s: f64) -> u64 {
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

/// A stream of `events` event ids, `round(events * (1 - duplicates))` of them distinct (ids
/// `0..unique` in order of first appearance); each duplicate repeats an id already seen, picked
/// with Zipf exponent `s` over the ids seen so far (the oldest ids are the hot keys). Returns the
/// stream and the number of distinct ids.
pub(crate) fn zipf_stream(events: u64, duplicates: f64, s: f64, seed: u64) -> (Vec<u64>, u64) {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let unique = ((events as f64) * (1.0 - duplicates.clamp(0.0, 0.99))).round() as u64;
    let unique = unique.clamp(1, events.max(1));
    let mut rng = Lcg(seed);
    let mut out = Vec::with_capacity(usize::try_from(events).unwrap_or(0));
    let (mut next_new, mut dups_left) = (0u64, events.saturating_sub(unique));
    for i in 0..events {
        let left = events - i;
        if next_new > 0 && (next_new == unique || rng.below(left) < dups_left) {
            dups_left -= 1;
            out.push(rng.zipf(next_new, s) - 1);
        } else {
            out.push(next_new);
            next_new += 1;
        }
    }
    (out, unique)
}
