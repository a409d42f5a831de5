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
use dedup_pg::outbox::{OutboxLease, Position, RelayStore, Rotation, Step};
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

    /// Runs until `stop` resolves: stands by, leads, publishes. On stop (observed between turns
    /// and during a round, whose unacknowledged messages are then published again by the next
    /// leader) it lets the lease go, so a stand-by takes over at once.
    ///
    /// # Errors
    /// None today: every failure (Postgres or the broker away, the lease taken over, a producer
    /// that cannot be made anew) is waited out. The producer's configuration was checked by
    /// [`new`](Self::new).
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) -> Result<(), RelayError> {
        let mut producer = self.producer.clone();
        tokio::pin!(stop);
        let mut leading: Option<Leading> = None;
        let mut backoff = Duration::ZERO;
        let mut last_move = Instant::now();
        let mut last_rotate = Instant::now();
        let mut last_status: Option<Instant> = None;
        let mut refusals = Refusals::default();
        // The first turn asks for the lease at once; a round that read rows goes again at once.
        let mut again = true;
        'run: loop {
            if last_status.is_none_or(|t| t.elapsed() >= STATUS_EVERY) {
                last_status = Some(Instant::now());
                self.read_status().await;
            }
            let wait = if std::mem::take(&mut again) {
                Duration::ZERO
            } else if backoff > Duration::ZERO {
                backoff
            } else if leading.is_some() {
                self.config.poll
            } else {
                (self.config.lease / 5).max(Duration::from_millis(50))
            };
            tokio::select! {
                biased;
                () = &mut stop => break 'run,
                () = self.wake.notified(), if leading.is_some() && backoff.is_zero() => {}
                () = tokio::time::sleep(wait) => {}
            }
            let Some(lead) = leading.as_mut() else {
                leading = self.try_lead().await;
                again = leading.is_some();
                backoff = Duration::ZERO;
                continue;
            };
            let store_idle = last_move.elapsed() >= Duration::from_secs(10);
            let outcome = tokio::select! {
                biased;
                () = &mut stop => break 'run,
                r = self.round(&producer, lead, &mut refusals, store_idle) => r,
            };
            match outcome {
                Ok(read) => {
                    backoff = Duration::ZERO;
                    if read.moved {
                        last_move = Instant::now();
                    }
                    again = read.rows > 0;
                }
                Err(PageError::LeaseLost) => self.lost(&mut leading),
                Err(PageError::Passing(why)) => {
                    self.counters.failed_rounds.fetch_add(1, Ordering::Relaxed);
                    warn!(reason = %why, "an outbox round failed; it runs again from its last page");
                    if producer.client().fatal_error().is_some() {
                        match producer_of(&self.client, &self.config) {
                            Ok(p) => {
                                info!("the outbox producer was made anew after a fatal error");
                                producer = p;
                            }
                            Err(e) => warn!(error = %e, "making the outbox producer anew failed"),
                        }
                    }
                    backoff = self.next_backoff(backoff);
                }
            }
            if let Some(lead) = &leading
                && last_rotate.elapsed() >= self.config.rotate_every.min(Duration::from_secs(5))
            {
                last_rotate = Instant::now();
                match self
                    .relay
                    .rotate(
                        &lead.lease,
                        self.config.rotate_every,
                        Duration::from_millis(100),
                    )
                    .await
                {
                    Ok(Rotation::Rotated { ring }) => debug!(ring, "the outbox ring rotated"),
                    Ok(Rotation::LeaseLost) => self.lost(&mut leading),
                    Ok(_) => {}
                    Err(e) => debug!(error = %e, "the outbox ring could not rotate"),
                }
            }
        }
        if let Some(lead) = leading
            && let Err(e) = self.relay.release(&lead.lease).await
        {
            debug!(error = %e, "the outbox relay could not let its lease go");
        }
        self.counters.leading.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Takes the lease if none holds, and reads where the last leader stood.
    async fn try_lead(&self) -> Option<Leading> {
        let lease = match self.relay.acquire(&self.leader, self.config.lease).await {
            Ok(Some(l)) => l,
            Ok(None) => return None,
            Err(e) => {
                debug!(error = %e, "the outbox relay could not ask for the lease");
                return None;
            }
        };
        match self.relay.progress().await {
            Ok(p) => {
                info!(leader = %self.leader, epoch = lease.epoch, "the outbox relay leads");
                self.counters.leading.store(true, Ordering::Relaxed);
                self.counters.epoch.store(lease.epoch, Ordering::Relaxed);
                Some(Leading {
                    lease,
                    position: p.position,
                    resume: p.round,
                    last_renew: Instant::now(),
                })
            }
            Err(e) => {
                warn!(error = %e, "the outbox relay could not read its position; letting the lease go");
                let _ = self.relay.release(&lease).await;
                None
            }
        }
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

    fn lost(&self, leading: &mut Option<Leading>) {
        if leading.take().is_some() {
            warn!(leader = %self.leader, "the outbox relay's lease was taken over; standing by");
        }
        self.counters.leading.store(false, Ordering::Relaxed);
    }

    fn next_backoff(&self, b: Duration) -> Duration {
        (b * 2)
            .max(Duration::from_millis(100))
            .min(self.config.max_backoff)
    }

    /// Counts what one advance recorded: `rows` read, `dead` of them refused for good.
    fn note(&self, rows: usize, dead: usize, last_written_ms: Option<i64>) {
        let c = &self.counters;
        c.published
            .fetch_add((rows - dead) as u64, Ordering::Relaxed);
        c.dead_lettered.fetch_add(dead as u64, Ordering::Relaxed);
        if let Some(ms) = last_written_ms {
            let lag = now_ms() - ms;
            c.last_lag_ms.store(lag, Ordering::Relaxed);
            c.max_lag_ms.fetch_max(lag, Ordering::Relaxed);
        }
    }

    /// One round: every row of the transactions committed since the position (or after the
    /// last page of a round left mid-way), page by page, each page's deliveries awaited. A full
    /// page is recorded as the round's progress, so a relay that takes over resumes after it;
    /// the round's end moves the position. An idle round stores its snapshot only when
    /// `store_idle`.
    async fn round(
        &self,
        producer: &FutureProducer,
        lead: &mut Leading,
        refusals: &mut Refusals,
        store_idle: bool,
    ) -> Result<Read, PageError> {
        let passing = |e: dedup_core::StoreError| PageError::Passing(e.to_string());
        // Renewed at every round, an idle one too (a database where nothing took a transaction
        // id since the last snapshot reads nothing).
        lead.renew_if_due(&self.relay, self.config.lease).await?;
        let (cur, mut after) = match lead.resume.clone() {
            Some((target, after)) => (target, Some(after)),
            None => (self.relay.snapshot().await.map_err(passing)?, None),
        };
        let mut read = Read::default();
        if lead.resume.is_none() && cur == lead.position {
            return Ok(read);
        }
        let (mut rows_last, mut dead_last, mut written_last) = (0, Vec::new(), None);
        loop {
            lead.renew_if_due(&self.relay, self.config.lease).await?;
            let rows = self
                .relay
                .read(&lead.position, &cur, after, self.config.page)
                .await
                .map_err(passing)?;
            let Some(last) = rows.last() else { break };
            let at = (last.xid, last.pos);
            let mut lags = Vec::with_capacity(rows.len());
            let dead = publish_page(
                producer,
                &rows,
                &self.relay,
                lead,
                self.config.lease,
                &mut lags,
                refusals,
            )
            .await?;
            self.counters.note_lags(&lags);
            read.rows += rows.len();
            if rows.len() < self.config.page {
                (rows_last, dead_last, written_last) = (rows.len(), dead, Some(last.written_ms));
                break;
            }
            // More may follow: this page is the round's progress.
            if !self
                .relay
                .advance(&lead.lease, Step::Page(&cur, at), rows.len() as u64, &dead)
                .await
                .map_err(passing)?
            {
                return Err(PageError::LeaseLost);
            }
            self.note(rows.len(), dead.len(), Some(last.written_ms));
            lead.resume = Some((cur.clone(), at));
            after = Some(at);
        }
        if lead.resume.is_none() && rows_last == 0 && !store_idle {
            return Ok(read);
        }
        if !self
            .relay
            .advance(&lead.lease, Step::Done(&cur), rows_last as u64, &dead_last)
            .await
            .map_err(passing)?
        {
            return Err(PageError::LeaseLost);
        }
        self.note(rows_last, dead_last.len(), written_last);
        self.counters.rounds.fetch_add(1, Ordering::Relaxed);
        lead.position = cur;
        lead.resume = None;
        lead.last_renew = Instant::now();
        refusals.clear();
        read.moved = true;
        Ok(read)
    }
}

