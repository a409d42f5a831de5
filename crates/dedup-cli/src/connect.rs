//! Connections from configuration, with errors that name what to fix (and never a password).
//! A configuration error or an unreachable server exits with code 2; a failed run with 1.

use std::process::ExitCode;
use std::time::Duration;

use dedup_pg::ConnectError;
use dedup_redis::RedisFastPath;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// The configuration is wrong (a bad URL, a bad argument): exit code 2.
    #[error("{0}")]
    Config(String),
    /// A server named by the configuration cannot be reached: exit code 2.
    #[error("{0}")]
    Unreachable(String),
    /// The work failed: exit code 1.
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    pub(crate) fn exit_code(&self) -> ExitCode {
        match self {
            Self::Config(_) | Self::Unreachable(_) => ExitCode::from(2),
            Self::Failed(_) => ExitCode::from(1),
        }
    }
}

/// `url` without its user and password, for messages.
pub(crate) fn redact(url: &str) -> String {
    dedup_pg::redact_url(url)
}

/// A pool on `DATABASE_URL`, TLS as its `sslmode` says.
pub(crate) async fn connect_pg(url: &str, max: u32) -> Result<PgPool, CliError> {
    let options = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5));
    dedup_pg::connect(url, options).await.map_err(|e| match e {
        ConnectError::Unreachable { .. } => CliError::Unreachable(format!(
            "{e} (DATABASE_URL). Is it running? \
             `source scripts/services.sh && ensure_postgres` starts one"
        )),
        ConnectError::Url { .. } => CliError::Config(format!("DATABASE_URL: {e}")),
        other => CliError::Config(format!("{other} (DATABASE_URL)")),
    })
}

pub(crate) async fn connect_redis(url: &str, prefix: &str) -> Result<RedisFastPath, CliError> {
    if !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://"))
    {
        return Err(CliError::Config(format!(
            "REDIS_URL ({}) must start with redis:// (or rediss://)",
            redact(url)
        )));
    }
    let fast = RedisFastPath::connect(url).await.map_err(|e| {
        CliError::Unreachable(format!(
            "cannot connect to Redis at {} (REDIS_URL): {e}. Is it running? \
             `source scripts/services.sh && ensure_redis` starts one",
            redact(url)
        ))
    })?;
    Ok(fast.with_prefix(prefix))
}
