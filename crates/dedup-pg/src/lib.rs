//! dedup-pg: the Postgres store, dedup's durable source of truth.
//!
//! Postgres alone grants leases and issues fencing tokens (from one sequence, so they never
//! repeat), on its own clock. Every call that changes a claimed record is fenced: it applies only
//! where the key's token and state still match, and otherwise fails with
//! [`StoreError::LeaseLost`] having changed nothing.
//!
//! # Two ways to hold a key
//! - **Lease mode** ([`Store`] on [`PgStore`]): the claim commits an IN_PROGRESS row with a lease;
//!   the handler runs outside any transaction while `Dedup::process` extends the lease; the
//!   completion is fenced by the token.
//! - **Transactional completion** ([`PgStore::transact`], or [`PgStore::complete_in`] plus
//!   [`PgStore::commit`]): the handler's business writes and the fenced completion commit in one
//!   transaction, so a zombie whose lease was taken over cannot commit its writes either.
//! - **Transaction mode** ([`PgStore::claim_in`]): the claim itself runs inside the caller's
//!   transaction; until it ends, the uncommitted row is the lock (a second claimer waits, or
//!   answers `InFlight` after the caller's `lock_timeout`), and a crash rolls it back. By the
//!   batch, [`PgStore::transact_batch`]; one request held open for the caller's writes,
//!   [`PgStore::begin_claim`] (a key another transaction holds answers `InFlight` at once).
//!
//! Queries are plain `sqlx::query` strings (not the compile-time checked macros) so that building
//! dedup needs no database and no `.sqlx/` data that can drift; every statement is exercised by the
//! conformance and Postgres tests against a real server.
//!
//! Here: `PgStore` on a `PgPool` and its transactional helpers (`claim_in`, `complete_in`,
//! `commit`, `transact`, `complete_batch_in`, `commit_batch`: a transaction commits whole, so an
//! unknown commit is read back through one lease; `get_many`), and `PgStore::statements`, the
//! round trips its `Store` calls made. Every other concern has a file of its own.
//!
//! # Example
//! ```no_run
//! use dedup_core::{Dedup, Fingerprint, HandlerError, IdempotencyKey, Scope};
//! use dedup_pg::PgStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//! dedup_pg::migrate(&pool).await?;
//! let store = PgStore::new(pool);
//! let dedup = Dedup::new(store.clone());
//!
//! let key = IdempotencyKey::new(Scope::new("orders")?, "order-created-981")?;
//! let payload = br#"{"order": 981, "total": 4200}"#;
//! let done = dedup
//!     .process(&key, Some(Fingerprint::of(payload)), |lease| {
//!         let store = store.clone();
//!         async move {
//!             // The business write and the fenced completion commit together.
//!             store
//!                 .transact(&lease, |tx| {
//!                     Box::pin(async move {
//!                         sqlx::query("INSERT INTO orders (id, total) VALUES (981, 4200)")
//!                             .execute(&mut *tx)
//!                             .await
//!                             .map_err(HandlerError::Retryable)?;
//!                         Ok(bytes::Bytes::from_static(b"order 981 stored"))
//!                     })
//!                 })
//!                 .await
//!         }
//!     })
//!     .await?;
//! println!("{:?} (executed: {})", done.result(), done.executed());
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use dedup_core::{
    ClaimOutcome, ClaimRequest, Completion, HandlerError, IdempotencyKey, Lease, LeaseContext,
    Record, State, Store, StoreError,
};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Row, Transaction};
use tracing::warn;

mod admin;
mod batch_tx;
mod claim;
mod classify;
mod complete;
mod connect;
mod instance;
mod layout;
mod migrate;
pub mod outbox;
mod retention;
mod rows;
mod sql;
mod store;
mod text;

pub use admin::ForgetReport;
pub use batch_tx::{
    BatchAnswer, BatchBody, BatchRequest, BatchWrites, BatchWritesFuture, ClaimedTx, ItemResult,
    TxBatchConfig, TxClaim,
};