/// The lease a relay leads under, and where it stands.
pub(super) struct Leading {
    pub(super) lease: OutboxLease,
    /// Every row visible in it is published.
    position: Position,
    /// A round left mid-way (by this relay's failure, or by the one it took over from): its
    /// snapshot and its last row published.
    resume: Option<(Position, (i64, i64))>,
    /// When the lease was last taken or renewed (an advance renews nothing).
    pub(super) last_renew: Instant,
}

impl Leading {
    /// Renews the lease once a third of it has passed since the last renewal.
    pub(super) async fn renew_if_due(
        &mut self,
        relay: &RelayStore,
        ttl: Duration,
    ) -> Result<(), PageError> {
        if self.last_renew.elapsed() < ttl / 3 {
            return Ok(());
        }
        match relay.renew(&self.lease, ttl).await {
            Ok(true) => {
                self.last_renew = Instant::now();
                Ok(())
            }
            Ok(false) => Err(PageError::LeaseLost),
            // Postgres away: the lease may run out; the position cannot move without it anyway.
            Err(e) => Err(PageError::Passing(e.to_string())),
        }
    }
}

/// Rows the broker refused for good, kept across a round's retries: a row refused in a
/// produce batch is suspect (the broker refuses a whole batch for one record) and is sent
/// again alone; refused alone, it is a dead letter and the round goes on without it.
#[derive(Debug, Default)]
pub(super) struct Refusals {
    pub(super) suspect: std::collections::HashSet<(i64, i64)>,
    pub(super) refused: std::collections::HashMap<(i64, i64), String>,
}

impl Refusals {
    fn clear(&mut self) {
        self.suspect.clear();
        self.refused.clear();
    }
}

/// What a round read, and whether it moved the position.
#[derive(Debug, Default)]
struct Read {
    rows: usize,
    moved: bool,
}

/// The producer: idempotent and gapless (a partition's order kept across retries), every
/// replica's ack, the partitioner Java clients use (`murmur2_random`), so a message key goes
/// to the same partition whoever produces it; messages up to 1 MiB, so one queued at
/// `OutboxMessage::MAX_BYTES` still fits with the relay's headers.
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
        .set("message.max.bytes", "1048576")
        .set(
            "message.timeout.ms",
            config.message_timeout.as_millis().to_string(),
        );
    pc.create()
}
