//! The dead-letter topic's size limit, checked at start: a dead-letter topic that accepts less
//! than its source topics (`max.message.bytes`) refuses the largest messages' dead letters every
//! time. Said once, at start, with what happens to them (kept in Postgres, or a stall). The
//! limits are read in the background, so the runner does not wait for them.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tracing::{debug, info, warn};

/// What the check found: the dead-letter topic's limit and the largest of its sources'.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Limits {
    pub(crate) dead_letter_topic: u64,
    pub(crate) largest_source: u64,
}

impl Limits {
    /// Whether a message its source accepted can be too large for the dead-letter topic (with
    /// the headers a dead letter adds).
    pub(crate) fn too_small(&self) -> bool {
        self.dead_letter_topic
            < self
                .largest_source
                .saturating_add(super::MAX_REASON_LEN as u64 * 2)
    }
}

/// Reads `max.message.bytes` of the dead-letter topic and the sources (bounded by `timeout`);
/// `None` where the cluster does not say.
pub(crate) async fn read(
    config: &ClientConfig,
    dead_letter_topic: &str,
    sources: &[String],
    timeout: Duration,
) -> Option<Limits> {
    let admin: AdminClient<DefaultClientContext> = match config.create() {
        Ok(a) => a,
        Err(e) => {
            debug!(error = %e, "no admin client to read the dead-letter topic's limit");
            return None;
        }
    };
    let mut specs = vec![ResourceSpecifier::Topic(dead_letter_topic)];
    specs.extend(sources.iter().map(|t| ResourceSpecifier::Topic(t)));
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let got = tokio::time::timeout(
        timeout + Duration::from_secs(1),
        admin.describe_configs(&specs, &opts),
    )
    .await
    .ok()?
    .ok()?;
    let limit = |i: usize| -> Option<u64> {
        got.get(i)?
            .as_ref()
            .ok()?
            .get("max.message.bytes")?
            .value
            .as_deref()?
            .parse()
            .ok()
    };
    let dead_letter_topic = limit(0)?;
    let largest_source = (1..=sources.len()).filter_map(limit).max()?;
    Some(Limits {
        dead_letter_topic,
        largest_source,
    })
}

/// Checks the limits in the background and says what it found (never delays the start).
pub(crate) fn check_at_start(
    config: ClientConfig,
    dead_letter_topic: String,
    sources: Vec<String>,
    kept_in_postgres: bool,
    gauge: std::sync::Arc<crate::stats::Counters>,
) {
    tokio::spawn(async move {
        let Some(limits) = read(
            &config,
            &dead_letter_topic,
            &sources,
            Duration::from_secs(10),
        )
        .await
        else {
            debug!(topic = %dead_letter_topic, "the cluster did not say the dead-letter topic's max.message.bytes");
            return;
        };
        gauge.dead_letter_max_bytes.set(limits.dead_letter_topic);
        if limits.too_small() {
            let then = if kept_in_postgres {
                "they are kept in Postgres (dedup_dead_letters, `dedup dead-letters`)"
            } else {
                "their partition stalls: raise its max.message.bytes, or give the runner a Postgres table for them"
            };
            warn!(topic = %dead_letter_topic, max_message_bytes = limits.dead_letter_topic, largest_source = limits.largest_source, "the dead-letter topic accepts less than its sources: the largest messages' dead letters will be refused; {then}");
        } else {
            info!(topic = %dead_letter_topic, max_message_bytes = limits.dead_letter_topic, "the dead-letter topic's size limit covers its sources");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::Limits;

    #[test]
    fn a_dead_letter_topic_smaller_than_its_sources_plus_headers_is_too_small() {
        let l = |d, s| Limits {
            dead_letter_topic: d,
            largest_source: s,
        };
        assert!(l(500_000, 1_048_588).too_small());
        assert!(
            l(1_048_588, 1_048_588).too_small(),
            "the headers need room too"
        );
        assert!(!l(2_097_152, 1_048_588).too_small());
    }
}
