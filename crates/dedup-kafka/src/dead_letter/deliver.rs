//! Delivering a dead letter until it is somewhere: the dead-letter topic, or (for a dead letter
//! the topic refuses for good) a Postgres table. Every runner gives its dead letters up through
//! [`DeadLetters::deliver`] (or `settle`), so that the offset never moves past a message that is nowhere and
//! a partition never stalls for good on the path meant to unstall it.
//!
//! `settle` answers a `Settled`; the writer holds the runner's counters, backoff and stop flag,
//! and awaits the broker's acknowledgement. The Postgres table is reached through `RefusedTable`
//! (implemented by `PgStore`: `dedup_dead_letters`).
//!
//! What the producer's answer means:
//! - acknowledged (`acks=all`): written;
//! - refused for good (`MessageSizeTooLarge`, `MessageBatchTooLarge`, `InvalidRecord`: the same
//!   record is refused every time): kept in `dedup_dead_letters` where a Postgres table is given
//!   (under its coordinates and its content's digest, with its idempotency key: a letter at the
//!   coordinates of an older one is kept beside it, the same letter written again is kept once),
//!   otherwise the partition stalls, loudly; so does a letter Postgres refuses for good;
//! - refused until an operator acts (authorization, an unknown or invalid topic): retried with
//!   backoff, each time counted and logged with what to do;
//! - a fatal producer error (the idempotent producer gave up): the producer is made anew, since
//!   every later send on it would fail the same way;
//! - anything else: retried with backoff.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use dedup_core::{IdempotencyKey, StoreError};
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tokio::sync::watch;
use tokio::time::sleep;
use tracing::{error, info, warn};

use super::{Fresh, header_list};
use crate::config::Backoff;
use crate::consumer::Settled;
use crate::delivery::Delivery;
use crate::stats::Counters;

/// A future a refused-dead-letter table answers.
pub(crate) type TableFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

/// Where dead letters refused for good by the dead-letter topic are kept (`dedup_pg`'s
/// `dedup_dead_letters`): a trait so that the runners do not depend on the `pg` feature.
pub(crate) trait RefusedTable: std::fmt::Debug + Send + Sync + 'static {
    #[allow(clippy::too_many_arguments)]
    fn keep<'a>(
        &'a self,
        group: &'a str,
        d: &'a Delivery,
        key: Option<&'a IdempotencyKey>,
        reason: &'a str,
        attempts: u32,
        dead_letter_topic: &'a str,
        refusal: &'a str,
    ) -> TableFuture<'a>;
}
impl RefusedTable for dedup_pg::PgStore {
    fn keep<'a>(
        &'a self,
        group: &'a str,
        d: &'a Delivery,
        key: Option<&'a IdempotencyKey>,
        reason: &'a str,
        attempts: u32,
        dead_letter_topic: &'a str,
        refusal: &'a str,
    ) -> TableFuture<'a> {
        Box::pin(async move {
            let mut row = super::RefusedDeadLetter::new(group, &d.topic, d.partition, d.offset);
            row.message_key = d.key.as_ref().map(|k| k.to_vec());
            row.payload = d.payload.as_ref().map(|p| p.to_vec());
            row.headers = d
                .headers
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_ref().map(|v| v.to_vec())))
                .collect();
            row.timestamp_ms = d.timestamp_ms;
            row.idempotency_key = key.cloned();
            row.reason = reason.to_owned();
            row.attempts = attempts;
            row.dead_letter_topic = dead_letter_topic.to_owned();
            row.refusal = refusal.to_owned();
            // Written now, or the same letter was kept before (a replay after a crash).
            super::KeptDeadLetters::new(self)
                .keep(&row)
                .await
                .map(|_| ())
        })
    }
}

/// What the producer's refusal means.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Refusal {
    /// The same record is refused every time.
    Permanent,
    /// Refused until an operator acts (an ACL, a topic to create).
    Operator,
    /// The producer itself is dead (a fatal error): make it anew.
    Fatal,
    /// Anything else: try again.
    Passing,
}

/// What `e` (a producer's answer to a dead letter) means.
pub(crate) fn refusal_of(e: &KafkaError) -> Refusal {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::InvalidRecord,
        ) => Refusal::Permanent,
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::InvalidTopic,
        ) => Refusal::Operator,
        Some(RDKafkaErrorCode::Fatal) => Refusal::Fatal,
        _ => Refusal::Passing,
    }
}

