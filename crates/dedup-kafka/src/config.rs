//! How a [`Runner`](crate::Runner) is set up.

use std::time::Duration;

/// Where a message's idempotency key comes from.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum KeySource {
    /// The value of this header (the default: `idempotency-key`).
    Header(String),
    /// The value at this JSON pointer (RFC 6901, such as `/order/id`) in a JSON payload. A string
    /// is taken as is; a number or boolean as its JSON text.
    JsonPointer(String),
    /// A digest of the values at these JSON pointers: for producers that send no key, the fields
    /// that make two messages the same event (such as `/account` and `/request_id`).
    Fields(Vec<String>),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::Header(DEFAULT_KEY_HEADER.to_owned())
    }
}

/// The header [`KeySource::default`] reads.
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";

/// What happens to a message that has no idempotency key.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Send it to the dead-letter topic with the reason (the default).
    #[default]
    DeadLetter,
    /// Run the handler without dedup (at least once: a redelivery runs it again).
    ProcessWithoutDedup,
}

/// Which messages may run at the same time.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub enum Ordering {
    /// One message at a time per partition, in offset order (the default). Partitions run
    /// concurrently.
    #[default]
    PerPartition,
    /// Messages of one partition run concurrently when their keys differ; one key's messages run
    /// in offset order. Offsets are committed up to the first message not yet settled.
    PerKey,
}

/// Waits between retries of a message: doubling from `initial` up to `max`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Backoff {
    /// The first wait.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// A backoff from `initial` doubling to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
        }
    }

    /// The wait before retry number `retry` (1-based).
    pub fn delay(&self, retry: u32) -> Duration {
        let factor = 1u32 << retry.saturating_sub(1).min(16);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

/// A runner's configuration. [`RunnerConfig::new`] gives the defaults; the `with_` methods change
/// them.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunnerConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The consumer group (`group.id`); also the default dedup scope.
    pub group_id: String,
    /// The topics to consume.
    pub topics: Vec<String>,
    /// Where poison messages, permanent failures and (by default) keyless messages go.
    pub dead_letter_topic: String,
    /// Where the idempotency key comes from.
    pub key: KeySource,
    /// The dedup scope; `None` uses the group id.
    pub scope: Option<String>,
    /// What happens to a message without a key.
    pub missing_key: MissingKey,
    /// Whether the payload's fingerprint is checked (a key reused with another payload is then
    /// dead-lettered as a mismatch).
    pub check_payload: bool,
    /// The most messages held at once (running or waiting their turn). At the bound the runner
    /// takes no more until one settles; after a second without one it pauses its partitions.
    pub max_in_flight: usize,
    /// Which messages may run at the same time.
    pub ordering: Ordering,
    /// Waits between retries.
    pub backoff: Backoff,
    /// How often settled offsets are committed (also on revocation and shutdown).
    pub commit_interval: Duration,
    /// How long shutdown waits for running messages before it leaves them to redelivery.
    pub drain_timeout: Duration,
    /// Further librdkafka properties for the consumer and the dead-letter producer (for example
    /// `broker.address.family=v4`, `security.protocol`, `group.protocol`).
    pub client: Vec<(String, String)>,
}

impl RunnerConfig {
    /// A configuration with the defaults: key from the `idempotency-key` header, scope = group,
    /// dead-letter topic `<first topic>.dlq`, keyless messages dead-lettered, payload checked,
    /// 1,024 messages in flight, per-partition order, commits every second.
    pub fn new(
        brokers: impl Into<String>,
        group_id: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        let topics: Vec<String> = topics.into_iter().map(Into::into).collect();
        let dead_letter_topic = format!("{}.dlq", topics.first().map_or("dedup", |t| t.as_str()));
        Self {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics,
            dead_letter_topic,
            key: KeySource::default(),
            scope: None,
            missing_key: MissingKey::default(),
            check_payload: true,
            max_in_flight: 1024,
            ordering: Ordering::default(),
            backoff: Backoff::default(),
            commit_interval: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(30),
            client: Vec::new(),
        }
    }

    /// Sets the dead-letter topic.
    pub fn with_dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = topic.into();
        self
    }

    /// Sets where keys come from.
    pub fn with_key(mut self, key: KeySource) -> Self {
        self.key = key;
        self
    }

    /// Sets the dedup scope (default: the group id).
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Sets what happens to keyless messages.
    pub fn with_missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
        self
    }

    /// Turns the payload check on or off.
    pub fn with_payload_check(mut self, on: bool) -> Self {
        self.check_payload = on;
        self
    }

    /// Sets the in-flight bound.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Sets the ordering.
    pub fn with_ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// Sets the retry backoff.
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets the commit interval.
    pub fn with_commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// Sets the drain timeout.
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Adds a librdkafka property for both the consumer and the dead-letter producer.
    pub fn with_client(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.push((key.into(), value.into()));
        self
    }
}
