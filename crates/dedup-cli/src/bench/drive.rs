//! What every contender shares: driving the stream at the bench's concurrency, and the latencies.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{Ctx, window};

/// The `p` percentile of `sorted` (µs) in milliseconds; `None` where it is empty.
pub(super) fn percentile_ms(sorted: &[u64], p: f64) -> Option<f64> {
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
pub(super) struct Latencies {
    pub(super) all: Vec<u64>,
    pub(super) dropping: Vec<u64>,
}

impl Latencies {
    /// `n` events that took `us` each, started when the drop stood at `phase`.
    pub(super) fn record(&mut self, us: u64, n: usize, phase: u64) {
        self.all.extend(std::iter::repeat_n(us, n));
        if window::overlapped(phase) {
            self.dropping.extend(std::iter::repeat_n(us, n));
        }
    }

    /// Another task's.
    pub(super) fn merge(&mut self, other: Self) {
        self.all.extend(other.all);
        self.dropping.extend(other.dropping);
    }

    pub(super) fn sorted(mut self) -> Self {
        self.all.sort_unstable();
        self.dropping.sort_unstable();
        self
    }
}

/// Runs `one` on every event of the stream from `concurrency` tasks; answers the time taken, each
/// event's latency and the number of errors.
pub(super) async fn drive<F, Fut>(ctx: &Ctx, one: F) -> (Duration, Latencies, u64)
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

pub(super) fn result_of(id: u64) -> String {
    format!("done:{id}")
}
