//! The outbox's messages: what a handler queues to publish once its transaction commits
//! ([`OutboxMessage`]), and the key derived for the next consumer ([`derived_key`]), which the
//! relay sends in the [`OUTBOX_KEY`] header with the cause beside it.
//!
//! The derived key is a function of the consumed message's idempotency key (scope and bytes), the
//! topic and the message's ordinal among that consumed message's publishes, so every attempt of
//! the same event derives the same keys, whichever batch or part it ran in. It is shaped as a
//! time-ordered key ([`IdempotencyKey::timed`]'s UUIDv7 text: the consumed event's time, then a
//! digest), so a downstream window partitioned by the key's time stays flat.

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::error::InputError;
use crate::key::{IdempotencyKey, uuid7_text};

/// Outbox header: the derived idempotency key (the default `KeySource` of a dedup consumer reads
/// it, so a downstream consumer drops the relay's duplicates with no code).
pub const OUTBOX_KEY: &str = "idempotency-key";
/// Outbox header: the scope of the consumed message's key (the cause).
pub const OUTBOX_CAUSE_SCOPE: &str = "dedup-cause-scope";
/// Outbox header: the consumed message's key (the cause).
pub const OUTBOX_CAUSE_KEY: &str = "dedup-cause-key";

/// Every header the relay writes on a published message, by its exact name: a header of one of
/// these names (in any case) that a handler queued is replaced by the relay's.
pub const OUTBOX_HEADERS: &[&str] = &[OUTBOX_KEY, OUTBOX_CAUSE_SCOPE, OUTBOX_CAUSE_KEY];

/// Whether `name` is one of [`OUTBOX_HEADERS`], in any case.
pub fn is_outbox_header(name: &str) -> bool {
    OUTBOX_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// A message a handler queues on the outbox: a topic, an optional key (the partitioner's input,
/// so every message of one key goes to one partition, in order), an optional payload (none is a
/// tombstone) and headers. Queued in the transaction of the handler's effect, it is published
/// once that transaction commits, never if it rolls back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    topic: String,
    key: Option<Bytes>,
    payload: Option<Bytes>,
    headers: Vec<(String, Option<Bytes>)>,
}

impl OutboxMessage {
    /// The largest message queued, in bytes of key, payload, header names and values (below
    /// the broker's default `message.max.bytes` of 1,048,588, with room for the record's framing
    /// and the relay's own headers).
    pub const MAX_BYTES: usize = 1_000_000;

    /// A message to `topic` with `payload` and no key (the producer spreads keyless messages, so
    /// their order across partitions is not kept: give a key where order matters).
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            topic: topic.into(),
            key: None,
            payload: Some(payload.into()),
            headers: Vec::new(),
        }
    }

    /// A tombstone for `key` on a compacted `topic`: a key and no payload.
    pub fn tombstone(topic: impl Into<String>, key: impl Into<Bytes>) -> Self {
        Self {
            topic: topic.into(),
            key: Some(key.into()),
            payload: None,
            headers: Vec::new(),
        }
    }

    /// Sets the message key.
    #[must_use]
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header (Kafka keeps their order and allows repeats; `None` is a null value).
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: Option<Bytes>) -> Self {
        self.headers.push((name.into(), value));
        self
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The message key.
    pub fn key(&self) -> Option<&Bytes> {
        self.key.as_ref()
    }

    /// The payload (`None`: a tombstone).
    pub fn payload(&self) -> Option<&Bytes> {
        self.payload.as_ref()
    }

    /// The headers, in order.
    pub fn headers(&self) -> &[(String, Option<Bytes>)] {
        &self.headers
    }

    /// Its size as [`MAX_BYTES`](Self::MAX_BYTES) counts it.
    pub fn size(&self) -> usize {
        let len = |b: &Option<Bytes>| b.as_ref().map_or(0, Bytes::len);
        len(&self.key)
            + len(&self.payload)
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + len(v))
                .sum::<usize>()
    }

    /// Checks what the relay could never publish: a topic Kafka refuses by its name, a message
    /// over [`MAX_BYTES`](Self::MAX_BYTES).
    ///
    /// # Errors
    /// [`InputError::OutboxTopic`], [`InputError::OutboxMessageTooLarge`].
    pub fn check(&self) -> Result<(), InputError> {
        let t = &self.topic;
        let valid = !t.is_empty()
            && t.len() <= 249
            && t != "."
            && t != ".."
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !valid {
            return Err(InputError::OutboxTopic(t.clone()));
        }
        let len = self.size();
        if len > Self::MAX_BYTES {
            return Err(InputError::OutboxMessageTooLarge {
                topic: t.clone(),
                len,
                max: Self::MAX_BYTES,
            });
        }
        Ok(())
    }
}

