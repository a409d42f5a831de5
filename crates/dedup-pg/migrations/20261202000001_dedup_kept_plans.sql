-- The batch completion, heartbeat, read and re-grant keep their plans per connection (issue 26).
--
-- Since migrations 20261127000001 and 20261128000001 these four were SQL functions, whose
-- statement is planned again at every call, so that no plan made while dedup_records looked
-- empty was kept (docs/ARCHITECTURE.md, invariant 31). On the single table that planning cost
-- about 0.1 ms a call. On the table partitioned by the key's time it is the plan of a join over
-- every partition, with the partition day's expression in every partition's filter: 3.2 ms of
-- a completion of 128 keys over eight partitions, and lease mode by the batch at 0.63-0.69 of
-- its rate on the single table (docs/PERFORMANCE.md, "Batch functions that keep their plans").
--
-- Now they are PL/pgSQL, as the fresh check and the batch claim already are, and all six batch
-- functions keep one generic plan per connection (plan_cache_mode = force_generic_plan: the
-- custom plans the planner would try first would cost the same planning). A kept plan is safe
-- only by its shape, whatever the statistics said when it was made. The four below join the
-- batch to the records with sequential scans, plain index scans, hash joins and merge joins
-- ruled out: the plan left is a nested loop with a bitmap probe of the primary key per key (a
-- bitmap scan needs an index condition, so it cannot read a whole index; a kept join that
-- allows plain index scans, made on empty statistics, reads the whole primary key at every
-- call). Over the partitioned table each probe is pruned to its key's partition at run time.
-- The fresh check and the batch claim keep their shape (a LATERAL probe per key). Each of the
-- five but the claim (which already did) computes every key's partition day once, in a subquery
-- the planner keeps apart (OFFSET 0), instead of in each partition's filter and its pruning:
-- 0.39 ms against 0.51 for a fresh check of 128 keys over eight partitions. The plans
-- are made again when the table's statistics or partitions change. tests/it/pg_plans.rs counts
-- the index entries each reads, after plans made on empty statistics.
--
-- A kept plan also keeps the planner settings of the call that made it, so each function pins
-- every setting its shape relies on (bitmap scans, nested loops, pruning on, JIT off; the probes'
-- index and TID scans on): a session that turned one off at a connection's first call would
-- otherwise leave that connection a plan of full index scans for good.
--
-- Two more changes, found by a review of this migration: dedup_get_many is VOLATILE (it was
-- STABLE, so it read with its caller's snapshot, taken before a wait for a partition change's
-- lock: a record the change moved to another partition was missing from the answer); and the
-- batch claim's takeover names the key's partition day, so its TID scan is pruned to one
-- partition instead of run in every one.
--
-- Same signatures, same answers: the floor stays 1, and binaries of generation 7 use them as
-- they are. Generation 8.

CREATE OR REPLACE FUNCTION dedup_complete_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_results bytea[], p_rets int8[]
) RETURNS TABLE (done_scope text, done_key bytea)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_indexscan = off
SET enable_bitmapscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
    UPDATE dedup_records AS r SET state = 'completed', lease_until = NULL, result = q.result,
        failure = NULL, updated_at = statement_timestamp(),
        expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at
            ELSE statement_timestamp() + q.ret_us::float8 * interval '1 microsecond' END,
        pinned_ttl = CASE WHEN r.expires_at = 'infinity'
            THEN q.ret_us::float8 * interval '1 microsecond' ELSE r.pinned_ttl END
    FROM (SELECT q.*, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys, p_tokens, p_results, p_rets)
        AS q(scope, key, token, result, ret_us) OFFSET 0) AS q
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = q.kt AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.scope, r.key;
END
$$;

CREATE OR REPLACE FUNCTION dedup_get_many(p_scopes text[], p_keys bytea[])
RETURNS SETOF dedup_records
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_indexscan = off
SET enable_bitmapscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
    SELECT r.* FROM (SELECT q.*, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys) AS q(scope, key) OFFSET 0) AS q
    JOIN dedup_records r ON r.scope = q.scope AND r.key = q.key AND r.kt = q.kt;
END
$$;

CREATE OR REPLACE FUNCTION dedup_extend_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_leases int8[], p_rets int8[]
) RETURNS SETOF dedup_records
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_indexscan = off
SET enable_bitmapscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
    UPDATE dedup_records AS r SET updated_at = statement_timestamp(),
        lease_until = statement_timestamp() + q.lease_us::float8 * interval '1 microsecond',
        expires_at = greatest(r.expires_at,
            statement_timestamp() + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond')
    FROM (SELECT q.*, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys, p_tokens, p_leases, p_rets)
        AS q(scope, key, token, lease_us, ret_us) OFFSET 0) AS q
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = q.kt AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*;
END
$$;

