//! The `Store` trait every backend implements, and the in-memory reference store.
//!
//! The trait's async methods return `impl Future + Send`. `claim_batch` and `complete_batch` have
//! looping defaults that a backend overrides; `answer_cached` answers from memory without I/O;
//! `withdraw` gives back a lease nobody used together with its attempt (a first attempt's record
//! goes, a later one is released with one attempt fewer). `MemoryStore` applies `machine` under a
//! lock.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::error::StoreError;
use crate::instance::{Adoption, InstanceId};
use crate::key::IdempotencyKey;
use crate::machine::{self, ClaimStep};
use crate::record::{
    AfterFailure, ClaimOutcome, ClaimRequest, FencingToken, Lease, Record, Timestamp,
};

/// A place that keeps idempotency records and grants fenced leases.
///
/// Every implementation answers exactly as the pure state machine in [`machine`] does; the
/// conformance suite in the `tests` crate runs the same cases against each.
///
/// Calls that change a claimed record carry the [`Lease`] and fail with
/// [`StoreError::LeaseLost`] when its token no longer holds the key; they then change nothing.
///
/// Batch calls have default implementations that loop over the single-key ones; a backend that
/// can do better (one statement for the batch) overrides them without changing their meaning.
pub trait Store: Send + Sync {
    /// Claims a key: see [`ClaimOutcome`] for the answers.
    fn claim(
        &self,
        req: &ClaimRequest,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// Stores `result` for replay and marks the key COMPLETED.
    fn complete(
        &self,
        lease: &Lease,
        result: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Releases the key after a retryable failure (attempts kept), or marks it FAILED when the
    /// attempts are used up.
    fn fail_retryable(
        &self,
        lease: &Lease,
        error: &str,
    ) -> impl Future<Output = Result<AfterFailure, StoreError>> + Send;

    /// Gives back a lease that was granted but never used (its caller went away before it could
    /// run anything), with the attempt its claim counted: a first attempt's record goes (the key
    /// stands as if never claimed), a later one's key is released with one attempt fewer. The
    /// next claim is granted at once, as the same attempt. Fenced like every other change.
    ///
    /// The default releases the key through [`fail_retryable`](Self::fail_retryable), which
    /// keeps the attempt; a store that can give the attempt back overrides it.
    fn withdraw(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            self.fail_retryable(lease, "the claim was withdrawn: its caller was cancelled")
                .await
                .map(drop)
        }
    }

    /// Marks the key FAILED (poison).
    fn fail_permanent(
        &self,
        lease: &Lease,
        reason: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The heartbeat: extends the lease by the policy's lease from now (store clock); returns the
    /// new end.
    fn extend(&self, lease: &Lease) -> impl Future<Output = Result<Timestamp, StoreError>> + Send;

    /// Reads a key's record as stored (even one past its retention that was not purged yet).
    fn get(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Deletes up to `limit` records past their retention; returns how many it deleted. Call it
    /// until it returns less than `limit`.
    fn purge(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Tells the store that `lease` was completed with `result` inside a caller's transaction that
    /// has committed (transactional mode). The authority already holds it; a store with caches
    /// backfills them now. The default does nothing.
    fn committed(&self, lease: &Lease, result: &[u8]) -> impl Future<Output = ()> + Send {
        let _ = (lease, result);
        async {}
    }

    /// Answers a claim from memory, without I/O, when the store can (an L1 hit in the tiered
    /// store); `None` sends the caller to [`claim`](Self::claim). Never `Acquired`. The default
    /// answers nothing.
    fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        let _ = req;
        None
    }

    /// Claims many keys; one answer per request, in order. Each answer means what
    /// [`claim`](Self::claim) would have answered, as if the requests were made one after the
    /// other: a key that appears twice is answered as a duplicate of its first appearance.
    fn claim_batch(
        &self,
        reqs: &[ClaimRequest],
    ) -> impl Future<Output = Vec<Result<ClaimOutcome, StoreError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(reqs.len());
            for req in reqs {
                out.push(self.claim(req).await);
            }
            out
        }
    }

    /// Extends many leases (a heartbeat for every live lease of a batch at once); one answer per
    /// lease, in order, each as [`extend`](Self::extend) would answer it.
    fn extend_batch(
        &self,
        leases: &[Lease],
    ) -> impl Future<Output = Vec<Result<Timestamp, StoreError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(leases.len());
            for lease in leases {
                out.push(self.extend(lease).await);
            }
            out
        }
    }

    /// Ends, at once, the live leases of earlier incarnations of `instance`: owners that start
    /// with [`InstanceId::owner_prefix`] but not with `mine` (this incarnation's prefix). Their
    /// keys can then be taken over at once, under new tokens. Only while this process holds the
    /// identity (a store that can tell a live holder, as Postgres does with a session lock, gates
    /// it, and keeps holding the identity afterwards); otherwise [`Adoption::HeldElsewhere`].
    /// The default: [`Adoption::Unsupported`].
    fn adopt(
        &self,
        instance: &InstanceId,
        mine: &str,
    ) -> impl Future<Output = Result<Adoption, StoreError>> + Send {
        let _ = (instance, mine);
        async { Ok(Adoption::Unsupported) }
    }

    /// Completes many leases; one answer per item, in order, each as
    /// [`complete`](Self::complete) would answer it.
    fn complete_batch(
        &self,
        items: &[(Lease, bytes::Bytes)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(items.len());
            for (lease, result) in items {
                out.push(self.complete(lease, result).await);
            }
            out
        }
    }
}

