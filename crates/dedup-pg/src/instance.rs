//! Instance identities: the session lock that says an identity's holder is alive, and adoption of
//! a dead predecessor's leases.

use std::time::Duration;

use dedup_core::{Adoption, IdempotencyKey, InstanceId, Scope, StoreError};
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};
use tracing::{info, warn};

use crate::classify::classify;
use crate::rows::record_from_row;
use crate::sql::{ADOPT_SQL, IDENTITY_LOCK_SQL};
use crate::{PgStore, sql};

/// How long `adopt` tries for the identity lock: a predecessor killed a moment ago may still have
/// a session that the server has not yet seen close.
const LOCK_WAIT: Duration = Duration::from_secs(3);
const LOCK_RETRY: Duration = Duration::from_millis(100);

/// The identity this store holds, on a session of its own (not pooled): the session-level
/// advisory lock lives as long as that session, so the server releases it when the process dies.
#[derive(Debug, Default)]
pub(crate) struct Identity {
    held: Option<(InstanceId, PgConnection)>,
}

/// `s` as a LIKE pattern that matches it literally (escape character `\`).
fn like_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    for c in s.chars() {
        if matches!(c, '\\' | '%' | '_') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl PgStore {
    /// Takes the identity's session lock (on a connection of its own, kept), waiting up to
    /// [`LOCK_WAIT`] for a dying predecessor's session to end. False: a live process holds it.
    async fn hold_identity(&self, id: &InstanceId) -> Result<bool, StoreError> {
        let mut identity = self.identity.lock().await;
        if let Some((held, conn)) = identity.held.as_mut() {
            if held == id && conn.ping().await.is_ok() {
                return Ok(true);
            }
            // Another identity, or a session that ended (a server restart ended its lock too).
            identity.held = None;
        }
        let mut conn = PgConnection::connect_with(&self.pool.connect_options())
            .await
            .map_err(|e| classify(e, false))?;
        let deadline = tokio::time::Instant::now() + LOCK_WAIT;
        loop {
            self.count(1);
            let got: bool = sqlx::query_scalar(IDENTITY_LOCK_SQL)
                .bind(sql::IDENTITY_LOCK_CLASS)
                .bind(id.as_str())
                .fetch_one(&mut conn)
                .await
                .map_err(|e| classify(e, false))?;
            if got {
                identity.held = Some((id.clone(), conn));
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(LOCK_RETRY).await;
        }
    }

    pub(crate) async fn adopt_leases(
        &self,
        id: &InstanceId,
        mine: &str,
    ) -> Result<Adoption, StoreError> {
        if !self.hold_identity(id).await? {
            warn!(instance = %id, "another live process holds this instance identity: nothing adopted");
            return Ok(Adoption::HeldElsewhere);
        }
        self.count(1);
        let mut conn = self.conn().await?;
        let rows = sqlx::query(ADOPT_SQL)
            .bind(format!("{}%", like_literal(&id.owner_prefix())))
            .bind(format!("{}%", like_literal(mine)))
            .fetch_all(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        let rows = conn.checked(rows)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let scope: String = row.try_get("scope").map_err(|e| classify(e, false))?;
            let key: Vec<u8> = row.try_get("key").map_err(|e| classify(e, false))?;
            let Ok(key) = Scope::new(&scope).and_then(|s| IdempotencyKey::new(s, &key)) else {
                warn!(scope, "an adopted row's key is not a valid key; skipped");
                continue;
            };
            out.push(record_from_row(&key, row)?);
        }
        info!(instance = %id, adopted = out.len(), "adopted the leases of earlier incarnations");
        Ok(Adoption::Adopted(out))
    }
}
