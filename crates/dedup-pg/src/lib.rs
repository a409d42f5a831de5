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
//!   answers `InFlight` after the caller's `lock_timeout`), and a crash rolls it back.
//!
//! Queries are plain `sqlx::query` strings (not the compile-time checked macros) so that building
//! dedup needs no database and no `.sqlx/` data that can drift; every statement is exercised by the
//! conformance and Postgres tests against a real server.
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
use std::time::Duration;

use bytes::Bytes;
use dedup_core::machine::{self, ClaimStep};
use dedup_core::{
    AfterFailure, ClaimOutcome, ClaimRequest, Completion, FencingToken, Fingerprint, HandlerError,
    IdempotencyKey, Lease, LeaseContext, OwnerId, Record, State, Store, StoreError, Timestamp,
    micros,
};
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::{Postgres, Row, Transaction};
use tracing::{debug, warn};

mod batch_tx;
mod classify;
mod sql;

pub use batch_tx::{BatchAnswer, BatchBody, ItemResult, TxBatchConfig};

use classify::must_discard;
pub use classify::{classify, is_passing, sqlstate};
use sql::*;

/// The embedded migrations (the workspace's top-level `migrations/`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Applies the migrations that have not run yet.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// How many times a claim that lost a race to a concurrent writer is re-run before giving up
/// with [`StoreError::Unavailable`]. Each re-run sees the winner's committed row.
const CLAIM_RACE_TRIES: u32 = 16;

/// The Postgres store. Cheap to clone (it holds a pool).
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    statements: Arc<AtomicU64>,
}

/// The body of a transaction run by [`PgStore::transact`]: business writes on the transaction's
/// connection, returning the result to store.
pub type TxBody<'c, E> = Pin<Box<dyn Future<Output = Result<Bytes, HandlerError<E>>> + Send + 'c>>;

impl PgStore {
    /// A store on `pool`. Run [`migrate`] once before use.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            statements: Arc::default(),
        }
    }

    /// How many statements (round trips) this store and its clones sent to Postgres through the
    /// [`Store`] calls, batches and their fallbacks included (not the caller's own transactions).
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    fn count(&self, n: u64) {
        self.statements.fetch_add(n, Ordering::Relaxed);
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.pool
            .acquire()
            .await
            .map(Conn)
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

/// A claim that kept losing races to concurrent writers.
#[derive(Debug)]
struct Contention(String);

impl std::fmt::Display for Contention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "claim of {} kept losing races to concurrent writers",
            self.0
        )
    }
}

impl std::error::Error for Contention {}

/// [`PgStore::claim_in`], also answering how many statements it sent.
async fn claim_counted(
    conn: &mut PgConnection,
    req: &ClaimRequest,
) -> (Result<ClaimOutcome, StoreError>, u64) {
    if let Err(e) = req.policy.validate() {
        return (Err(e.into()), 0);
    }
    let mut statements = 0;
    loop {
        statements += 1;
        match claim_once(conn, req).await {
            Ok(Some(outcome)) => return (Ok(outcome), statements),
            Err(e) => return (Err(e), statements),
            Ok(None) if statements >= u64::from(CLAIM_RACE_TRIES) => {
                let e = StoreError::unavailable(Contention(req.key.to_string()));
                return (Err(e), statements);
            }
            Ok(None) => debug!(key = %req.key, statements, "claim lost a race; re-reading"),
        }
    }
}

/// Each settled request's index, its answer, and the record as the statement left it (with the
/// statement's clock), from which a repeat of the key is answered.
type ClaimedMany = Vec<(
    usize,
    Result<ClaimOutcome, StoreError>,
    Option<(Record, Timestamp)>,
)>;

