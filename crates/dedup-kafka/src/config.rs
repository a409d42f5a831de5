//! How a [`Runner`](crate::Runner) is set up.
//!
//! `RunnerConfig` and its parts (`key_source.rs`: where the idempotency key comes from).
//! `RunnerConfig::validate`, which `Runner::new` runs, makes a setting that would fail at run time
//! (a zero commit interval, a wait too long for the clock, an empty topic, a list of key sources
//! that cannot agree) a `ConfigError` naming it.

use std::time::Duration;

pub use crate::kill_switch::KillSwitch;
pub use key_source::{DEFAULT_KEY_HEADER, EventTime, KeySource};

mod key_source;

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
    /// Messages of one partition run concurrently when their *ordering keys* differ (an order, an
    /// account: see [`OrderingKey`]); one ordering key's messages run in offset order. Messages
    /// without an ordering key run in partition order. Offsets are committed up to the first
    /// message not yet settled.
    PerKey,
}

/// Where a message's *ordering key* comes from: what [`Ordering::PerKey`] keeps in order. It is
/// not the idempotency key, which is unique per event: two events of one account have two
/// idempotency keys and one ordering key.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub enum OrderingKey {
    /// The Kafka message key (the default): what the producer partitioned by.
    #[default]
    MessageKey,
    /// The value of this header.
    Header(String),
    /// The value at this JSON pointer (RFC 6901) in a JSON payload; a string as is, a number or
    /// boolean as its JSON text.
    JsonPointer(String),
}

/// A setting that cannot work, named.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("{setting}: {problem}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The setting, as the runner's configuration names it (the consumer builder's `build`
    /// answers the builder method instead).
    pub setting: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl ConfigError {
    /// `setting` cannot work, for `problem`.
    pub fn new(setting: &'static str, problem: impl Into<String>) -> Self {
        Self {
            setting,
            problem: problem.into(),
        }
    }
}

/// The longest wait a setting may hold: far beyond any sensible value, and far inside what a
/// clock can add without overflowing.
pub const MAX_SETTING_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

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
pub(crate) struct RunnerConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The consumer group (`group.id`); never the dedup scope.
    pub group_id: String,
    /// The topics to consume.
    pub topics: Vec<String>,
    /// Where poison messages, permanent failures and (by default) keyless messages go.
    pub dead_letter_topic: String,
    /// Where the idempotency key comes from.
    pub key: KeySource,
    /// The dedup scope (required: the engine's; never the group id).
    pub scope: Option<String>,
    /// What happens to a message without a key.
    pub missing_key: MissingKey,
    /// Whether the payload's fingerprint is checked (a key reused with another payload is then
    /// dead-lettered as a mismatch).
    pub check_payload: bool,
    /// The most messages held at once (running or waiting their turn), shared fairly between the
    /// partitions with work (a lone busy partition may hold all of it). At the bound the runner
    /// takes no more until one settles; after a second without one it pauses its partitions.
    pub max_in_flight: usize,
    /// The most messages held in *blocked* lanes ([`Runner`](crate::Runner)): a message whose key
    /// another holder's live lease covers (a process that died holding it, before its lease ends
    /// or its successor adopts it) and the messages of its lane behind it. They do not count
    /// against `max_in_flight`, so other lanes keep flowing; at this bound the partitions of
    /// blocked lanes are paused (others go on) until half of them have drained.
    pub max_blocked: usize,
    /// Which messages may run at the same time.
    pub ordering: Ordering,
    /// What [`Ordering::PerKey`] keeps in order (default: the Kafka message key).
    pub ordering_key: OrderingKey,
    /// Waits between retries.
    pub backoff: Backoff,
    /// How often settled offsets are committed (also on revocation and shutdown).
    pub commit_interval: Duration,
    /// How long shutdown waits for running messages before it leaves them to redelivery.
    pub drain_timeout: Duration,
    /// Further librdkafka properties for the consumer and the dead-letter producer (for example
    /// `broker.address.family=v4`, `security.protocol`, `group.protocol`).
    pub client: Vec<(String, String)>,
    /// When the runner stops taking messages because its handler fails everything; off by
    /// default.
    pub kill_switch: Option<KillSwitch>,
}

