//! The consumer side every runner shares: the partitions this member owns and what is settled in
//! them, the rebalance callbacks, offset commits, why partitions are paused (`pause`), and the
//! Kafka clients.
//!
//! `Part` is a partition owned: its generation, revoked flag, pending offsets, next offset and
//! last commit. `commit` commits each partition up to its first unsettled offset. `Source` is what
//! a loop reads: the partition queues within their shares (`fetch.rs`), and the consumer's queue,
//! for the callbacks, while the loop is not saturated (or has paused). `clients` makes the
//! consumer and the dead-letter producer, and `Contact` watches them: a TLS or SASL failure before
//! the first assignment (a certificate the client does not trust or that does not name the
//! broker, a refused login) ends the run with `RunnerError::Refused`, whose reason is librdkafka's
//! and names the broker; after the first assignment such errors are logged and librdkafka
//! reconnects. The loop itself is in `drive.rs`; how a message ended in `settled.rs`.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::dead_letter::{DeadLetters, RefusedTable};
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::config::RunnerConfig;
use crate::stats::Counters;

mod drive;
mod fetch;
mod pause;
mod settled;
pub(crate) use drive::{Drive, Work};
pub(crate) use fetch::Fetch;
pub(crate) use pause::{Backpressure, PauseReason, Pauses, apply as apply_pauses};
pub(crate) use settled::Settled;

pub(crate) type TopicPartition = (String, i32);

/// A partition this member owns, as the runner tracks it.
#[derive(Debug)]
pub(crate) struct Part {
    /// Changes on every assignment, so work from an earlier ownership is never counted.
    pub(crate) generation: u64,
    pub(crate) revoked: Arc<AtomicBool>,
    /// Offsets received and not yet settled.
    pub(crate) pending: BTreeSet<i64>,
    /// The offset after the last one received.
    pub(crate) next: Option<i64>,
    /// What was last committed (or sent to be).
    pub(crate) committed: Option<i64>,
}

impl Part {
    /// The next offset to read: nothing before it is unsettled.
    pub(crate) fn position(&self) -> Option<i64> {
        self.pending.first().copied().or(self.next)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) parts: HashMap<TopicPartition, Part>,
    pub(crate) generation: u64,
    /// Why partitions are paused.
    pub(crate) pauses: Pauses,
    /// Stored start positions of the partitions being assigned (from `pre_rebalance` to
    /// `post_rebalance`).
    pub(crate) starts: HashMap<TopicPartition, i64>,
}

impl Shared {
    /// A message of `tp` at `offset` was received: it is pending until it settles, and the next
    /// offset moves past it. Answers the partition's generation and revoked flag, or `None` if
    /// the partition is not this member's (a message fetched before a revocation: its new owner
    /// reads it).
    pub(crate) fn received(
        &mut self,
        tp: &TopicPartition,
        offset: i64,
    ) -> Option<(u64, Arc<AtomicBool>)> {
        let Some(part) = self.parts.get_mut(tp) else {
            debug!(topic = %tp.0, partition = tp.1, "message for a partition not assigned");
            return None;
        };
        part.pending.insert(offset);
        part.next = Some(part.next.map_or(offset + 1, |n| n.max(offset + 1)));
        Some((part.generation, part.revoked.clone()))
    }
}

/// Whether the consumer has reached the cluster, and the first TLS or authentication failure
/// before it did. A certificate the client does not trust, or a refused password, is a
/// configuration error: the runner stops with it ([`crate::RunnerError::Refused`]) instead of
/// retrying for ever. After the first assignment such an error is only logged (a broker
/// restarting mid-handshake looks the same) and librdkafka keeps reconnecting.
#[derive(Debug, Default)]
pub(crate) struct Contact {
    reached: AtomicBool,
    refused: Mutex<Option<String>>,
    notify: tokio::sync::Notify,
}

impl Contact {
    pub(crate) fn reached(&self) {
        self.reached.store(true, AtomicOrdering::Release);
    }

    fn refused(&self, reason: String) {
        if self.reached.load(AtomicOrdering::Acquire) {
            return;
        }
        let mut slot = self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(reason);
            self.notify.notify_one();
        }
    }

    /// Completes with the reason once the cluster refused this client before it was reached.
    pub(crate) async fn refusal(&self) -> String {
        loop {
            if let Some(r) = self
                .refused
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
            {
                return r;
            }
            self.notify.notified().await;
        }
    }
}