/// The consumed event's time for its derived keys: the time in its key where the key is
/// time-ordered ([`IdempotencyKey::uuid7_millis`]), or else `fallback_ms` (the consumed record's
/// timestamp, or the time of the claim). Capped at 48 bits.
pub fn event_ms(cause: &IdempotencyKey, fallback_ms: u64) -> u64 {
    cause
        .uuid7_millis()
        .unwrap_or(fallback_ms)
        .min((1 << 48) - 1)
}

/// The idempotency key of the `ordinal`-th message (from 0) that the event keyed `cause` publishes
/// to `topic`, as text: a UUIDv7 whose time is `event_ms` and whose other 74 bits are a digest of
/// the cause's scope and key, the topic and the ordinal (each length-prefixed, so no two inputs
/// run together). Every attempt of the event derives the same keys; two events, or two messages
/// of one event, share one only by a 74-bit digest collision in the same millisecond.
pub fn derived_key(cause: &IdempotencyKey, topic: &str, ordinal: u32, event_ms: u64) -> String {
    let mut h = Sha256::new();
    h.update(b"dedup-outbox-v1");
    for part in [
        cause.scope().as_str().as_bytes(),
        cause.key_bytes(),
        topic.as_bytes(),
    ] {
        h.update(u64::try_from(part.len()).unwrap_or(u64::MAX).to_be_bytes());
        h.update(part);
    }
    h.update(ordinal.to_be_bytes());
    uuid7_text(event_ms.min((1 << 48) - 1), &h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Scope;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(Scope::new("orders").expect("scope"), k).expect("key")
    }

    #[test]
    fn a_derived_key_is_a_function_of_the_cause_the_topic_and_the_ordinal() {
        let k = derived_key(&key("o-1"), "charged", 0, 1_795_000_000_123);
        assert_eq!(k, derived_key(&key("o-1"), "charged", 0, 1_795_000_000_123));
        let others = [
            derived_key(&key("o-1"), "charged", 1, 1_795_000_000_123),
            derived_key(&key("o-2"), "charged", 0, 1_795_000_000_123),
            derived_key(&key("o-1"), "charge", 0, 1_795_000_000_123),
            derived_key(
                &IdempotencyKey::new(Scope::new("order").expect("scope"), "o-1").expect("key"),
                "charged",
                0,
                1_795_000_000_123,
            ),
        ];
        for o in &others {
            assert_ne!(&k, o);
        }
        // Time-ordered: the downstream reads the event's time back from it.
        let downstream =
            IdempotencyKey::new(Scope::new("ledger").expect("scope"), &k).expect("key");
        assert_eq!(downstream.uuid7_millis(), Some(1_795_000_000_123));
    }

    #[test]
    fn a_time_ordered_cause_gives_its_own_time() {
        let cause =
            IdempotencyKey::timed(Scope::new("orders").expect("scope"), 1_700_000_000_001, "e")
                .expect("key");
        assert_eq!(event_ms(&cause, 5), 1_700_000_000_001);
        assert_eq!(event_ms(&key("o-1"), 5), 5);
        assert_eq!(event_ms(&key("o-1"), u64::MAX), (1 << 48) - 1);
    }

    #[test]
    fn a_message_the_relay_could_never_publish_is_refused_when_queued() {
        assert!(OutboxMessage::new("orders.charged", "x").check().is_ok());
        for bad in ["", ".", "..", "a b", "ä", &"t".repeat(250)] {
            assert_eq!(
                OutboxMessage::new(bad, "x").check(),
                Err(InputError::OutboxTopic(bad.to_owned()))
            );
        }
        let big = OutboxMessage::new("t", vec![0_u8; OutboxMessage::MAX_BYTES])
            .with_header("h", Some(Bytes::from_static(b"v")));
        assert_eq!(
            big.check(),
            Err(InputError::OutboxMessageTooLarge {
                topic: "t".to_owned(),
                len: OutboxMessage::MAX_BYTES + 2,
                max: OutboxMessage::MAX_BYTES
            })
        );
        assert!(is_outbox_header("Idempotency-Key"));
        assert!(!is_outbox_header("dedup-cause"));
    }
}
