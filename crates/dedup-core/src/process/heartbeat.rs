//! One heartbeat for every live lease of the instance's batches: each batch registers its leases,
//! and whichever batch's timer fires first extends all of them in one call
//! ([`Store::extend_batch`]); the others find it done and wait for their next turn.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tracing::warn;

use super::Granted;
use crate::record::Lease;
use crate::store::Store;

/// A registered lease: where its heartbeat reports.
#[derive(Clone)]
pub(super) struct Beat {
    pub(super) lease: Lease,
    pub(super) lost: Arc<AtomicBool>,
    pub(super) granted: Arc<Granted>,
    /// Its end is recorded: it needs no more extending.
    pub(super) done: Arc<AtomicBool>,
}

/// The leases of the instance's running batches.
#[derive(Default)]
pub(crate) struct Heartbeats {
    inner: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    next: u64,
    beats: HashMap<u64, Beat>,
    /// When the last heartbeat of all of them was sent.
    last: Option<Instant>,
}

impl std::fmt::Debug for Heartbeats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeats")
            .field("leases", &self.lock().beats.len())
            .finish()
    }
}

/// Takes a batch's leases out of the registry when dropped (the batch ended, or was cancelled).
pub(super) struct Registered<'h> {
    hub: &'h Heartbeats,
    ids: Vec<u64>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut r = self.hub.lock();
        for id in &self.ids {
            r.beats.remove(id);
        }
    }
}

impl Heartbeats {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a batch's leases until the returned guard is dropped.
    pub(super) fn register(&self, beats: Vec<Beat>) -> Registered<'_> {
        let mut r = self.lock();
        let mut ids = Vec::with_capacity(beats.len());
        for beat in beats {
            let id = r.next;
            r.next += 1;
            r.beats.insert(id, beat);
            ids.push(id);
        }
        Registered { hub: self, ids }
    }

    /// Extends every live registered lease in one call, unless a heartbeat of them all went out
    /// less than half of `every` ago (another batch's timer came first). Answers whether the
    /// call failed for some (to try again sooner).
    pub(super) async fn beat<S: Store>(&self, store: &S, every: Duration) -> bool {
        let due: Vec<Beat> = {
            let mut r = self.lock();
            if r.last.is_some_and(|l| l.elapsed() < every / 2) {
                return false;
            }
            r.last = Some(Instant::now());
            r.beats
                .values()
                .filter(|b| !b.done.load(Ordering::Acquire) && !b.lost.load(Ordering::Acquire))
                .cloned()
                .collect()
        };
        if due.is_empty() {
            return false;
        }
        let leases: Vec<Lease> = due.iter().map(|b| b.lease.clone()).collect();
        let sent = Instant::now();
        let mut failed = false;
        for (b, answer) in due.iter().zip(store.extend_batch(&leases).await) {
            match answer {
                Ok(_) => b.granted.extended(sent + b.lease.policy.lease),
                Err(e) if e.is_lease_lost() => {
                    warn!(key = %b.lease.key, token = b.lease.token.get(), "heartbeat found the lease taken over");
                    b.lost.store(true, Ordering::Release);
                }
                Err(e) => {
                    failed = true;
                    warn!(key = %b.lease.key, error = %e, "heartbeat failed; retrying");
                }
            }
        }
        if failed {
            // Let the next timer, whichever batch's, try again at once.
            self.lock().last = None;
        }
        failed
    }
}
