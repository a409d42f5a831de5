//! What a cache holds (`Cached`), and the fast path's contract (`FastPath`).
//!
//! `Cached` is a copy of an authority record. `FastPath` is L2's contract and names no backend
//! (`dedup-redis` implements it). `NoFastPath` leaves L1 and the authority only.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use crate::error::StoreError;
use crate::key::{Fingerprint, IdempotencyKey};
use crate::machine;
use crate::record::{
    ClaimOutcome, ClaimRequest, FencingToken, Lease, OwnerId, Record, State, Timestamp,
};

/// A copy of (part of) an authority's record, as a cache holds it.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Cached {
    /// IN_PROGRESS (L2 only), COMPLETED or FAILED.
    pub state: State,
    /// The token of the claim the copy came from.
    pub token: FencingToken,
    /// The authority's fingerprint for the key.
    pub fingerprint: Option<Fingerprint>,
    /// Attempts made.
    pub attempts: u32,
    /// The holder (IN_PROGRESS).
    pub owner: Option<OwnerId>,
    /// The end of the lease on the authority's clock (IN_PROGRESS).
    pub lease_until: Option<Timestamp>,
    /// The result (COMPLETED).
    pub result: Option<Bytes>,
    /// The reason (FAILED).
    pub failure: Option<String>,
    /// How long the cache will still hold it, where the cache says.
    pub expires_in: Option<Duration>,
}

impl Cached {
    /// A bare copy; set the other public fields.
    pub fn new(state: State, token: FencingToken) -> Self {
        Self {
            state,
            token,
            fingerprint: None,
            attempts: 0,
            owner: None,
            lease_until: None,
            result: None,
            failure: None,
            expires_in: None,
        }
    }

    /// The IN_PROGRESS marker of a granted lease.
    pub fn in_progress(lease: &Lease) -> Self {
        Self {
            fingerprint: lease.fingerprint,
            attempts: lease.attempts,
            owner: Some(lease.owner.clone()),
            lease_until: Some(lease.lease_until),
            ..Self::new(State::InProgress, lease.token)
        }
    }

    /// The COMPLETED copy of `lease`'s completion.
    pub fn completed(lease: &Lease, result: Bytes) -> Self {
        Self {
            fingerprint: lease.fingerprint,
            attempts: lease.attempts,
            result: Some(result),
            ..Self::new(State::Completed, lease.token)
        }
    }

    /// The FAILED copy of `lease`'s failure.
    pub fn failed(lease: &Lease, reason: String) -> Self {
        Self {
            fingerprint: lease.fingerprint,
            attempts: lease.attempts,
            failure: Some(reason),
            ..Self::new(State::Failed, lease.token)
        }
    }

    /// The copy of a terminal record.
    pub fn of_record(record: &Record) -> Option<Self> {
        record.state.is_terminal().then(|| Self {
            fingerprint: record.fingerprint,
            attempts: record.attempts,
            result: record.result.clone(),
            failure: record.failure.clone(),
            ..Self::new(record.state, record.token)
        })
    }

    /// What this copy lets a cache answer to `req`, if anything. Never `Acquired`.
    pub fn answer(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        if machine::mismatch(self.fingerprint, req.fingerprint) {
            return Some(ClaimOutcome::PayloadMismatch);
        }
        match self.state {
            State::Completed => Some(ClaimOutcome::Completed {
                result: self.result.clone().unwrap_or_default(),
                token: self.token,
                fingerprint: self.fingerprint,
            }),
            State::Failed => Some(ClaimOutcome::Failed {
                reason: self.failure.clone().unwrap_or_default(),
                attempts: self.attempts,
            }),
            // The marker exists only while its lease does (it expires with it).
            State::InProgress => Some(ClaimOutcome::InFlight {
                owner: self.owner.clone(),
                lease_until: self.lease_until,
            }),
            _ => None,
        }
    }

    /// Roughly how many bytes the copy holds.
    pub fn size(&self) -> usize {
        96 + self.result.as_ref().map_or(0, Bytes::len)
            + self.failure.as_ref().map_or(0, String::len)
            + self.owner.as_ref().map_or(0, |o| o.as_str().len())
    }
}

/// The fast path (L2): a shared cache in front of the authority. Every call is advisory: the
/// tiered store treats an error or a timeout as a miss. Implementations keep these rules:
///
/// - an IN_PROGRESS marker expires with its lease (`ttl`);
/// - a write never replaces a copy holding a newer token, and a marker never replaces a terminal
///   copy of the same token (a zombie's late write cannot overwrite a newer record);
/// - data at a key that is not a well-formed copy of that key's record reads as a miss (with a
///   warning), never as an answer.
pub trait FastPath: Send + Sync {
    /// Reads the copy held for `key`.
    fn lookup(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Cached>, StoreError>> + Send;

    /// Writes `copy` of `key` for `ttl`, unless a newer token is held. Returns whether it wrote.
    fn store(
        &self,
        key: &IdempotencyKey,
        copy: &Cached,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Drops the IN_PROGRESS marker of `lease` (the key was released). Returns whether it did.
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Moves `lease`'s marker to `lease_until`, expiring in `ttl`. Returns whether it did.
    fn extend(
        &self,
        lease: &Lease,
        lease_until: Timestamp,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Reads the copies held for `keys`: one answer per key, in order. The default loops over
    /// [`lookup`](Self::lookup); a backend that can answers them all in one round trip.
    fn lookup_many(
        &self,
        keys: &[IdempotencyKey],
    ) -> impl Future<Output = Vec<Result<Option<Cached>, StoreError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(keys.len());
            for key in keys {
                out.push(self.lookup(key).await);
            }
            out
        }
    }

    /// Writes many copies, each as [`store`](Self::store) would: one answer per item, in order.
    fn store_many(
        &self,
        items: &[(IdempotencyKey, Cached, Duration)],
    ) -> impl Future<Output = Vec<Result<bool, StoreError>>> + Send {
        async move {
            let mut out = Vec::with_capacity(items.len());
            for (key, copy, ttl) in items {
                out.push(self.store(key, copy, *ttl).await);
            }
            out
        }
    }
}

/// No fast path: a tiered store with L1 and the authority only.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFastPath;

impl FastPath for NoFastPath {
    async fn lookup(&self, _: &IdempotencyKey) -> Result<Option<Cached>, StoreError> {
        Ok(None)
    }
    async fn store(&self, _: &IdempotencyKey, _: &Cached, _: Duration) -> Result<bool, StoreError> {
        Ok(false)
    }
    async fn release(&self, _: &Lease) -> Result<bool, StoreError> {
        Ok(false)
    }
    async fn extend(&self, _: &Lease, _: Timestamp, _: Duration) -> Result<bool, StoreError> {
        Ok(false)
    }
}