pub(crate) struct RunnerContext {
    pub(crate) contact: Arc<Contact>,
    pub(crate) shared: Arc<Mutex<Shared>>,
    pub(crate) counters: Arc<Counters>,
    /// Where assigned partitions start, if the runner stores positions itself.
    pub(crate) start_offsets: Option<Arc<dyn StartOffsets>>,
    /// Each partition's own queue, for a fair share of the in-flight bound.
    pub(crate) fetch: Arc<Fetch>,
}

/// Positions a runner stores itself (offsets in the transaction), read when partitions are
/// assigned; `None` (not in time, or an error): start from Kafka's committed offsets.
pub(crate) trait StartOffsets: Send + Sync {
    fn stored(&self, partitions: &[(String, i32)]) -> Option<HashMap<(String, i32), i64>>;
}

pub(crate) fn lock(m: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // A panic elsewhere must not stop offset tracking: the data is plain bookkeeping.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ClientContext for RunnerContext {
    fn error(&self, error: KafkaError, reason: &str) {
        // librdkafka names the broker in `reason` ("ssl://host:port/bootstrap: SSL handshake
        // failed: ..."); it never logs a password.
        if matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::SSL
                    | RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SaslAuthenticationFailed
            )
        ) {
            self.contact.refused(format!("{error}: {reason}"));
        }
        warn!(error = %error, reason, "kafka client error");
    }
}

impl ConsumerContext for RunnerContext {
    fn pre_rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        rebalance: &Rebalance<'_>,
    ) {
        // Each partition's queue is split before librdkafka assigns it, so that none of its
        // messages goes to the consumer's queue (see `fetch`).
        match rebalance {
            Rebalance::Assign(tpl) => self.fetch.assigning(&partitions_of(tpl)),
            Rebalance::Revoke(tpl) => self.fetch.revoked(&partitions_of(tpl)),
            Rebalance::Error(_) => {}
        }
        if let (Rebalance::Assign(tpl), Some(source)) = (rebalance, &self.start_offsets) {
            // Start each partition where the stored position says (set in the list that is about
            // to be assigned: a seek right after the assignment would fail).
            let partitions: Vec<(String, i32)> = tpl
                .elements()
                .iter()
                .map(|e| (e.topic().to_owned(), e.partition()))
                .collect();
            let found = source.stored(&partitions).unwrap_or_default();
            for ((topic, partition), next) in &found {
                if let Some(mut e) = tpl.find_partition(topic, *partition)
                    && e.set_offset(Offset::Offset(*next)).is_ok()
                {
                    debug!(topic, partition, next, "starting from the stored position");
                }
            }
            info!(
                stored = found.len(),
                partitions = partitions.len(),
                "assigned partitions start from stored positions where there are some"
            );
            lock(&self.shared).starts = found;
            return;
        }
        let Rebalance::Revoke(tpl) = rebalance else {
            return;
        };
        // Still ours during this callback: stop the work, and commit what is settled.
        let mut commit = TopicPartitionList::new();
        {
            let mut shared = lock(&self.shared);
            let revoked: Vec<TopicPartition> = tpl
                .elements()
                .iter()
                .map(|e| (e.topic().to_owned(), e.partition()))
                .collect();
            shared.pauses.revoked(revoked.iter());
            for e in tpl.elements() {
                let tp = (e.topic().to_owned(), e.partition());
                if let Some(part) = shared.parts.remove(&tp) {
                    part.revoked.store(true, AtomicOrdering::Release);
                    if let Some(pos) = part.position()
                        && part.committed != Some(pos)
                    {
                        let _ = commit.add_partition_offset(&tp.0, tp.1, Offset::Offset(pos));
                    }
                }
            }
        }
        self.counters.revoked.add(tpl.count() as u64);
        self.counters
            .partitions
            .set(lock(&self.shared).parts.len() as u64);
        info!(partitions = tpl.count(), "partitions revoked");
        if commit.count() > 0 {
            match consumer.commit(&commit, CommitMode::Sync) {
                Ok(()) => self.counters.commits.add(1),
                Err(e) => {
                    self.counters.commit_errors.add(1);
                    warn!(error = %e, "commit on revocation failed; those messages will be replayed");
                }
            }
        }
    }

    fn post_rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        rebalance: &Rebalance<'_>,
    ) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                self.contact.reached();
                let (pause, resume) = {
                    let mut shared = lock(&self.shared);
                    shared.generation += 1;
                    let generation = shared.generation;
                    let starts = std::mem::take(&mut shared.starts);
                    let assigned: Vec<TopicPartition> = tpl
                        .elements()
                        .iter()
                        .map(|e| (e.topic().to_owned(), e.partition()))
                        .collect();
                    for tp in &assigned {
                        // From a stored position, that is the position until a message comes.
                        let next = starts.get(tp).copied();
                        shared.parts.insert(
                            tp.clone(),
                            Part {
                                generation,
                                revoked: Arc::new(AtomicBool::new(false)),
                                pending: BTreeSet::new(),
                                next,
                                committed: None,
                            },
                        );
                    }
                    self.counters.partitions.set(shared.parts.len() as u64);
                    shared.pauses.assigned(assigned.iter(), generation)
                };
                // librdkafka keeps an application pause across revoke and re-assign: say
                // explicitly which state these partitions are in (paused only if a reason of the
                // whole assignment holds them: their own reasons begin afresh).
                let paused = !pause.is_empty();
                for (tps, pausing) in [(pause, true), (resume, false)] {
                    if tps.is_empty() {
                        continue;
                    }
                    let mut list = TopicPartitionList::new();
                    for (topic, partition) in &tps {
                        list.add_partition(topic, *partition);
                    }
                    let r = if pausing {
                        consumer.pause(&list)
                    } else {
                        consumer.resume(&list)
                    };
                    if let Err(e) = r {
                        debug!(error = %e, pausing, "pause/resume on assignment");
                    }
                }
                self.counters.assigned.add(tpl.count() as u64);
                info!(partitions = tpl.count(), paused, "partitions assigned");
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            self.counters.commit_errors.add(1);
            warn!(error = %e, "offset commit failed; it is retried");
            // Forget what we thought committed, so the next round sends it again.
            let mut shared = lock(&self.shared);
            for e in offsets.elements() {
                if let Some(p) = shared.parts.get_mut(&(e.topic().to_owned(), e.partition())) {
                    p.committed = None;
                }
            }
        }
    }
}

