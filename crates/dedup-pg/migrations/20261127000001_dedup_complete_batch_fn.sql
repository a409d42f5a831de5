-- A batch completion as a function whose plan finds each completed key through the primary key,
-- whatever the table's statistics say (issue 27).
--
-- The statement the binary sent before (an UPDATE joined to the batch's arrays, prepared once per
-- connection) was planned on statistics that say the table is empty after a VACUUM removes
-- every row (a fresh database, a bench's cleanup, a purge that emptied the table). The plan was a
-- hash join over a sequential scan of dedup_records, and the connection kept it while the table
-- grew: every completion then read the whole table. On the 2-core test machine a completion cost
-- 8.4 ms instead of 2.6 ms on average, and lease mode ran at about half its rate. A SQL function
-- with SET clauses is planned at each call, under its settings. With sequential scans and merge
-- joins ruled out, and the state compared with a value the planner cannot see (so that the
-- partial index on IN_PROGRESS owners, which a full scan could use, does not apply), the only
-- plans left probe the primary key once per key. It reads and writes what the statement did, and
-- runs as its caller (SECURITY INVOKER), on the caller's search path.
--
-- Generation 3: binaries of generation 3 call this function. It only adds, so the floor stays 1.
CREATE FUNCTION dedup_complete_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_results bytea[], p_rets int8[]
) RETURNS TABLE (done_scope text, done_key bytea)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_mergejoin = off
AS $$
    UPDATE dedup_records AS r SET state = 'completed', lease_until = NULL, result = q.result,
        failure = NULL, updated_at = statement_timestamp(),
        expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at
            ELSE statement_timestamp() + q.ret_us::float8 * interval '1 microsecond' END,
        pinned_ttl = CASE WHEN r.expires_at = 'infinity'
            THEN q.ret_us::float8 * interval '1 microsecond' ELSE r.pinned_ttl END
    FROM unnest(p_scopes, p_keys, p_tokens, p_results, p_rets)
        AS q(scope, key, token, result, ret_us)
    WHERE r.scope = q.scope AND r.key = q.key AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.scope, r.key
$$;

UPDATE dedup_schema SET generation = 3;
