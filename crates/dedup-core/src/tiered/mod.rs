//! Three tiers, one authority: an in-process L1 (`quick_cache`), a fast path L2 (Redis, through
//! the [`FastPath`] trait) and the authority (Postgres, any [`Store`]).
//!
//! - L1 holds only terminal outcomes (COMPLETED, FAILED): bounded by entries and by bytes, each
//!   entry living no longer than its record's retention.
//! - L2 holds terminal outcomes and live IN_PROGRESS markers that expire with their lease.
//! - Only the authority grants a lease. A cache may answer Completed, Failed, PayloadMismatch or
//!   InFlight; it never answers Acquired.
//! - Caches learn an outcome only after the authority has it (backfill after commit).
//! - A miss, an error or a timeout in a cache falls through to the authority: losing a cache costs
//!   speed, never a second effect.
//!
//! Here: `TieredStore<A: Store, F: FastPath>`, the tier machinery (claims through the tiers,
//! backfills, the background writer). `store.rs` is its `Store` implementation; `batch_cache.rs`
//! the caches transaction mode uses (`BatchCache`); `cache.rs` `Cached`, the `FastPath` trait and
//! `NoFastPath`; `l1.rs` L1; `config.rs` the settings and counters; `gate.rs` whether a batch
//! claim asks the fast path; `span.rs` the `dedup.decision` span.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::timeout;
use tracing::warn;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::record::{ClaimOutcome, ClaimRequest, State};
use crate::store::Store;

mod batch_cache;
mod cache;
mod config;
mod gate;
mod l1;
mod span;
mod store;

pub use batch_cache::{BatchCache, CacheFuture};
pub use cache::{Cached, FastPath, NoFastPath};
use config::{Counters, bump};
pub use config::{L1Policy, TierStats, TieredConfig};
pub(crate) use span::{decision_span, record_decision};

/// Which tier answered a claim.
#[derive(Clone, Copy, Debug)]
enum Tier {
    L1,
    L2,
    Authority,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::L2 => "l2",
            Self::Authority => "authority",
        }
    }
}

/// The tiered store: L1, the fast path `F` (L2), and the authority `A`.
pub struct TieredStore<A, F> {
    authority: A,
    fast: F,
    l1: l1::L1,
    config: TieredConfig,
    counters: Arc<Counters>,
    /// Whether batch claims ask the fast path.
    gate: gate::L2Gate,
    /// Where batch backfills go when they are written in the background.
    deferred: Option<mpsc::Sender<Vec<Fill>>>,
}

/// A copy to write to the fast path, and for how long.
type Fill = (IdempotencyKey, Cached, Duration);

/// How many batches of backfills may wait for the background writer before more are dropped
/// (a dropped backfill costs a later lookup its hit, never an answer).
const DEFERRED_BATCHES: usize = 64;

impl<A: fmt::Debug, F: fmt::Debug> fmt::Debug for TieredStore<A, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieredStore")
            .field("authority", &self.authority)
            .field("fast", &self.fast)
            .field("config", &self.config)
            .field("l1_entries", &self.l1.len())
            .finish_non_exhaustive()
    }
}

impl<A: Store, F: FastPath> TieredStore<A, F> {
    /// Puts L1 and `fast` in front of `authority`.
    pub fn new(authority: A, fast: F, config: TieredConfig) -> Self {
        let l1 = l1::L1::new(&config);
        Self {
            authority,
            fast,
            l1,
            gate: gate::L2Gate::new(config.l2_batch_min_hit_rate),
            config,
            counters: Arc::default(),
            deferred: None,
        }
    }

