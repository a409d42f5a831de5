-- Transaction mode's fresh check and the batch claim, as functions whose every possible plan
-- probes dedup_records once per key, whatever the table's statistics say (issue 27; migrations
-- 20261127000001 and 20261128000001 did this for the completion, the heartbeat, the read and the
-- re-grant, as SQL functions planned at each call).
--
-- Both statements were sent inline, prepared once per pooled connection, and planned as a join of
-- the batch's arrays to dedup_records on whatever the statistics said then, and the connection
-- kept that plan while the table grew, until autovacuum next analyzed it. On a fresh database or
-- after a TRUNCATE, the fresh check's plan was a hash join over a sequential scan (8.6-11.8 ms a
-- batch instead of 0.6; transaction mode at 12,000-16,000 events/s instead of 40,000-52,000).
-- After a VACUUM of an emptied table (a bench's cleanup, a purge that emptied the table), the
-- batch claim's plan read the table the same way (15-17 ms a statement instead of 1.4;
-- transaction mode at 7,700 events/s, lease mode's p99 at 106-117 ms).
--
-- Both are on hot paths, so they are PL/pgSQL, whose plans are made once per connection and kept
-- (a SQL function is planned at each call, which cost 0.25-0.3 ms a batch). A kept plan is safe
-- here because of the statements' shape, not the statistics at the time:
--   * every read of dedup_records is a LATERAL subquery per key, which the planner cannot turn
--     into a join (its key is a parameter of the subquery). Inside it the only paths are a probe
--     of the primary key and a sequential scan, which enable_seqscan = off rules out. It selects
--     columns outside the primary key, so an index-only scan of the whole index is not a path
--     either;
--   * the batch claim's takeover updates the row versions it read by their ctid (a TID scan per
--     key). Its key columns are compared with IS NOT DISTINCT FROM, a check on the row rather
--     than a join condition, so no plan can walk the primary key in order to meet them.
-- (A PL/pgSQL form that joined the arrays to dedup_records was tried: its kept plan could be a
-- full scan of the primary key after a VACUUM of the emptied table.)
--
-- The takeover reads the row version the statement's snapshot sees and updates that version. If a
-- concurrent writer changed the row meanwhile, what READ COMMITTED does depends on the minor
-- release: before the fix that rechecks a TID scan's ctid under EvalPlanQual (upstream commit
-- dee21ea, backpatched to 13; 15.18 has it), it follows the row to its newest version and checks
-- the takeover's conditions again there, as the join did; since, it leaves the key out. A key left out is answered from
-- what was read ('cur'), and its caller claims it again on its own (the single-key claim) when
-- that says the key was claimable: one more statement, never a second owner. The takeovers now
-- lock their rows in key order, as the insert of new keys always did.
--
-- Each reads and writes what the statement it replaces did, and runs as its caller (SECURITY
-- INVOKER), on the caller's search path. dedup_claim_batch names every column it answers, so a
-- column added to dedup_records (by a later migration, or by an application) leaves it working;
-- a column dropped or renamed needs it replaced. Generation 5: binaries of
-- generation 5 call these functions. They only add, so the floor stays 1.

CREATE FUNCTION dedup_fresh_batch(p_scopes text[], p_keys bytea[])
RETURNS TABLE (n int8, fresh boolean, token int8, now_us int8)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    RETURN QUERY
    SELECT q.n, x.state IS NULL,
        CASE WHEN x.state IS NULL THEN nextval('dedup_token_seq') END,
        (extract(epoch FROM statement_timestamp()) * 1000000)::int8
    FROM unnest(p_scopes, p_keys) WITH ORDINALITY AS q(scope, key, n)
    LEFT JOIN LATERAL (SELECT r.state FROM dedup_records r
        WHERE r.scope = q.scope AND r.key = q.key OFFSET 0) x ON true
    ORDER BY q.n;
END
$$;

