//! The relay's loop: the lease, the rounds, the position, the ring.
//!
//! ```text
//! stand by ──(the lease ran out or was let go: acquire, a new epoch)──► lead
//! lead: a round at each wake-up (a local commit that wrote rows, or the poll)
//!   snapshot cur; pages of the rows in (position, cur], in (xid8, pos) order
//!   each page sent, every delivery awaited (the lease renewed meanwhile)
//!   advance(epoch, cur): the position moves only under the lease's epoch
//!   rotate the ring when due (the next table emptied once all of it is published)
//! a passing failure: the round again from the position, after a backoff (the same rows, the
//! same bytes: duplicates that the derived key lets the next consumer drop)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dedup_core::OwnerIds;
use dedup_pg::PgStore;
use dedup_pg::outbox::{OutboxLease, Position, RelayStore, Rotation};
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::publish::{PageError, now_ms, publish_page};

/// How often a relay reads the outbox's status (what waits, who leads) into its counters.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// How the relay runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RelayConfig {
    /// The lease's length: a stand-by takes over within this of the leader's SIGKILL (or pause).
    /// Renewed every third of it. Default 5 s.
    pub lease: Duration,
    /// The poll, when no local commit wakes the relay. Default 250 ms.
    pub poll: Duration,
    /// Rows read and sent per page. Default 1,000.
    pub page: usize,
    /// How often the ring moves to its next table (which is emptied then, once every row in it
    /// is published). Default 60 s.
    pub rotate_every: Duration,
    /// The longest wait between rounds after a passing failure (the broker down). Default 5 s.
    pub max_backoff: Duration,
    /// How long the producer tries one message before the round fails and runs again
    /// (`message.timeout.ms`). Default 30 s.
    pub message_timeout: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(5),
            poll: Duration::from_millis(250),
            page: 1000,
            rotate_every: Duration::from_secs(60),
            max_backoff: Duration::from_secs(5),
            message_timeout: Duration::from_secs(30),
        }
    }
}

impl RelayConfig {
    /// Sets the lease's length (at least 300 ms).
    #[must_use]
    pub fn with_lease(mut self, d: Duration) -> Self {
        self.lease = d.max(Duration::from_millis(300));
        self
    }

    /// Sets the poll (at least 10 ms).
    #[must_use]
    pub fn with_poll(mut self, d: Duration) -> Self {
        self.poll = d.max(Duration::from_millis(10));
        self
    }

    /// Sets the rows per page (1 to 10,000).
    #[must_use]
    pub fn with_page(mut self, n: usize) -> Self {
        self.page = n.clamp(1, 10_000);
        self
    }

    /// Sets how often the ring rotates.
    #[must_use]
    pub fn with_rotate_every(mut self, d: Duration) -> Self {
        self.rotate_every = d;
        self
    }
}

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The producer could not be made (a configuration librdkafka refuses). Not retryable.
    #[error("the outbox relay's producer could not be made: {0}")]
    Producer(#[from] KafkaError),
}

/// The relay's counters.
#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    dead_lettered: AtomicU64,
    rounds: AtomicU64,
    failed_rounds: AtomicU64,
    leading: AtomicBool,
    epoch: AtomicI64,
    last_lag_ms: AtomicI64,
    max_lag_ms: AtomicI64,
    /// From the last status read (every `STATUS_EVERY`, leading or standing by); -1 before the
    /// first.
    unpublished: AtomicI64,
    oldest_ms: AtomicI64,
    someone_leads: AtomicBool,
    /// From each published row's write to its ack, in milliseconds: the last `LAGS` rows.
    lags: std::sync::Mutex<std::collections::VecDeque<i64>>,
}

/// How many of the last rows' lags the counters keep for the percentiles.
const LAGS: usize = 10_000;

impl Counters {
    /// The `p`-th percentile of the kept lags (nearest rank), 0 before any.
    fn lag_percentile(&self, p: usize) -> i64 {
        let mut l: Vec<i64> = self
            .lags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect();
        if l.is_empty() {
            return 0;
        }
        l.sort_unstable();
        l[((l.len() * p).div_ceil(100)).clamp(1, l.len()) - 1]
    }

    fn note_lags(&self, lags: &[i64]) {
        let mut kept = self
            .lags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for &l in lags {
            if kept.len() == LAGS {
                kept.pop_front();
            }
            kept.push_back(l);
        }
    }
}

