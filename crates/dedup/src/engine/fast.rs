//! The engine's fast path (L2): none, one Redis server, or a Redis Cluster, as one type.

use std::time::Duration;

use dedup_core::{Cached, FastPath, IdempotencyKey, Lease, NoFastPath, StoreError, Timestamp};
use dedup_redis::RedisFastPath;
use dedup_redis::redis::cluster_async::ClusterConnection;

/// Which fast path the engine was built with.
#[derive(Clone, Debug)]
pub(crate) enum Fast {
    /// None: L1 and Postgres only.
    Off(NoFastPath),
    /// One Redis server.
    Redis(RedisFastPath),
    /// A Redis Cluster.
    Cluster(RedisFastPath<ClusterConnection>),
}

macro_rules! each {
    ($self:ident, $f:ident => $call:expr) => {
        match $self {
            Fast::Off($f) => $call.await,
            Fast::Redis($f) => $call.await,
            Fast::Cluster($f) => $call.await,
        }
    };
}

impl FastPath for Fast {
    async fn lookup(&self, key: &IdempotencyKey) -> Result<Option<Cached>, StoreError> {
        each!(self, f => f.lookup(key))
    }

    async fn store(
        &self,
        key: &IdempotencyKey,
        copy: &Cached,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        each!(self, f => f.store(key, copy, ttl))
    }

    async fn release(&self, lease: &Lease) -> Result<bool, StoreError> {
        each!(self, f => f.release(lease))
    }

    async fn extend(
        &self,
        lease: &Lease,
        lease_until: Timestamp,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        each!(self, f => f.extend(lease, lease_until, ttl))
    }

    async fn lookup_many(
        &self,
        keys: &[IdempotencyKey],
    ) -> Vec<Result<Option<Cached>, StoreError>> {
        each!(self, f => f.lookup_many(keys))
    }

    async fn store_many(
        &self,
        items: &[(IdempotencyKey, Cached, Duration)],
    ) -> Vec<Result<bool, StoreError>> {
        each!(self, f => f.store_many(items))
    }
}