use claim::claim_counted;
pub use classify::{classify, is_passing, sqlstate};
use complete::{complete_many, finish};
pub use connect::{ConnectError, connect, redact_url};
pub use layout::{KeyTimeLayout, RangePolicy, RangeReport, maintain_ranges, partition_by_key_time};
pub use migrate::{
    MIGRATIONS_TABLE, MIGRATOR, MigrationMode, ParseMigrationModeError, SCHEMA_GENERATION,
    SchemaError, SchemaStatus, SchemaVersion, migrate, prepare,
};
pub use retention::{Retention, RetentionConfig, RetentionRound, RetentionState, RetentionStats};
use rows::record_from_row;
use sql::GET_MANY_SQL;
pub use store::PgConn;
pub use text::{MAX_TEXT_BYTES, safe_text};

/// How many times a claim that lost a race to a concurrent writer is re-run before giving up
/// with [`StoreError::Unavailable`]. Each re-run sees the winner's committed row.
pub(crate) const CLAIM_RACE_TRIES: u32 = 16;

/// The Postgres store. Cheap to clone (it holds a pool).
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    statements: Arc<AtomicU64>,
    /// The instance identity this store holds (`Store::adopt`), shared by its clones.
    identity: Arc<tokio::sync::Mutex<instance::Identity>>,
    /// Woken after a commit that wrote outbox rows: an outbox relay in this process waits on it.
    outbox_wake: Arc<tokio::sync::Notify>,
}

/// The body of a transaction run by [`PgStore::transact`]: business writes on the transaction's
/// connection, returning the result to store.
pub type TxBody<'c, E> = Pin<Box<dyn Future<Output = Result<Bytes, HandlerError<E>>> + Send + 'c>>;

