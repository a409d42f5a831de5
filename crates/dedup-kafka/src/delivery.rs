//! A consumed message, and how its idempotency key is found.
//!
//! `Delivery` is an owned message. `extract_key` reads the key as its `KeySource` says (a header,
//! a JSON pointer, or a digest of JSON fields); `KeyError` tells a missing key from an unusable
//! one. `ordering_key` finds a message's ordering key.

use bytes::Bytes;
use dedup_core::{Fingerprint, IdempotencyKey, InputError, Scope};
use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Headers};

use crate::config::{KeySource, OrderingKey};

/// A message as the handler sees it: owned, with its coordinates.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Delivery {
    /// Its topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The Kafka message key.
    pub key: Option<Bytes>,
    /// The payload.
    pub payload: Option<Bytes>,
    /// The headers, in order.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// The message timestamp, in milliseconds since the epoch, where the broker gave one.
    pub timestamp_ms: Option<i64>,
}

impl Delivery {
    /// Copies a consumed message.
    pub fn from_message(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(Bytes::copy_from_slice)))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(Bytes::copy_from_slice),
            payload: m.payload().map(Bytes::copy_from_slice),
            headers,
            timestamp_ms: m.timestamp().to_millis(),
        }
    }

    /// A delivery built by hand (for tests of a handler).
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            offset,
            key: None,
            payload: None,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// Sets the payload.
    pub fn with_payload(mut self, payload: impl Into<Bytes>) -> Self {
        self.payload = Some(payload.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), Some(value.into())));
        self
    }

    /// The first header called `name` that has a value.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(k, v)| k == name && v.is_some())
            .and_then(|(_, v)| v.as_deref())
    }

    /// The payload, or empty.
    pub fn payload_bytes(&self) -> &[u8] {
        self.payload.as_deref().unwrap_or_default()
    }
}

/// Why a message's key could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The message has no key where the configuration looks.
    #[error("no idempotency key ({0})")]
    Missing(String),
    /// The payload had to be JSON and is not.
    #[error("payload is not JSON: {0}")]
    NotJson(String),
    /// The key's value is not usable (an object or array at a pointer).
    #[error("idempotency key at {pointer} is not a string, number or boolean")]
    NotScalar {
        /// Where it was looked for.
        pointer: String,
    },
    /// The key is not valid (empty, too long).
    #[error("invalid idempotency key: {0}")]
    Invalid(#[from] InputError),
}

/// Finds `delivery`'s idempotency key under `scope`.
pub fn extract_key(
    source: &KeySource,
    scope: &Scope,
    delivery: &Delivery,
) -> Result<IdempotencyKey, KeyError> {
    match source {
        KeySource::Header(name) => match delivery.header(name) {
            Some(v) => Ok(IdempotencyKey::new(scope.clone(), v)?),
            None => Err(KeyError::Missing(format!("no header {name:?}"))),
        },
        KeySource::JsonPointer(pointer) => {
            let json = parse(delivery)?;
            match json.pointer(pointer) {
                None | Some(serde_json::Value::Null) => {
                    Err(KeyError::Missing(format!("nothing at {pointer}")))
                }
                Some(serde_json::Value::String(s)) => Ok(IdempotencyKey::new(scope.clone(), s)?),
                Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                    Ok(IdempotencyKey::new(scope.clone(), v.to_string())?)
                }
                Some(_) => Err(KeyError::NotScalar {
                    pointer: pointer.clone(),
                }),
            }
        }
        KeySource::Fields(pointers) => {
            let json = parse(delivery)?;
            let values: Vec<&serde_json::Value> = pointers
                .iter()
                .map(|p| json.pointer(p).unwrap_or(&serde_json::Value::Null))
                .collect();
            if values.iter().all(|v| v.is_null()) {
                return Err(KeyError::Missing(format!("none of {pointers:?} present")));
            }
            // The values' JSON text, in the configured order: equal fields give equal keys.
            let canonical = serde_json::to_vec(&values).unwrap_or_default();
            let digest = Fingerprint::of(&canonical);
            let hex: String = digest
                .as_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            Ok(IdempotencyKey::new(scope.clone(), hex)?)
        }
    }
}

/// Finds `delivery`'s ordering key: what [`Ordering::PerKey`](crate::Ordering::PerKey) keeps in
/// order. `None` (no such key, no such header, nothing usable at the pointer, a payload that is not
/// JSON) puts the message in its partition's own lane, behind every message of the partition that
/// has no ordering key either.
pub fn ordering_key(source: &OrderingKey, delivery: &Delivery) -> Option<Vec<u8>> {
    match source {
        OrderingKey::MessageKey => delivery.key.as_ref().map(|k| k.to_vec()),
        OrderingKey::Header(name) => delivery.header(name).map(<[u8]>::to_vec),
        OrderingKey::JsonPointer(pointer) => match parse(delivery).ok()?.pointer(pointer)? {
            serde_json::Value::String(s) => Some(s.clone().into_bytes()),
            v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => {
                Some(v.to_string().into_bytes())
            }
            _ => None,
        },
    }
}

fn parse(delivery: &Delivery) -> Result<serde_json::Value, KeyError> {
    match delivery.payload.as_deref() {
        None | Some([]) => Err(KeyError::Missing("empty payload".into())),
        Some(p) => serde_json::from_slice(p).map_err(|e| KeyError::NotJson(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordering_keys_come_from_the_message_key_a_header_or_a_json_pointer() {
        let mut d = Delivery::new("t", 0, 1)
            .with_header("account", "acct-7")
            .with_payload(r#"{"order":{"id":42},"flag":true,"list":[1]}"#);
        assert_eq!(ordering_key(&OrderingKey::MessageKey, &d), None);
        d.key = Some(Bytes::from_static(b"acct-1"));
        assert_eq!(
            ordering_key(&OrderingKey::MessageKey, &d).as_deref(),
            Some(b"acct-1".as_slice())
        );
        assert_eq!(
            ordering_key(&OrderingKey::Header("account".into()), &d).as_deref(),
            Some(b"acct-7".as_slice())
        );
        assert_eq!(ordering_key(&OrderingKey::Header("nope".into()), &d), None);
        let pointer = |p: &str| ordering_key(&OrderingKey::JsonPointer(p.into()), &d);
        assert_eq!(pointer("/order/id").as_deref(), Some(b"42".as_slice()));
        assert_eq!(pointer("/flag").as_deref(), Some(b"true".as_slice()));
        assert_eq!(pointer("/list"), None, "not a scalar: partition order");
        assert_eq!(pointer("/missing"), None);
        let not_json = Delivery::new("t", 0, 2).with_payload("plain text");
        assert_eq!(
            ordering_key(&OrderingKey::JsonPointer("/a".into()), &not_json),
            None
        );
    }
}