/// Runs [`CLAIM_BATCH_SQL`] for `reqs[i]`, `i` in `batch` (distinct keys); answers what it settled.
/// Keys it leaves out (lost races, keys out of attempts) go through the single-key claim.
async fn claim_many(
    conn: &mut PgConnection,
    reqs: &[ClaimRequest],
    batch: &[usize],
) -> Result<ClaimedMany, StoreError> {
    let n = batch.len();
    let (mut scopes, mut keys, mut owners, mut fps) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut leases, mut rets, mut maxes) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut index: HashMap<(&str, &[u8]), usize> = HashMap::with_capacity(n);
    for &i in batch {
        let req = &reqs[i];
        scopes.push(req.key.scope().as_str());
        keys.push(req.key.key_bytes());
        owners.push(req.owner.as_str());
        fps.push(req.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()));
        leases.push(micros(req.policy.lease));
        rets.push(micros(req.policy.retention));
        maxes.push(attempts_i32(req.policy.max_attempts));
        index.insert((req.key.scope().as_str(), req.key.key_bytes()), i);
    }
    let rows = sqlx::query(CLAIM_BATCH_SQL)
        .bind(&scopes)
        .bind(&keys)
        .bind(&owners)
        .bind(&fps)
        .bind(&leases)
        .bind(&rets)
        .bind(&maxes)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let mut answers = Vec::with_capacity(n);
    // The latest clock reading after the writes: when the claims took effect.
    let mut done = Timestamp::from_micros(i64::MIN);
    for row in &rows {
        let at: i64 = row.try_get("done_us").map_err(|e| classify(e, false))?;
        done = done.max(Timestamp::from_micros(at));
    }
    for row in &rows {
        let scope: &str = row.try_get("scope").map_err(|e| classify(e, false))?;
        let key: &[u8] = row.try_get("key").map_err(|e| classify(e, false))?;
        let Some(&i) = index.get(&(scope, key)) else {
            continue;
        };
        let req = &reqs[i];
        let src: &str = row.try_get("src").map_err(|e| classify(e, false))?;
        let now = Timestamp::from_micros(row.try_get("now_us").map_err(|e| classify(e, false))?);
        let record = match record_from_row(&req.key, row) {
            Ok(record) => record,
            Err(e) => {
                answers.push((i, Err(e), None));
                continue;
            }
        };
        let answer = match (src, record.state) {
            ("ins" | "upd", State::InProgress) => {
                ClaimOutcome::Acquired(Lease::granted(&record, req))
            }
            ("cur", _) => match machine::claim(Some(&record), req, now, || record.token) {
                ClaimStep::Answer(outcome) => outcome,
                // Out of attempts, or claimable when read but changed by a concurrent writer:
                // the single-key claim settles it.
                _ => continue,
            },
            _ => continue,
        };
        answers.push((i, Ok(answer), Some((record, now))));
    }
    // Leases granted from before a wait (the statement waited on a lock): re-grant them from now
    // in one statement. A key taken over in between is left out and claimed again on its own.
    let stale: Vec<usize> = answers
        .iter()
        .enumerate()
        .filter(|(_, (i, answer, seen))| {
            matches!(answer, Ok(ClaimOutcome::Acquired(_)))
                && seen
                    .as_ref()
                    .is_some_and(|(_, now)| waited(*now, done, reqs[*i].policy.lease))
        })
        .map(|(a, _)| a)
        .collect();
    if !stale.is_empty() {
        let leases: Vec<&Lease> = stale
            .iter()
            .filter_map(|&a| match &answers[a].1 {
                Ok(ClaimOutcome::Acquired(lease)) => Some(lease),
                _ => None,
            })
            .collect();
        let ends = regrant(conn, &leases).await?;
        let mut lost = Vec::new();
        for (&a, end) in stale.iter().zip(ends) {
            match (end, &mut answers[a]) {
                (Some(until), (_, Ok(ClaimOutcome::Acquired(lease)), seen)) => {
                    lease.lease_until = until;
                    if let Some((record, _)) = seen {
                        record.lease_until = Some(until);
                    }
                }
                _ => lost.push(a),
            }
        }
        for a in lost.into_iter().rev() {
            let _lost = answers.remove(a);
        }
    }
    Ok(answers)
}

