//! A consumer's settings kept in one value, as the scenarios pass them around before an engine
//! exists: each is applied to the user's builder (`engine.consumer()`) by
//! [`consumer_for`](super::consumer_for); what a scenario leaves unset keeps the builder's
//! default.

use std::time::Duration;

use dedup_kafka::{Backoff, KeySource, KillSwitch, MissingKey, Ordering, OrderingKey};

/// What a scenario sets on its consumer.
#[derive(Clone, Debug, Default)]
pub(crate) struct Settings {
    pub(crate) brokers: String,
    pub(crate) group_id: String,
    pub(crate) topics: Vec<String>,
    /// The engine's scope: the scenarios' own convention is the group id where none is given.
    pub(crate) scope: Option<String>,
    pub(crate) dead_letter_topic: Option<String>,
    pub(crate) key: Option<KeySource>,
    pub(crate) missing_key: Option<MissingKey>,
    pub(crate) payload_check: Option<bool>,
    pub(crate) max_in_flight: Option<usize>,
    pub(crate) max_blocked: Option<usize>,
    pub(crate) ordering: Option<Ordering>,
    pub(crate) ordering_key: Option<OrderingKey>,
    pub(crate) backoff: Option<Backoff>,
    pub(crate) commit_interval: Option<Duration>,
    pub(crate) drain_timeout: Option<Duration>,
    pub(crate) kill_switch: Option<KillSwitch>,
    pub(crate) client: Vec<(String, String)>,
}

#[allow(dead_code)]
impl Settings {
    pub(crate) fn new(
        brokers: impl Into<String>,
        group_id: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// The engine's scope: the one given, or the group id.
    pub(crate) fn scope(&self) -> String {
        self.scope.clone().unwrap_or_else(|| self.group_id.clone())
    }

    pub(crate) fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    pub(crate) fn with_dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    pub(crate) fn with_key(mut self, key: KeySource) -> Self {
        self.key = Some(key);
        self
    }

    pub(crate) fn with_missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = Some(policy);
        self
    }

    pub(crate) fn with_payload_check(mut self, on: bool) -> Self {
        self.payload_check = Some(on);
        self
    }

    pub(crate) fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = Some(n);
        self
    }

    pub(crate) fn with_max_blocked(mut self, n: usize) -> Self {
        self.max_blocked = Some(n);
        self
    }

    pub(crate) fn with_ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = Some(ordering);
        self
    }

    pub(crate) fn with_ordering_key(mut self, key: OrderingKey) -> Self {
        self.ordering_key = Some(key);
        self
    }

    pub(crate) fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    pub(crate) fn with_commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = Some(interval);
        self
    }

    pub(crate) fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = Some(timeout);
        self
    }

    pub(crate) fn with_kill_switch(mut self, kill_switch: KillSwitch) -> Self {
        self.kill_switch = Some(kill_switch);
        self
    }

    pub(crate) fn with_client(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.push((key.into(), value.into()));
        self
    }
}
