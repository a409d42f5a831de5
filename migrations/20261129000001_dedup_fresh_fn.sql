-- Transaction mode's fresh check as a function whose every possible plan probes dedup_records
-- once per key, whatever the table's statistics say (issue 27; migrations 20261127000001 and
-- 20261128000001 did this for the completion, the heartbeat, the read and the re-grant, as SQL
-- functions planned at each call).
--
-- The check was sent inline, prepared once per pooled connection, and planned as a join of the
-- batch's arrays to dedup_records on whatever the statistics said then. On a fresh database or
-- after a TRUNCATE, its cached plan was a hash join over a sequential scan, kept while the table
-- grew: 10.1 ms a batch instead of 0.57 ms, and transaction mode at 12,000-16,000 events/s
-- instead of 40,000-52,000.
--
-- It is on transaction mode's hot path, so it is PL/pgSQL, whose plan is made once per connection
-- and kept (a SQL function is planned at each call, which cost 0.25-0.3 ms a batch). A kept plan
-- is safe here because of the statement's shape, not the statistics at the time: the read of
-- dedup_records is a LATERAL subquery per key, which the planner cannot turn into a join (its key
-- is a parameter of the subquery). Inside it the only paths are a probe of the primary key and a
-- sequential scan, which enable_seqscan = off rules out. It selects a column outside the primary
-- key, so an index-only scan of the whole index is not a path either. (A PL/pgSQL form that
-- joined the arrays to dedup_records was tried: its kept plan could be a full scan of the primary
-- key after a VACUUM of the emptied table.)
--
-- It reads what the statement it replaces did, draws a token for each fresh key as it did, and
-- runs as its caller (SECURITY INVOKER), on the caller's search path. Generation 5: binaries of
-- generation 5 call it. It only adds, so the floor stays 1.

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

UPDATE dedup_schema SET generation = 5;
