//! What every runner does before its loop: its errors, its dedup scope, and taking over the
//! leases an earlier incarnation of its identity left behind.
//!
//! `RunnerError`; `scope_of`; `adopt_at_start`; and `start`, which makes the clients, the refusal
//! watch, the stop flag and the kill switch (`Started`).

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use dedup_core::{Adoption, Dedup, Scope, Store};
use rdkafka::error::KafkaError;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::config::{ConfigError, RunnerConfig};
use crate::consumer::{Contact, Shared, Source, StartOffsets, clients, until_refused};
use crate::dead_letter::{DeadLetters, RefusedTable};
use crate::kill_switch::Breaker;
use crate::stats::Counters;

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

/// The dedup scope of a runner: the engine's, set explicitly (never derived from the group id,
/// so that a renamed group or a blue/green deploy under a new one still finds every key done).
pub(crate) fn scope_of(config: &RunnerConfig) -> Result<Scope, ConfigError> {
    let Some(scope) = config.scope.as_deref() else {
        return Err(ConfigError {
            setting: "scope",
            problem: "required: the engine's scope, never the group id".into(),
        });
    };
    Scope::new(scope).map_err(|e| ConfigError {
        setting: "scope",
        problem: format!("not usable as a dedup scope: {e}"),
    })
}

/// A runner, started: its clients, the partitions it owns, the future it runs until (the caller's
/// shutdown, or the cluster refusing it), the flag that tells its tasks it stops, and its kill
/// switch.
pub(crate) struct Started<F> {
    pub(crate) shared: Arc<Mutex<Shared>>,
    pub(crate) source: Source,
    pub(crate) dead_letters: DeadLetters,
    pub(crate) shutdown: F,
    pub(crate) refused: Arc<OnceLock<String>>,
    pub(crate) stop_tx: watch::Sender<bool>,
    pub(crate) stopping: watch::Receiver<bool>,
    pub(crate) breaker: Arc<Breaker>,
}

/// What every runner does before its loop: the Kafka clients (with stored start positions and a
/// table for refused dead letters where the runner has them), the watch for a refusal, the stop
/// flag and the kill switch.
pub(crate) fn start<F: Future<Output = ()>>(
    config: &RunnerConfig,
    counters: &Arc<Counters>,
    start_offsets: Option<Arc<dyn StartOffsets>>,
    refused_table: Option<Arc<dyn RefusedTable>>,
    shutdown: F,
) -> Result<Started<impl Future<Output = ()> + use<F>>, RunnerError> {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let contact = Arc::new(Contact::default());
    let (stop_tx, stopping) = watch::channel(false);
    let (source, dead_letters) = clients(
        config,
        &shared,
        counters,
        start_offsets,
        &contact,
        refused_table,
        stopping.clone(),
    )?;
    let (shutdown, refused) = until_refused(shutdown, &contact);
    Ok(Started {
        shared,
        source,
        dead_letters,
        shutdown,
        refused,
        stop_tx,
        stopping,
        breaker: Arc::new(Breaker::new(config.kill_switch, counters.clone())),
    })
}
