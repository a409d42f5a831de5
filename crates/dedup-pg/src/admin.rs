//! Operator changes to records: forgetting chosen keys, so that a message dead-lettered under
//! them (FAILED for `failed_retention`, 30 days by default) can be re-driven once its handler is
//! fixed (docs/RECOVERY.md, "Re-driving dead letters"). `forget_keys` never forgets a key under a
//! live lease or one a parked message names.

use std::collections::{HashMap, HashSet};

use dedup_core::{IdempotencyKey, StoreError};
use sqlx::Row;

use crate::PgStore;
use crate::classify::classify;

/// Forgets keys, in one statement, and says what became of each.
///
/// A row is deleted unless it is IN_PROGRESS under a live lease (a running holder keeps its key:
/// `busy`) or a parked message still carries its key (`dedup_parked.dedup_scope`, `dedup_key`:
/// the parked run must find what was stored before, as `dedup purge` keeps it: `parked`). The
/// delete re-checks the live lease on the row it deletes (READ COMMITTED re-evaluates its `WHERE`
/// on a row changed meanwhile), so a claim granted between the read and the delete is never
/// pulled from under its holder; such a key is answered `busy`.
///
/// $1 scopes, $2 keys, $3 apply (false: nothing is deleted, each key is answered as it would be).
/// One row per distinct key asked: scope, key, outcome (`forgotten`, `busy`, `parked`, `absent`).
const FORGET_SQL: &str = concat!(
    "WITH q AS (SELECT DISTINCT scope, key FROM unnest($1::text[], $2::bytea[]) AS q(scope, key)), ",
    "cur AS (",
    "  SELECT r.scope, r.key,",
    "    coalesce(r.state = 'in_progress' AND r.lease_until > statement_timestamp(), false) AS busy,",
    "    EXISTS (SELECT 1 FROM dedup_parked p",
    "      WHERE p.dedup_scope = r.scope AND p.dedup_key = r.key) AS parked",
    "  FROM dedup_records r JOIN q ON r.scope = q.scope AND r.key = q.key",
    "    AND r.kt = dedup_kt(q.key)), ",
    "del AS (",
    "  DELETE FROM dedup_records r USING q",
    "  WHERE $3::bool AND r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key)",
    "  AND (r.state <> 'in_progress' OR r.lease_until <= statement_timestamp())",
    "  AND NOT EXISTS (SELECT 1 FROM dedup_parked p",
    "    WHERE p.dedup_scope = r.scope AND p.dedup_key = r.key)",
    "  RETURNING r.scope, r.key) ",
    "SELECT q.scope, q.key, CASE",
    "  WHEN d.key IS NOT NULL THEN 'forgotten'",
    "  WHEN c.key IS NULL THEN 'absent'",
    "  WHEN c.busy THEN 'busy'",
    "  WHEN c.parked THEN 'parked'",
    // Not deleted although it looked free: a claim took it in between (or a dry run).
    "  WHEN $3::bool THEN 'busy'",
    "  ELSE 'forgotten' END AS outcome ",
    "FROM q LEFT JOIN del d ON d.scope = q.scope AND d.key = q.key",
    " LEFT JOIN cur c ON c.scope = q.scope AND c.key = q.key"
);

/// What [`PgStore::forget_keys`] did with each key asked (each distinct key once, in the order
/// asked).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ForgetReport {
    /// Records deleted: the next claim of the key runs its handler as for a new key.
    pub forgotten: Vec<IdempotencyKey>,
    /// IN_PROGRESS under a live lease: a holder is running it, so its record was kept. Ask again
    /// once it ended (its lease at most).
    pub busy: Vec<IdempotencyKey>,
    /// A parked message still carries the key: its record was kept for the parked run (which
    /// runs it with the fixed handler, or dead-letters it when the attempts are spent). Free the
    /// key with `dedup unpark` or `dedup drop` first.
    pub parked: Vec<IdempotencyKey>,
    /// No record: nothing to forget.
    pub absent: Vec<IdempotencyKey>,
}

impl PgStore {
    /// Forgets `keys`: deletes their records, so that the next claim of each runs its handler
    /// again (a dead-lettered message re-driven after a fix, a completed key an operator resets).
    /// Never a key under a live lease (`busy`) nor one a parked message carries (`parked`). One
    /// statement; apart from keys changed concurrently, asking again after it applied answers
    /// the forgotten keys `absent`.
    ///
    /// Forgetting acts on Postgres alone. Copies in the fast tiers of a tiered store (a FAILED or
    /// COMPLETED copy in Redis, and for up to `l1_ttl` in each consumer's L1) still answer until
    /// they are dropped or expire: see docs/RECOVERY.md.
    pub async fn forget_keys(&self, keys: &[IdempotencyKey]) -> Result<ForgetReport, StoreError> {
        self.forget(keys, true).await
    }

    /// What [`forget_keys`](Self::forget_keys) would do now, changing nothing (a dry run).
    pub async fn forget_keys_preview(
        &self,
        keys: &[IdempotencyKey],
    ) -> Result<ForgetReport, StoreError> {
        self.forget(keys, false).await
    }

    async fn forget(
        &self,
        keys: &[IdempotencyKey],
        apply: bool,
    ) -> Result<ForgetReport, StoreError> {
        let mut seen = HashSet::with_capacity(keys.len());
        let keys: Vec<&IdempotencyKey> = keys.iter().filter(|k| seen.insert(*k)).collect();
        let mut report = ForgetReport::default();
        if keys.is_empty() {
            return Ok(report);
        }
        let scopes: Vec<&str> = keys.iter().map(|k| k.scope().as_str()).collect();
        let bytes: Vec<&[u8]> = keys.iter().map(|k| k.key_bytes()).collect();
        self.count(1);
        let mut conn = self.conn().await?;
        let rows = sqlx::query(FORGET_SQL)
            .bind(&scopes)
            .bind(&bytes)
            .bind(apply)
            .fetch_all(&mut **conn)
            .await
            .map_err(|e| classify(e, apply));
        let rows = conn.checked(rows)?;
        let mut outcome: HashMap<(&str, &[u8]), String> = HashMap::with_capacity(rows.len());
        for row in &rows {
            let scope: &str = row.try_get("scope").map_err(|e| classify(e, false))?;
            let key: &[u8] = row.try_get("key").map_err(|e| classify(e, false))?;
            let what: String = row.try_get("outcome").map_err(|e| classify(e, false))?;
            outcome.insert((scope, key), what);
        }
        for k in keys {
            let list = match outcome
                .get(&(k.scope().as_str(), k.key_bytes()))
                .map(String::as_str)
            {
                Some("forgotten") => &mut report.forgotten,
                Some("busy") => &mut report.busy,
                Some("parked") => &mut report.parked,
                Some("absent") => &mut report.absent,
                other => {
                    return Err(StoreError::Corrupt {
                        key: k.clone(),
                        detail: format!("forgetting the key answered {other:?}"),
                    });
                }
            };
            list.push(k.clone());
        }
        Ok(report)
    }
}
