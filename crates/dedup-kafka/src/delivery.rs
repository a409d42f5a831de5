//! A consumed message, and how its idempotency key is found.
//!
//! `Delivery` is an owned message. `extract_key` reads the key as its `KeySource` says (a header,
//! a JSON pointer, a digest of JSON fields, an id keyed with its event's time, or the first of a
//! list of these that finds one); `KeyError` tells a missing key from an unusable one.
//! `ordering_key` finds a message's ordering key.

use bytes::Bytes;
use dedup_core::{Fingerprint, IdempotencyKey, InputError, Scope};
use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Headers};

use crate::config::{EventTime, KeySource, OrderingKey};

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
    /// The event's time ([`KeySource::Timed`]) is neither a whole number of milliseconds since
    /// the Unix epoch nor an RFC 3339 timestamp at or after it.
    #[error(
        "event time at {at} is neither a whole number of milliseconds since the Unix epoch nor an RFC 3339 timestamp: {value}"
    )]
    BadTime {
        /// Where it was read.
        at: String,
        /// What was there (cut to 64 characters).
        value: String,
    },
}

/// Finds `delivery`'s idempotency key under `scope`. Of a [`KeySource::FirstOf`] list, the first
/// source that finds a key gives it; only a source that finds nothing ([`KeyError::Missing`])
/// hands over to the next, any other error is the answer.
pub fn extract_key(
    source: &KeySource,
    scope: &Scope,
    delivery: &Delivery,
) -> Result<IdempotencyKey, KeyError> {
    match source {
        // The id only goes into the key's digest: it may be longer than a key.
        KeySource::Timed { id, time } => {
            let id = key_text(id, scope, delivery)?;
            // An empty id is a bad key whatever the time says: dead-lettered, as a plain key.
            if id.is_empty() {
                return Err(InputError::EmptyKey.into());
            }
            let ms = event_time(time, delivery)?;
            Ok(IdempotencyKey::timed(scope.clone(), ms, id)?)
        }
        KeySource::FirstOf(sources) => {
            let mut tried = Vec::with_capacity(sources.len());
            for source in sources {
                match extract_key(source, scope, delivery) {
                    Err(KeyError::Missing(why)) => tried.push(why),
                    found => return found,
                }
            }
            Err(KeyError::Missing(if tried.is_empty() {
                "an empty list of key sources".to_owned()
            } else {
                tried.join("; ")
            }))
        }
        _ => Ok(IdempotencyKey::new(
            scope.clone(),
            key_text(source, scope, delivery)?,
        )?),
    }
}

/// The bytes `source` finds in `delivery`, before they are made a key.
fn key_text(source: &KeySource, scope: &Scope, delivery: &Delivery) -> Result<Vec<u8>, KeyError> {
    match source {
        KeySource::Header(name) => match delivery.header(name) {
            Some(v) => Ok(v.to_vec()),
            None => Err(KeyError::Missing(format!("no header {name:?}"))),
        },
        KeySource::JsonPointer(pointer) => {
            let json = parse(delivery, || format!("nothing at {pointer}"))?;
            match json.pointer(pointer) {
                None | Some(serde_json::Value::Null) => {
                    Err(KeyError::Missing(format!("nothing at {pointer}")))
                }
                Some(serde_json::Value::String(s)) => Ok(s.clone().into_bytes()),
                Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                    Ok(v.to_string().into_bytes())
                }
                Some(_) => Err(KeyError::NotScalar {
                    pointer: pointer.clone(),
                }),
            }
        }
        KeySource::Fields(pointers) => {
            let json = parse(delivery, || format!("none of {pointers:?} present"))?;
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
            Ok(digest
                .as_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes())
        }
        KeySource::Timed { .. } | KeySource::FirstOf(_) => {
            Ok(extract_key(source, scope, delivery)?.key_bytes().to_vec())
        }
    }
}

/// The event's own time in milliseconds since the Unix epoch, where `source` says it is.
fn event_time(source: &EventTime, delivery: &Delivery) -> Result<u64, KeyError> {
    let bad = |at: &str, value: &str| KeyError::BadTime {
        at: at.to_owned(),
        value: value.chars().take(64).collect(),
    };
    let text = |at: &str, text: &str| event_time_ms(text).ok_or_else(|| bad(at, text));
    match source {
        EventTime::Header(name) => match delivery.header(name) {
            None => Err(KeyError::Missing(format!("no event time header {name:?}"))),
            Some(v) => {
                let at = format!("header {name:?}");
                match std::str::from_utf8(v) {
                    Ok(v) => text(&at, v),
                    Err(_) => Err(bad(&at, &String::from_utf8_lossy(v))),
                }
            }
        },
        EventTime::JsonPointer(pointer) => {
            let json = parse(delivery, || format!("no event time at {pointer}"))?;
            match json.pointer(pointer) {
                None | Some(serde_json::Value::Null) => {
                    Err(KeyError::Missing(format!("no event time at {pointer}")))
                }
                Some(serde_json::Value::String(s)) => text(pointer, s),
                Some(serde_json::Value::Number(n)) => {
                    n.as_u64().ok_or_else(|| bad(pointer, &n.to_string()))
                }
                Some(v) => Err(bad(pointer, &v.to_string())),
            }
        }
    }
}

