//! How a runner of batches cuts them ([`Batching`]), and the checks every runner of batches
//! makes at construction: among them, `MissingKey::ProcessWithoutDedup` is refused (every
//! message of a batch runs under a claim).

use std::time::Duration;

use dedup_core::Scope;
use dedup_pg::TxBatchConfig;

use crate::config::ConfigError;

/// How a consumer that takes batches (transaction mode, lease mode with the consumer builder's
/// `batching`) cuts them.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Batching {
    /// The most messages in one transaction. Default 500.
    pub size: usize,
    /// How long a partition's first waiting message waits for others before its batch runs
    /// anyway. Default 5 ms.
    pub wait: Duration,
    /// The transaction's bounds (idle in transaction, lock waits).
    pub transaction: TxBatchConfig,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            size: 500,
            wait: Duration::from_millis(5),
            transaction: TxBatchConfig::default(),
        }
    }
}

impl Batching {
    /// Sets the size and the wait.
    pub fn new(size: usize, wait: Duration) -> Self {
        Self {
            size,
            wait,
            ..Self::default()
        }
    }

    /// Sets the transaction's bounds.
    pub fn with_transaction(mut self, transaction: TxBatchConfig) -> Self {
        self.transaction = transaction;
        self
    }

    /// The checks every runner of batches makes at construction: the runner's settings, the
    /// batching's, and [`MissingKey::ProcessWithoutDedup`](crate::MissingKey), which no batch can
    /// honour (every message of a batch runs under a claim); `mode` names the runner in the
    /// refusal. Answers the dedup scope.
    pub(crate) fn check(
        &self,
        config: &crate::RunnerConfig,
        mode: &str,
    ) -> Result<Scope, crate::RunnerError> {
        config.validate()?;
        self.validate()?;
        if matches!(config.missing_key, crate::MissingKey::ProcessWithoutDedup) {
            return Err(ConfigError {
                setting: "missing_key",
                problem: format!(
                    "{mode} runs every message under a claim: dead-letter keyless messages, or use the per-message Runner"
                ),
            }
            .into());
        }
        Ok(crate::start::scope_of(config)?)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.size == 0 || self.size > MAX_BATCH {
            return Err(ConfigError {
                setting: "batching.size",
                problem: format!("{} is not between 1 and {MAX_BATCH}", self.size),
            });
        }
        if self.wait > MAX_BATCH_WAIT {
            return Err(ConfigError {
                setting: "batching.wait",
                problem: format!("{:?} is longer than {MAX_BATCH_WAIT:?}", self.wait),
            });
        }
        Ok(())
    }
}

/// The largest batch: its arrays go to Postgres as statement parameters.
pub const MAX_BATCH: usize = 10_000;
const MAX_BATCH_WAIT: Duration = Duration::from_secs(10);
