//! The store's statements, each a `const`: plain `sqlx::query` strings (not the compile-time
//! checked macros), each exercised by the tests against a real server. `admin.rs` and
//! `migrate/` keep theirs beside the code that runs them (and the Kafka crate its own tables'
//! statements: parking, kept dead letters, offsets). `WITHDRAW_SQL` gives a lease back.
//!
//! Leases are granted from `statement_timestamp()`. A claim that waited on a lock (an
//! uncommitted claim of the same key, a row lock) has values computed before the wait, so every
//! claim also answers `clock_timestamp()` as `done_us`, read after its writes: a claim that took
//! longer than a tenth of its lease re-grants its leases from then ([`REGRANT_SQL`]).

/// The record's columns, with times as microseconds since the epoch.
macro_rules! record_cols {
    ($t:literal) => {
        concat!(
            $t,
            ".scope, ",
            $t,
            ".key, ",
            $t,
            ".state, ",
            $t,
            ".owner, ",
            $t,
            ".token, ",
            "(extract(epoch FROM ",
            $t,
            ".lease_until) * 1000000)::int8 AS lease_until_us, ",
            $t,
            ".attempts, ",
            $t,
            ".fingerprint, ",
            $t,
            ".result, ",
            $t,
            ".failure, ",
            "(extract(epoch FROM ",
            $t,
            ".created_at) * 1000000)::int8 AS created_us, ",
            "(extract(epoch FROM ",
            $t,
            ".updated_at) * 1000000)::int8 AS updated_us, ",
            // A pinned record's 'infinity' as the year 9999: int8 microseconds cannot hold it.
            "(extract(epoch FROM least(",
            $t,
            ".expires_at, timestamptz '9999-12-31 00:00:00+00')) * 1000000)::int8 AS expires_us"
        )
    };
}

/// One round trip: read the row; insert it if absent, or take it over if its lease expired, it
/// was released, or it is past its retention (a fresh claim); otherwise answer from what was read.
/// A duplicate costs a plain read: no row lock, no WAL. `src` says which branch produced the row.
///
/// $1 scope, $2 key, $3 owner, $4 fingerprint, $5 lease (µs), $6 retention (µs), $7 max attempts.
pub(crate) const CLAIM_SQL: &str = concat!(
    "WITH clock AS (SELECT statement_timestamp() AS t), ",
    "cur AS (SELECT r.* FROM dedup_records r WHERE r.scope = $1 AND r.key = $2 AND r.kt = dedup_kt($2)), ",
    "ins AS (",
    "  INSERT INTO dedup_records AS r (scope, key, kt, state, owner, token, lease_until, attempts,",
    "    fingerprint, created_at, updated_at, expires_at)",
    "  SELECT $1, $2, dedup_kt($2), 'in_progress', $3, nextval('dedup_token_seq'),",
    "    c.t + $5::float8 * interval '1 microsecond', 1, $4, c.t, c.t,",
    "    c.t + ($5 + $6)::float8 * interval '1 microsecond'",
    "  FROM clock c WHERE NOT EXISTS (SELECT 1 FROM cur)",
    "  ON CONFLICT DO NOTHING RETURNING r.*), ",
    "upd AS (",
    "  UPDATE dedup_records AS r SET state = 'in_progress', owner = $3,",
    "    token = nextval('dedup_token_seq'),",
    "    lease_until = c.t + $5::float8 * interval '1 microsecond',",
    "    attempts = CASE WHEN r.expires_at <= c.t THEN 1 ELSE r.attempts + 1 END,",
    "    fingerprint = CASE WHEN r.expires_at <= c.t THEN $4 ELSE coalesce(r.fingerprint, $4) END,",
    "    result = NULL,",
    "    failure = CASE WHEN r.expires_at <= c.t THEN NULL ELSE r.failure END,",
    "    created_at = CASE WHEN r.expires_at <= c.t THEN c.t ELSE r.created_at END,",
    "    updated_at = c.t,",
    // A pinned record (named by a parked message) stays pinned.
    "    expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at",
    "      ELSE c.t + ($5 + $6)::float8 * interval '1 microsecond' END",
    "  FROM clock c",
    "  WHERE r.scope = $1 AND r.key = $2 AND r.kt = dedup_kt($2)",
    "  AND (r.expires_at <= c.t OR (r.attempts < $7",
    "    AND ($4::bytea IS NULL OR r.fingerprint IS NULL OR r.fingerprint = $4)",
    "    AND (r.state = 'released' OR (r.state = 'in_progress' AND r.lease_until <= c.t))))",
    "  RETURNING r.*) ",
    "SELECT 'ins' AS src, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8 AS now_us, ",
    "(extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS done_us, ",
    record_cols!("ins"),
    " FROM ins ",
    "UNION ALL SELECT 'upd', (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8, ",
    "(extract(epoch FROM clock_timestamp()) * 1000000)::int8, ",
    record_cols!("upd"),
    " FROM upd ",
    "UNION ALL SELECT 'cur', (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8, ",
    "(extract(epoch FROM clock_timestamp()) * 1000000)::int8, ",
    record_cols!("cur"),
    " FROM cur ",
    "WHERE NOT EXISTS (SELECT 1 FROM ins) AND NOT EXISTS (SELECT 1 FROM upd)"
);