/// The partitions of a rebalance's list (none for an empty list, which `elements` would not
/// like).
fn partitions_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    if tpl.count() == 0 {
        return Vec::new();
    }
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// Where a runner's messages come from: each partition's own queue (read by its task, see
/// `fetch`), and the consumer's queue, which serves the rebalance callbacks and any message of a
/// partition that could not be split.
pub(crate) struct Source {
    pub(crate) consumer: Arc<StreamConsumer<RunnerContext>>,
    pub(crate) fetch: Arc<Fetch>,
    fetched: tokio::sync::mpsc::UnboundedReceiver<fetch::Fetched>,
}

impl Source {
    /// The next message; `None` for a consumer error (counted and logged) or a message a stopped
    /// partition task had sent (its partition was revoked or assigned again since). The
    /// consumer's queue is read while `taking` (also while every partition is paused, for the
    /// callbacks: a paused partition's messages never come that way); the partitions' own queues
    /// only while `room` (fewer held than the bound: what their tasks hold is not dropped by a
    /// pause).
    pub(crate) async fn recv(
        &mut self,
        counters: &Counters,
        taking: bool,
        room: bool,
    ) -> Option<crate::Delivery> {
        tokio::select! {
            m = self.consumer.recv(), if taking => match m {
                Ok(m) => {
                    let d = crate::Delivery::from_message(&m);
                    if self.fetch.is_split(&(d.topic.clone(), d.partition)) {
                        // Split before its assignment, none should come this way.
                        warn!(topic = %d.topic, partition = d.partition, offset = d.offset, "a message of a split partition came through the consumer's queue");
                    }
                    Some(d)
                }
                // The end of a partition that could not be split: no error.
                Err(KafkaError::PartitionEOF(_)) => None,
                Err(e) => {
                    counters.consumer_errors.add(1);
                    warn!(error = %e, "consumer error");
                    None
                }
            },
            Some(f) = self.fetched.recv(), if room => self.fetch.take(&f).then_some(f.delivery),
        }
    }

    /// Stops the partition tasks (shutdown), leaving the consumer's queue for the callbacks.
    pub(crate) fn stop(&self) {
        self.fetch.stop();
    }
}

impl Drop for Source {
    /// A runner dropped mid-run (its future cancelled) must not leave partition tasks behind:
    /// each holds the consumer, which would stay in its group, heartbeating, with its partitions.
    fn drop(&mut self) {
        self.fetch.stop();
    }
}

