//! [`EngineStore`]: the store everything built from an engine claims through, opaque so that
//! `Engine::dedup()` answers a type a user can name without the tiers in it.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use dedup_core::{
    Adoption, AfterFailure, Batched, ClaimOutcome, ClaimRequest, IdempotencyKey, InstanceId, Lease,
    Record, Store, StoreError, Timestamp,
};

use super::Tiers;

/// The engine's store: L1 in the process and Redis (if any) in front of Postgres, with concurrent
/// claims and completions sent to Postgres in batches (group commit). `engine.dedup()` is a
/// [`Dedup<EngineStore>`](dedup_core::Dedup); clones share everything.
#[derive(Clone)]
pub struct EngineStore(pub(crate) Arc<Batched<Arc<Tiers>>>);

impl fmt::Debug for EngineStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("EngineStore").field(&self.0).finish()
    }
}

impl Store for EngineStore {
    fn claim(
        &self,
        req: &ClaimRequest,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
        self.0.claim(req)
    }
    fn complete(
        &self,
        lease: &Lease,
        result: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.complete(lease, result)
    }
    fn fail_retryable(
        &self,
        lease: &Lease,
        error: &str,
    ) -> impl Future<Output = Result<AfterFailure, StoreError>> + Send {
        self.0.fail_retryable(lease, error)
    }
    fn fail_permanent(
        &self,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.fail_permanent(lease, reason)
    }
    fn withdraw(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.0.withdraw(lease)
    }
    fn extend(&self, lease: &Lease) -> impl Future<Output = Result<Timestamp, StoreError>> + Send {
        self.0.extend(lease)
    }
    fn get(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.0.get(key)
    }
    fn purge(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send {
        self.0.purge(limit)
    }
    fn committed(&self, lease: &Lease, result: &[u8]) -> impl Future<Output = ()> + Send {
        self.0.committed(lease, result)
    }
    fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        self.0.answer_cached(req)
    }
    fn claim_batch(
        &self,
        reqs: &[ClaimRequest],
    ) -> impl Future<Output = Vec<Result<ClaimOutcome, StoreError>>> + Send {
        self.0.claim_batch(reqs)
    }
    fn complete_batch(
        &self,
        items: &[(Lease, Bytes)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        self.0.complete_batch(items)
    }
    fn extend_batch(
        &self,
        leases: &[Lease],
    ) -> impl Future<Output = Vec<Result<Timestamp, StoreError>>> + Send {
        self.0.extend_batch(leases)
    }
    fn adopt(
        &self,
        instance: &InstanceId,
        mine: &str,
    ) -> impl Future<Output = Result<Adoption, StoreError>> + Send {
        self.0.adopt(instance, mine)
    }
}