/// The reference store: the state machine applied under a lock, in process, on this process's
/// clock. Not durable. It is the model the other stores must match, and a fine store for tests of
/// code built on dedup.
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<HashMap<IdempotencyKey, Record>>,
    last_token: AtomicU64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<IdempotencyKey, Record>) -> T) -> T {
        // The lock is never held across an await, and every update is computed before it is
        // written, so a poisoned map is still consistent.
        let mut map = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut map)
    }

    fn fenced(
        &self,
        lease: &Lease,
        f: impl FnOnce(Option<&Record>, Timestamp) -> Result<Record, StoreError>,
    ) -> Result<Record, StoreError> {
        let now = Timestamp::now();
        self.with(|map| {
            let next = f(map.get(&lease.key), now)?;
            map.insert(lease.key.clone(), next.clone());
            Ok(next)
        })
    }
}

impl Store for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        req.policy.validate()?;
        let now = Timestamp::now();
        self.with(|map| {
            let step = machine::claim(map.get(&req.key), req, now, || {
                FencingToken::new(self.last_token.fetch_add(1, Ordering::Relaxed) + 1)
            });
            let outcome = step.outcome();
            match step {
                ClaimStep::Acquire { record, .. } | ClaimStep::Exhaust { record } => {
                    map.insert(req.key.clone(), record);
                }
                ClaimStep::Answer(_) => {}
            }
            Ok(outcome)
        })
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        self.fenced(lease, |cur, now| machine::complete(cur, lease, result, now))
            .map(drop)
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        let mut after = None;
        self.fenced(lease, |cur, now| {
            let (record, a) = machine::fail_retryable(cur, lease, error, now)?;
            after = Some(a);
            Ok(record)
        })?;
        Ok(after.unwrap_or(AfterFailure::Released {
            attempts: lease.attempts,
        }))
    }

    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        let now = Timestamp::now();
        self.with(|map| {
            match machine::withdraw(map.get(&lease.key), lease, now)? {
                Some(record) => map.insert(lease.key.clone(), record),
                None => map.remove(&lease.key),
            };
            Ok(())
        })
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        self.fenced(lease, |cur, now| {
            machine::fail_permanent(cur, lease, reason, now)
        })
        .map(drop)
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        let rec = self.fenced(lease, |cur, now| machine::extend(cur, lease, now))?;
        Ok(rec.lease_until.unwrap_or(rec.updated_at))
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        Ok(self.with(|map| map.get(key).cloned()))
    }

    /// In one process the identity is always this instance's: every live lease of an earlier
    /// incarnation ends.
    async fn adopt(&self, instance: &InstanceId, mine: &str) -> Result<Adoption, StoreError> {
        let now = Timestamp::now();
        let prefix = instance.owner_prefix();
        Ok(Adoption::Adopted(self.with(|map| {
            let mut out = Vec::new();
            for rec in map.values_mut() {
                let theirs = rec.owner.as_ref().is_some_and(|o| {
                    o.as_str().starts_with(&prefix) && !o.as_str().starts_with(mine)
                });
                if theirs
                    && rec.state == crate::record::State::InProgress
                    && rec.lease_until.is_some_and(|t| t > now)
                {
                    rec.lease_until = Some(now);
                    rec.updated_at = now;
                    out.push(rec.clone());
                }
            }
            out
        })))
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        let now = Timestamp::now();
        self.with(|map| {
            let mut expired: Vec<(Timestamp, IdempotencyKey)> = map
                .values()
                .filter(|r| machine::purgeable(r, now))
                .map(|r| (r.expires_at, r.key.clone()))
                .collect();
            expired.sort_unstable_by_key(|(at, _)| *at);
            let mut n = 0;
            for (_, key) in expired.into_iter().take(limit as usize) {
                map.remove(&key);
                n += 1;
            }
            Ok(n)
        })
    }
}

macro_rules! forward_store {
    ($($ty:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $ty {
            fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
                (**self).claim(req)
            }
            fn complete(&self, lease: &Lease, result: &[u8]) -> impl Future<Output = Result<(), StoreError>> + Send {
                (**self).complete(lease, result)
            }
            fn fail_retryable(&self, lease: &Lease, error: &str) -> impl Future<Output = Result<AfterFailure, StoreError>> + Send {
                (**self).fail_retryable(lease, error)
            }
            fn fail_permanent(&self, lease: &Lease, reason: &str) -> impl Future<Output = Result<(), StoreError>> + Send {
                (**self).fail_permanent(lease, reason)
            }
            fn withdraw(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
                (**self).withdraw(lease)
            }
            fn extend(&self, lease: &Lease) -> impl Future<Output = Result<Timestamp, StoreError>> + Send {
                (**self).extend(lease)
            }
            fn get(&self, key: &IdempotencyKey) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
                (**self).get(key)
            }
            fn purge(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send {
                (**self).purge(limit)
            }
            fn committed(&self, lease: &Lease, result: &[u8]) -> impl Future<Output = ()> + Send {
                (**self).committed(lease, result)
            }
            fn answer_cached(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
                (**self).answer_cached(req)
            }
            fn claim_batch(&self, reqs: &[ClaimRequest]) -> impl Future<Output = Vec<Result<ClaimOutcome, StoreError>>> + Send {
                (**self).claim_batch(reqs)
            }
            fn complete_batch(&self, items: &[(Lease, bytes::Bytes)]) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
                (**self).complete_batch(items)
            }
            fn extend_batch(&self, leases: &[Lease]) -> impl Future<Output = Vec<Result<Timestamp, StoreError>>> + Send {
                (**self).extend_batch(leases)
            }
            fn adopt(&self, instance: &InstanceId, mine: &str) -> impl Future<Output = Result<Adoption, StoreError>> + Send {
                (**self).adopt(instance, mine)
            }
        }
    )*};
}

forward_store!(&S, std::sync::Arc<S>);
