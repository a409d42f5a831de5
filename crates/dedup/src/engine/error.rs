//! The one error every builder's `build()` answers.

use dedup_core::StoreError;

/// Why an engine, a consumer or an HTTP layer could not be built. A bad setting is named by its
/// builder method.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A setting that cannot work, or a combination the engine cannot honour, by the name of the
    /// builder method that set it (`scope`, `instance`, `parking`, ...).
    #[error("{setting}: {problem}")]
    Setting {
        /// The builder method whose value is at fault.
        setting: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// Postgres could not be connected to (a URL given to the builder).
    #[cfg(feature = "pg")]
    #[error(transparent)]
    Connect(#[from] dedup_pg::ConnectError),
    /// dedup's schema is missing, too old or too new for this binary, or could not be migrated.
    #[cfg(feature = "pg")]
    #[error("dedup's schema: {0}")]
    Schema(#[from] dedup_pg::SchemaError),
    /// A server failed a call the build makes (Redis at connect, Postgres while adopting).
    #[error("{what}: {source}")]
    Store {
        /// What was being done.
        what: &'static str,
        /// The store's error.
        source: StoreError,
    },
}

impl BuildError {
    pub(crate) fn setting(setting: &'static str, problem: impl ToString) -> Self {
        Self::Setting {
            setting,
            problem: problem.to_string(),
        }
    }

    /// Whether building again later may succeed without a change (a server that was down). A
    /// bad setting will not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Setting { .. } => false,
            #[cfg(feature = "pg")]
            Self::Connect(e) => e.is_retryable(),
            #[cfg(feature = "pg")]
            Self::Schema(e) => e.is_retryable(),
            Self::Store { source, .. } => source.is_retryable(),
        }
    }
}

#[cfg(feature = "kafka")]
impl From<dedup_kafka::ConfigError> for BuildError {
    fn from(e: dedup_kafka::ConfigError) -> Self {
        Self::Setting {
            setting: e.setting,
            problem: e.problem,
        }
    }
}
