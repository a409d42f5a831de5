//! Instance identities: the session lock that says an identity's holder is alive, and adoption of
//! a dead predecessor's leases.
//!
//! The lock is session-level, on a connection of its own kept for the store's life, and its
//! keeper task (`keep`, a check every second) takes it back after the session ended under it
//! (docs/ARCHITECTURE.md, invariant 24). Adoption is `ADOPT_SQL`, which the partial index
//! `dedup_records_live_owner_idx` on live owners serves. `PgStore::release_identity` lets the lock
//! go at shutdown.

use std::sync::{Arc, Weak};
use std::time::Duration;

use dedup_core::{Adoption, IdempotencyKey, InstanceId, Scope, StoreError};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use tracing::{debug, error, info, warn};

use crate::classify::classify;
use crate::rows::record_from_row;
use crate::sql::{ADOPT_SQL, IDENTITY_LOCK_SQL};
use crate::{PgStore, sql};

/// How long `adopt` tries for the identity lock: a predecessor killed a moment ago may still have
/// a session that the server has not yet seen close.
const LOCK_WAIT: Duration = Duration::from_secs(3);
const LOCK_RETRY: Duration = Duration::from_millis(100);
/// How often the keeper checks that the identity's session (and so its lock) still stands, and
/// how long one attempt to take it again may last.
const KEEP_EVERY: Duration = Duration::from_secs(1);
const KEEP_TRY: Duration = Duration::from_secs(5);

/// The identity this store holds, on a session of its own (not pooled): the session-level
/// advisory lock lives as long as that session, so the server releases it when the process dies.
#[derive(Debug, Default)]
pub(crate) struct Identity {
    held: Option<(InstanceId, PgConnection)>,
    /// The identity the keeper task holds on to (the last one taken): it takes the lock again
    /// after a session ended under it (a Postgres restart ends every session, and with it every
    /// session lock), so a second process with the same identity cannot adopt this one's leases.
    wanted: Option<InstanceId>,
    keeper: bool,
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

/// `pg_try_advisory_lock` of the identity on `conn`: false when another session holds it.
async fn try_lock(conn: &mut PgConnection, id: &InstanceId) -> Result<bool, StoreError> {
    sqlx::query_scalar(IDENTITY_LOCK_SQL)
        .bind(sql::IDENTITY_LOCK_CLASS)
        .bind(id.as_str())
        .fetch_one(conn)
        .await
        .map_err(|e| classify(e, false))
}

/// The keeper of a store's identity lock, one per store (and its clones), ending with the last
/// of them. Every [`KEEP_EVERY`] it pings the lock's session; when the session is gone (a
/// Postgres restart or failover, a connection the network cut) it connects again and takes the
/// lock, each attempt bounded by [`KEEP_TRY`]. Without it the lock would come back only at the
/// next `adopt`, and meanwhile a second process started with the same identity could adopt this
/// live one's leases. A lock another session took in the gap is not this process's to take back:
/// that is logged as an error (two live processes share one identity, a misconfiguration) and
/// tried again on every tick.
async fn keep(weak: Weak<tokio::sync::Mutex<Identity>>, options: Arc<PgConnectOptions>) {
    let mut warned = false;
    loop {
        tokio::time::sleep(KEEP_EVERY).await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let mut identity = shared.lock().await;
        let Some(id) = identity.wanted.clone() else {
            continue;
        };
        if let Some((_, conn)) = identity.held.as_mut() {
            if tokio::time::timeout(KEEP_TRY, conn.ping())
                .await
                .is_ok_and(|r| r.is_ok())
            {
                continue;
            }
            warn!(instance = %id, "the identity lock's session ended: taking the lock again");
            identity.held = None;
        }
        let retaken = tokio::time::timeout(KEEP_TRY, async {
            let mut conn = PgConnection::connect_with(&options)
                .await
                .map_err(|e| classify(e, false))?;
            let got = try_lock(&mut conn, &id).await?;
            Ok::<_, StoreError>(got.then_some(conn))
        })
        .await;
        match retaken {
            Ok(Ok(Some(conn))) => {
                info!(instance = %id, "the identity lock is held again");
                identity.held = Some((id, conn));
                warned = false;
            }
            Ok(Ok(None)) => {
                if !warned {
                    error!(instance = %id, "another live process took this instance identity while its lock was down: two processes share it, and the other may adopt this one's leases");
                    warned = true;
                }
            }
            Ok(Err(e)) => {
                debug!(instance = %id, error = %e, "the identity lock cannot be taken yet")
            }
            Err(_) => debug!(instance = %id, "taking the identity lock timed out; trying again"),
        }
    }
}

impl PgStore {
    /// Lets go of the instance identity this store (and its clones) holds: its session, and with
    /// it the lock, end now, and the keeper stops taking it again. For a clean shutdown, after
    /// every claim under the identity has ended; a successor with the identity then takes it at
    /// once instead of waiting for this process to exit. Returns whether one was held.
    pub async fn release_identity(&self) -> bool {
        let mut identity = self.identity.lock().await;
        identity.wanted = None;
        let held = identity.held.take();
        drop(identity);
        match held {
            Some((id, conn)) => {
                if let Err(e) = conn.close().await {
                    debug!(instance = %id, error = %e, "closing the identity's session");
                }
                info!(instance = %id, "released the instance identity");
                true
            }
            None => false,
        }
    }

    /// Takes the identity's session lock (on a connection of its own, kept), waiting up to
    /// [`LOCK_WAIT`] for a dying predecessor's session to end. False: a live process holds it.
    /// Once taken, a keeper task checks the session every [`KEEP_EVERY`] and takes the lock again
    /// when the session ended (see [`keep`]).
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
            if try_lock(&mut conn, id).await? {
                identity.held = Some((id.clone(), conn));
                identity.wanted = Some(id.clone());
                if !identity.keeper {
                    identity.keeper = true;
                    tokio::spawn(keep(
                        Arc::downgrade(&self.identity),
                        self.pool.connect_options(),
                    ));
                }
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
