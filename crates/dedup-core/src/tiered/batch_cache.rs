//! The caches in front of a batch path that bypasses the `Store` trait (transaction mode by the
//! batch): answers for keys already settled, before the batch's transaction, and copies of what
//! it committed, after.
//!
//! `BatchCache` is the trait, implemented by the tiered store: `settled_many` before the
//! transaction (terminal answers only, L1 then one fast-path call, unless the L2 gate says the
//! fast path answers too few of them: `gate.rs`), `committed_many` after the
//! commit (the copies of what it completed or replayed). A replay from the authority carries the
//! stored token and fingerprint (`dedup_pg::BatchAnswer::Replayed`), so a cache that lost a key is
//! refilled by the next batch that meets it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;

use std::time::Duration;

use tokio::time::timeout;
use tracing::warn;

use super::config::bump;
use super::{FastPath, TieredStore};
use crate::key::IdempotencyKey;
use crate::record::{ClaimOutcome, ClaimRequest};
use crate::store::Store;
use crate::tiered::cache::Cached;

/// A boxed future, so that [`BatchCache`] can be a trait object.
pub type CacheFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Caches in front of a batch path's authority. Only terminal answers are taken from them
/// (Completed, Failed, PayloadMismatch): a key in flight, or unknown to the caches, goes to the
/// authority. Copies are written only after the authority committed (invariant: nothing
/// COMPLETED in a cache before the commit).
pub trait BatchCache: Send + Sync + std::fmt::Debug {
    /// For each request, the caches' terminal answer, or `None` (ask the authority). L1 first,
    /// then one fast-path call for the rest.
    fn settled_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> CacheFuture<'a, Vec<Option<ClaimOutcome>>>;

    /// Copies of records the authority has just committed (`(key, copy, how long to keep it)`;
    /// terminal copies go to L1 too), to the fast path in one call.
    fn committed_many(
        &self,
        copies: Vec<(IdempotencyKey, Cached, Duration)>,
    ) -> CacheFuture<'_, ()>;
}

impl<A, F> BatchCache for TieredStore<A, F>
where
    A: Store + Send + Sync + std::fmt::Debug,
    F: FastPath + std::fmt::Debug,
{
    fn settled_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> CacheFuture<'a, Vec<Option<ClaimOutcome>>> {
        Box::pin(async move {
            let mut out: Vec<Option<ClaimOutcome>> = Vec::with_capacity(reqs.len());
            let mut pending = Vec::new();
            for (i, req) in reqs.iter().enumerate() {
                match self.l1_answer(req) {
                    Some(answer) => out.push(Some(answer)),
                    None => {
                        bump(&self.counters.l1_misses);
                        pending.push(i);
                        out.push(None);
                    }
                }
            }
            if pending.is_empty() {
                return out;
            }
            let asked = pending.len();
            // As for batch claims: while the fast path answers almost none of the keys L1
            // misses, the authority is asked straight away (one lookup in 16 still asks).
            if !self.gate.ask() {
                self.counters
                    .l2_bypassed
                    .fetch_add(asked as u64, Ordering::Relaxed);
                self.counters
                    .authority_claims
                    .fetch_add(asked as u64, Ordering::Relaxed);
                bump(&self.counters.authority_calls);
                return out;
            }
            let keys: Vec<_> = pending.iter().map(|&i| reqs[i].key.clone()).collect();
            let Ok(found) = timeout(self.config.l2_timeout, self.fast.lookup_many(&keys)).await
            else {
                bump(&self.counters.l2_timeouts);
                warn!(
                    n = keys.len(),
                    "fast path batch lookup timed out; asking the authority"
                );
                self.counters
                    .authority_claims
                    .fetch_add(asked as u64, Ordering::Relaxed);
                return out;
            };
            for (i, got) in pending.into_iter().zip(found) {
                match got {
                    // A marker says someone holds the key; the batch's own lock decides that.
                    Ok(Some(copy)) if copy.state.is_terminal() => {
                        out[i] = self.l2_answer(&reqs[i], copy);
                    }
                    Ok(_) => bump(&self.counters.l2_misses),
                    Err(e) => {
                        bump(&self.counters.l2_errors);
                        warn!(key = %reqs[i].key, error = %e, "fast path lookup failed; asking the authority");
                    }
                }
            }
            let left = out.iter().filter(|a| a.is_none()).count();
            self.gate.observe(asked, asked.saturating_sub(left));
            self.counters
                .authority_claims
                .fetch_add(left as u64, Ordering::Relaxed);
            bump(&self.counters.authority_calls);
            out
        })
    }

    fn committed_many(
        &self,
        copies: Vec<(IdempotencyKey, Cached, Duration)>,
    ) -> CacheFuture<'_, ()> {
        Box::pin(self.backfill_many(copies))
    }
}
