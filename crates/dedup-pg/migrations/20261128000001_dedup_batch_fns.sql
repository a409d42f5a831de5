-- Three of the statements that join dedup_records to a batch's arrays, as functions whose plans
-- find each key through the primary key whatever the table's statistics say (issue 27; migration
-- 20261127000001 did this for batch completions): the batch heartbeat, the read of many records,
-- and the re-grant after a claim that waited.
--
-- Each was prepared once per pooled connection and planned, like the completion before it, on
-- whatever the statistics said at the time. On a fresh database, after a TRUNCATE, or after a
-- VACUUM of an emptied table, they say "empty", and the cached plan is a hash join (or a nested
-- loop) over a sequential scan of dedup_records, which the connection keeps while the table grows,
-- until autovacuum next analyzes the table. A batch heartbeat planned that way reads the whole
-- table at every beat.
--
-- The functions run under settings that rule out sequential scans, hash joins and merge joins,
-- and the state a heartbeat and a re-grant compare is a value the planner cannot see, so that the
-- partial index on IN_PROGRESS owners (which a full scan could use) does not apply. They are SQL
-- functions, planned at each call (as dedup_complete_batch): a plan made while the table looked
-- empty is never kept. (PL/pgSQL, whose plans are kept per connection, was tried: after a VACUUM
-- of the emptied table its generic plan could be a full scan of the primary key, kept while the
-- table grew.) Each reads and writes what the statement it replaces did, and runs as its caller
-- (SECURITY INVOKER), on the caller's search path.
--
-- Generation 4: binaries of generation 4 call these functions. It only adds, so the floor stays 1.

CREATE FUNCTION dedup_get_many(p_scopes text[], p_keys bytea[])
RETURNS SETOF dedup_records
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    SELECT r.* FROM unnest(p_scopes, p_keys) AS q(scope, key)
    JOIN dedup_records r ON r.scope = q.scope AND r.key = q.key
$$;

CREATE FUNCTION dedup_extend_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_leases int8[], p_rets int8[]
) RETURNS SETOF dedup_records
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    UPDATE dedup_records AS r SET updated_at = statement_timestamp(),
        lease_until = statement_timestamp() + q.lease_us::float8 * interval '1 microsecond',
        expires_at = greatest(r.expires_at,
            statement_timestamp() + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond')
    FROM unnest(p_scopes, p_keys, p_tokens, p_leases, p_rets)
        AS q(scope, key, token, lease_us, ret_us)
    WHERE r.scope = q.scope AND r.key = q.key AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*
$$;

CREATE FUNCTION dedup_regrant_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_leases int8[], p_rets int8[]
) RETURNS SETOF dedup_records
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    UPDATE dedup_records AS r SET
        lease_until = clock_timestamp() + q.lease_us::float8 * interval '1 microsecond',
        updated_at = clock_timestamp(),
        expires_at = greatest(r.expires_at,
            clock_timestamp() + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond')
    FROM unnest(p_scopes, p_keys, p_tokens, p_leases, p_rets)
        AS q(scope, key, token, lease_us, ret_us)
    WHERE r.scope = q.scope AND r.key = q.key AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*
$$;


UPDATE dedup_schema SET generation = 4;
