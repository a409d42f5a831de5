//! The [`Store`] trait answered through the tiers: a claim asks L1, then L2, then the
//! authority; every write goes to the authority first, and the caches learn a terminal outcome
//! only after it committed.
//!
//! A batch claim filters through L1, asks the fast path once (`FastPath::lookup_many`; not while
//! the fast path answers too few batch keys to be worth a round trip, `gate.rs`), the
//! authority once for the rest, and backfills once (`store_many`), or hands the backfill to the
//! background writer (`TieredStore::with_background_backfill`) so that a batch answers as soon as
//! the authority has. A batch claim writes no IN_PROGRESS markers (a single claim does): a
//! concurrent duplicate elsewhere asks the authority, in a batch statement of its own, so each
//! unique key costs the fast path a lookup and a terminal copy, not three writes. Each batch claim
//! is a `dedup.claim_batch` span (size, keys sent to L2, keys sent to the authority).
//! `extend_batch` extends on the authority only (a marker that expires early only sends a
//! duplicate to the authority). `adopt` also drops the adopted leases' IN_PROGRESS markers, so a
//! duplicate reaches the authority and takes the key over instead of waiting out a marker.

use std::time::Instant;

use bytes::Bytes;
use tracing::{Instrument, info_span};

use super::config::bump;
use super::{Cached, FastPath, TieredStore, decision_span, record_decision};
use crate::error::StoreError;
use crate::instance::{Adoption, InstanceId};
use crate::key::IdempotencyKey;
use crate::machine;
use crate::record::{AfterFailure, ClaimOutcome, ClaimRequest, Lease, Record, Timestamp};
use crate::store::Store;

impl<A: Store, F: FastPath> Store for TieredStore<A, F> {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        req.policy.validate()?;
        let span = decision_span(&req.key);
        let started = Instant::now();
        let res = self.claim_tiered(req).instrument(span.clone()).await;
        if let Ok((outcome, tier)) = &res {
            record_decision(&span, tier.name(), outcome, started);
        }
        res.map(|(outcome, _)| outcome)
    }

    fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        self.l1_answer(req)
    }

    /// L1 first, then one fast-path call for what L1 could not answer, then one authority call
    /// for what the fast path could not settle; then one fast-path call to backfill.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Vec<Result<ClaimOutcome, StoreError>> {
        let span = info_span!(
            "dedup.claim_batch",
            size = reqs.len(),
            l2_asked = tracing::field::Empty,
            authority_asked = tracing::field::Empty,
        );
        self.claim_batch_tiered(reqs, &span)
            .instrument(span.clone())
            .await
    }

    /// One authority call, then one fast-path call to backfill what it completed.
    async fn complete_batch(&self, items: &[(Lease, Bytes)]) -> Vec<Result<(), StoreError>> {
        bump(&self.counters.authority_calls);
        let done = self.authority.complete_batch(items).await;
        let fills = items
            .iter()
            .zip(&done)
            .filter(|(_, r)| r.is_ok())
            .map(|((lease, result), _)| {
                let copy = Cached::completed(lease, result.clone());
                (lease.key.clone(), copy, lease.policy.retention)
            })
            .collect();
        self.backfill_many(fills).await;
        done
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        bump(&self.counters.authority_calls);
        self.authority.complete(lease, result).await?;
        let copy = Cached::completed(lease, Bytes::copy_from_slice(result));
        self.backfill(&lease.key, copy, lease.policy.retention)
            .await;
        Ok(())
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        bump(&self.counters.authority_calls);
        let after = self.authority.fail_retryable(lease, error).await?;
        match after {
            AfterFailure::Released { .. } => {
                let _ = self
                    .fast("release", &lease.key, self.fast.release(lease))
                    .await;
            }
            AfterFailure::Failed { attempts } => {
                let reason =
                    machine::exhausted_reason(attempts, lease.policy.max_attempts, Some(error));
                let copy = Cached::failed(lease, reason);
                self.backfill(&lease.key, copy, lease.policy.failed_retention)
                    .await;
            }
        }
        Ok(after)
    }

    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        bump(&self.counters.authority_calls);
        self.authority.withdraw(lease).await?;
        let _ = self
            .fast("release", &lease.key, self.fast.release(lease))
            .await;
        Ok(())
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        bump(&self.counters.authority_calls);
        self.authority.fail_permanent(lease, reason).await?;
        let copy = Cached::failed(lease, reason.to_owned());
        self.backfill(&lease.key, copy, lease.policy.failed_retention)
            .await;
        Ok(())
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        bump(&self.counters.authority_calls);
        let until = self.authority.extend(lease).await?;
        let _ = self
            .fast(
                "extend",
                &lease.key,
                self.fast.extend(lease, until, lease.policy.lease),
            )
            .await;
        Ok(until)
    }

    /// The authority extends every lease in one call. IN_PROGRESS markers in the fast path are
    /// not extended: one that expires before its lease only makes a concurrent duplicate ask the
    /// authority, which answers InFlight.
    async fn extend_batch(&self, leases: &[Lease]) -> Vec<Result<Timestamp, StoreError>> {
        bump(&self.counters.authority_calls);
        self.authority.extend_batch(leases).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        bump(&self.counters.authority_calls);
        self.authority.get(key).await
    }

    /// The authority adopts; then the adopted leases' IN_PROGRESS markers are dropped, so that a
    /// duplicate asks the authority (and takes the key over) instead of waiting out a marker. A
    /// marker that could not be dropped (the fast path is down) only delays its key until it
    /// expires with the old lease.
    async fn adopt(&self, instance: &InstanceId, mine: &str) -> Result<Adoption, StoreError> {
        bump(&self.counters.authority_calls);
        let adoption = self.authority.adopt(instance, mine).await?;
        if let Adoption::Adopted(records) = &adoption {
            let leases: Vec<Lease> = records.iter().filter_map(Lease::of_record).collect();
            futures_util::future::join_all(
                leases
                    .iter()
                    .map(|lease| self.fast("release", &lease.key, self.fast.release(lease))),
            )
            .await;
        }
        Ok(adoption)
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        bump(&self.counters.authority_calls);
        self.authority.purge(limit).await
    }

    async fn committed(&self, lease: &Lease, result: &[u8]) {
        self.authority.committed(lease, result).await;
        let copy = Cached::completed(lease, Bytes::copy_from_slice(result));
        self.backfill(&lease.key, copy, lease.policy.retention)
            .await;
    }
}
