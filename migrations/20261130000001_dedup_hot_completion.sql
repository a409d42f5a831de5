-- A completion that Postgres can write as a HOT update (issue 27).
--
-- Lease mode writes each key twice: the claim inserts the record IN_PROGRESS, the completion
-- updates it to COMPLETED. Postgres writes an update as HOT (heap-only: the new row version on
-- the same page, no new index entry, less WAL) only when no indexed column changes and the page
-- has room. Up to generation 5 no completion could be HOT: it changed `state`, which the partial
-- index on live owners names in its predicate, and `expires_at`, which is indexed. Each one
-- inserted a new entry into the primary key and the `expires_at` index, and (f) wrote about
-- 1,190 bytes of WAL per key against transaction mode's 520.
--
-- From this generation:
--   * adoption finds live leases by their end: `dedup_records_lease_idx` on `lease_until`, over
--     the rows that have one. Adoption's statement (every generation's) asks for
--     `lease_until > now`, which this index answers: the live leases, and the records completed
--     less than a lease ago. The old index on live owners goes;
--   * a completion keeps the row's `lease_until` (no longer read once the state is not
--     IN_PROGRESS: a binary of generation 6 reads it as absent) and keeps its `expires_at` when
--     that is already at least the retention from now. A claim sets `expires_at` to the lease's
--     end plus the retention, and a heartbeat moves it with the lease, so a completion within its
--     lease changes neither, and a record is kept at least its retention after its completion
--     and at most one lease longer;
--   * pages are filled to 70% by inserts, leaving room on each for its rows' completed versions.
--     Only pages written from now on are filled so. A deployment that runs transaction mode
--     alone, whose rows are written once, can set it back to 100.
--
-- Binaries of every earlier generation still work against this schema: their statements are
-- unchanged, their completions (lease end cleared, expiry moved) are valid rows, and their
-- adoption statement is served by the new index. The floor stays 1. The index is built here in
-- one statement, which holds off writes to dedup_records while it runs: on a large table, build
-- it first with CREATE INDEX CONCURRENTLY under this name, and this migration keeps it.

CREATE INDEX IF NOT EXISTS dedup_records_lease_idx ON dedup_records (lease_until)
    WHERE lease_until IS NOT NULL;

DROP INDEX IF EXISTS dedup_records_live_owner_idx;

ALTER TABLE dedup_records SET (fillfactor = 70);

CREATE OR REPLACE FUNCTION dedup_complete_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_results bytea[], p_rets int8[]
) RETURNS TABLE (done_scope text, done_key bytea)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_mergejoin = off
AS $$
    UPDATE dedup_records AS r SET state = 'completed', result = q.result,
        failure = NULL, updated_at = statement_timestamp(),
        expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at
            ELSE greatest(r.expires_at,
                statement_timestamp() + q.ret_us::float8 * interval '1 microsecond') END,
        pinned_ttl = CASE WHEN r.expires_at = 'infinity'
            THEN q.ret_us::float8 * interval '1 microsecond' ELSE r.pinned_ttl END
    FROM unnest(p_scopes, p_keys, p_tokens, p_results, p_rets)
        AS q(scope, key, token, result, ret_us)
    WHERE r.scope = q.scope AND r.key = q.key AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.scope, r.key
$$;

UPDATE dedup_schema SET generation = 6;
