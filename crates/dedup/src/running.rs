//! Stopping what an engine runs: one flag every consumer watches, a count of the consumers whose
//! `run` has not returned, and a count of the consumers whose message tasks may still hold a
//! lease ([`Alive`]), so that shutdown lets go of the identity only once the last of them ended.
//!
//! A consumer's `run` returns after its drain timeout even where a handler still runs: its task
//! is not aborted (aborting undoes no effect already made), so it keeps its lease and its
//! heartbeat. Were the identity released then, a successor with the same identity would adopt
//! that lease and run the message's effect while the old task is still in it. So the identity
//! stays held until every consumer's handler has been dropped, which happens only after the last
//! task holding it ended (docs/ARCHITECTURE.md, invariant 24).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
#[cfg(feature = "kafka")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::task::{Context, Poll};

use tokio::sync::watch;

/// The engine's run state: whether it is stopping, how many consumers still run, how many
/// consumers' handlers are still alive, and how many handler calls are running.
#[derive(Debug)]
pub(crate) struct Running {
    stop: watch::Sender<bool>,
    count: watch::Sender<usize>,
    holders: watch::Sender<usize>,
    calls: Arc<AtomicUsize>,
}

impl Default for Running {
    fn default() -> Self {
        Self {
            stop: watch::Sender::new(false),
            count: watch::Sender::new(0),
            holders: watch::Sender::new(0),
            calls: Arc::default(),
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

    /// Waits until no consumer's `run` runs.
    pub(crate) async fn finished(&self) {
        let mut rx = self.count.subscribe();
        // The sender lives in `self`: the wait ends only when the count reaches zero.
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// A consumer's handler's token (not counted until [`Alive::arm`]).
    #[cfg(feature = "kafka")]
    pub(crate) fn alive(&self) -> Alive {
        Alive(Arc::new(AliveCell {
            holders: self.holders.clone(),
            calls: self.calls.clone(),
            armed: AtomicBool::new(false),
        }))
    }

    /// Handler calls running now.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(AtomicOrdering::Acquire)
    }

    /// Whether a consumer's handler is still alive (a task that may hold a lease).
    pub(crate) fn held(&self) -> bool {
        *self.holders.borrow() > 0
    }

    /// Completes once no consumer's handler is alive.
    pub(crate) fn released(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.holders.subscribe();
        async move {
            let _ = rx.wait_for(|n| *n == 0).await;
        }
    }
}

/// A consumer's handler's hold on the engine's identity: shared by the handler (and so by every
/// task of the consumer's, which all hold the handler) and by the consumer until its `run`
/// starts. Counted once armed (when `run` starts), until the last clone drops.
#[cfg(feature = "kafka")]
#[derive(Clone, Debug)]
pub(crate) struct Alive(Arc<AliveCell>);

#[cfg(feature = "kafka")]
#[derive(Debug)]
struct AliveCell {
    holders: watch::Sender<usize>,
    calls: Arc<AtomicUsize>,
    armed: AtomicBool,
}

#[cfg(feature = "kafka")]
impl Alive {
    /// Counts the handler as alive from now until it drops (once, however often called).
    fn arm(&self) {
        if !self.0.armed.swap(true, AtomicOrdering::AcqRel) {
            self.0.holders.send_modify(|n| *n += 1);
        }
    }
}

#[cfg(feature = "kafka")]
impl dedup_kafka::Liveness for Alive {
    fn arm(&self) {
        Alive::arm(self);
    }

    fn enter(&self) {
        self.0.calls.fetch_add(1, AtomicOrdering::AcqRel);
    }

    fn exit(&self) {
        self.0.calls.fetch_sub(1, AtomicOrdering::AcqRel);
    }
}

#[cfg(feature = "kafka")]
impl Drop for AliveCell {
    fn drop(&mut self) {
        if *self.armed.get_mut() {
            self.holders.send_modify(|n| *n = n.saturating_sub(1));
        }
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