/// Whether a claim statement that started at `now` and finished its writes at `done` waited
/// long enough (a tenth of the lease) that its leases must be re-granted from now.
fn waited(now: Timestamp, done: Timestamp, lease: Duration) -> bool {
    done.as_micros().saturating_sub(now.as_micros()) > micros(lease) / 10
}

/// Re-grants `leases` from now ([`REGRANT_SQL`]): each one's new end, or `None` where its token no
/// longer holds the key (taken over in between).
async fn regrant(
    conn: &mut PgConnection,
    leases: &[&Lease],
) -> Result<Vec<Option<Timestamp>>, StoreError> {
    let scopes: Vec<&str> = leases.iter().map(|l| l.key.scope().as_str()).collect();
    let keys: Vec<&[u8]> = leases.iter().map(|l| l.key.key_bytes()).collect();
    let tokens: Vec<i64> = leases.iter().map(|l| token_i64(l.token)).collect();
    let lease_us: Vec<i64> = leases.iter().map(|l| micros(l.policy.lease)).collect();
    let ret_us: Vec<i64> = leases.iter().map(|l| micros(l.policy.retention)).collect();
    let rows = sqlx::query(REGRANT_SQL)
        .bind(&scopes)
        .bind(&keys)
        .bind(&tokens)
        .bind(&lease_us)
        .bind(&ret_us)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    let mut ends: HashMap<(String, Vec<u8>), Timestamp> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let scope: String = row.try_get("scope").map_err(|e| classify(e, false))?;
        let key: Vec<u8> = row.try_get("key").map_err(|e| classify(e, false))?;
        let until: i64 = row
            .try_get("lease_until_us")
            .map_err(|e| classify(e, false))?;
        ends.insert((scope, key), Timestamp::from_micros(until));
    }
    debug!(
        n = leases.len(),
        held = ends.len(),
        "re-granted leases after a waiting claim"
    );
    Ok(leases
        .iter()
        .map(|l| {
            ends.get(&(
                l.key.scope().as_str().to_owned(),
                l.key.key_bytes().to_vec(),
            ))
            .copied()
        })
        .collect())
}

/// Runs [`COMPLETE_BATCH_SQL`] on `conn`, then completes each repeat of a key on its own. One
/// answer per item; the error that failed the whole statement, if one did (each item then holds
/// a copy of it); and how many statements were sent.
async fn complete_many(
    conn: &mut PgConnection,
    items: &[(Lease, Bytes)],
) -> (Vec<Result<(), StoreError>>, Option<StoreError>, u64) {
    let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
    let mut deferred = Vec::new();
    let (mut scopes, mut keys, mut tokens, mut results, mut rets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut index: HashMap<(&str, &[u8]), usize> = HashMap::with_capacity(items.len());
    for (i, (lease, result)) in items.iter().enumerate() {
        if let Err(e) = lease.policy.check_result(result) {
            out.push(Some(Err(e.into())));
            continue;
        }
        if index.contains_key(&(lease.key.scope().as_str(), lease.key.key_bytes())) {
            // A repeat of a key: completed after the batch, as if one after the other.
            deferred.push(i);
            out.push(None);
            continue;
        }
        index.insert((lease.key.scope().as_str(), lease.key.key_bytes()), i);
        scopes.push(lease.key.scope().as_str());
        keys.push(lease.key.key_bytes());
        tokens.push(token_i64(lease.token));
        results.push(result.as_ref());
        rets.push(micros(lease.policy.retention));
        out.push(None);
    }
    let mut failed = None;
    let mut statements = 0;
    if !scopes.is_empty() {
        statements += 1;
        let done = sqlx::query(COMPLETE_BATCH_SQL)
            .bind(&scopes)
            .bind(&keys)
            .bind(&tokens)
            .bind(&results)
            .bind(&rets)
            .fetch_all(&mut *conn)
            .await;
        match done {
            Ok(rows) => {
                for row in &rows {
                    let scope: Result<&str, _> = row.try_get("scope");
                    let key: Result<&[u8], _> = row.try_get("key");
                    if let (Ok(scope), Ok(key)) = (scope, key)
                        && let Some(&i) = index.get(&(scope, key))
                    {
                        out[i] = Some(Ok(()));
                    }
                }
            }
            Err(e) => {
                let e = classify(e, true);
                for &i in index.values() {
                    out[i] = Some(Err(echo(&e)));
                }
                for &i in &deferred {
                    out[i] = Some(Err(echo(&e)));
                }
                failed = Some(e);
            }
        }
    }
    if failed.is_none() {
        for i in deferred {
            let (lease, result) = &items[i];
            statements += 1;
            out[i] = Some(PgStore::complete_in(conn, lease, result).await);
        }
    }
    let out = out
        .into_iter()
        .zip(items)
        .map(|(answer, (lease, _))| {
            answer.unwrap_or_else(|| {
                Err(StoreError::LeaseLost {
                    key: lease.key.clone(),
                    token: lease.token,
                })
            })
        })
        .collect();
    (out, failed, statements)
}

/// A batch statement failed as a whole: each of its items is told so.
#[derive(Debug)]
struct BatchFailed(String);

impl std::fmt::Display for BatchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BatchFailed {}

/// A copy of `e` of the same kind (retryable, unknown outcome or not), for each item of a batch
/// that `e` failed.
fn echo(e: &StoreError) -> StoreError {
    let msg = BatchFailed(format!("batch failed: {e}"));
    if e.is_outcome_unknown() {
        StoreError::outcome_unknown(msg)
    } else if e.is_retryable() {
        StoreError::unavailable(msg)
    } else {
        StoreError::backend(msg)
    }
}

fn unanswered(key: &IdempotencyKey) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: "the batch left this request unanswered".into(),
    }
}

