//! Stopping what an engine runs: one flag every consumer watches, and a count of what still
//! runs, so that shutdown can wait for the last of them before it lets go of the identity.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::watch;

/// The engine's run state: whether it is stopping, and how many consumers still run.
#[derive(Debug)]
pub(crate) struct Running {
    stop: watch::Sender<bool>,
    count: watch::Sender<usize>,
}

impl Default for Running {
    fn default() -> Self {
        Self {
            stop: watch::Sender::new(false),
            count: watch::Sender::new(0),
        }
    }
}

impl Running {
    pub(crate) fn handle(&self) -> Shutdown {
        Shutdown {
            stop: self.stop.clone(),
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Counts one running consumer until the guard drops.
    #[cfg(feature = "kafka")]
    pub(crate) fn guard(&self) -> RunningGuard {
        self.count.send_modify(|n| *n += 1);
        RunningGuard {
            count: self.count.clone(),
        }
    }

    /// Waits until nothing runs.
    pub(crate) async fn finished(&self) {
        let mut rx = self.count.subscribe();
        // The sender lives in `self`: the wait ends only when the count reaches zero.
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

/// One running consumer.
#[cfg(feature = "kafka")]
#[derive(Debug)]
pub(crate) struct RunningGuard {
    count: watch::Sender<usize>,
}

#[cfg(feature = "kafka")]
impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.count.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// A handle that stops everything built from an engine ([`Engine::shutdown_handle`]): cheap to
/// clone, usable from a signal handler's task.
///
/// [`Engine::shutdown_handle`]: crate::Engine::shutdown_handle
#[derive(Clone, Debug)]
pub struct Shutdown {
    stop: watch::Sender<bool>,
}

impl Shutdown {
    /// Tells every consumer of the engine to stop taking messages and drain. To also wait for
    /// them and release the identity, call [`Engine::shutdown`](crate::Engine::shutdown).
    pub fn trigger(&self) {
        self.stop.send_replace(true);
    }

    /// Whether the engine is stopping.
    pub fn is_triggered(&self) -> bool {
        *self.stop.borrow()
    }

    /// A future that completes once the engine is stopping: the graceful-shutdown signal of an
    /// HTTP server (`axum::serve(...).with_graceful_shutdown(engine.shutdown_handle().stopped())`).
    pub fn stopped(&self) -> Stopped {
        let mut rx = self.stop.subscribe();
        Stopped(Box::pin(async move {
            let _ = rx.wait_for(|stopping| *stopping).await;
        }))
    }
}

/// Completes once the engine is stopping ([`Shutdown::stopped`]).
#[must_use = "futures do nothing unless awaited"]
pub struct Stopped(Pin<Box<dyn Future<Output = ()> + Send>>);

impl std::fmt::Debug for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stopped")
    }
}

impl Future for Stopped {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}