CREATE OR REPLACE FUNCTION dedup_regrant_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_leases int8[], p_rets int8[]
) RETURNS SETOF dedup_records
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_indexscan = off
SET enable_bitmapscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
    UPDATE dedup_records AS r SET
        lease_until = clock_timestamp() + q.lease_us::float8 * interval '1 microsecond',
        updated_at = clock_timestamp(),
        expires_at = greatest(r.expires_at,
            clock_timestamp() + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond')
    FROM (SELECT q.*, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys, p_tokens, p_leases, p_rets)
        AS q(scope, key, token, lease_us, ret_us) OFFSET 0) AS q
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = q.kt AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*;
END
$$;

CREATE OR REPLACE FUNCTION dedup_fresh_batch(p_scopes text[], p_keys bytea[])
RETURNS TABLE (n int8, fresh boolean, token int8, now_us int8)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_indexscan = on
SET enable_bitmapscan = on
SET enable_tidscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
    SELECT q.n, x.state IS NULL,
        CASE WHEN x.state IS NULL THEN nextval('dedup_token_seq') END,
        (extract(epoch FROM statement_timestamp()) * 1000000)::int8
    FROM (SELECT q.*, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys) WITH ORDINALITY AS q(scope, key, n) OFFSET 0) AS q
    LEFT JOIN LATERAL (SELECT r.state FROM dedup_records r
        WHERE r.scope = q.scope AND r.key = q.key AND r.kt = q.kt OFFSET 0) x ON true
    ORDER BY q.n;
END
$$;

CREATE OR REPLACE FUNCTION dedup_claim_batch(
    p_scopes text[], p_keys bytea[], p_owners text[], p_fps bytea[], p_leases int8[],
    p_rets int8[], p_maxes int4[]
) RETURNS TABLE (src text, now_us int8, done_us int8, scope text, key bytea, state text,
    owner text, token int8, lease_until timestamptz, attempts int4, fingerprint bytea,
    result bytea, failure text, created_at timestamptz, updated_at timestamptz,
    expires_at timestamptz, pinned_ttl interval)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_indexscan = on
SET enable_bitmapscan = on
SET enable_tidscan = on
SET enable_nestloop = on
SET enable_partition_pruning = on
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS (SELECT statement_timestamp() AS t),
    q AS (SELECT *, dedup_kt(q.key) AS kt
        FROM unnest(p_scopes, p_keys, p_owners, p_fps, p_leases, p_rets, p_maxes)
        AS q(scope, key, owner, fp, lease_us, ret_us, max_attempts)),
    -- New keys first, with no read before: a key that has a row is a conflict, which DO NOTHING
    -- skips without a lock or a write. One lock order for every batch.
    ins AS (
        INSERT INTO dedup_records AS r (scope, key, kt, state, owner, token, lease_until,
            attempts, fingerprint, created_at, updated_at, expires_at)
        SELECT q.scope, q.key, q.kt, 'in_progress', q.owner, nextval('dedup_token_seq'),
            c.t + q.lease_us::float8 * interval '1 microsecond', 1, q.fp, c.t, c.t,
            c.t + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond'
        FROM q, clock c
        ORDER BY q.scope, q.key
        ON CONFLICT DO NOTHING
        RETURNING r.scope, r.key, r.state, r.owner, r.token, r.lease_until, r.attempts,
            r.fingerprint, r.result, r.failure, r.created_at, r.updated_at, r.expires_at,
            r.pinned_ttl),
    -- The keys the insert left out (computed first: only they are probed).
    qc AS MATERIALIZED (SELECT q.* FROM q WHERE NOT EXISTS
        (SELECT 1 FROM ins WHERE ins.scope = q.scope AND ins.key = q.key)),
    -- Each read from the statement's snapshot by a probe of its key's partition, with its row
    -- version's table and ctid. A key whose row was committed after the snapshot is in neither:
    -- it lost a race, and is claimed on its own.
    cur AS (SELECT qc.owner AS q_owner, qc.fp AS q_fp, qc.lease_us AS q_lease_us,
            qc.ret_us AS q_ret_us, qc.max_attempts AS q_max, qc.kt AS q_kt, x.*
        FROM qc CROSS JOIN LATERAL (SELECT r.tableoid AS rel, r.ctid AS tid, r.scope, r.key,
                r.state, r.owner, r.token, r.lease_until, r.attempts, r.fingerprint, r.result,
                r.failure, r.created_at, r.updated_at, r.expires_at, r.pinned_ttl
            FROM dedup_records r WHERE r.scope = qc.scope AND r.key = qc.key AND r.kt = qc.kt
            OFFSET 0) x
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
            AND r.kt = q.q_kt
            AND r.tableoid IS NOT DISTINCT FROM q.rel
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

UPDATE dedup_schema SET generation = 8;
