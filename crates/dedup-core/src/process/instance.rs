//! A stable instance identity on `Dedup`, and adopting a dead predecessor's leases.
//!
//! `Dedup::with_instance` gives owner ids `<id>/<incarnation>#<n>`; `Dedup::adopt` asks
//! `Store::adopt` to end the live leases of the identity's earlier incarnations
//! (docs/ARCHITECTURE.md, invariant 24).

use std::process;

use crate::error::StoreError;
use crate::instance::{Adoption, InstanceId};
use crate::record::{OwnerIds, Timestamp};
use crate::store::Store;

use super::Dedup;

/// A nonce of this start of the process: its pid and the time, in hex.
pub(super) fn incarnation() -> String {
    format!("{:x}{:x}", process::id(), Timestamp::now().as_micros())
}

impl<S: Store> Dedup<S> {
    /// Gives this instance a stable identity (a pod or host name, the same after a restart; see
    /// [`InstanceId`]). Its claims are then owned by `<id>/<incarnation>#<n>`, and
    /// [`adopt`](Self::adopt) can end the leases an earlier incarnation left behind.
    pub fn with_instance(mut self, id: InstanceId) -> Self {
        self.owners = OwnerIds::with_prefix(format!("{}{}", id.owner_prefix(), incarnation()));
        self.instance = Some(id);
        self
    }

    /// What this incarnation's owner ids start with (`<id>/<incarnation>` with an identity).
    pub fn owner_prefix(&self) -> &str {
        self.owners.prefix()
    }

    /// Ends the live leases of this identity's earlier incarnations (a predecessor killed
    /// mid-handler), so that their messages, redelivered, are taken over at once under new
    /// fencing tokens instead of after the lease. Call it once at start, before consuming; the
    /// store keeps holding the identity afterwards, so a later incarnation cannot adopt this
    /// one's leases while it lives. Without an identity: [`Adoption::Unsupported`].
    pub async fn adopt(&self) -> Result<Adoption, StoreError> {
        let Some(id) = &self.instance else {
            return Ok(Adoption::Unsupported);
        };
        let mine = format!("{}#", self.owners.prefix());
        self.store.adopt(id, &mine).await
    }
}
