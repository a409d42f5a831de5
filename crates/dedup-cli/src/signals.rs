//! The signals that stop a long-running command.

use crate::connect::CliError;

/// SIGINT or SIGTERM, registered when a command starts so a signal during set-up is not lost.
pub(crate) struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn install() -> Result<Self, CliError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let err =
                |e: std::io::Error| CliError::Failed(format!("installing signal handlers: {e}"));
            Ok(Self {
                int: signal(SignalKind::interrupt()).map_err(err)?,
                term: signal(SignalKind::terminate()).map_err(err)?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
