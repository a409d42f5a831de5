//! The dead-letter topic: where poison messages, permanent failures and keyless messages go,
//! with the reason, the attempts, the original coordinates and the idempotency key in headers.
//!
//! A dead letter carries the original message's headers except those named exactly as one dedup
//! writes ([`DLQ_HEADERS`], any case): those are written fresh. A dead letter re-driven to its
//! source topic after a fix (docs/RECOVERY.md) and dead-lettered again so carries one
//! `dedup-reason`, the latest, never a stack of them. Any other header is copied, whatever its
//! name: a user's `dedup-event-ms` stays (it may be the message's key or event time). The reason
//! is bounded to 1 KiB; the idempotency key goes in `dedup-scope` and `dedup-key`. Delivery is
//! in `deliver.rs`, the size check at start in `limits.rs`.

use std::borrow::Cow;

use dedup_core::IdempotencyKey;

use crate::delivery::Delivery;

mod deliver;
mod kept;
mod limits;

pub(crate) use deliver::{DeadLetters, Owner, Refusal, RefusedTable, refusal_of};
pub use kept::{KeptDeadLetters, RefusedDeadLetter};
pub(crate) use limits::check_at_start;

/// Dead-letter header: why the message was dead-lettered (at most 1,024 bytes).
pub const DLQ_REASON: &str = "dedup-reason";
/// Dead-letter header: the attempts made.
pub const DLQ_ATTEMPTS: &str = "dedup-attempts";
/// Dead-letter header: the original topic.
pub const DLQ_TOPIC: &str = "dedup-original-topic";
/// Dead-letter header: the original partition.
pub const DLQ_PARTITION: &str = "dedup-original-partition";
/// Dead-letter header: the original offset.
pub const DLQ_OFFSET: &str = "dedup-original-offset";
/// Dead-letter header: the idempotency key's scope (UTF-8), where the message had a usable key.
pub const DLQ_SCOPE: &str = "dedup-scope";
/// Dead-letter header: the idempotency key's bytes, where the message had a usable key.
pub const DLQ_KEY: &str = "dedup-key";

/// Every header dedup writes on a dead letter, by its exact name: an original header of one of
/// these names (in any case) is not copied, since the fresh one replaces it (or, for the key's
/// two, the message names no usable key now). Every other header is copied.
pub const DLQ_HEADERS: &[&str] = &[
    DLQ_REASON,
    DLQ_ATTEMPTS,
    DLQ_TOPIC,
    DLQ_PARTITION,
    DLQ_OFFSET,
    DLQ_SCOPE,
    DLQ_KEY,
];

/// The longest `dedup-reason` header, in bytes (a handler's error may quote a whole payload).
pub(crate) const MAX_REASON_LEN: usize = 1024;

/// The values of the headers dedup writes, as text.
pub(crate) struct Fresh<'a> {
    reason: Cow<'a, str>,
    attempts: String,
    partition: String,
    offset: String,
}

impl<'a> Fresh<'a> {
    pub(crate) fn new(d: &Delivery, reason: &'a str, attempts: u32) -> Self {
        Self {
            reason: bounded_reason(reason),
            attempts: attempts.to_string(),
            partition: d.partition.to_string(),
            offset: d.offset.to_string(),
        }
    }
}

/// Whether `name` is one of the headers dedup writes ([`DLQ_HEADERS`]), in any case.
fn is_dedup_header(name: &str) -> bool {
    DLQ_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// A dead letter's headers, in order: the original ones that are not dedup's, then dedup's,
/// fresh (the key's scope and bytes where `key` is given).
pub(crate) fn header_list<'a>(
    d: &'a Delivery,
    fresh: &'a Fresh<'_>,
    key: Option<&'a IdempotencyKey>,
) -> Vec<(&'a str, Option<&'a [u8]>)> {
    let mut out: Vec<(&'a str, Option<&'a [u8]>)> = Vec::with_capacity(d.headers.len() + 7);
    for (k, v) in &d.headers {
        if !is_dedup_header(k) {
            out.push((k.as_str(), v.as_deref()));
        }
    }
    out.push((DLQ_REASON, Some(fresh.reason.as_bytes())));
    out.push((DLQ_ATTEMPTS, Some(fresh.attempts.as_bytes())));
    out.push((DLQ_TOPIC, Some(d.topic.as_bytes())));
    out.push((DLQ_PARTITION, Some(fresh.partition.as_bytes())));
    out.push((DLQ_OFFSET, Some(fresh.offset.as_bytes())));
    if let Some(key) = key {
        out.push((DLQ_SCOPE, Some(key.scope().as_str().as_bytes())));
        out.push((DLQ_KEY, Some(key.key_bytes())));
    }
    out
}

