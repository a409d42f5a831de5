//! dedup-core: run each message's effect exactly once.
//!
//! Brokers deliver at least once. dedup gives every logical operation an [`IdempotencyKey`], holds
//! the key under a fenced [`Lease`] while its effect runs, and replays the stored result to every
//! duplicate. This crate holds the semantics and no I/O: keys and records, the state machine as
//! pure functions ([`machine`]), the [`Store`] trait with an in-memory reference store, and the
//! consumer API ([`Dedup::process`]). Backends live in their own crates (`dedup-pg` is the durable
//! source of truth).
//!
//! Its dependencies: `bytes`, `quick_cache` (L1), `sha2` (payload fingerprints), `serde` and
//! `bincode` (typed results; `serde_json` with the `json` feature), `thiserror`, `tracing`,
//! `futures-util` (joining futures, catching a handler's panic), and `tokio` for timers (the
//! heartbeat, the in-flight wait), synchronisation (`Batched`'s queue) and the one background task
//! (`TieredStore::with_background_backfill`).
//!
//! # A tour
//! - A **claim** answers [`ClaimOutcome::Acquired`] (run the effect under this token),
//!   [`Completed`](ClaimOutcome::Completed) (replay), [`InFlight`](ClaimOutcome::InFlight),
//!   [`Failed`](ClaimOutcome::Failed) (poison) or [`PayloadMismatch`](ClaimOutcome::PayloadMismatch).
//! - Every later call carries the lease's [`FencingToken`]; a call whose token was overtaken by a
//!   takeover fails with [`StoreError::LeaseLost`] and changes nothing.
//! - Errors say whether a retry can help ([`StoreError::is_retryable`]) and whether the outcome is
//!   unknown ([`StoreError::is_outcome_unknown`]); an unknown outcome is resolved by reading the
//!   record back, never by guessing.
//! - Throughput: [`TieredStore`] answers duplicates from memory (L1) and a fast path (L2) before
//!   asking the authority, and [`Batched`] turns concurrent claims and completions into batch
//!   calls (group commit).
//!
//! # Example
//! ```
//! use dedup_core::{Completion, Dedup, Fingerprint, HandlerError, IdempotencyKey, MemoryStore, Scope};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dedup = Dedup::new(MemoryStore::new());
//! let key = IdempotencyKey::new(Scope::new("payments")?, "evt-42")?;
//! let payload = br#"{"amount": 100}"#;
//!
//! for delivery in 0..3 {
//!     let done = dedup
//!         .process(&key, Some(Fingerprint::of(payload)), |_lease| async {
//!             // The effect: charge the card, write the order...
//!             Ok::<_, HandlerError<std::io::Error>>(Completion::store("charged"))
//!         })
//!         .await?;
//!     assert_eq!(done.result().as_ref(), b"charged");
//!     assert_eq!(done.executed(), delivery == 0);
//! }
//! # Ok(())
//! # }
//! ```

mod batch;
mod error;
mod instance;
mod key;
pub mod machine;
pub mod outbox;
mod process;
mod record;
mod store;
mod tiered;
pub mod typed;

pub use batch::{BatchConfig, BatchCounts, Batched};
pub use error::{BoxError, InputError, StoreError};
pub use instance::{Adoption, InstanceId, MAX_INSTANCE_ID_LEN};
pub use key::{Fingerprint, IdempotencyKey, MAX_KEY_LEN, MAX_SCOPE_LEN, Scope};
pub use process::{
    AfterHandlerError, BatchItem, Completion, Dedup, HandlerError, LeaseContext, MAX_WAIT,
    ProcessError, Processed,
};
pub use record::{
    AfterFailure, ClaimOutcome, ClaimRequest, FencingToken, Lease, OwnerId, OwnerIds, Policy,
    Record, State, Timestamp, micros,
};
pub use store::{MemoryStore, Store};
pub use tiered::{
    BatchCache, CacheFuture, Cached, FastPath, L1Policy, NoFastPath, TierStats, TieredConfig,
    TieredStore,
};
pub use typed::{ResultCodec, TypedProcessed};

/// docs/TYPED.md's examples run as doctests too.
#[cfg(doctest)]
#[doc = include_str!("../TYPED.md")]
struct TypedDoctests;
