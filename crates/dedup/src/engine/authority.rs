//! The engine's authority: Postgres, or (for tests of code built on dedup) the in-memory
//! reference store, as one type.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use dedup_core::{
    Adoption, AfterFailure, ClaimOutcome, ClaimRequest, IdempotencyKey, InstanceId, Lease,
    MemoryStore, Record, Store, StoreError, Timestamp,
};
use dedup_pg::PgStore;

/// What grants the engine's leases and fencing tokens and keeps its records: Postgres, or, in an
/// engine built [`in_memory`](crate::EngineBuilder::in_memory), this process's memory.
#[derive(Clone)]
pub(crate) struct Authority(Kind);

#[derive(Clone)]
enum Kind {
    Postgres(PgStore),
    Memory(Arc<MemoryStore>),
}

impl Authority {
    pub(crate) fn postgres(pg: PgStore) -> Self {
        Self(Kind::Postgres(pg))
    }

    pub(crate) fn memory() -> Self {
        Self(Kind::Memory(Arc::new(MemoryStore::new())))
    }
}

impl fmt::Debug for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Postgres(pg) => pg.fmt(f),
            Kind::Memory(_) => f.write_str("MemoryStore"),
        }
    }
}

/// Why an engine has no Postgres to give: it was built [`in_memory`](crate::EngineBuilder::in_memory).
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error(
    "this engine is in memory (built for tests): it has no Postgres, so no transaction mode, \
     parking or transactional HTTP path"
)]
#[non_exhaustive]
pub struct NoPostgres;

macro_rules! each {
    ($self:ident, $s:ident => $call:expr) => {
        match &$self.0 {
            Kind::Postgres($s) => $call,
            Kind::Memory($s) => $call,
        }
    };
}

impl Store for Authority {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        each!(self, s => s.claim(req).await)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        each!(self, s => s.complete(lease, result).await)
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        each!(self, s => s.fail_retryable(lease, error).await)
    }

    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        each!(self, s => s.withdraw(lease).await)
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        each!(self, s => s.fail_permanent(lease, reason).await)
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        each!(self, s => s.extend(lease).await)
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        each!(self, s => s.get(key).await)
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        each!(self, s => s.purge(limit).await)
    }

    async fn committed(&self, lease: &Lease, result: &[u8]) {
        each!(self, s => s.committed(lease, result).await);
    }

    fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        each!(self, s => s.answer_cached(req))
    }

    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Vec<Result<ClaimOutcome, StoreError>> {
        each!(self, s => s.claim_batch(reqs).await)
    }

    async fn extend_batch(&self, leases: &[Lease]) -> Vec<Result<Timestamp, StoreError>> {
        each!(self, s => s.extend_batch(leases).await)
    }

    async fn adopt(&self, instance: &InstanceId, mine: &str) -> Result<Adoption, StoreError> {
        each!(self, s => s.adopt(instance, mine).await)
    }

    async fn complete_batch(&self, items: &[(Lease, Bytes)]) -> Vec<Result<(), StoreError>> {
        each!(self, s => s.complete_batch(items).await)
    }
}