impl PgStore {
    /// A store on `pool`. Run [`migrate()`] (or [`prepare`]) once before use.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            statements: Arc::default(),
            identity: Arc::default(),
            outbox_wake: Arc::default(),
        }
    }

    /// How many statements (round trips) this store and its clones sent to Postgres through the
    /// [`Store`] calls, batches and their fallbacks included (not the caller's own transactions).
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    /// Adds `n` to [`statements`](Self::statements): for the crates that keep their own tables
    /// beside the records (the Kafka consumer's parked messages) through [`conn`](Self::conn).
    pub fn count(&self, n: u64) {
        self.statements.fetch_add(n, Ordering::Relaxed);
    }

    /// A connection from the store's pool, closed instead of returned once an error says it must
    /// not be reused ([`PgConn::checked`]).
    ///
    /// # Errors
    /// The pool's, classified ([`classify`]).
    pub async fn conn(&self) -> Result<PgConn, StoreError> {
        self.pool
            .acquire()
            .await
            .map(PgConn)
            .map_err(|e| classify(e, false))
    }

    /// Completes many leases inside the caller's transaction, in one statement: the completions
    /// commit or roll back with the caller's business writes. One answer per item, in order.
    /// Where any answer is an error (a lease was taken over), the caller must roll back, since the
    /// transaction holds that key's business writes too, and may retry the others.
    pub async fn complete_batch_in(
        conn: &mut PgConnection,
        items: &[(Lease, Bytes)],
    ) -> Vec<Result<(), StoreError>> {
        complete_many(conn, items).await.0
    }

    /// Commits a transaction that completed `leases` with
    /// [`complete_batch_in`](Self::complete_batch_in). A transaction commits whole, so an unknown
    /// outcome is resolved by reading back one of its leases.
    pub async fn commit_batch(
        &self,
        tx: Transaction<'_, Postgres>,
        leases: &[Lease],
    ) -> Result<(), StoreError> {
        match leases.first() {
            Some(lease) => self.commit(tx, lease).await,
            None => tx.commit().await.map_err(|e| classify(e, true)),
        }
    }

    /// What an outbox relay in this process waits on: notified after each commit through this
    /// store (or its clones) that wrote outbox rows, so the relay publishes them at once rather
    /// than at its next poll.
    pub fn outbox_wake(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.outbox_wake)
    }

    /// Wakes this process's outbox relay: call it after committing a transaction of your own
    /// that wrote outbox rows ([`outbox::OutboxWriter`]).
    pub fn wake_outbox(&self) {
        self.outbox_wake.notify_one();
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Claims inside the caller's transaction (transaction mode). Until that transaction ends,
    /// the uncommitted row is the lock: another claimer of the key waits on it, or answers
    /// [`ClaimOutcome::InFlight`] once the transaction's `lock_timeout` runs out (that error aborts
    /// the caller's transaction, which must then roll back). Use READ COMMITTED (the default).
    pub async fn claim_in(
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        claim_counted(conn, req).await.0
    }

    /// Reads the records of `keys` in one statement, by key (absent keys are left out).
    pub async fn get_many<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k IdempotencyKey>,
    ) -> Result<HashMap<IdempotencyKey, Record>, StoreError> {
        let keys: Vec<&IdempotencyKey> = keys.into_iter().collect();
        let scopes: Vec<&str> = keys.iter().map(|k| k.scope().as_str()).collect();
        let bytes: Vec<&[u8]> = keys.iter().map(|k| k.key_bytes()).collect();
        let mut conn = self.conn().await?;
        let rows = sqlx::query(GET_MANY_SQL)
            .bind(&scopes)
            .bind(&bytes)
            .fetch_all(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        let rows = conn.checked(rows)?;
        let by_id: HashMap<(&str, &[u8]), &IdempotencyKey> = keys
            .iter()
            .map(|k| ((k.scope().as_str(), k.key_bytes()), *k))
            .collect();
        let mut out = HashMap::with_capacity(rows.len());
        for row in &rows {
            let scope: &str = row.try_get("scope").map_err(|e| classify(e, false))?;
            let key: &[u8] = row.try_get("key").map_err(|e| classify(e, false))?;
            if let Some(k) = by_id.get(&(scope, key)) {
                out.insert((*k).clone(), record_from_row(k, row)?);
            }
        }
        Ok(out)
    }

    /// Completes `lease` inside the caller's transaction: the completion commits or rolls back
    /// with the caller's business writes. Fails with [`StoreError::LeaseLost`] (and the caller must
    /// roll back) where the lease was taken over.
    pub async fn complete_in(
        conn: &mut PgConnection,
        lease: &Lease,
        result: &[u8],
    ) -> Result<(), StoreError> {
        lease.policy.check_result(result)?;
        finish(
            conn,
            lease,
            State::Completed,
            Some(result),
            None,
            lease.policy.retention,
        )
        .await
    }

    /// Commits a transaction that completed `lease` with [`complete_in`](Self::complete_in). A
    /// commit whose outcome is unknown (the connection dropped) is resolved by reading the record
    /// back on another connection: COMPLETED under our token means it committed.
    pub async fn commit(
        &self,
        tx: Transaction<'_, Postgres>,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let err = match tx.commit().await {
            Ok(()) => return Ok(()),
            Err(e) => classify(e, true),
        };
        if !err.is_outcome_unknown() {
            return Err(err);
        }
        warn!(key = %lease.key, error = %err, "commit outcome unknown; reading it back");
        match self.get(&lease.key).await {
            Ok(Some(r)) if r.token == lease.token && r.state == State::Completed => Ok(()),
            Ok(Some(r)) if r.token == lease.token && r.state == State::InProgress => {
                // Not committed (yet). Any later fenced call is refused if it lands after all.
                Err(match err {
                    StoreError::OutcomeUnknown { source } => StoreError::Unavailable { source },
                    other => other,
                })
            }
            Ok(_) => Err(StoreError::LeaseLost {
                key: lease.key.clone(),
                token: lease.token,
            }),
            Err(_) => Err(err),
        }
    }

    /// Transactional completion for `Dedup::process`: begins a transaction, runs `body` on it (the
    /// business writes), completes the lease in the same transaction and commits. If the lease
    /// was taken over, the completion is refused and the body's writes roll back with it.
    pub async fn transact<E, F>(
        &self,
        lease: &LeaseContext,
        body: F,
    ) -> Result<Completion, HandlerError<E>>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxBody<'c, E>,
    {
        let lease = lease.lease();
        let mut conn = self.conn().await?;
        let out = async {
            let mut tx = sqlx::Connection::begin(&mut **conn)
                .await
                .map_err(|e| classify(e, false))?;
            let result = body(&mut tx).await?;
            Self::complete_in(&mut tx, lease, &result).await?;
            self.commit(tx, lease).await?;
            Ok(Completion::committed(result))
        }
        .await;
        if let Err(HandlerError::Store(e)) = &out {
            conn.saw(e);
        }
        out
    }
}