/// One run of the claim statement; `None` when it lost a race and must run again.
async fn claim_once(
    conn: &mut PgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, StoreError> {
    let p = req.policy;
    let row = sqlx::query(CLAIM_SQL)
        .bind(req.key.scope().as_str())
        .bind(req.key.key_bytes())
        .bind(req.owner.as_str())
        .bind(req.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
        .bind(micros(p.lease))
        .bind(micros(p.retention))
        .bind(attempts_i32(p.max_attempts))
        .fetch_optional(&mut *conn)
        .await;
    let row = match row {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(None),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
            // lock_timeout while an uncommitted claim (transaction mode) holds the key.
            return Ok(Some(ClaimOutcome::InFlight {
                owner: None,
                lease_until: None,
            }));
        }
        Err(e) => return Err(classify(e, true)),
    };
    let src: String = row.try_get("src").map_err(|e| classify(e, false))?;
    let now = Timestamp::from_micros(row.try_get("now_us").map_err(|e| classify(e, false))?);
    let done = Timestamp::from_micros(row.try_get("done_us").map_err(|e| classify(e, false))?);
    let record = record_from_row(&req.key, &row)?;
    Ok(match (src.as_str(), record.state) {
        ("ins" | "upd", State::InProgress) => {
            let mut lease = Lease::granted(&record, req);
            if waited(now, done, p.lease) {
                // Granted from before a wait: the lease must run from now. Re-granted under its
                // token; if someone took the key over in between, this claim is simply re-run.
                match regrant(conn, &[&lease]).await?.pop().flatten() {
                    Some(until) => lease.lease_until = until,
                    None => return Ok(None),
                }
            }
            Some(ClaimOutcome::Acquired(lease))
        }
        ("cur", _) => match machine::claim(Some(&record), req, now, || record.token) {
            ClaimStep::Answer(outcome) => Some(outcome),
            ClaimStep::Exhaust { record: failed } => exhaust(conn, &record, &failed, req).await?,
            // It was claimable when read, but a concurrent writer changed it first.
            _ => None,
        },
        _ => {
            return Err(StoreError::Corrupt {
                key: req.key.clone(),
                detail: format!("claim wrote a row in state {}", record.state),
            });
        }
    })
}

/// Marks a key that ran out of attempts FAILED, fenced on the record that was read.
async fn exhaust(
    conn: &mut PgConnection,
    read: &Record,
    failed: &Record,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, StoreError> {
    let done = sqlx::query(EXHAUST_SQL)
        .bind(req.key.scope().as_str())
        .bind(req.key.key_bytes())
        .bind(token_i64(read.token))
        .bind(read.state.as_str())
        .bind(failed.failure.as_deref())
        .bind(micros(req.policy.failed_retention))
        .bind(attempts_i32(req.policy.max_attempts))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    Ok((done.rows_affected() == 1).then(|| machine::failed_outcome(failed)))
}

async fn finish(
    conn: &mut PgConnection,
    lease: &Lease,
    state: State,
    result: Option<&[u8]>,
    failure: Option<&str>,
    retention: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(FINISH_SQL)
        .bind(lease.key.scope().as_str())
        .bind(lease.key.key_bytes())
        .bind(token_i64(lease.token))
        .bind(state.as_str())
        .bind(result)
        .bind(failure)
        .bind(micros(retention))
        .execute(&mut *conn)
        .await
        .map_err(|e| classify(e, true))?;
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(StoreError::LeaseLost {
            key: lease.key.clone(),
            token: lease.token,
        })
    }
}

impl Store for PgStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.conn().await?;
        let (outcome, statements) = claim_counted(&mut conn, req).await;
        self.count(statements);
        conn.checked(outcome)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        self.count(1);
        let done = Self::complete_in(&mut conn, lease, result).await;
        conn.checked(done)
    }

    /// One statement for the batch's distinct keys; a key that lost a race to a concurrent writer
    /// (rare) and each repeat of a key are then claimed one by one, in order.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Vec<Result<ClaimOutcome, StoreError>> {
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(e) => return reqs.iter().map(|_| Err(echo(&e))).collect(),
        };
        let mut out: Vec<Option<Result<ClaimOutcome, StoreError>>> = Vec::with_capacity(reqs.len());
        let mut first: HashMap<&IdempotencyKey, usize> = HashMap::with_capacity(reqs.len());
        let mut batch = Vec::with_capacity(reqs.len());
        let mut after: HashMap<&IdempotencyKey, (Record, Timestamp)> = HashMap::new();
        for (i, req) in reqs.iter().enumerate() {
            match req.policy.validate() {
                Err(e) => out.push(Some(Err(e.into()))),
                Ok(()) => {
                    if first.insert(&req.key, i).is_none() {
                        batch.push(i);
                    }
                    out.push(None);
                }
            }
        }
        if batch.len() > 1 {
            self.count(1);
            match claim_many(&mut conn, reqs, &batch).await {
                Ok(answers) => {
                    for (i, answer, seen) in answers {
                        out[i] = Some(answer);
                        if let Some(seen) = seen {
                            after.insert(&reqs[i].key, seen);
                        }
                    }
                }
                // Not applied (deadlock, overload...): every key is claimed one by one below.
                Err(e) if !e.is_outcome_unknown() => {
                    conn.saw(&e);
                    if must_discard(&e) {
                        // This connection cannot claim: the fallback takes a fresh one.
                        match self.conn().await {
                            Ok(fresh) => conn = fresh,
                            Err(e) => return reqs.iter().map(|_| Err(echo(&e))).collect(),
                        }
                    }
                    debug!(error = %e, "batch claim failed; claiming one by one");
                }
                // It may have applied: claim one by one too, each claim re-reading the row. A
                // lease the lost answer granted is held by our owner id and expires unused.
                Err(e) => warn!(error = %e, "batch claim outcome unknown; claiming one by one"),
            }
        }
        for (i, req) in reqs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            // A repeat of a key is answered from the record its first claim left, when that
            // answer needs no write (it is InFlight after a grant, or a replay).
            if let Some((record, now)) = after.get(&req.key)
                && let ClaimStep::Answer(answer) =
                    machine::claim(Some(record), req, *now, || record.token)
            {
                out[i] = Some(Ok(answer));
            } else {
                let (answer, statements) = claim_counted(&mut conn, req).await;
                self.count(statements);
                if let Ok(ClaimOutcome::Acquired(_) | ClaimOutcome::Failed { .. }) = &answer {
                    // The record changed: a later repeat must not be answered from before.
                    after.remove(&req.key);
                }
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .zip(reqs)
            .map(|(answer, req)| conn.checked(answer.unwrap_or_else(|| Err(unanswered(&req.key)))))
            .collect()
    }

    /// One statement; an outcome that is unknown (a dropped connection) is read back.
    async fn complete_batch(&self, items: &[(Lease, Bytes)]) -> Vec<Result<(), StoreError>> {
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(e) => return items.iter().map(|_| Err(echo(&e))).collect(),
        };
        let (mut out, failed, statements) = complete_many(&mut conn, items).await;
        self.count(statements);
        let Some(err) = failed else {
            return out;
        };
        conn.saw(&err);
        drop(conn);
        if !err.is_outcome_unknown() {
            return out;
        }
        warn!(error = %err, n = items.len(), "batch completion outcome unknown; reading it back");
        self.count(1);
        let records = match self.get_many(items.iter().map(|(l, _)| &l.key)).await {
            Ok(records) => records,
            Err(_) => return out,
        };
        for ((lease, _), answer) in items.iter().zip(out.iter_mut()) {
            if answer.as_ref().is_err_and(StoreError::is_outcome_unknown) {
                *answer = match records.get(&lease.key) {
                    Some(r) if r.token == lease.token && r.state == State::Completed => Ok(()),
                    Some(r) if r.token == lease.token && r.state == State::InProgress => {
                        Err(StoreError::unavailable(BatchFailed(
                            "the batch completion did not apply; retry".into(),
                        )))
                    }
                    _ => Err(StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    }),
                };
            }
        }
        out
    }

    async fn fail_retryable(&self, lease: &Lease, error: &str) -> Result<AfterFailure, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        // The token pins the attempt count: it changes only with a takeover, which changes the
        // token too. So the lease's count is the record's.
        let p = lease.policy;
        let (state, failure, retention, after) = if lease.attempts >= p.max_attempts {
            let reason = machine::exhausted_reason(lease.attempts, p.max_attempts, Some(error));
            let after = AfterFailure::Failed {
                attempts: lease.attempts,
            };
            (State::Failed, reason, p.failed_retention, after)
        } else {
            let after = AfterFailure::Released {
                attempts: lease.attempts,
            };
            (State::Released, error.to_owned(), p.retention, after)
        };
        let done = finish(&mut conn, lease, state, None, Some(&failure), retention).await;
        conn.checked(done).map(|()| after)
    }

    async fn fail_permanent(&self, lease: &Lease, reason: &str) -> Result<(), StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let retention = lease.policy.failed_retention;
        let done = finish(
            &mut conn,
            lease,
            State::Failed,
            None,
            Some(reason),
            retention,
        )
        .await;
        conn.checked(done)
    }

    async fn withdraw(&self, lease: &Lease) -> Result<(), StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let done = sqlx::query_scalar::<_, i64>(WITHDRAW_SQL)
            .bind(lease.key.scope().as_str())
            .bind(lease.key.key_bytes())
            .bind(token_i64(lease.token))
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| classify(e, true))
            .and_then(|changed| {
                if changed == 1 {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    })
                }
            });
        conn.checked(done)
    }

    async fn extend(&self, lease: &Lease) -> Result<Timestamp, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let until = sqlx::query_scalar::<_, i64>(EXTEND_SQL)
            .bind(lease.key.scope().as_str())
            .bind(lease.key.key_bytes())
            .bind(token_i64(lease.token))
            .bind(micros(lease.policy.lease))
            .bind(micros(lease.policy.retention))
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, true))
            .and_then(|until| {
                until
                    .map(Timestamp::from_micros)
                    .ok_or_else(|| StoreError::LeaseLost {
                        key: lease.key.clone(),
                        token: lease.token,
                    })
            });
        conn.checked(until)
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let row = sqlx::query(GET_SQL)
            .bind(key.scope().as_str())
            .bind(key.key_bytes())
            .fetch_optional(&mut **conn)
            .await
            .map_err(|e| classify(e, false));
        conn.checked(row)?
            .map(|row| record_from_row(key, &row))
            .transpose()
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        self.count(1);
        let mut conn = self.conn().await?;
        let done = sqlx::query(PURGE_SQL)
            .bind(i64::from(limit))
            .execute(&mut **conn)
            .await
            .map_err(|e| classify(e, true));
        conn.checked(done).map(|d| d.rows_affected())
    }
}