/// `shutdown`, or the cluster refusing this client before it was reached (the reason is then in
/// the returned cell): what a runner's loop runs until.
pub(crate) fn until_refused<F: Future<Output = ()>>(
    shutdown: F,
    contact: &Arc<Contact>,
) -> (impl Future<Output = ()> + use<F>, Arc<OnceLock<String>>) {
    let cell = Arc::new(OnceLock::new());
    let (contact, out) = (contact.clone(), cell.clone());
    let stop = async move {
        tokio::select! {
            () = shutdown => {}
            reason = contact.refusal() => {
                warn!(reason, "the Kafka cluster refused this client; stopping");
                let _ = out.set(reason);
            }
        }
    };
    (stop, cell)
}

/// The runner's end: refused, or stopped with these counters.
pub(crate) fn refused_or(
    refused: Arc<OnceLock<String>>,
    stats: crate::RunnerStats,
) -> Result<crate::RunnerStats, crate::RunnerError> {
    match refused.get() {
        Some(reason) => Err(crate::RunnerError::Refused(reason.clone())),
        None => Ok(stats),
    }
}

/// The Kafka clients of a runner: the consumer (manual commits, offsets stored by the runner),
/// subscribed to the configured topics, with its partitions' own queues, and the dead-letter
/// producer (idempotent, `acks=all`).
pub(crate) fn clients(
    config: &RunnerConfig,
    shared: &Arc<Mutex<Shared>>,
    counters: &Arc<Counters>,
    start_offsets: Option<Arc<dyn StartOffsets>>,
    contact: &Arc<Contact>,
    refused: Option<Arc<dyn RefusedTable>>,
    stopping: tokio::sync::watch::Receiver<bool>,
) -> Result<(Source, DeadLetters), KafkaError> {
    let base = || {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &config.brokers);
        for (k, v) in &config.client {
            c.set(k, v);
        }
        c
    };
    let mut cc = base();
    cc.set("group.id", &config.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // The end of a partition tells the fair share that a partition newly assigned has
        // answered (`fetch.rs`); it is no error.
        .set("enable.partition.eof", "true");
    if !config.client.iter().any(|(k, _)| k == "auto.offset.reset") {
        cc.set("auto.offset.reset", "earliest");
    }
    let (fetch, fetched) = Fetch::new(counters.clone());
    let consumer: Arc<StreamConsumer<RunnerContext>> =
        Arc::new(cc.create_with_context(RunnerContext {
            contact: contact.clone(),
            shared: shared.clone(),
            counters: counters.clone(),
            start_offsets,
            fetch: fetch.clone(),
        })?);
    fetch.set_consumer(&consumer);
    let mut pc = base();
    pc.set("enable.idempotence", "true").set("acks", "all");
    // Consumer-only properties would make the producer refuse to start.
    for k in [
        "group.protocol",
        "group.instance.id",
        "partition.assignment.strategy",
        "auto.offset.reset",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
    ] {
        pc.remove(k);
    }
    crate::dead_letter::check_at_start(
        base(),
        config.dead_letter_topic.clone(),
        config.topics.clone(),
        refused.is_some(),
        counters.clone(),
    );
    let dead_letters = DeadLetters::new(
        pc,
        config.dead_letter_topic.clone(),
        config.group_id.clone(),
        refused,
        crate::dead_letter::Owner {
            counters: counters.clone(),
            backoff: config.backoff,
            stopping,
        },
    )?;
    let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    info!(group = %config.group_id, topics = ?topics, "runner subscribed");
    let source = Source {
        consumer,
        fetch,
        fetched,
    };
    Ok((source, dead_letters))
}

/// Commits, for each partition this member owns, the offset before which all is settled.
pub(crate) fn commit(
    consumer: &StreamConsumer<RunnerContext>,
    shared: &Mutex<Shared>,
    counters: &Counters,
    mode: CommitMode,
) {
    let mut tpl = TopicPartitionList::new();
    {
        let mut shared = lock(shared);
        for ((topic, partition), part) in shared.parts.iter_mut() {
            if let Some(pos) = part.position()
                && part.committed != Some(pos)
            {
                let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(pos));
                part.committed = Some(pos);
            }
        }
    }
    if tpl.count() == 0 {
        return;
    }
    match consumer.commit(&tpl, mode) {
        Ok(()) => counters.commits.add(1),
        Err(e) => {
            counters.commit_errors.add(1);
            warn!(error = %e, "offset commit failed; it is retried");
            let mut shared = lock(shared);
            for e in tpl.elements() {
                if let Some(p) = shared.parts.get_mut(&(e.topic().to_owned(), e.partition())) {
                    p.committed = None;
                }
            }
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
pub(crate) async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