    /// Writes the batch paths' backfills to the fast path from a background task, so that a
    /// batch answers as soon as the authority has: a fast-path write then no longer adds to a
    /// batch's latency. The copies are still sent only after the authority has the outcome, and
    /// single-key calls still backfill before they return. Needs a Tokio runtime (without one,
    /// the store stays as it was) and stops when the store is dropped. At most 64 batches wait;
    /// past that, backfills are dropped and counted in `TierStats::backfills_failed`.
    pub fn with_background_backfill(mut self) -> Self
    where
        F: Clone + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            warn!("no Tokio runtime: batch backfills stay in the foreground");
            return self;
        };
        let (tx, mut rx) = mpsc::channel::<Vec<Fill>>(DEFERRED_BATCHES);
        // Off the critical path, a large pipeline may take longer than a lookup's timeout.
        let (fast, counters, limit) = (
            self.fast.clone(),
            Arc::clone(&self.counters),
            self.config.l2_timeout.max(Duration::from_secs(1)),
        );
        runtime.spawn(async move {
            while let Some(mut items) = rx.recv().await {
                // Whatever else is waiting goes in the same pipeline.
                while let Ok(more) = rx.try_recv() {
                    items.extend(more);
                }
                write_fills(&fast, &counters, limit, &items).await;
            }
        });
        self.deferred = Some(tx);
        self
    }

    /// The authority.
    pub fn authority(&self) -> &A {
        &self.authority
    }

    /// The fast path.
    pub fn fast_path(&self) -> &F {
        &self.fast
    }

    /// Drops every L1 entry (for tests and operators; never needed for correctness).
    pub fn clear_l1(&self) {
        self.l1.clear();
    }

    /// How many entries L1 holds (expired ones included until a lookup or an eviction meets them).
    pub fn l1_entry_count(&self) -> u64 {
        self.l1.len()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TierStats {
        let c = &*self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            l1_hits: n(&c.l1_hits),
            l1_misses: n(&c.l1_misses),
            l2_hits: n(&c.l2_hits),
            l2_misses: n(&c.l2_misses),
            l2_errors: n(&c.l2_errors),
            l2_timeouts: n(&c.l2_timeouts),
            l2_bypassed: n(&c.l2_bypassed),
            backfills: n(&c.backfills),
            backfills_refused: n(&c.backfills_refused),
            backfills_failed: n(&c.backfills_failed),
            authority_claims: n(&c.authority_claims),
            authority_calls: n(&c.authority_calls),
        }
    }

    /// Runs a fast-path call under the timeout; errors and timeouts are counted, logged and
    /// turned into `None`.
    async fn fast<T>(
        &self,
        what: &str,
        key: &IdempotencyKey,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        match timeout(self.config.l2_timeout, call).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                bump(&self.counters.l2_errors);
                warn!(key = %key, error = %e, "fast path {what} failed; falling through");
                None
            }
            Err(_) => {
                bump(&self.counters.l2_timeouts);
                warn!(key = %key, "fast path {what} timed out; falling through");
                None
            }
        }
    }

    /// Writes a copy the authority already holds to L2 (and, if terminal, to L1).
    async fn backfill(&self, key: &IdempotencyKey, copy: Cached, ttl: Duration) {
        if copy.state.is_terminal() {
            self.fill_l1(key, copy.clone(), ttl);
        }
        match self
            .fast("backfill", key, self.fast.store(key, &copy, ttl))
            .await
        {
            Some(true) => bump(&self.counters.backfills),
            Some(false) => bump(&self.counters.backfills_refused),
            None => bump(&self.counters.backfills_failed),
        }
    }

    /// Writes copies the authority already holds to L2 in one call (and the terminal ones to L1),
    /// or hands them to the background writer.
    async fn backfill_many(&self, items: Vec<Fill>) {
        if items.is_empty() {
            return;
        }
        for (key, copy, ttl) in &items {
            if copy.state.is_terminal() {
                self.fill_l1(key, copy.clone(), *ttl);
            }
        }
        if let Some(tx) = &self.deferred {
            if let Err(e) = tx.try_send(items) {
                // Not a Redis error: the writer is behind. Counted per copy, as dropped.
                let n = match e {
                    mpsc::error::TrySendError::Full(v) | mpsc::error::TrySendError::Closed(v) => {
                        v.len()
                    }
                };
                self.counters
                    .backfills_failed
                    .fetch_add(n as u64, Ordering::Relaxed);
                warn!(
                    n,
                    "background backfill queue full; dropping these backfills"
                );
            }
            return;
        }
        write_fills(&self.fast, &self.counters, self.config.l2_timeout, &items).await;
    }

    /// Answers what the fast path can of `reqs[i]` for each `i` in `pending` (filling `out`);
    /// returns the indexes it could not answer.
    async fn lookup_pending(
        &self,
        reqs: &[ClaimRequest],
        pending: Vec<usize>,
        out: &mut [Option<Result<ClaimOutcome, StoreError>>],
    ) -> Vec<usize> {
        let keys: Vec<IdempotencyKey> = pending.iter().map(|&i| reqs[i].key.clone()).collect();
        let Ok(found) = timeout(self.config.l2_timeout, self.fast.lookup_many(&keys)).await else {
            bump(&self.counters.l2_timeouts);
            warn!(
                n = keys.len(),
                "fast path batch lookup timed out; falling through"
            );
            return pending;
        };
        let mut rest = Vec::with_capacity(pending.len());
        for (i, got) in pending.into_iter().zip(found) {
            let req = &reqs[i];
            match got {
                Ok(Some(copy)) => {
                    if let Some(answer) = self.l2_answer(req, copy) {
                        out[i] = Some(Ok(answer));
                        continue;
                    }
                }
                Ok(None) => bump(&self.counters.l2_misses),
                Err(e) => {
                    bump(&self.counters.l2_errors);
                    warn!(key = %req.key, error = %e, "fast path lookup failed; falling through");
                }
            }
            rest.push(i);
        }
        rest
    }

    /// [`Store::claim_batch`]: L1, then one fast-path call (unless the gate says the fast path
    /// is answering too few batch keys to be worth asking: `gate.rs`), then one authority call.
    async fn claim_batch_tiered(
        &self,
        reqs: &[ClaimRequest],
        span: &tracing::Span,
    ) -> Vec<Result<ClaimOutcome, StoreError>> {
        let mut out: Vec<Option<Result<ClaimOutcome, StoreError>>> = Vec::with_capacity(reqs.len());
        let mut pending = Vec::new();
        for (i, req) in reqs.iter().enumerate() {
            let answer = match req.policy.validate() {
                Err(e) => Some(Err(e.into())),
                Ok(()) => self.l1_answer(req).map(Ok),
            };
            if answer.is_none() {
                bump(&self.counters.l1_misses);
                pending.push(i);
            }
            out.push(answer);
        }
        if pending.is_empty() {
            span.record("l2_asked", 0);
        } else {
            if self.gate.ask() {
                let asked = pending.len();
                span.record("l2_asked", asked);
                pending = self.lookup_pending(reqs, pending, &mut out).await;
                self.gate.observe(asked, asked - pending.len());
            } else {
                span.record("l2_asked", 0);
                self.counters
                    .l2_bypassed
                    .fetch_add(pending.len() as u64, Ordering::Relaxed);
            }
        }
        span.record("authority_asked", pending.len());
        if !pending.is_empty() {
            let sub: Vec<ClaimRequest> = pending.iter().map(|&i| reqs[i].clone()).collect();
            self.counters
                .authority_claims
                .fetch_add(sub.len() as u64, Ordering::Relaxed);
            bump(&self.counters.authority_calls);
            let answers = self.authority.claim_batch(&sub).await;
            let mut fills = Vec::new();
            for ((i, req), answer) in pending.into_iter().zip(sub).zip(answers) {
                // A batch writes no IN_PROGRESS markers: a concurrent duplicate elsewhere asks
                // the authority, which answers InFlight in its own batch statement, and each
                // unique key costs the fast path one lookup and one terminal copy, not three.
                if let Ok(outcome) = &answer
                    && !matches!(outcome, ClaimOutcome::Acquired(_))
                    && let Some((copy, ttl)) = authority_copy(&req, outcome)
                {
                    fills.push((req.key, copy, ttl));
                }
                out[i] = Some(answer);
            }
            self.backfill_many(fills).await;
        }
        out.into_iter()
            .zip(reqs)
            .map(|(answer, req)| {
                // Every index was answered above; a hole would be a bug, reported, not a panic.
                answer.unwrap_or_else(|| {
                    Err(StoreError::Corrupt {
                        key: req.key.clone(),
                        detail: "the batch left this request unanswered".into(),
                    })
                })
            })
            .collect()
    }

    fn fill_l1(&self, key: &IdempotencyKey, copy: Cached, ttl: Duration) {
        let ttl = ttl
            .min(self.config.l1_ttl)
            .min(copy.expires_in.unwrap_or(Duration::MAX));
        if copy.state.is_terminal() {
            self.l1.insert(key, copy, ttl);
        }
    }

    fn retention_of(copy: &Cached, lease_policy: crate::Policy) -> Duration {
        if copy.state == State::Failed {
            lease_policy.failed_retention
        } else {
            lease_policy.retention
        }
    }

    /// What a fast-path copy lets us answer, counting the hit or the miss; a terminal copy that
    /// answers goes to L1 too.
    fn l2_answer(&self, req: &ClaimRequest, copy: Cached) -> Option<ClaimOutcome> {
        let Some(answer) = copy.answer(req) else {
            bump(&self.counters.l2_misses);
            return None;
        };
        bump(&self.counters.l2_hits);
        if copy.state.is_terminal() {
            let ttl = Self::retention_of(&copy, req.policy);
            self.fill_l1(&req.key, copy, ttl);
        }
        Some(answer)
    }

    /// L1's answer, counting the hit.
    fn l1_answer(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        let answer = self.l1.get(&req.key)?.copy.answer(req)?;
        bump(&self.counters.l1_hits);
        Some(answer)
    }

    async fn claim_tiered(&self, req: &ClaimRequest) -> Result<(ClaimOutcome, Tier), StoreError> {
        if let Some(answer) = self.l1_answer(req) {
            return Ok((answer, Tier::L1));
        }
        bump(&self.counters.l1_misses);
        match self
            .fast("lookup", &req.key, self.fast.lookup(&req.key))
            .await
        {
            Some(Some(copy)) => {
                if let Some(answer) = self.l2_answer(req, copy) {
                    return Ok((answer, Tier::L2));
                }
            }
            Some(None) => bump(&self.counters.l2_misses),
            None => {}
        }
        bump(&self.counters.authority_claims);
        bump(&self.counters.authority_calls);
        let outcome = self.authority.claim(req).await?;
        if let Some((copy, ttl)) = authority_copy(req, &outcome) {
            self.backfill(&req.key, copy, ttl).await;
        }
        Ok((outcome, Tier::Authority))
    }
}