/// [`CLAIM_SQL`] for many keys at once (each key at most once), from parallel arrays: the same
/// branches per key, one statement, one WAL flush. Keys whose row is missing from the answer lost
/// a race with a concurrent writer and are claimed again one by one.
///
/// Through `dedup_claim_batch` (migration 20261129000001). New keys are inserted first, with no
/// read before and in one lock order (scope, key), so that two batches never wait on each other
/// in a cycle; a key that has a row is a conflict `DO NOTHING` skips without a lock or a write.
/// The keys the insert left out are read from the statement's snapshot, each by a probe of the
/// primary key, and taken over through their row's ctid (in key order) where their lease expired,
/// they were released, or they are past retention. A key whose row was committed after the
/// snapshot is in neither: it lost a race. PL/pgSQL, its plan kept per connection; the
/// statement's shape leaves no plan but probes, whatever the table's statistics said when it was
/// made (invariant 31).
///
/// $1 scopes, $2 keys, $3 owners, $4 fingerprints, $5 leases (µs), $6 retentions (µs),
/// $7 max attempts.
pub(crate) const CLAIM_BATCH_SQL: &str = concat!(
    "SELECT f.src, f.now_us, f.done_us, ",
    record_cols!("f"),
    " FROM dedup_claim_batch($1::text[], $2::bytea[], $3::text[], $4::bytea[], $5::int8[],",
    " $6::int8[], $7::int4[]) AS f"
);

/// [`FINISH_SQL`] completing many leases at once (each key at most once); answers the keys it
/// completed. $1 scopes, $2 keys, $3 tokens, $4 results, $5 retentions (µs).
///
/// Through `dedup_complete_batch` (PL/pgSQL since migration 20261202000001): the same UPDATE,
/// its plan kept per connection, with sequential scans, plain index scans and hash and merge
/// joins ruled out, so that each key is found by a bitmap probe of the primary key even when the
/// plan was made on statistics that say the table is empty (a prepared join planned then kept a
/// sequential scan of the whole table while the table grew; invariant 31).
pub(crate) const COMPLETE_BATCH_SQL: &str = "SELECT s AS scope, k AS key \
     FROM dedup_complete_batch($1::text[], $2::bytea[], $3::int8[], $4::bytea[], $5::int8[]) \
     AS f(s, k)";

/// Reads many records. $1 scopes, $2 keys. Through `dedup_get_many` (migration
/// 20261202000001), whose kept plan can only probe each key (as [`COMPLETE_BATCH_SQL`]'s).
pub(crate) const GET_MANY_SQL: &str = concat!(
    "SELECT ",
    record_cols!("r"),
    " FROM dedup_get_many($1::text[], $2::bytea[]) AS r"
);

