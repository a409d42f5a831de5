//! A stable instance identity, and the adoption of a dead predecessor's leases.
//!
//! An instance configured with an [`InstanceId`] (a pod or host name that survives a restart,
//! never random per start) names each claim `<id>/<incarnation>#<n>`: the identity, a nonce of
//! this start, and a counter. The owner stays unique per claim (a claim read back after a lost
//! reply is recognised as this claim, not a predecessor's). A restarted instance asks the store to
//! [`adopt`](crate::Dedup::adopt) the leases that earlier incarnations of its identity still hold:
//! they end at once, so their keys are taken over (under new fencing tokens) as soon as their
//! messages are redelivered, instead of after the lease.
//!
//! Only a dead predecessor's leases may be ended. The store gates adoption on something only a
//! live instance holds (Postgres: a session-level advisory lock on the identity, held for the
//! life of the instance); if another live process holds the identity, nothing is adopted and the
//! leases run out as usual.
//!
//! Here: `InstanceId` (1 to 100 of `A-Za-z0-9._:-`) and `Adoption`, what an adoption answers.
//! `Dedup::with_instance` and `Dedup::adopt` are in `process/instance.rs`.

use std::fmt;

use crate::error::InputError;
use crate::record::Record;

/// The longest identity.
pub const MAX_INSTANCE_ID_LEN: usize = 100;

/// A stable instance identity: 1 to 100 of `A-Z a-z 0-9 . _ : -`.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct InstanceId(String);

impl InstanceId {
    /// Checks and wraps an identity.
    pub fn new(id: impl Into<String>) -> Result<Self, InputError> {
        let id = id.into();
        let ok = !id.is_empty()
            && id.len() <= MAX_INSTANCE_ID_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
        if ok {
            Ok(Self(id))
        } else {
            Err(InputError::Setting {
                setting: "instance_id",
                problem: "must be 1 to 100 of A-Z a-z 0-9 . _ : -",
            })
        }
    }

    /// The identity.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What every owner id of this identity starts with: `<id>/`.
    pub fn owner_prefix(&self) -> String {
        format!("{}/", self.0)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What [`Store::adopt`](crate::Store::adopt) did.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Adoption {
    /// This instance holds its identity; these leases of its earlier incarnations were live and
    /// now end (as they were, with the lease end moved to now).
    Adopted(Vec<Record>),
    /// Another live process holds this identity: nothing was adopted (two processes are
    /// configured with one identity; their leases run out as usual).
    HeldElsewhere,
    /// The store has no instance identities (it grants no leases that outlive a process).
    Unsupported,
}

impl Adoption {
    /// How many leases were ended.
    pub fn adopted(&self) -> usize {
        match self {
            Self::Adopted(v) => v.len(),
            _ => 0,
        }
    }
}
