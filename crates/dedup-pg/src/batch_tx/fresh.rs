//! Fresh keys in a batch transaction: keys with no row at all. The transaction holds their
//! advisory locks, so no other batch can write them; their leases are granted without a claim
//! statement (a token from the sequence), and their rows are written once, at the end: COMPLETED
//! for a success (one row version per key instead of a claim and a completion), or as the claim
//! would have left them for a failure, which is then recorded like any other.
//!
//! `FRESH_SQL` reads which locked keys have no row, with a token from the sequence for each;
//! `INSERT_COMPLETED_SQL` writes the successes COMPLETED in one statement (one row version per
//! key, no claim row to update); `INSERT_CLAIMED_SQL` writes a failed fresh key as its claim would
//! have.
//!
//! A writer that takes no advisory lock (a lease-mode claim) may write one of these keys in the
//! meantime: the final insert then leaves that key out, and the batch must not commit
//! ([`Taken`]): rolled back whole and run again, it finds the row and claims it as usual.

use bytes::Bytes;
use dedup_core::{ClaimRequest, FencingToken, Lease, Record, State, StoreError, Timestamp, micros};
use sqlx::Row;
use sqlx::postgres::PgConnection;

use crate::classify::classify;
use crate::rows::token_i64;
use crate::sql::{FRESH_SQL, INSERT_CLAIMED_SQL, INSERT_COMPLETED_SQL};

/// A fresh key was written by another writer while the batch ran.
#[derive(Debug, thiserror::Error)]
#[error(
    "a key of the batch was claimed by another writer while the batch ran; the batch is run again"
)]
pub(crate) struct Taken;

/// For `reqs[i]`, `i` in `locked`: the lease of each fresh key (`None`: the key has a row, and
/// goes through the claim statement).
pub(crate) async fn read_fresh(
    conn: &mut PgConnection,
    reqs: &[ClaimRequest],
    locked: &[usize],
) -> Result<Vec<Option<Lease>>, StoreError> {
    let scopes: Vec<&str> = locked
        .iter()
        .map(|&i| reqs[i].key.scope().as_str())
        .collect();
    let keys: Vec<&[u8]> = locked.iter().map(|&i| reqs[i].key.key_bytes()).collect();
    let rows = sqlx::query(FRESH_SQL)
        .bind(&scopes)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| classify(e, false))?;
    let mut out = Vec::with_capacity(locked.len());
    for (&i, row) in locked.iter().zip(&rows) {
        let req = &reqs[i];
        let fresh: bool = row.try_get("fresh").map_err(|e| classify(e, false))?;
        let token: Option<i64> = row.try_get("token").map_err(|e| classify(e, false))?;
        let now_us: i64 = row.try_get("now_us").map_err(|e| classify(e, false))?;
        out.push(match (fresh, token) {
            (true, Some(token)) => Some(fresh_lease(req, token, now_us)),
            _ => None,
        });
    }
    Ok(out)
}

/// The lease of a fresh key: its first attempt, under `token` from the sequence, from the
/// server's clock `now_us`.
pub(crate) fn fresh_lease(req: &ClaimRequest, token: i64, now_us: i64) -> Lease {
    let now = Timestamp::from_micros(now_us);
    let mut record = Record::new(
        req.key.clone(),
        State::InProgress,
        FencingToken::new(u64::try_from(token).unwrap_or(0)),
        1,
        now,
        now,
    );
    record.lease_until = Some(Timestamp::from_micros(
        now_us.saturating_add(micros(req.policy.lease)),
    ));
    record.fingerprint = req.fingerprint;
    Lease::granted(&record, req)
}

/// The columns both inserts of fresh keys bind: each lease's identity, token, fingerprint and
/// retention.
struct Columns<'a> {
    scopes: Vec<&'a str>,
    keys: Vec<&'a [u8]>,
    owners: Vec<&'a str>,
    tokens: Vec<i64>,
    fps: Vec<Option<&'a [u8]>>,
    rets: Vec<i64>,
}

impl<'a> Columns<'a> {
    fn of(leases: impl ExactSizeIterator<Item = &'a Lease>) -> Self {
        let n = leases.len();
        let mut c = Self {
            scopes: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            owners: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            fps: Vec::with_capacity(n),
            rets: Vec::with_capacity(n),
        };
        for lease in leases {
            c.scopes.push(lease.key.scope().as_str());
            c.keys.push(lease.key.key_bytes());
            c.owners.push(lease.owner.as_str());
            c.tokens.push(token_i64(lease.token));
            c.fps
                .push(lease.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()));
            c.rets.push(micros(lease.policy.retention));
        }
        c
    }

    /// Runs `sql` with these columns and `middle` (the statement's own column, bound as $6)
    /// between the fingerprints and the retentions; every row must be written.
    async fn insert<T>(
        &self,
        conn: &mut PgConnection,
        sql: &'static str,
        middle: &T,
    ) -> Result<(), StoreError>
    where
        T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Sync,
    {
        let written = sqlx::query(sql)
            .bind(&self.scopes)
            .bind(&self.keys)
            .bind(&self.owners)
            .bind(&self.tokens)
            .bind(&self.fps)
            .bind(middle)
            .bind(&self.rets)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| classify(e, true))?;
        if written.len() == self.keys.len() {
            Ok(())
        } else {
            Err(StoreError::unavailable(Taken))
        }
    }
}

/// Writes fresh keys COMPLETED with their results, in one statement.
pub(crate) async fn insert_completed(
    conn: &mut PgConnection,
    items: &[(Lease, Bytes)],
) -> Result<(), StoreError> {
    let results: Vec<&[u8]> = items.iter().map(|(_, r)| r.as_ref()).collect();
    Columns::of(items.iter().map(|(l, _)| l))
        .insert(conn, INSERT_COMPLETED_SQL, &results)
        .await
}

/// Writes fresh keys as their claims would have left them (IN_PROGRESS, first attempt), in one
/// statement, so that their failures are recorded like any other.
pub(crate) async fn insert_claimed(
    conn: &mut PgConnection,
    leases: &[&Lease],
) -> Result<(), StoreError> {
    let lease_us: Vec<i64> = leases.iter().map(|l| micros(l.policy.lease)).collect();
    Columns::of(leases.iter().copied())
        .insert(conn, INSERT_CLAIMED_SQL, &lease_us)
        .await
}
