//! The HTTP Idempotency-Key layer built from an [`Engine`]: the engine's store, caches and
//! owner ids; the layer's own policy, header and scope ([`IdempotencyConfig`]).

use std::sync::Arc;

use dedup_http::{IdempotencyConfig, IdempotencyLayer};

use crate::engine::{BuildError, Engine, EngineStore};

/// The layer [`Engine::http_layer`] builds.
pub type EngineLayer = IdempotencyLayer<Arc<EngineStore>>;

impl Engine {
    /// A tower layer that runs each request carrying an `Idempotency-Key` once and replays its
    /// response to retries, on this engine. `config` holds the layer's own settings, its policy
    /// included (a running request's lease, how long responses are kept). [`Engine::shutdown`]
    /// waits for the requests it started.
    ///
    /// # Errors
    /// A policy or in-flight wait that cannot work.
    pub fn http_layer(&self, config: IdempotencyConfig) -> Result<EngineLayer, BuildError> {
        let member = self.member(None);
        let dedup = self.member_dedup(self.policy(), member.owner_prefix)?;
        let layer = IdempotencyLayer::on(dedup, config)
            .map_err(|e| BuildError::setting("http_layer", e))?;
        self.keep_layer(layer.clone());
        Ok(layer)
    }
}
