//! The parked queue on Postgres: [`ParkStore`] for `dedup_pg::PgStore`, through `store`.

use std::time::Duration;

use dedup_pg::PgStore;

use super::store::{
    HeadSettled, HeadTaken, ParkEpoch, ParkOutcome, ParkedMessage, ParkedPartition, ParkedQueue,
};

use super::{Barrier, Head, HeadOutcome, ParkStore, Parked, PartRef, StoreFuture, Taken};
use crate::delivery::Delivery;

fn part(p: &PartRef) -> ParkedPartition {
    ParkedPartition::new(p.group.clone(), p.topic.clone(), p.partition)
}

fn vec_of(b: Option<&bytes::Bytes>) -> Option<Vec<u8>> {
    b.map(|b| b.to_vec())
}

impl ParkStore for PgStore {
    fn acquire<'a>(
        &'a self,
        p: &'a PartRef,
        owner: &'a str,
        owned: &'a (dyn Fn() -> bool + Send + Sync),
    ) -> StoreFuture<'a, Option<Barrier>> {
        Box::pin(async move {
            Ok(ParkedQueue::new(self)
                .acquire_parked_while(&part(p), owner, owned)
                .await?
                .map(|(epoch, keys)| (epoch.0, keys)))
        })
    }

    fn park<'a>(
        &'a self,
        p: &'a PartRef,
        epoch: i64,
        d: &'a Delivery,
        key: Option<Vec<u8>>,
        dedup_key: Option<(String, Vec<u8>)>,
        error: &'a str,
        attempts: u32,
        due_in: Duration,
        marker: bool,
    ) -> StoreFuture<'a, Parked> {
        Box::pin(async move {
            let mut message = ParkedMessage::new(d.offset, key, error, attempts).with_message(
                vec_of(d.key.as_ref()),
                vec_of(d.payload.as_ref()),
                d.headers
                    .iter()
                    .map(|(k, v)| (k.clone(), vec_of(v.as_ref())))
                    .collect(),
                d.timestamp_ms,
            );
            if let Some((scope, k)) = dedup_key {
                message = message.with_dedup_key(scope, k);
            }
            if marker {
                // Dead-lettered already: the row only holds its key; nothing of it runs again.
                message = message.with_message(None, None, Vec::new(), d.timestamp_ms);
                message = message.into_held_marker();
            }
            match ParkedQueue::new(self)
                .park(&part(p), ParkEpoch(epoch), &message, due_in)
                .await
            {
                Ok(ParkOutcome::Parked) => Ok(Parked::Written),
                Ok(ParkOutcome::AlreadyParked) => Ok(Parked::Already),
                Ok(_) => Ok(Parked::Fenced),
                // A data exception (a NUL in a header name, say) or a program limit: the same
                // row is refused every time. Any other error (a missing column, a permission)
                // is retried as a store that is not ready.
                Err(e)
                    if dedup_pg::sqlstate(&e)
                        .is_some_and(|c| c.starts_with("22") || c == "54000") =>
                {
                    Ok(Parked::Refused(e.to_string()))
                }
                Err(e) => Err(e),
            }
        })
    }

    fn due_heads<'a>(
        &'a self,
        group: &'a str,
        parts: &'a [(String, i32)],
        limit: u32,
    ) -> StoreFuture<'a, Vec<Head>> {
        Box::pin(async move {
            let heads = ParkedQueue::new(self)
                .due_heads(group, parts, limit)
                .await?;
            Ok(heads
                .into_iter()
                .map(|h| {
                    let m = h.message;
                    Head {
                        delivery: Delivery {
                            topic: h.topic,
                            partition: h.partition,
                            offset: m.offset,
                            key: m.message_key.map(bytes::Bytes::from),
                            payload: m.payload.map(bytes::Bytes::from),
                            headers: m
                                .headers
                                .into_iter()
                                .map(|(k, v)| (k, v.map(bytes::Bytes::from)))
                                .collect(),
                            timestamp_ms: m.timestamp_ms,
                        },
                        key: m.ordering_key,
                        error: m.error,
                        attempts: m.attempts,
                        dropped: h.dropped,
                        gave_up: h.gave_up,
                    }
                })
                .collect())
        })
    }

    fn take<'a>(
        &'a self,
        p: &'a PartRef,
        epoch: i64,
        offset: i64,
        bound: Duration,
    ) -> StoreFuture<'a, Taken> {
        Box::pin(async move {
            Ok(
                match ParkedQueue::new(self)
                    .take_head(&part(p), ParkEpoch(epoch), offset, bound)
                    .await?
                {
                    HeadTaken::Taken => Taken::Run,
                    HeadTaken::Gone => Taken::Gone,
                    _ => Taken::Fenced,
                },
            )
        })
    }

    fn settle<'a>(
        &'a self,
        p: &'a PartRef,
        epoch: i64,
        offset: i64,
        hold_rest: bool,
    ) -> StoreFuture<'a, HeadOutcome> {
        Box::pin(async move {
            Ok(
                match ParkedQueue::new(self)
                    .settle_head(&part(p), ParkEpoch(epoch), offset, hold_rest)
                    .await?
                {
                    HeadSettled::Removed => HeadOutcome::Removed,
                    HeadSettled::Held => HeadOutcome::Held,
                    HeadSettled::Gone => HeadOutcome::Gone,
                    _ => HeadOutcome::Fenced,
                },
            )
        })
    }

    fn defer<'a>(
        &'a self,
        p: &'a PartRef,
        epoch: i64,
        offset: i64,
        error: &'a str,
        attempts: u32,
        due_in: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            ParkedQueue::new(self)
                .defer_head(&part(p), ParkEpoch(epoch), offset, error, attempts, due_in)
                .await
        })
    }

    fn gauges<'a>(
        &'a self,
        group: &'a str,
        parts: &'a [(String, i32)],
    ) -> StoreFuture<'a, (u64, u64, Duration)> {
        Box::pin(async move {
            let g = ParkedQueue::new(self).parked_gauges(group, parts).await?;
            Ok((g.keys, g.messages, g.oldest))
        })
    }
}