/// A claim found the key out of attempts: mark it FAILED, fenced on what was read.
/// $1 scope, $2 key, $3 token, $4 state read, $5 reason, $6 failed retention (µs), $7 max attempts.
pub(crate) const EXHAUST_SQL: &str = concat!(
    "UPDATE dedup_records SET state = 'failed', lease_until = NULL, failure = $5,",
    " updated_at = statement_timestamp(),",
    " expires_at = CASE WHEN expires_at = 'infinity' THEN expires_at",
    "   ELSE statement_timestamp() + $6::float8 * interval '1 microsecond' END,",
    " pinned_ttl = CASE WHEN expires_at = 'infinity'",
    "   THEN $6::float8 * interval '1 microsecond' ELSE pinned_ttl END",
    " WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2) AND token = $3 AND state = $4",
    " AND attempts >= $7",
    " AND expires_at > statement_timestamp()",
    " AND (state = 'released' OR lease_until <= statement_timestamp())"
);

/// Every fenced end of a lease (complete, release, fail): applies only under the live token. A
/// completed record keeps no owner (migration 20261205000001); a released or failed one keeps its
/// last holder's. $1 scope, $2 key, $3 token, $4 new state, $5 result, $6 failure, $7 retention
/// (µs).
pub(crate) const FINISH_SQL: &str = concat!(
    "UPDATE dedup_records SET state = $4, lease_until = NULL, result = $5, failure = $6,",
    " owner = CASE WHEN $4 = 'completed' THEN NULL ELSE owner END,",
    " updated_at = statement_timestamp(),",
    // A pinned record stays pinned, and keeps the span it gets once its parked message settles.
    " expires_at = CASE WHEN expires_at = 'infinity' THEN expires_at",
    "   ELSE statement_timestamp() + $7::float8 * interval '1 microsecond' END,",
    " pinned_ttl = CASE WHEN expires_at = 'infinity'",
    "   THEN $7::float8 * interval '1 microsecond' ELSE pinned_ttl END",
    " WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2) AND token = $3",
    " AND state = 'in_progress'"
);

/// The heartbeat. $1 scope, $2 key, $3 token, $4 lease (µs), $5 retention (µs).
pub(crate) const EXTEND_SQL: &str = concat!(
    "UPDATE dedup_records SET updated_at = statement_timestamp(),",
    " lease_until = statement_timestamp() + $4::float8 * interval '1 microsecond',",
    " expires_at = greatest(expires_at,",
    "   statement_timestamp() + ($4 + $5)::float8 * interval '1 microsecond')",
    " WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2) AND token = $3",
    " AND state = 'in_progress'",
    " RETURNING (extract(epoch FROM lease_until) * 1000000)::int8"
);

pub(crate) const GET_SQL: &str = concat!(
    "SELECT ",
    record_cols!("r"),
    " FROM dedup_records r WHERE r.scope = $1 AND r.key = $2 AND r.kt = dedup_kt($2)"
);

/// Bounded retention purge; skips rows another transaction holds.
pub(crate) const PURGE_SQL: &str = concat!(
    "WITH doomed AS (SELECT scope, key, kt FROM dedup_records r",
    "  WHERE expires_at <= statement_timestamp()",
    // The ranges of days of the partitioned table, [$2, $3) in days since the epoch, go whole
    // (layout/ranges.rs); $2 = $3 leaves nothing out.
    "  AND (r.kt < date '1970-01-01' + $2::int4 OR r.kt >= date '1970-01-01' + $3::int4)",
    // A parked message's record stays until the message ran or was dead-lettered.
    "  AND NOT EXISTS (SELECT 1 FROM dedup_parked p",
    "  WHERE p.dedup_scope = r.scope AND p.dedup_key = r.key)",
    "  ORDER BY expires_at LIMIT $1",
    "  FOR UPDATE SKIP LOCKED) ",
    "DELETE FROM dedup_records r USING doomed d",
    " WHERE r.scope = d.scope AND r.key = d.key AND r.kt = d.kt"
);

