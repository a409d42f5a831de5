//! One page of outbox rows to Kafka: each row sent as it was stored (topic, key, payload, the
//! queued headers, the Kafka timestamp), with the relay's headers (the derived key, the cause)
//! written fresh; then every delivery awaited, the lease renewed meanwhile.

use std::time::Duration;

use dedup_core::outbox::{OUTBOX_CAUSE_KEY, OUTBOX_CAUSE_SCOPE, OUTBOX_KEY, is_outbox_header};
use dedup_pg::outbox::{OutboxDeadLetter, OutboxRow, RelayStore, decode_headers};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

use super::relay::{Leading, Refusals};
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

/// Sends `rows` and awaits every delivery, renewing the lease meanwhile (a third of `ttl` after
/// its last renewal). A row already refused for good is not sent: it is answered as a dead
/// letter. A row the broker refused in a produce batch is suspect: the page fails, and the next
/// try sends it alone once everything before it is acknowledged. Answers the rows to keep as
/// dead letters, or why the page must be sent again.
pub(super) async fn publish_page(
    producer: &FutureProducer,
    rows: &[OutboxRow],
    relay: &RelayStore,
    lead: &mut Leading,
    ttl: Duration,
    lags: &mut Vec<i64>,
    refusals: &mut Refusals,
) -> Result<Vec<OutboxDeadLetter>, PageError> {
    let mut dead = Vec::new();
    let mut pending: Vec<(usize, DeliveryFuture)> = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let id = (row.xid, row.pos);
        if let Some(reason) = refusals.refused.get(&id) {
            dead.push(OutboxDeadLetter {
                row: row.clone(),
                reason: reason.clone(),
            });
            continue;
        }
        let alone = refusals.suspect.contains(&id);
        if alone {
            await_all(
                std::mem::take(&mut pending),
                rows,
                relay,
                lead,
                ttl,
                lags,
                refusals,
            )
            .await?;
        }
        let f = loop {
            match producer.send_result(record_of(row)) {
                Ok(f) => break Some(f),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    lead.renew_if_due(relay, ttl).await?;
                }
                // Refused before it left (too large for the producer): this row alone.
                Err((e, _)) if refused_for_good(&e) => {
                    dead.push(OutboxDeadLetter {
                        row: row.clone(),
                        reason: e.to_string(),
                    });
                    break None;
                }
                Err((e, _)) => return Err(PageError::Passing(e.to_string())),
            }
        };
        let Some(f) = f else { continue };
        pending.push((i, f));
        if alone {
            // Suspect again only if the broker refuses it for good once more.
            refusals.suspect.remove(&id);
            match await_all(
                std::mem::take(&mut pending),
                rows,
                relay,
                lead,
                ttl,
                lags,
                refusals,
            )
            .await
            {
                Ok(()) => {}
                Err(PageError::Passing(why)) if refusals.suspect.contains(&id) => {
                    // Refused alone: for good. The next try goes on without it (under the
                    // gapless guarantee the producer is fatal now, and is made anew).
                    refusals.suspect.remove(&id);
                    refusals.refused.insert(id, why.clone());
                    return Err(PageError::Passing(format!(
                        "a message refused for good ({why}); the page is sent again without it"
                    )));
                }
                Err(e) => return Err(e),
            }
        }
    }
    await_all(pending, rows, relay, lead, ttl, lags, refusals).await?;
    Ok(dead)
}

/// Awaits `pending` deliveries (of `rows`), renewing the lease meanwhile; a row the broker
/// refused for good becomes suspect, and any failure fails the page (after every delivery is
/// in, so none is left behind).
async fn await_all(
    pending: Vec<(usize, DeliveryFuture)>,
    rows: &[OutboxRow],
    relay: &RelayStore,
    lead: &mut Leading,
    ttl: Duration,
    lags: &mut Vec<i64>,
    refusals: &mut Refusals,
) -> Result<(), PageError> {
    let mut failed = None;
    for (i, mut f) in pending {
        let answer = loop {
            let due = lead.last_renew + ttl / 3;
            tokio::select! {
                a = &mut f => break a,
                () = tokio::time::sleep_until(due.into()) => lead.renew_if_due(relay, ttl).await?,
            }
        };
        match answer {
            Ok(Ok(_)) => lags.push(now_ms() - rows[i].written_ms),
            Ok(Err((e, _))) => {
                if refused_for_good(&e) {
                    refusals.suspect.insert((rows[i].xid, rows[i].pos));
                }
                failed.get_or_insert_with(|| e.to_string());
            }
            Err(_) => {
                failed.get_or_insert_with(|| "the producer dropped a delivery".to_owned());
            }
        }
    }
    match failed {
        Some(why) => Err(PageError::Passing(why)),
        None => Ok(()),
    }
}

/// The record a row goes out as: topic, key, payload, the queued headers and the relay's, the
/// Kafka timestamp of its write.
fn record_of(row: &OutboxRow) -> FutureRecord<'_, [u8], [u8]> {
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&row.topic)
        .timestamp(row.written_ms)
        .headers(headers_of(row));
    if let Some(k) = &row.key {
        record = record.key(&k[..]);
    }
    if let Some(p) = &row.payload {
        record = record.payload(&p[..]);
    }
    record
}

/// Now, in milliseconds since the Unix epoch.
pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