/// What the relay has done, read through [`RelayStatsHandle::snapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Messages acknowledged by the broker (a round run again counts its messages again).
    pub published: u64,
    /// Messages the broker refused for good, kept in `dedup_outbox_dead`.
    pub dead_lettered: u64,
    /// Rounds that moved the position.
    pub rounds: u64,
    /// Rounds that failed and ran again.
    pub failed_rounds: u64,
    /// Whether this relay holds the lease now.
    pub leading: bool,
    /// The epoch it leads (or last led) under.
    pub epoch: i64,
    /// From a row's write to its ack, for the last row of the last round, in milliseconds.
    pub last_lag_ms: i64,
    /// The longest of those since the relay started.
    pub max_lag_ms: i64,
    /// Committed rows not yet published, at the last status read (every 5 s; -1 before
    /// the first): whichever relay leads.
    pub unpublished: i64,
    /// How long the oldest of them has waited, in milliseconds, at the last status read.
    pub oldest_ms: i64,
    /// Whether some relay (this one or another) held the lease at the last status read.
    pub someone_leads: bool,
    /// The median lag from a row's write (just before its transaction's commit) to its ack,
    /// over the last 10,000 rows this relay published, in milliseconds (0 before any).
    pub lag_p50_ms: i64,
    /// The 99th percentile of the same.
    pub lag_p99_ms: i64,
}

/// A handle on a relay's counters.
#[derive(Clone, Debug)]
pub struct RelayStatsHandle(Arc<Counters>);

impl RelayStatsHandle {
    /// The counters now.
    pub fn snapshot(&self) -> RelayStats {
        let c = &self.0;
        RelayStats {
            published: c.published.load(Ordering::Relaxed),
            dead_lettered: c.dead_lettered.load(Ordering::Relaxed),
            rounds: c.rounds.load(Ordering::Relaxed),
            failed_rounds: c.failed_rounds.load(Ordering::Relaxed),
            leading: c.leading.load(Ordering::Relaxed),
            epoch: c.epoch.load(Ordering::Relaxed),
            last_lag_ms: c.last_lag_ms.load(Ordering::Relaxed),
            max_lag_ms: c.max_lag_ms.load(Ordering::Relaxed),
            unpublished: c.unpublished.load(Ordering::Relaxed),
            oldest_ms: c.oldest_ms.load(Ordering::Relaxed),
            someone_leads: c.someone_leads.load(Ordering::Relaxed),
            lag_p50_ms: c.lag_percentile(50),
            lag_p99_ms: c.lag_percentile(99),
        }
    }
}

