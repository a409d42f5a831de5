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
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_indexscan = off
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

ALTER FUNCTION dedup_claim_batch(text[], bytea[], text[], bytea[], int8[], int8[], int4[])
    SET plan_cache_mode = force_generic_plan;

UPDATE dedup_schema SET generation = 8;