/// Where a dead letter went.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Delivered {
    /// To the dead-letter topic.
    Topic,
    /// Refused for good by the topic, and kept in Postgres.
    Table,
}

/// Writes dead letters.
pub(crate) struct DeadLetters {
    /// Made anew after a fatal error.
    producer: RwLock<FutureProducer>,
    config: ClientConfig,
    pub(crate) topic: String,
    group: String,
    table: Option<Arc<dyn RefusedTable>>,
    /// Where failed writes and their retries are counted.
    counters: Arc<Counters>,
    /// The wait between retries.
    backoff: Backoff,
    /// The runner stops: a wait between retries ends early.
    stopping: watch::Receiver<bool>,
}

/// The runner a dead-letter writer belongs to: where it counts, how it waits, and when it stops.
pub(crate) struct Owner {
    pub(crate) counters: Arc<Counters>,
    pub(crate) backoff: Backoff,
    pub(crate) stopping: watch::Receiver<bool>,
}

impl DeadLetters {
    /// A writer to `topic` with a producer made from `config`; dead letters the topic refuses
    /// for good are kept in `table` where one is given.
    pub(crate) fn new(
        config: ClientConfig,
        topic: String,
        group: String,
        table: Option<Arc<dyn RefusedTable>>,
        owner: Owner,
    ) -> Result<Self, KafkaError> {
        let producer: FutureProducer = config.create()?;
        Ok(Self {
            producer: RwLock::new(producer),
            config,
            topic,
            group,
            table,
            counters: owner.counters,
            backoff: owner.backoff,
            stopping: owner.stopping,
        })
    }

    fn producer(&self) -> FutureProducer {
        self.producer
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Flushes what the producer has in flight (at shutdown).
    pub(crate) fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        self.producer().flush(timeout)
    }

    /// Makes the producer anew after a fatal error (every later send on it would fail).
    fn renew(&self) {
        match self.config.create::<FutureProducer>() {
            Ok(p) => {
                *self
                    .producer
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = p;
                info!(topic = %self.topic, "the dead-letter producer was made anew after a fatal error");
            }
            Err(e) => warn!(error = %e, "making the dead-letter producer anew failed"),
        }
    }