/// The outbox relay: one per process at most; any number of processes may run one (one leads,
/// the others stand by).
pub struct OutboxRelay {
    relay: RelayStore,
    producer: FutureProducer,
    wake: Arc<Notify>,
    client: ClientConfig,
    config: RelayConfig,
    leader: String,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("leader", &self.leader)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl OutboxRelay {
    /// A relay publishing `store`'s outbox with a producer made from `client` (the brokers and
    /// any security settings; the relay sets the idempotent producer's own). Woken by the
    /// commits through `store` (and its clones) that wrote outbox rows.
    ///
    /// # Errors
    /// [`RelayError::Producer`]: librdkafka refuses the producer's configuration.
    pub fn new(
        store: &PgStore,
        client: ClientConfig,
        config: RelayConfig,
    ) -> Result<Self, RelayError> {
        let producer = producer_of(&client, &config)?;
        Ok(Self {
            relay: RelayStore::new(store.clone()),
            producer,
            wake: store.outbox_wake(),
            client,
            config,
            leader: format!("relay-{}", OwnerIds::for_process().prefix()),
            counters: Arc::new(Counters {
                unpublished: AtomicI64::new(-1),
                ..Counters::default()
            }),
        })
    }

    /// Names this relay in the lease (default `relay-pid<pid>-...`).
    #[must_use]
    pub fn named(mut self, leader: impl Into<String>) -> Self {
        self.leader = leader.into();
        self
    }

    /// A handle on its counters.
    pub fn stats(&self) -> RelayStatsHandle {
        RelayStatsHandle(self.counters.clone())
    }

    /// Runs until `stop` resolves: stands by, leads, publishes. On stop it lets the lease go,
    /// so a stand-by takes over at once.
    ///
    /// # Errors
    /// [`RelayError::Producer`]: the producer cannot be made. Every other failure (Postgres or
    /// the broker away, the lease taken over) is waited out.
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) -> Result<(), RelayError> {
        let mut producer = self.producer.clone();
        tokio::pin!(stop);
        let mut lease: Option<OutboxLease> = None;
        let mut position: Option<Position> = None;
        let mut backoff = Duration::ZERO;
        let mut last_renew = Instant::now();
        let mut last_move = Instant::now();
        let mut last_rotate = Instant::now();
        // The first turn asks for the lease at once.
        let mut again = true;
        let mut last_status: Option<Instant> = None;
        loop {
            if last_status.is_none_or(|t| t.elapsed() >= STATUS_EVERY) {
                last_status = Some(Instant::now());
                self.read_status().await;
            }
            // Between rounds: a wake-up, the poll, a backoff, or the stop.
            let wait = if backoff > Duration::ZERO {
                backoff
            } else if lease.is_some() {
                self.config.poll
            } else {
                (self.config.lease / 5).max(Duration::from_millis(50))
            };
            // A round that read rows goes again at once: more may have committed meanwhile.
            if !std::mem::take(&mut again) {
                tokio::select! {
                    () = &mut stop => break,
                    () = self.wake.notified(), if lease.is_some() && backoff.is_zero() => {}
                    () = tokio::time::sleep(wait) => {}
                }
            }
            let Some(held) = lease.clone() else {
                match self.relay.acquire(&self.leader, self.config.lease).await {
                    Ok(Some(l)) => match self.relay.position().await {
                        Ok(p) => {
                            info!(leader = %self.leader, epoch = l.epoch, "the outbox relay leads");
                            self.counters.leading.store(true, Ordering::Relaxed);
                            self.counters.epoch.store(l.epoch, Ordering::Relaxed);
                            position = Some(p);
                            last_renew = Instant::now();
                            lease = Some(l);
                            backoff = Duration::ZERO;
                        }
                        Err(e) => warn!(error = %e, "the outbox relay could not read its position"),
                    },
                    Ok(None) => {}
                    Err(e) => debug!(error = %e, "the outbox relay could not ask for the lease"),
                }
                continue;
            };
            if last_renew.elapsed() >= self.config.lease / 3 {
                match self.relay.renew(&held, self.config.lease).await {
                    Ok(true) => last_renew = Instant::now(),
                    Ok(false) => {
                        self.lost(&mut lease);
                        continue;
                    }
                    Err(e) => {
                        debug!(error = %e, "the outbox relay could not renew its lease");
                        backoff = self.next_backoff(backoff);
                        continue;
                    }
                }
            }
            let Some(prev) = position.clone() else {
                self.lost(&mut lease);
                continue;
            };
            match self.round(&producer, &held, &prev).await {
                Ok(Some((cur, read))) => {
                    backoff = Duration::ZERO;
                    // An idle round moves nothing but the snapshot: store it now and then only.
                    if read.rows > 0 || last_move.elapsed() >= Duration::from_secs(10) {
                        match self.relay.advance(&held, &cur, read.rows, &read.dead).await {
                            Ok(true) => {
                                again = read.rows > 0;
                                self.note_round(&read);
                                position = Some(cur);
                                last_move = Instant::now();
                                last_renew = Instant::now();
                            }
                            Ok(false) => self.lost(&mut lease),
                            Err(e) => {
                                warn!(error = %e, "the outbox relay could not move its position");
                                backoff = self.next_backoff(backoff);
                            }
                        }
                    }
                }
                Ok(None) => {}
                Err(PageError::LeaseLost) => self.lost(&mut lease),
                Err(PageError::Passing(why)) => {
                    self.counters.failed_rounds.fetch_add(1, Ordering::Relaxed);
                    warn!(reason = %why, "an outbox round failed; it runs again from the position");
                    if producer.client().fatal_error().is_some() {
                        info!("the outbox producer is made anew after a fatal error");
                        producer = producer_of(&self.client, &self.config)?;
                    }
                    backoff = self.next_backoff(backoff);
                }
            }
            if let Some(held) = &lease
                && last_rotate.elapsed() >= self.config.rotate_every.min(Duration::from_secs(5))
            {
                last_rotate = Instant::now();
                match self
                    .relay
                    .rotate(held, self.config.rotate_every, Duration::from_millis(100))
                    .await
                {
                    Ok(Rotation::Rotated { ring }) => debug!(ring, "the outbox ring rotated"),
                    Ok(Rotation::LeaseLost) => self.lost(&mut lease),
                    Ok(_) => {}
                    Err(e) => debug!(error = %e, "the outbox ring could not rotate"),
                }
            }
        }
        if let Some(held) = lease {
            let _ = producer.flush(self.config.message_timeout);
            if let Err(e) = self.relay.release(&held).await {
                debug!(error = %e, "the outbox relay could not let its lease go");
            }
        }
        self.counters.leading.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Reads the outbox's status into the counters (what waits, and whether anyone leads).
    async fn read_status(&self) {
        match self.relay.status().await {
            Ok(s) => {
                let c = &self.counters;
                c.unpublished.store(s.unpublished, Ordering::Relaxed);
                c.oldest_ms.store(s.oldest_ms, Ordering::Relaxed);
                c.someone_leads.store(s.leader.is_some(), Ordering::Relaxed);
            }
            Err(e) => debug!(error = %e, "the outbox status could not be read"),
        }
    }

    fn lost(&self, lease: &mut Option<OutboxLease>) {
        if lease.take().is_some() {
            warn!(leader = %self.leader, "the outbox relay's lease was taken over; standing by");
        }
        self.counters.leading.store(false, Ordering::Relaxed);
    }

    fn next_backoff(&self, b: Duration) -> Duration {
        (b * 2)
            .max(Duration::from_millis(100))
            .min(self.config.max_backoff)
    }

    fn note_round(&self, read: &Read) {
        let c = &self.counters;
        c.rounds.fetch_add(1, Ordering::Relaxed);
        let dead = read.dead.len() as u64;
        c.published.fetch_add(read.rows - dead, Ordering::Relaxed);
        c.dead_lettered.fetch_add(dead, Ordering::Relaxed);
        if let Some(ms) = read.last_written_ms {
            let lag = now_ms() - ms;
            c.last_lag_ms.store(lag, Ordering::Relaxed);
            c.max_lag_ms.fetch_max(lag, Ordering::Relaxed);
        }
    }

    /// One round: every row of the transactions committed since `prev`, page by page, each
    /// page's deliveries awaited. Answers the new position and what was read (`None`: nothing
    /// to read, and no snapshot worth storing).
    async fn round(
        &self,
        producer: &FutureProducer,
        lease: &OutboxLease,
        prev: &Position,
    ) -> Result<Option<(Position, Read)>, PageError> {
        let cur = self
            .relay
            .snapshot()
            .await
            .map_err(|e| PageError::Passing(e.to_string()))?;
        if &cur == prev {
            return Ok(None);
        }
        let mut read = Read {
            rows: 0,
            dead: Vec::new(),
            last_written_ms: None,
        };
        let mut after = None;
        loop {
            let rows = self
                .relay
                .read(prev, &cur, after, self.config.page)
                .await
                .map_err(|e| PageError::Passing(e.to_string()))?;
            let Some(last) = rows.last() else { break };
            after = Some((last.xid, last.pos));
            let mut lags = Vec::with_capacity(rows.len());
            let dead = publish_page(
                producer,
                &rows,
                &self.relay,
                lease,
                self.config.lease,
                &mut lags,
            )
            .await?;
            self.counters.note_lags(&lags);
            read.rows += rows.len() as u64;
            read.dead.extend(dead);
            read.last_written_ms = Some(last.written_ms);
            if rows.len() < self.config.page {
                break;
            }
        }
        Ok(Some((cur, read)))
    }
}

/// What a round read: how many rows, those refused for good, the last row's write time.
struct Read {
    rows: u64,
    dead: Vec<dedup_pg::outbox::OutboxDeadLetter>,
    last_written_ms: Option<i64>,
}

/// The producer: idempotent and gapless (a partition's order kept across retries), every
/// replica's ack, the partitioner Java clients use (`murmur2_random`), so a message key goes
/// to the same partition whoever produces it.
fn producer_of(client: &ClientConfig, config: &RelayConfig) -> Result<FutureProducer, KafkaError> {
    let mut pc = client.clone();
    for k in [
        "group.id",
        "group.protocol",
        "group.instance.id",
        "partition.assignment.strategy",
        "auto.offset.reset",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.partition.eof",
    ] {
        pc.remove(k);
    }
    pc.set("enable.idempotence", "true")
        .set("enable.gapless.guarantee", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("partitioner", "murmur2_random")
        .set(
            "message.timeout.ms",
            config.message_timeout.as_millis().to_string(),
        );
    pc.create()
}
