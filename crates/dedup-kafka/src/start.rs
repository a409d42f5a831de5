//! What every runner does before its loop: its errors, its dedup scope, and taking over the
//! leases an earlier incarnation of its identity left behind.

use dedup_core::{Adoption, Dedup, Scope, Store};
use rdkafka::error::KafkaError;
use tracing::{info, warn};

use crate::config::{ConfigError, RunnerConfig};

/// Why a runner could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// The configuration is not usable: the error names the setting.
    #[error("bad runner configuration: {0}")]
    Config(#[from] ConfigError),
    /// The Kafka client failed to start or to subscribe.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The cluster refused this client before it ever joined: a certificate it does not trust
    /// (or one that does not name the broker), or a refused SASL login. The reason names the
    /// broker; retrying without a change of configuration cannot help.
    #[error("the Kafka cluster refused this client (TLS or SASL): {0}")]
    Refused(String),
}

impl RunnerError {
    /// Whether starting again may help (a broker that was down); a bad configuration will not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Kafka(_))
    }
}

/// With an instance identity, ends the leases an earlier incarnation of it left behind, before
/// anything is consumed (their messages are redelivered to us, or to whoever owns them now, and
/// taken over at once). A failure only leaves those leases to run out.
pub(crate) async fn adopt_at_start<S: Store>(dedup: &Dedup<S>) {
    match dedup.adopt().await {
        Ok(Adoption::Adopted(records)) => {
            info!(adopted = records.len(), instance = ?dedup.instance(), "adopted the leases of earlier incarnations");
        }
        Ok(Adoption::HeldElsewhere) => {
            warn!(instance = ?dedup.instance(), "another live process has this instance identity: its leases are left to run out");
        }
        Ok(_) => {}
        Err(e) => {
            warn!(error = %e, "adopting earlier incarnations' leases failed: they run out as usual")
        }
    }
}

/// The dedup scope of a runner: the configured one, or the group id.
pub(crate) fn scope_of(config: &RunnerConfig) -> Result<Scope, ConfigError> {
    Scope::new(config.scope.as_deref().unwrap_or(&config.group_id)).map_err(|e| ConfigError {
        setting: if config.scope.is_some() {
            "scope"
        } else {
            "group_id"
        },
        problem: format!("not usable as a dedup scope: {e}"),
    })
}