/// `reason`, or where it is longer than [`MAX_REASON_LEN`] bytes its start, cut on a character
/// boundary, followed by "… (cut, N bytes in all)": at most [`MAX_REASON_LEN`] bytes in all.
pub(crate) fn bounded_reason(reason: &str) -> Cow<'_, str> {
    if reason.len() <= MAX_REASON_LEN {
        return Cow::Borrowed(reason);
    }
    let marker = format!("… (cut, {} bytes in all)", reason.len());
    let mut end = MAX_REASON_LEN.saturating_sub(marker.len());
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + marker.len());
    out.push_str(&reason[..end]);
    out.push_str(&marker);
    Cow::Owned(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use dedup_core::Scope;

    use super::*;

    #[test]
    fn a_short_reason_is_kept_whole() {
        assert_eq!(bounded_reason("negative amount"), "negative amount");
        let exact = "x".repeat(MAX_REASON_LEN);
        assert!(matches!(bounded_reason(&exact), Cow::Borrowed(r) if r == exact));
    }

    #[test]
    fn a_long_reason_is_cut_on_a_char_boundary_with_a_marker() {
        // Two-byte and four-byte characters, so that the cut falls inside one.
        for filler in ["é", "𝄞", "a"] {
            let long = format!("the handler failed: {}", filler.repeat(2000));
            let cut = bounded_reason(&long);
            assert!(cut.len() <= MAX_REASON_LEN, "{} bytes", cut.len());
            let marker = format!("… (cut, {} bytes in all)", long.len());
            assert!(cut.ends_with(&marker), "{cut}");
            let kept = &cut[..cut.len() - marker.len()];
            assert!(long.starts_with(kept));
            // No more than one character's worth shorter than the room there was.
            assert!(
                kept.len() + marker.len() + 4 > MAX_REASON_LEN,
                "{}",
                kept.len()
            );
        }
        let one_over = "y".repeat(MAX_REASON_LEN + 1);
        let cut = bounded_reason(&one_over);
        assert!(cut.len() <= MAX_REASON_LEN);
        assert!(cut.ends_with("… (cut, 1025 bytes in all)"), "{cut}");
    }

    #[test]
    fn dedup_headers_are_replaced_not_stacked_and_others_kept_in_order() {
        // A dead letter re-driven to its topic and dead-lettered again.
        let d = Delivery::new("orders", 2, 41)
            .with_payload("{}")
            .with_header("idempotency-key", "evt-7")
            .with_header(DLQ_REASON, "the handler failed permanently: bug")
            .with_header(DLQ_ATTEMPTS, "1")
            .with_header("traceparent", "00-abc-def-01")
            .with_header(DLQ_TOPIC, "orders")
            .with_header(DLQ_PARTITION, "0")
            .with_header(DLQ_OFFSET, "7")
            .with_header(DLQ_SCOPE, "old-scope")
            .with_header(DLQ_KEY, "old-key")
            .with_header("DEDUP-Reason", "an old reason in another case")
            .with_header("dedup-event-ms", "1700000000000")
            .with_header("Dedup-Something", "the user's too")
            .with_header("dedupe", "not ours");
        let key = IdempotencyKey::new(Scope::new("g").unwrap(), "evt-7").unwrap();
        let fresh = Fresh::new(&d, "still failing", 3);
        let list = header_list(&d, &fresh, Some(&key));
        let text: Vec<(&str, &str)> = list
            .iter()
            .map(|(k, v)| (*k, std::str::from_utf8(v.unwrap_or_default()).unwrap()))
            .collect();
        assert_eq!(
            text,
            vec![
                ("idempotency-key", "evt-7"),
                ("traceparent", "00-abc-def-01"),
                ("dedup-event-ms", "1700000000000"),
                ("Dedup-Something", "the user's too"),
                ("dedupe", "not ours"),
                (DLQ_REASON, "still failing"),
                (DLQ_ATTEMPTS, "3"),
                (DLQ_TOPIC, "orders"),
                (DLQ_PARTITION, "2"),
                (DLQ_OFFSET, "41"),
                (DLQ_SCOPE, "g"),
                (DLQ_KEY, "evt-7"),
            ]
        );
        let without_key = header_list(&d, &fresh, None);
        assert_eq!(
            without_key
                .iter()
                .filter(|(k, _)| DLQ_HEADERS.contains(k))
                .count(),
            5
        );
        assert!(
            !without_key
                .iter()
                .any(|(k, _)| *k == DLQ_SCOPE || *k == DLQ_KEY)
        );
    }

    #[test]
    fn every_header_dedup_writes_is_listed_and_no_other() {
        let d = Delivery::new("t", 0, 0);
        let key = IdempotencyKey::new(Scope::new("g").unwrap(), "k").unwrap();
        let fresh = Fresh::new(&d, "r", 1);
        let written: Vec<&str> = header_list(&d, &fresh, Some(&key))
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(written, DLQ_HEADERS);
        assert!(!is_dedup_header("dedup-event-ms"));
        assert!(!is_dedup_header("dedup-"));
        assert!(is_dedup_header("Dedup-Original-Offset"));
    }

    #[test]
    fn the_reason_header_is_bounded() {
        let d = Delivery::new("t", 0, 0);
        let long = "z".repeat(100_000);
        let fresh = Fresh::new(&d, &long, 1);
        let list = header_list(&d, &fresh, None);
        let reason = list
            .iter()
            .find(|(k, _)| *k == DLQ_REASON)
            .and_then(|(_, v)| *v)
            .unwrap();
        assert!(reason.len() <= MAX_REASON_LEN);
    }
}