impl RunnerConfig {
    /// A configuration with the defaults: key from the `idempotency-key` header, no scope (required),
    /// dead-letter topic `<first topic>.dlq`, keyless messages dead-lettered, payload checked,
    /// 1,024 messages in flight (and 4,096 in blocked lanes), per-partition order, commits every
    /// second.
    pub(crate) fn new(
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
            max_blocked: 4096,
            ordering: Ordering::default(),
            ordering_key: OrderingKey::default(),
            backoff: Backoff::default(),
            commit_interval: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(30),
            client: Vec::new(),
            kill_switch: None,
        }
    }

    /// Sets the dead-letter topic.
    #[cfg(test)]
    pub(crate) fn with_dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = topic.into();
        self
    }

    /// Sets where keys come from.
    #[cfg(test)]
    pub(crate) fn with_key(mut self, key: KeySource) -> Self {
        self.key = key;
        self
    }

    /// Sets the in-flight bound.
    #[cfg(test)]
    pub(crate) fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Sets the bound on messages in blocked lanes (see [`RunnerConfig::max_blocked`]).
    #[cfg(test)]
    pub(crate) fn with_max_blocked(mut self, n: usize) -> Self {
        self.max_blocked = n;
        self
    }

    /// Sets where [`Ordering::PerKey`]'s ordering key comes from.
    #[cfg(test)]
    pub(crate) fn with_ordering_key(mut self, key: OrderingKey) -> Self {
        self.ordering_key = key;
        self
    }

    /// Sets the retry backoff.
    #[cfg(test)]
    pub(crate) fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets the commit interval.
    #[cfg(test)]
    pub(crate) fn with_commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// Checks every setting that could fail at run time; [`Runner::new`](crate::Runner::new)
    /// calls it. The error names the setting.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let bounded = |setting: &'static str, d: Duration| {
            if d > MAX_SETTING_DURATION {
                Err(ConfigError::new(
                    setting,
                    format!("{d:?} is longer than the limit of {MAX_SETTING_DURATION:?}"),
                ))
            } else {
                Ok(())
            }
        };
        if self.brokers.trim().is_empty() {
            return Err(ConfigError::new("brokers", "no bootstrap servers given"));
        }
        if self.group_id.is_empty() {
            return Err(ConfigError::new("group_id", "the group id is empty"));
        }
        if self.topics.is_empty() || self.topics.iter().any(String::is_empty) {
            return Err(ConfigError::new(
                "topics",
                "no topics, or an empty topic name",
            ));
        }
        if self.dead_letter_topic.is_empty() {
            return Err(ConfigError::new(
                "dead_letter_topic",
                "the topic name is empty",
            ));
        }
        if self.topics.contains(&self.dead_letter_topic) {
            return Err(ConfigError::new(
                "dead_letter_topic",
                "it is also a consumed topic: dead letters would be consumed again",
            ));
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError::new("max_in_flight", "must be at least 1"));
        }
        if self.max_blocked == 0 {
            return Err(ConfigError::new("max_blocked", "must be at least 1"));
        }
        if self.commit_interval.is_zero() {
            return Err(ConfigError::new(
                "commit_interval",
                "must be longer than zero",
            ));
        }
        bounded("commit_interval", self.commit_interval)?;
        bounded("drain_timeout", self.drain_timeout)?;
        if self.backoff.initial.is_zero() {
            return Err(ConfigError::new(
                "backoff",
                "the initial wait must be longer than zero",
            ));
        }
        bounded("backoff", self.backoff.max)?;
        if let Some(ks) = &self.kill_switch {
            ks.validate()?;
        }
        self.key.validate()?;
        match &self.ordering_key {
            OrderingKey::Header(h) if h.is_empty() => {
                Err(ConfigError::new("ordering_key", "empty header name"))
            }
            OrderingKey::JsonPointer(p) if !p.is_empty() && !p.starts_with('/') => Err(
                ConfigError::new("ordering_key", format!("{p:?} is not a JSON pointer")),
            ),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RunnerConfig {
        RunnerConfig::new("127.0.0.1:9092", "g", ["t"])
    }

    #[test]
    fn settings_that_would_panic_at_run_time_are_refused_by_name() {
        assert_eq!(config().validate(), Ok(()));
        let cases = [
            (
                config().with_commit_interval(Duration::ZERO),
                "commit_interval",
            ),
            (
                config().with_commit_interval(Duration::MAX),
                "commit_interval",
            ),
            (
                RunnerConfig {
                    drain_timeout: Duration::MAX,
                    ..config()
                },
                "drain_timeout",
            ),
            (
                config().with_backoff(Backoff::new(Duration::ZERO, Duration::ZERO)),
                "backoff",
            ),
            (
                config().with_backoff(Backoff::new(Duration::from_millis(1), Duration::MAX)),
                "backoff",
            ),
            (config().with_max_in_flight(0), "max_in_flight"),
            (config().with_max_blocked(0), "max_blocked"),
            (config().with_dead_letter_topic("t"), "dead_letter_topic"),
            (RunnerConfig::new("", "g", ["t"]), "brokers"),
            (RunnerConfig::new("b", "", ["t"]), "group_id"),
            (RunnerConfig::new("b", "g", Vec::<String>::new()), "topics"),
            (config().with_key(KeySource::Header(String::new())), "key"),
            (
                config().with_ordering_key(OrderingKey::JsonPointer("account".into())),
                "ordering_key",
            ),
        ];
        for (config, setting) in cases {
            let err = config.validate().expect_err(setting);
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.to_string().starts_with(setting), "{err}");
        }
    }
}