/// A pooled connection that is closed, instead of returned to the pool, once an error says it
/// must not be reused: 25006 (it reaches a server that cannot write, such as a primary demoted in
/// a failover), or a session the server ended. See [`classify`](mod@classify).
struct Conn(sqlx::pool::PoolConnection<Postgres>);

impl Conn {
    /// Marks the connection for closing if `e` says it must not be reused.
    fn saw(&mut self, e: &StoreError) {
        if must_discard(e) {
            warn!(error = %e, "closing a Postgres connection that must not be reused");
            self.0.close_on_drop();
        }
    }

    /// `r`, after [`saw`](Self::saw) its error.
    fn checked<T>(&mut self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &r {
            self.saw(e);
        }
        r
    }
}

impl std::ops::Deref for Conn {
    type Target = sqlx::pool::PoolConnection<Postgres>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

fn token_i64(token: FencingToken) -> i64 {
    // Tokens come from a bigint sequence with MINVALUE 1, so they always fit.
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

fn attempts_i32(n: u32) -> i32 {
    // Policy::validate keeps max_attempts within 31 bits.
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Reads a row as a record of `key`; anything that is not a dedup record is [`StoreError::Corrupt`].
fn record_from_row(key: &IdempotencyKey, row: &PgRow) -> Result<Record, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        key: key.clone(),
        detail,
    };
    let get_err = |e: sqlx::Error| corrupt(e.to_string());
    let scope: String = row.try_get("scope").map_err(get_err)?;
    let key_bytes: Vec<u8> = row.try_get("key").map_err(get_err)?;
    if scope != key.scope().as_str() || key_bytes != key.key_bytes() {
        return Err(corrupt("the row belongs to another key".into()));
    }
    let state: String = row.try_get("state").map_err(get_err)?;
    let state = State::parse(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?;
    let token: i64 = row.try_get("token").map_err(get_err)?;
    let token = u64::try_from(token).map_err(|_| corrupt(format!("negative token {token}")))?;
    let attempts: i32 = row.try_get("attempts").map_err(get_err)?;
    let attempts =
        u32::try_from(attempts).map_err(|_| corrupt(format!("negative attempts {attempts}")))?;
    let ts = |col: &str| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(col)
            .map(Timestamp::from_micros)
            .map_err(get_err)
    };
    let mut record = Record::new(
        key.clone(),
        state,
        FencingToken::new(token),
        attempts,
        ts("created_us")?,
        ts("expires_us")?,
    );
    record.updated_at = ts("updated_us")?;
    record.owner = row
        .try_get::<Option<String>, _>("owner")
        .map_err(get_err)?
        .map(OwnerId::new);
    record.lease_until = row
        .try_get::<Option<i64>, _>("lease_until_us")
        .map_err(get_err)?
        .map(Timestamp::from_micros);
    record.fingerprint = match row
        .try_get::<Option<Vec<u8>>, _>("fingerprint")
        .map_err(get_err)?
    {
        None => None,
        Some(b) => Some(
            Fingerprint::from_slice(&b)
                .ok_or_else(|| corrupt("fingerprint is not 32 bytes".into()))?,
        ),
    };
    record.result = row
        .try_get::<Option<Vec<u8>>, _>("result")
        .map_err(get_err)?
        .map(Bytes::from);
    record.failure = row.try_get("failure").map_err(get_err)?;
    Ok(record)
}