/// Re-grants leases from now, after a claim that waited: each lease runs its full length from
/// when the claim took effect, not from when its statement arrived. Fenced on the token, like
/// every change to a claimed record. $1 scopes, $2 keys, $3 tokens, $4 leases (µs),
/// $5 retentions (µs). Through `dedup_regrant_batch` (migration 20261202000001), whose kept plan
/// can only probe each key, as [`COMPLETE_BATCH_SQL`]'s.
pub(crate) const REGRANT_SQL: &str = concat!(
    "SELECT r.scope, r.key, (extract(epoch FROM r.lease_until) * 1000000)::int8 AS lease_until_us",
    " FROM dedup_regrant_batch($1::text[], $2::bytea[], $3::int8[], $4::int8[], $5::int8[]) AS r"
);

/// Gives back a lease that was never used, with the attempt its claim counted: a first
/// attempt's row is deleted (as if never claimed), a later one is released with one attempt
/// fewer. Answers how many rows it changed (1, or 0 where the token no longer holds the key).
/// $1 scope, $2 key, $3 token.
pub(crate) const WITHDRAW_SQL: &str = concat!(
    "WITH d AS (DELETE FROM dedup_records WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2)",
    "  AND token = $3",
    "  AND state = 'in_progress' AND attempts <= 1 RETURNING 1), ",
    "u AS (UPDATE dedup_records SET state = 'released', lease_until = NULL,",
    "  attempts = attempts - 1, updated_at = statement_timestamp()",
    "  WHERE scope = $1 AND key = $2 AND kt = dedup_kt($2) AND token = $3",
    "  AND state = 'in_progress' AND attempts > 1",
    "  RETURNING 1) ",
    "SELECT (SELECT count(*) FROM d) + (SELECT count(*) FROM u)"
);

/// Transaction mode by the batch: takes each key's transaction-scoped advisory lock if it is free,
/// without waiting (a key another batch holds answers InFlight), and sets the batch's bounds: how
/// long its session may sit idle in its transaction, and how long a statement may wait on a lock
/// (a row another kind of transaction holds uncommitted, such as a `claim_in`). One row per key,
/// in order. $1 scopes, $2 keys, $3 idle_in_transaction_session_timeout, $4 lock_timeout.
pub(crate) const TRY_LOCK_SQL: &str = concat!(
    "SELECT pg_try_advisory_xact_lock(hashtextextended(q.scope || E'\\n' || encode(q.key, 'hex'), 0))",
    " FROM unnest($1::text[], $2::bytea[]) WITH ORDINALITY AS q(scope, key, n),",
    " (SELECT set_config('idle_in_transaction_session_timeout', $3, true),",
    "   set_config('lock_timeout', $4, true)) AS s",
    " ORDER BY q.n"
);

/// Transaction mode by the batch, for keys its transaction has try-locked: which have no row at
/// all (fresh: no claim statement needed), with a fencing token for each fresh one, and the
/// server's clock. One row per key, in order. $1 scopes, $2 keys. Through `dedup_fresh_batch`
/// (migration 20261129000001): a probe of the primary key per key, whatever the table's
/// statistics said when its plan was made (invariant 31).
pub(crate) const FRESH_SQL: &str = concat!(
    "SELECT f.fresh, f.token, f.now_us FROM dedup_fresh_batch($1::text[], $2::bytea[]) AS f",
    " ORDER BY f.n"
);

/// Transaction mode by the batch: fresh keys whose handler succeeded, written COMPLETED at once
/// (one row version per key instead of a claim and a completion). Answers the keys it wrote; a
/// key missing from the answer was written meanwhile by a writer that does not take the batch's
/// advisory locks (a lease-mode claim), and the batch must not commit. A completed record keeps
/// no owner (migration 20261205000001): the owners are bound, as for [`INSERT_CLAIMED_SQL`], and
/// not written.
/// $1 scopes, $2 keys, $3 owners, $4 tokens, $5 fingerprints, $6 results, $7 retentions (µs).
pub(crate) const INSERT_COMPLETED_SQL: &str = concat!(
    "INSERT INTO dedup_records AS r (scope, key, kt, state, owner, token, lease_until, attempts,",
    "  fingerprint, result, created_at, updated_at, expires_at)",
    " SELECT q.scope, q.key, dedup_kt(q.key), 'completed', NULL, q.token, NULL, 1, q.fp, q.result,",
    "  statement_timestamp(), statement_timestamp(),",
    "  statement_timestamp() + q.ret_us::float8 * interval '1 microsecond'",
    " FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int8[], $5::bytea[], $6::bytea[],",
    "  $7::int8[]) AS q(scope, key, owner, token, fp, result, ret_us)",
    " ORDER BY q.scope, q.key",
    " ON CONFLICT DO NOTHING RETURNING r.scope, r.key"
);