/// The copy the fast tiers get after the authority answered a claim, and for how long: a granted
/// lease's IN_PROGRESS marker (concurrent duplicates then get InFlight from L2 without asking the
/// authority; single claims only), or the completed record the authority showed (restoring the fast tiers after a
/// flush, a restart or an eviction). Failed answers are not copied: their token is not known
/// here, and poison keys are rare.
fn authority_copy(req: &ClaimRequest, outcome: &ClaimOutcome) -> Option<(Cached, Duration)> {
    match outcome {
        ClaimOutcome::Acquired(lease) => Some((Cached::in_progress(lease), lease.policy.lease)),
        ClaimOutcome::Completed {
            result,
            token,
            fingerprint,
        } => {
            let mut copy = Cached::new(State::Completed, *token);
            copy.fingerprint = *fingerprint;
            copy.result = Some(result.clone());
            Some((copy, req.policy.retention))
        }
        _ => None,
    }
}

/// Writes `items` to the fast path in one call, counting what happened.
async fn write_fills<F: FastPath>(fast: &F, counters: &Counters, limit: Duration, items: &[Fill]) {
    match timeout(limit, fast.store_many(items)).await {
        Ok(written) => {
            for (w, (key, _, _)) in written.into_iter().zip(items) {
                match w {
                    Ok(true) => bump(&counters.backfills),
                    Ok(false) => bump(&counters.backfills_refused),
                    Err(e) => {
                        bump(&counters.l2_errors);
                        bump(&counters.backfills_failed);
                        warn!(key = %key, error = %e, "fast path backfill failed");
                    }
                }
            }
        }
        Err(_) => {
            bump(&counters.l2_timeouts);
            counters
                .backfills_failed
                .fetch_add(items.len() as u64, Ordering::Relaxed);
            warn!(n = items.len(), "fast path batch backfill timed out");
        }
    }
}
