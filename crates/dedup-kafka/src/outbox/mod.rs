//! The outbox relay (docs/OUTBOX.md): publishes what handlers queued on the outbox once their
//! transactions commit, to Kafka, with an idempotent producer, moving its position only after
//! the broker acknowledged every message behind it.
//!
//! - `relay.rs`: the loop: the lease (one relay publishes, others stand by and take over within
//!   a lease of a SIGKILL), a round per wake-up (a local commit that wrote outbox rows, or the
//!   poll), the position moved under the lease's epoch, the ring rotated.
//! - `publish.rs`: one page of rows sent and every delivery awaited; a message the broker refuses
//!   for good is kept in `dedup_outbox_dead` with the reason, and stops nothing else.

mod publish;
mod relay;

pub use relay::{OutboxRelay, RelayConfig, RelayError, RelayStats, RelayStatsHandle};