/// Transaction mode by the batch: fresh keys whose handler failed, written as the claim would
/// have left them (IN_PROGRESS under their token, first attempt), so that the failure is then
/// recorded as for any claim. Answers the keys it wrote (see [`INSERT_COMPLETED_SQL`]).
/// $1 scopes, $2 keys, $3 owners, $4 tokens, $5 fingerprints, $6 leases (µs), $7 retentions (µs).
pub(crate) const INSERT_CLAIMED_SQL: &str = concat!(
    "INSERT INTO dedup_records AS r (scope, key, kt, state, owner, token, lease_until, attempts,",
    "  fingerprint, created_at, updated_at, expires_at)",
    " SELECT q.scope, q.key, dedup_kt(q.key), 'in_progress', q.owner, q.token,",
    "  statement_timestamp() + q.lease_us::float8 * interval '1 microsecond', 1, q.fp,",
    "  statement_timestamp(), statement_timestamp(),",
    "  statement_timestamp() + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond'",
    " FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int8[], $5::bytea[], $6::int8[],",
    "  $7::int8[]) AS q(scope, key, owner, token, fp, lease_us, ret_us)",
    " ORDER BY q.scope, q.key",
    " ON CONFLICT DO NOTHING RETURNING r.scope, r.key"
);

/// [`EXTEND_SQL`] for many leases at once (a heartbeat for a whole batch); answers the keys it
/// extended, with their new lease end. $1 scopes, $2 keys, $3 tokens, $4 leases (µs),
/// $5 retentions (µs). Through `dedup_extend_batch` (migration 20261202000001), whose kept plan
/// can only probe each key (as [`COMPLETE_BATCH_SQL`]'s): a heartbeat planned on statistics that
/// say the table is empty would otherwise read the whole table at every beat.
pub(crate) const EXTEND_BATCH_SQL: &str = concat!(
    "SELECT r.scope, r.key, r.token, (extract(epoch FROM r.lease_until) * 1000000)::int8 AS until_us",
    " FROM dedup_extend_batch($1::text[], $2::bytea[], $3::int8[], $4::int8[], $5::int8[]) AS r"
);

/// The first half of an instance identity's advisory lock key (the two-`int4` form, a key space
/// apart from the one-`bigint` form that transaction mode's per-key locks use): "dedu".
pub(crate) const IDENTITY_LOCK_CLASS: i32 = 0x6465_6475;

/// Takes an instance identity's session lock if no other session holds it.
/// $1 the class, $2 the identity.
pub(crate) const IDENTITY_LOCK_SQL: &str = "SELECT pg_try_advisory_lock($1::int4, hashtext($2))";

/// The first half of the retention lock's key (the two-`int4` form, apart from the identities'
/// class): "dedr".
pub(crate) const RETENTION_LOCK_CLASS: i32 = 0x6465_6472;

/// Takes the retention lock of this database and of the schema that holds the `dedup_records`
/// this session sees, if no other session holds it: its holder is the one retention task that
/// purges. $1 the class.
pub(crate) const RETENTION_LOCK_SQL: &str = concat!(
    "SELECT pg_try_advisory_lock($1::int4, hashtext(n.nspname)) FROM pg_class c",
    " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'dedup_records'::regclass"
);

/// Ends the live leases of an identity's earlier incarnations (owners LIKE $1, not LIKE $2; both
/// patterns escaped with `\`); the partial index on live owners finds them.
pub(crate) const ADOPT_SQL: &str = concat!(
    "UPDATE dedup_records r SET lease_until = statement_timestamp(), updated_at = statement_timestamp()",
    " WHERE r.state = 'in_progress' AND r.owner LIKE $1 AND r.owner NOT LIKE $2",
    " AND r.lease_until > statement_timestamp()",
    " RETURNING ",
    record_cols!("r")
);
