-- Generation 11: a completed record keeps no owner. The owner id says who holds a lease; once the
-- effect is recorded nothing reads it (a completion is fenced by its token, an unknown outcome
-- is read back by state and token, adoption and recovery look only at live leases), and on every
-- record of the window it took 20 to 40 bytes (`OwnerIds::for_process` makes ids such as
-- `pid4711-6606d9c5b4a3e-0#12345`, 29 bytes): about a tenth of a completed record on disk
-- (docs/PERFORMANCE.md, "A completed record keeps no owner"). The batch completion clears it
-- here; a binary of generation 11 clears it in its single completion and writes none in
-- transaction mode's insert of completed records. Same signature, same answer: binaries of
-- generation 10 and older use the function as it is, and a record one of them completes keeps its
-- owner, which nothing reads. The floor stays.
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
    UPDATE dedup_records AS r SET state = 'completed', owner = NULL, lease_until = NULL,
        result = q.result, failure = NULL, updated_at = statement_timestamp(),
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

UPDATE dedup_schema SET generation = 11;