/// An event's time written as text, in milliseconds since the Unix epoch, as
/// [`KeySource::Timed`] reads it: decimal digits are milliseconds (`1795000000123`); anything
/// else must be an RFC 3339 timestamp (`2026-11-18T08:26:40.123Z`, `...+01:00`: CloudEvents'
/// `time`, most JSON producers' own), read to the millisecond, finer digits dropped. The same
/// instant written with another offset is the same time. `None` for anything else, and for a
/// time before the epoch. `dedup inspect --event-time` reads its argument with this too, so it
/// finds the key the runner made.
pub fn event_time_ms(text: &str) -> Option<u64> {
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().ok();
    }
    // RFC 3339 separates the date and the time by `T` (or `t`, or a space by its note); the
    // parser takes any one byte there, which another release may not.
    if !matches!(text.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    let at =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(at.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// Finds `delivery`'s ordering key: what [`Ordering::PerKey`](crate::Ordering::PerKey) keeps in
/// order. `None` (no such key, no such header, nothing usable at the pointer, a payload that is not
/// JSON) puts the message in its partition's own lane, behind every message of the partition that
/// has no ordering key either.
pub fn ordering_key(source: &OrderingKey, delivery: &Delivery) -> Option<Vec<u8>> {
    match source {
        OrderingKey::MessageKey => delivery.key.as_ref().map(|k| k.to_vec()),
        OrderingKey::Header(name) => delivery.header(name).map(<[u8]>::to_vec),
        OrderingKey::JsonPointer(pointer) => {
            match parse(delivery, String::new).ok()?.pointer(pointer)? {
                serde_json::Value::String(s) => Some(s.clone().into_bytes()),
                v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => {
                    Some(v.to_string().into_bytes())
                }
                _ => None,
            }
        }
    }
}

/// The payload as JSON; an empty one is `missing()` (what was looked for), as nothing found.
fn parse(
    delivery: &Delivery,
    missing: impl FnOnce() -> String,
) -> Result<serde_json::Value, KeyError> {
    match delivery.payload.as_deref() {
        None | Some([]) => Err(KeyError::Missing(format!("{}: empty payload", missing()))),
        Some(p) => serde_json::from_slice(p).map_err(|e| KeyError::NotJson(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_keys_are_the_event_id_keyed_with_its_time() {
        let scope = Scope::new("s").expect("a scope");
        let id = "9b2e6f1c-58d4-4c1a-a3f0-2d7e8b9c0a15";
        let ms = 1_795_000_000_123_u64;
        let want = IdempotencyKey::timed(scope.clone(), ms, id).expect("a key");
        let by_header = KeySource::timed(
            KeySource::Header("event-id".into()),
            EventTime::Header("event-ms".into()),
        );
        let by_json = KeySource::timed(
            KeySource::JsonPointer("/id".into()),
            EventTime::JsonPointer("/at".into()),
        );
        let headers = |time: &str| {
            Delivery::new("t", 0, 1)
                .with_header("event-id", id)
                .with_header("event-ms", time.to_owned())
        };
        let json = |time: &str| {
            Delivery::new("t", 0, 2).with_payload(format!(r#"{{"id": "{id}", "at": {time}}}"#))
        };
        // Every copy of the event, whatever else differs, gets the same key; its time reads back.
        for (source, d) in [
            (&by_header, headers(&ms.to_string())),
            (&by_header, headers(&ms.to_string()).with_header("x", "y")),
            (&by_json, json(&ms.to_string())),
            (&by_json, json(&format!("\"{ms}\""))),
        ] {
            let key = extract_key(source, &scope, &d).expect("a key");
            assert_eq!(key, want, "{d:?}");
            assert_eq!(key.uuid7_millis(), Some(ms));
        }
        // The same time in RFC 3339, as CloudEvents' `time` and most JSON producers write it:
        // UTC or any offset, digits past the millisecond dropped (checked apart with Python's
        // datetime), gives the same key.
        for time in [
            "2026-11-18T11:06:40.123Z",
            "2026-11-18T06:06:40.123999-05:00",
            "2026-11-18t11:06:40.123456789z",
        ] {
            for (source, d) in [
                (&by_header, headers(time)),
                (&by_json, json(&format!("\"{time}\""))),
            ] {
                let key = extract_key(source, &scope, &d).expect("a key");
                assert_eq!(key, want, "{time}");
            }
        }
        assert_eq!(event_time_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            event_time_ms("2026-11-18T11:06:40Z"),
            Some(1_795_000_000_000)
        );
        // Another time is another key.
        let later = extract_key(&by_json, &scope, &json(&(ms + 1).to_string())).expect("a key");
        assert_ne!(later, want);
        // No time, or no id: no key (the runner's `MissingKey` decides).
        let no_time = Delivery::new("t", 0, 3).with_header("event-id", id);
        assert!(matches!(
            extract_key(&by_header, &scope, &no_time),
            Err(KeyError::Missing(why)) if why.contains("event-ms")
        ));
        let no_id = Delivery::new("t", 0, 4).with_header("event-ms", "5");
        assert!(matches!(
            extract_key(&by_header, &scope, &no_id),
            Err(KeyError::Missing(_))
        ));
        assert!(matches!(
            extract_key(&by_json, &scope, &json("null")),
            Err(KeyError::Missing(_))
        ));
        // A time that is neither milliseconds nor RFC 3339, or is before the epoch:
        // dead-lettered with the reason.
        for bad in [
            "-5",
            "1.5",
            "1e3",
            "\"soon\"",
            "\"\"",
            "\" 5\"",
            "true",
            "[1]",
            "\"1969-12-31T23:59:59.999Z\"",
            "\"2026-11-18T11:06:40\"",
            "\"2026-02-30T11:06:40Z\"",
            "\"2026-11-18\"",
            "\"2026-11-18_11:06:40.123Z\"",
            "\"Wed, 18 Nov 2026 11:06:40 GMT\"",
        ] {
            let err = extract_key(&by_json, &scope, &json(bad)).expect_err("a bad time");
            assert!(
                matches!(&err, KeyError::BadTime { at, .. } if at == "/at"),
                "{bad}: {err:?}"
            );
            assert!(err.to_string().contains("RFC 3339"), "{err}");
        }
        for bad in [
            "",
            "+5",
            "5 ",
            "99999999999999999999999",
            "2026-11-18T11:06:40.123Z ",
            "2026-11-18T25:06:40Z",
        ] {
            let err = extract_key(&by_header, &scope, &headers(bad)).expect_err("a bad time");
            assert!(matches!(err, KeyError::BadTime { .. }), "{bad:?}: {err:?}");
        }
        // An empty id is a bad key (dead-lettered) even where the time is missing.
        let empty = Delivery::new("t", 0, 6).with_header("event-id", "");
        assert!(matches!(
            extract_key(&by_header, &scope, &empty),
            Err(KeyError::Invalid(InputError::EmptyKey))
        ));
        // An id longer than a key may be: only its digest goes into the key.
        let long = "i".repeat(dedup_core::MAX_KEY_LEN + 1);
        let d = Delivery::new("t", 0, 5)
            .with_header("event-id", long.clone())
            .with_header("event-ms", ms.to_string());
        assert_eq!(
            extract_key(&by_header, &scope, &d).expect("a key"),
            IdempotencyKey::timed(scope.clone(), ms, &long).expect("a key")
        );
        assert!(matches!(
            extract_key(&KeySource::Header("event-id".into()), &scope, &d),
            Err(KeyError::Invalid(InputError::KeyTooLong { .. }))
        ));
        // Past what 48 bits hold: an invalid key, named.
        let err = extract_key(&by_header, &scope, &headers(&(1_u64 << 48).to_string()));
        assert!(matches!(
            err,
            Err(KeyError::Invalid(InputError::EventTime { ms })) if ms == 1 << 48
        ));
    }

    /// The header, else the JSON field: the copy of an event with the header and the copy
    /// without it get one key; a header that is there but no key is an error, never a fallback.
    #[test]
    fn a_list_of_sources_takes_the_first_that_finds_a_key() {
        let scope = Scope::new("s").expect("a scope");
        let key = |text: &str| IdempotencyKey::new(scope.clone(), text).expect("a key");
        let source = KeySource::first_of([
            KeySource::Header("event-id".into()),
            KeySource::JsonPointer("/id".into()),
        ]);
        let find = |d: &Delivery| extract_key(&source, &scope, d);
        let header = Delivery::new("t", 0, 1).with_header("event-id", "abc");
        let field = Delivery::new("t", 0, 2).with_payload(r#"{"id":"abc"}"#);
        let both = field.clone().with_header("event-id", "abc");
        for d in [&header, &field, &both] {
            assert_eq!(find(d).expect("a key"), key("abc"), "{d:?}");
        }
        // The header wins where both are there.
        let differ = field.clone().with_header("event-id", "xyz");
        assert_eq!(find(&differ).expect("a key"), key("xyz"));
        // A number's JSON text is the header's digits.
        let number = Delivery::new("t", 0, 3).with_payload(r#"{"id":42}"#);
        let digits = Delivery::new("t", 0, 4).with_header("event-id", "42");
        assert_eq!(find(&number).expect("a key"), find(&digits).expect("a key"));
        // Neither: no key, naming every source tried.
        let neither = Delivery::new("t", 0, 5).with_payload(r#"{"other":1}"#);
        match find(&neither) {
            Err(KeyError::Missing(why)) => {
                assert!(why.contains("\"event-id\"") && why.contains("/id"), "{why}");
            }
            other => panic!("expected a missing key, got {other:?}"),
        }
        // No payload at all is nothing at the pointer either.
        match find(&Delivery::new("t", 0, 6)) {
            Err(KeyError::Missing(why)) => {
                assert!(why.contains("\"event-id\"") && why.contains("/id"), "{why}");
            }
            other => panic!("expected a missing key, got {other:?}"),
        }
        // A header that is there but is no key is an error, not a fall-through to the field.
        let empty = field.clone().with_header("event-id", "");
        assert!(
            matches!(find(&empty), Err(KeyError::Invalid(InputError::EmptyKey))),
            "{:?}",
            find(&empty)
        );
        let long = field
            .clone()
            .with_header("event-id", "k".repeat(dedup_core::MAX_KEY_LEN + 1));
        assert!(matches!(
            find(&long),
            Err(KeyError::Invalid(InputError::KeyTooLong { .. }))
        ));
        // So is a field that is there but is no key, whichever comes first.
        let field_first = KeySource::first_of([
            KeySource::JsonPointer("/id".into()),
            KeySource::Header("event-id".into()),
        ]);
        let nested = Delivery::new("t", 0, 7)
            .with_header("event-id", "abc")
            .with_payload(r#"{"id":{"v":1}}"#);
        assert!(matches!(
            extract_key(&field_first, &scope, &nested),
            Err(KeyError::NotScalar { .. })
        ));
        assert_eq!(
            extract_key(&field_first, &scope, &header).expect("a key"),
            key("abc")
        );
    }

    /// Timed sources in a list agree with each other, as fields digests of as many fields do.
    #[test]
    fn timed_sources_and_field_digests_in_a_list_give_one_key_per_event() {
        let scope = Scope::new("s").expect("a scope");
        let ms = 1_795_000_000_123_u64;
        let timed = KeySource::first_of([
            KeySource::timed(
                KeySource::Header("event-id".into()),
                EventTime::Header("event-ms".into()),
            ),
            KeySource::timed(
                KeySource::JsonPointer("/id".into()),
                EventTime::JsonPointer("/at".into()),
            ),
        ]);
        let headers = Delivery::new("t", 0, 1)
            .with_header("event-id", "abc")
            .with_header("event-ms", ms.to_string());
        let json = Delivery::new("t", 0, 2)
            .with_payload(r#"{"id":"abc","at":"2026-11-18T11:06:40.123Z"}"#);
        let want = IdempotencyKey::timed(scope.clone(), ms, "abc").expect("a key");
        for d in [&headers, &json] {
            assert_eq!(extract_key(&timed, &scope, d).expect("a key"), want);
        }
        // The id's header without its time header: that source finds nothing, the next one does.
        let no_time = json.clone().with_header("event-id", "abc");
        assert_eq!(extract_key(&timed, &scope, &no_time).expect("a key"), want);
        // A time that is there but unreadable is an error, not a fall-through.
        let bad_time = json
            .clone()
            .with_header("event-id", "abc")
            .with_header("event-ms", "soon");
        assert!(matches!(
            extract_key(&timed, &scope, &bad_time),
            Err(KeyError::BadTime { .. })
        ));
        let fields = KeySource::first_of([
            KeySource::Fields(vec!["/account".into(), "/request".into()]),
            KeySource::Fields(vec!["/acct".into(), "/req".into()]),
        ]);
        let old = Delivery::new("t", 0, 3).with_payload(r#"{"account":7,"request":"r-1"}"#);
        let new = Delivery::new("t", 0, 4).with_payload(r#"{"acct":7,"req":"r-1"}"#);
        assert_eq!(
            extract_key(&fields, &scope, &old).expect("a key"),
            extract_key(&fields, &scope, &new).expect("a key")
        );
    }

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
