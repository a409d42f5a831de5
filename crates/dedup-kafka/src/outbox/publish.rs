//! One page of outbox rows to Kafka: each row sent as it was stored (topic, key, payload, the
//! queued headers, the Kafka timestamp), with the relay's headers (the derived key, the cause)
//! written fresh; then every delivery awaited, the lease renewed meanwhile.

use std::time::Duration;

use dedup_core::outbox::{OUTBOX_CAUSE_KEY, OUTBOX_CAUSE_SCOPE, OUTBOX_KEY, is_outbox_header};
use dedup_pg::outbox::{OutboxDeadLetter, OutboxLease, OutboxRow, RelayStore, decode_headers};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

use crate::dead_letter::{Refusal, refusal_of};

/// Why a page did not go out whole.
#[derive(Debug)]
pub(super) enum PageError {
    /// A passing failure (the broker down, a timeout, a fatal producer error): the round runs
    /// again from the position, after a wait.
    Passing(String),
    /// The lease was taken over meanwhile: stand by.
    LeaseLost,
}

/// Whether `e` means the broker refuses the message for good: it goes to the dead letters.
fn refused_for_good(e: &KafkaError) -> bool {
    matches!(refusal_of(e), Refusal::Permanent)
        || matches!(
            e.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::UnknownTopicOrPartition
                    | RDKafkaErrorCode::UnknownTopic
                    | RDKafkaErrorCode::InvalidTopic
            )
        )
}

/// The headers a row goes out with: those queued (less any named as one of the relay's), then
/// the derived key and the cause.
fn headers_of(row: &OutboxRow) -> OwnedHeaders {
    let queued = decode_headers(&row.headers).unwrap_or_default();
    let mut h = OwnedHeaders::new_with_capacity(queued.len() + 3);
    for (name, value) in &queued {
        if is_outbox_header(name) {
            continue;
        }
        h = h.insert(Header {
            key: name.as_str(),
            value: value.as_deref(),
        });
    }
    h.insert(Header {
        key: OUTBOX_KEY,
        value: Some(&row.idem_key[..]),
    })
    .insert(Header {
        key: OUTBOX_CAUSE_SCOPE,
        value: Some(row.cause_scope.as_bytes()),
    })
    .insert(Header {
        key: OUTBOX_CAUSE_KEY,
        value: Some(&row.cause_key[..]),
    })
}

/// Sends `rows` and awaits every delivery, renewing `lease` every `renew` meanwhile. Answers the
/// rows the broker refused for good (with the reason), or why the page must be sent again.
pub(super) async fn publish_page(
    producer: &FutureProducer,
    rows: &[OutboxRow],
    relay: &RelayStore,
    lease: &OutboxLease,
    ttl: Duration,
    lags: &mut Vec<i64>,
) -> Result<Vec<OutboxDeadLetter>, PageError> {
    let renew_every = ttl / 3;
    let mut renew =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    let mut dead = Vec::new();
    let mut pending: Vec<(usize, DeliveryFuture)> = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&row.topic)
            .timestamp(row.written_ms)
            .headers(headers_of(row));
        if let Some(k) = &row.key {
            record = record.key(&k[..]);
        }
        if let Some(p) = &row.payload {
            record = record.payload(&p[..]);
        }
        loop {
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push((i, f));
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(5)) => {}
                        _ = renew.tick() => renew_lease(relay, lease, ttl).await?,
                    }
                }
                Err((e, _)) if refused_for_good(&e) => {
                    dead.push(OutboxDeadLetter {
                        row: row.clone(),
                        reason: e.to_string(),
                    });
                    break;
                }
                Err((e, _)) => return Err(PageError::Passing(e.to_string())),
            }
        }
    }
    let mut failed = None;
    for (i, mut f) in pending {
        let answer = loop {
            tokio::select! {
                a = &mut f => break a,
                _ = renew.tick() => renew_lease(relay, lease, ttl).await?,
            }
        };
        match answer {
            Ok(Ok(_)) => lags.push(now_ms() - rows[i].written_ms),
            Ok(Err((e, _))) if refused_for_good(&e) => dead.push(OutboxDeadLetter {
                row: rows[i].clone(),
                reason: e.to_string(),
            }),
            Ok(Err((e, _))) => {
                failed.get_or_insert_with(|| e.to_string());
            }
            Err(_) => {
                failed.get_or_insert_with(|| "the producer dropped a delivery".to_owned());
            }
        }
    }
    match failed {
        Some(why) => Err(PageError::Passing(why)),
        None => {
            dead.sort_by_key(|d| (d.row.xid, d.row.pos));
            Ok(dead)
        }
    }
}

async fn renew_lease(
    relay: &RelayStore,
    lease: &OutboxLease,
    ttl: Duration,
) -> Result<(), PageError> {
    match relay.renew(lease, ttl).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(PageError::LeaseLost),
        // Postgres away: the lease may run out; the position cannot move without it anyway.
        Err(e) => Err(PageError::Passing(e.to_string())),
    }
}

/// Now, in milliseconds since the Unix epoch.
pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