CREATE FUNCTION dedup_claim_batch(
    p_scopes text[], p_keys bytea[], p_owners text[], p_fps bytea[], p_leases int8[],
    p_rets int8[], p_maxes int4[]
) RETURNS TABLE (src text, now_us int8, done_us int8, scope text, key bytea, state text,
    owner text, token int8, lease_until timestamptz, attempts int4, fingerprint bytea,
    result bytea, failure text, created_at timestamptz, updated_at timestamptz,
    expires_at timestamptz, pinned_ttl interval)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS (SELECT statement_timestamp() AS t),
    q AS (SELECT * FROM unnest(p_scopes, p_keys, p_owners, p_fps, p_leases, p_rets, p_maxes)
        AS q(scope, key, owner, fp, lease_us, ret_us, max_attempts)),
    -- New keys first, with no read before: a key that has a row is a conflict, which DO NOTHING
    -- skips without a lock or a write. One lock order for every batch.
    ins AS (
        INSERT INTO dedup_records AS r (scope, key, state, owner, token, lease_until, attempts,
            fingerprint, created_at, updated_at, expires_at)
        SELECT q.scope, q.key, 'in_progress', q.owner, nextval('dedup_token_seq'),
            c.t + q.lease_us::float8 * interval '1 microsecond', 1, q.fp, c.t, c.t,
            c.t + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond'
        FROM q, clock c
        ORDER BY q.scope, q.key
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING r.scope, r.key, r.state, r.owner, r.token, r.lease_until, r.attempts,
            r.fingerprint, r.result, r.failure, r.created_at, r.updated_at, r.expires_at,
            r.pinned_ttl),
    -- The keys the insert left out (computed first: only they are probed).
    qc AS MATERIALIZED (SELECT q.* FROM q WHERE NOT EXISTS
        (SELECT 1 FROM ins WHERE ins.scope = q.scope AND ins.key = q.key)),
    -- Each read from the statement's snapshot by a probe, with its row version's ctid. A key
    -- whose row was committed after the snapshot is in neither: it lost a race, and is claimed on
    -- its own.
    cur AS (SELECT qc.owner AS q_owner, qc.fp AS q_fp, qc.lease_us AS q_lease_us,
            qc.ret_us AS q_ret_us, qc.max_attempts AS q_max, x.*
        FROM qc CROSS JOIN LATERAL (SELECT r.ctid AS tid, r.scope, r.key, r.state, r.owner,
                r.token, r.lease_until, r.attempts, r.fingerprint, r.result, r.failure,
                r.created_at, r.updated_at, r.expires_at, r.pinned_ttl
            FROM dedup_records r WHERE r.scope = qc.scope AND r.key = qc.key OFFSET 0) x
        ORDER BY qc.scope, qc.key),
    upd AS (
        UPDATE dedup_records AS r SET state = 'in_progress', owner = q.q_owner,
            token = nextval('dedup_token_seq'),
            lease_until = c.t + q.q_lease_us::float8 * interval '1 microsecond',
            attempts = CASE WHEN r.expires_at <= c.t THEN 1 ELSE r.attempts + 1 END,
            fingerprint = CASE WHEN r.expires_at <= c.t THEN q.q_fp
                ELSE coalesce(r.fingerprint, q.q_fp) END,
            result = NULL,
            failure = CASE WHEN r.expires_at <= c.t THEN NULL ELSE r.failure END,
            created_at = CASE WHEN r.expires_at <= c.t THEN c.t ELSE r.created_at END,
            updated_at = c.t,
            expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at
                ELSE c.t + (q.q_lease_us + q.q_ret_us)::float8 * interval '1 microsecond' END
        FROM clock c, cur q
        WHERE r.ctid = q.tid
            AND r.scope IS NOT DISTINCT FROM q.scope
            AND r.key IS NOT DISTINCT FROM q.key
            AND (r.expires_at <= c.t
                OR (r.attempts < q.q_max
                    AND (q.q_fp IS NULL OR r.fingerprint IS NULL OR r.fingerprint = q.q_fp)
                    AND (r.state = 'released'
                        OR (r.state = 'in_progress' AND r.lease_until <= c.t))))
        RETURNING r.scope, r.key, r.state, r.owner, r.token, r.lease_until, r.attempts,
            r.fingerprint, r.result, r.failure, r.created_at, r.updated_at, r.expires_at,
            r.pinned_ttl)
    SELECT 'ins'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, ins.*
    FROM ins
    UNION ALL SELECT 'upd'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, upd.*
    FROM upd
    UNION ALL SELECT 'cur'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, cur.scope, cur.key, cur.state,
        cur.owner, cur.token, cur.lease_until, cur.attempts, cur.fingerprint, cur.result,
        cur.failure, cur.created_at, cur.updated_at, cur.expires_at, cur.pinned_ttl
    FROM cur
    WHERE NOT EXISTS (SELECT 1 FROM upd WHERE upd.scope = cur.scope AND upd.key = cur.key);
END
$$;

UPDATE dedup_schema SET generation = 5;
