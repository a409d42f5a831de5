//! The outbox's Postgres half (docs/OUTBOX.md): what a handler queues is written to
//! `dedup_outbox` in the transaction of its effect, and read back by the relay once that
//! transaction has committed.
//!
//! - **Queueing** ([`OutboxBuffer`]): a batch's handler queues messages under each message's
//!   lease; the batch transaction writes the messages of the messages that settle in the pass
//!   that commits, in one statement, after their completions. A part that rolls back or runs
//!   again discards what it queued (each handler call starts its messages' queues afresh), so an
//!   ordinal counts a consumed message's publishes in its one attempt that commits.
//!   [`OutboxWriter`] is the same for one transaction of the caller's own (an HTTP request's, or
//!   a plain transaction naming its key).
//! - **Rows** (`rows.rs`): one multi-row insert; the header encoding.
//! - **The relay's side** (`relay.rs`): the lease with its epoch, the read by snapshot
//!   differences, the position, the ring's rotation, the dead letters and the status.

mod relay;
mod rows;

pub use relay::{
    OutboxDeadLetter, OutboxLease, OutboxRow, OutboxStatus, Position, Progress, RelayStore,
    Rotation, STATUS_COUNT_CAP, Step,
};
pub use rows::{decode_headers, encode_headers};

use std::collections::HashMap;
use std::sync::Mutex;

use dedup_core::outbox::{OutboxMessage, derived_key};
use dedup_core::{IdempotencyKey, InputError, Lease, StoreError};
use sqlx::postgres::PgConnection;

use rows::{Row, insert};

/// What a batch's handler queued, by the key of the message it ran for: written by the batch's
/// transaction for the messages that settle in the pass that commits
/// ([`BatchRequest::with_outbox`](crate::BatchRequest::with_outbox)). Each handler call on a
/// message starts its queue afresh, so a rerun never publishes what a rolled-back attempt queued.
#[derive(Debug, Default)]
pub struct OutboxBuffer {
    queued: Mutex<HashMap<IdempotencyKey, Queue>>,
}

#[derive(Debug)]
struct Queue {
    event_ms: u64,
    messages: Vec<OutboxMessage>,
}

impl OutboxBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues `message` for the message running under `lease`, published if its pass commits.
    /// `event_ms` is the consumed event's time for the derived keys
    /// ([`dedup_core::outbox::event_ms`]); the first call for a key sets it.
    ///
    /// # Errors
    /// A message the relay could never publish ([`OutboxMessage::check`]).
    pub fn publish(
        &self,
        lease: &Lease,
        event_ms: u64,
        message: OutboxMessage,
    ) -> Result<(), InputError> {
        message.check()?;
        let mut q = self
            .queued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.entry(lease.key.clone())
            .or_insert_with(|| Queue {
                event_ms,
                messages: Vec::new(),
            })
            .messages
            .push(message);
        Ok(())
    }

    /// Forgets what was queued for `leases` (a handler call on them is about to start).
    pub(crate) fn clear(&self, leases: &[Lease]) {
        let mut q = self
            .queued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.is_empty() {
            return;
        }
        for lease in leases {
            q.remove(&lease.key);
        }
    }

    /// Writes the messages queued for `leases`, in order, in one statement (none when nothing
    /// was queued). Answers the statements run.
    pub(crate) async fn write<'l>(
        &self,
        conn: &mut PgConnection,
        leases: impl Iterator<Item = &'l Lease>,
    ) -> Result<u64, StoreError> {
        let rows: Vec<Row> = {
            let q = self
                .queued
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if q.is_empty() {
                return Ok(0);
            }
            leases
                .filter_map(|l| q.get(&l.key).map(|queue| (&l.key, queue)))
                .flat_map(|(key, queue)| rows_of(key, queue.event_ms, &queue.messages))
                .collect()
        };
        if rows.is_empty() {
            return Ok(0);
        }
        insert(conn, &rows).await?;
        Ok(1)
    }
}

/// The rows of one consumed message's publishes, with their derived keys by ordinal.
fn rows_of(cause: &IdempotencyKey, event_ms: u64, messages: &[OutboxMessage]) -> Vec<Row> {
    let mut ordinals: HashMap<&str, u32> = HashMap::new();
    messages
        .iter()
        .map(|m| {
            let n = ordinals.entry(m.topic()).or_insert(0);
            let key = derived_key(cause, m.topic(), *n, event_ms);
            *n += 1;
            Row::new(cause, event_ms, key, m)
        })
        .collect()
}

/// The outbox of one transaction of the caller's own: messages queued under the idempotency key
/// of the work the transaction does (an HTTP request's, or one the caller names, as a
/// transactional session does), written into it with [`write`](Self::write) before it commits.
/// The derived keys count the messages per topic from the first queued, so queue every message
/// of the work on one writer.
#[derive(Debug)]
pub struct OutboxWriter {
    cause: IdempotencyKey,
    event_ms: u64,
    messages: Vec<OutboxMessage>,
    written: usize,
}

impl OutboxWriter {
    /// A writer for the work keyed `cause`; `event_ms` is its event time for the derived keys
    /// ([`dedup_core::outbox::event_ms`]).
    pub fn new(cause: IdempotencyKey, event_ms: u64) -> Self {
        Self {
            cause,
            event_ms,
            messages: Vec::new(),
            written: 0,
        }
    }

    /// Queues a message.
    ///
    /// # Errors
    /// A message the relay could never publish ([`OutboxMessage::check`]).
    pub fn publish(&mut self, message: OutboxMessage) -> Result<(), InputError> {
        message.check()?;
        self.messages.push(message);
        Ok(())
    }

    /// How many messages are queued and not yet written.
    pub fn pending(&self) -> usize {
        self.messages.len() - self.written
    }

    /// Writes the messages queued since the last write into `tx`, in one statement (none when
    /// nothing is queued). They are published once `tx` commits.
    ///
    /// # Errors
    /// The statement's, classified.
    pub async fn write(&mut self, tx: &mut PgConnection) -> Result<(), StoreError> {
        if self.pending() == 0 {
            return Ok(());
        }
        let rows: Vec<Row> = rows_of(&self.cause, self.event_ms, &self.messages)
            .into_iter()
            .skip(self.written)
            .collect();
        insert(tx, &rows).await?;
        self.written = self.messages.len();
        Ok(())
    }
}