    /// One attempt to write `d` to the dead-letter topic; returns once the broker acknowledged
    /// it (`acks=all`), so the offset may then move past the message; naming the message's
    /// idempotency key (where it had a usable one) in the `dedup-scope` and `dedup-key`
    /// headers, so that an operator can forget the key before re-driving the dead letter
    /// (`dedup forget --dead-letters`).
    pub(crate) async fn write_keyed(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&IdempotencyKey>,
    ) -> Result<(), KafkaError> {
        let fresh = Fresh::new(d, reason, attempts);
        let list = header_list(d, &fresh, key);
        let mut headers = OwnedHeaders::new_with_capacity(list.len());
        for (k, v) in list {
            headers = headers.insert(Header { key: k, value: v });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).headers(headers);
        if let Some(k) = &d.key {
            record = record.key(&k[..]);
        }
        if let Some(p) = &d.payload {
            record = record.payload(&p[..]);
        }
        let producer = self.producer();
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map(|_| ())
            .map_err(|(e, _)| {
                // A fatal error of the producer comes back as the error of the send that met
                // it, or as a later one's: ask the producer itself, unless the answer already
                // says what to do (a refusal for good, or one only an operator can cure).
                if refusal_of(&e) != Refusal::Passing {
                    return e;
                }
                match producer.client().fatal_error() {
                    Some((code, _)) if code != RDKafkaErrorCode::NoError => {
                        KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)
                    }
                    _ => e,
                }
            })
    }

    /// Gives `d` up until it is somewhere (see [`deliver`](Self::deliver)): `DeadLettered`, or
    /// `Abandoned` when `abandoned` answers true after a wait (revoked, or the runner stops).
    pub(crate) async fn settle(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&IdempotencyKey>,
        abandoned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Settled {
        match self.deliver(d, reason, attempts, key, abandoned).await {
            Some(_) => Settled::DeadLettered,
            None => Settled::Abandoned,
        }
    }

    /// Gives `d` up until it is somewhere: the dead-letter topic, or (refused for good there)
    /// the Postgres table. `None`: the message is left to redelivery (`abandoned` answered true
    /// after a wait: revoked, or the runner stops).
    pub(crate) async fn deliver(
        &self,
        d: &Delivery,
        reason: &str,
        attempts: u32,
        key: Option<&IdempotencyKey>,
        abandoned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Option<Delivered> {
        let counters = &self.counters;
        let mut retry = 0;
        let mut failing = None;
        loop {
            let e = match self.write_keyed(d, reason, attempts, key).await {
                Ok(()) => return Some(Delivered::Topic),
                Err(e) => e,
            };
            counters.dead_letter_errors.add(1);
            failing.get_or_insert_with(|| Failing::new(counters));
            match refusal_of(&e) {
                Refusal::Permanent => {
                    if let Some(table) = &self.table {
                        match table
                            .keep(
                                &self.group,
                                d,
                                key,
                                reason,
                                attempts,
                                &self.topic,
                                &e.to_string(),
                            )
                            .await
                        {
                            Ok(()) => {
                                counters.dead_letters_kept.add(1);
                                warn!(topic = %d.topic, partition = d.partition, offset = d.offset, dead_letter_topic = %self.topic, error = %e, "the dead-letter topic refuses this message for good: kept in dedup_dead_letters (see `dedup dead-letters`)");
                                return Some(Delivered::Table);
                            }
                            Err(se) if se.is_retryable() => {
                                warn!(error = %se, "keeping a refused dead letter in Postgres failed; retrying");
                            }
                            Err(se) => {
                                counters.dead_letter_stalls.add(1);
                                error!(topic = %d.topic, partition = d.partition, offset = d.offset, dead_letter_topic = %self.topic, error = %se, "the dead-letter topic refuses this message for good and Postgres cannot keep it in dedup_dead_letters: its partition stalls until the cause named here is dealt with");
                            }
                        }
                    } else {
                        counters.dead_letter_stalls.add(1);
                        error!(topic = %d.topic, partition = d.partition, offset = d.offset, dead_letter_topic = %self.topic, error = %e, "the dead-letter topic refuses this message for good and no Postgres table is configured to keep it: its partition stalls. Raise the dead-letter topic's max.message.bytes (and the producer's message.max.bytes), or give the runner a Postgres store");
                    }
                }
                Refusal::Operator => {
                    counters.dead_letter_stalls.add(1);
                    error!(dead_letter_topic = %self.topic, error = %e, "the dead-letter topic refuses writes: its partition stalls until an operator creates the topic or grants this client Write on it");
                }
                Refusal::Fatal => {
                    warn!(error = %e, "the dead-letter producer met a fatal error");
                    self.renew();
                }
                Refusal::Passing => {
                    warn!(error = %e, topic = %self.topic, "dead-letter write failed; retrying");
                }
            }
            retry += 1;
            counters.retries.add(1);
            let mut stopping = self.stopping.clone();
            tokio::select! {
                () = sleep(self.backoff.delay(retry)) => {}
                _ = stopping.wait_for(|s| *s) => {}
            }
            if abandoned() {
                return None;
            }
        }
    }
}

/// Counts one dead letter whose write has failed, until its delivery ends (`dead_letters_failing`).
struct Failing<'a>(&'a Counters);

impl<'a> Failing<'a> {
    fn new(counters: &'a Counters) -> Self {
        counters.dead_letters_failing.add(1);
        Self(counters)
    }
}

impl Drop for Failing<'_> {
    fn drop(&mut self) {
        self.0.dead_letters_failing.sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_apart() {
        let production = |code| KafkaError::MessageProduction(code);
        assert_eq!(
            refusal_of(&production(RDKafkaErrorCode::MessageSizeTooLarge)),
            Refusal::Permanent
        );
        assert_eq!(
            refusal_of(&production(RDKafkaErrorCode::InvalidRecord)),
            Refusal::Permanent
        );
        assert_eq!(
            refusal_of(&production(RDKafkaErrorCode::TopicAuthorizationFailed)),
            Refusal::Operator
        );
        assert_eq!(
            refusal_of(&production(RDKafkaErrorCode::Fatal)),
            Refusal::Fatal
        );
        assert_eq!(
            refusal_of(&production(RDKafkaErrorCode::RequestTimedOut)),
            Refusal::Passing
        );
    }
}
