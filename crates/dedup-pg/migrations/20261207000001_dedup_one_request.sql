-- Generation 13: a single request claimed in a transaction of its own (`PgStore::begin_claim`,
-- the HTTP layer's transactional path) is probed and completed through two functions, each
-- keeping one plan per connection that is safe by its shape, as the batch functions do
-- (migration 20261129000001).
--
-- The probe was a pooled statement: on a connection that first ran it while the statistics said
-- the table was empty, it kept a sequential scan, and read the whole table at every request as
-- the table grew. Sent inline instead, planned at each call, it cost Postgres more than the round
-- trip it saved (each plan inlines dedup_kt). Called from the request's simple queries with
-- constant arguments, these are planned once per connection, and each call is cheap to parse:
--   * dedup_probe_one tries the key's transaction-scoped advisory lock (the hash transaction
--     mode's batches take, so that a batch and a request never hold one key at once) and, once
--     locked, reads whether the key has a row, with a token from the sequence for a fresh key and
--     the server's clock. The read is a statement after the lock's: in a VOLATILE function each
--     statement takes its own snapshot, so it sees a first writer that committed before it let
--     go of the key. Its only paths are a probe of the primary key and a sequential scan, which
--     enable_seqscan = off rules out. The scope is compared in the primary key's collation: a
--     function's arguments come in their caller's collation, and `convert_from` answers in "C",
--     which no index of the table has;
--   * dedup_complete_one writes a fresh key COMPLETED, with no ON CONFLICT: a row another writer
--     put there meanwhile fails the insert (a unique violation), and the COMMIT sent after it in
--     the same query never runs.
--
-- Both run as their caller (SECURITY INVOKER), on the caller's search path. Only adds: the floor
-- stays.

CREATE OR REPLACE FUNCTION dedup_probe_one(
    p_scope text, p_key bytea,
    OUT locked boolean, OUT fresh boolean, OUT token int8, OUT now_us int8
)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    locked := pg_try_advisory_xact_lock(
        hashtextextended(p_scope || E'\n' || encode(p_key, 'hex'), 0));
    now_us := (extract(epoch FROM statement_timestamp()) * 1000000)::int8;
    fresh := false;
    IF locked THEN
        PERFORM FROM dedup_records r
            WHERE r.scope = p_scope COLLATE "default" AND r.key = p_key
                AND r.kt = dedup_kt(p_key);
        fresh := NOT FOUND;
        IF fresh THEN
            token := nextval('dedup_token_seq');
        END IF;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION dedup_complete_one(
    p_scope text, p_key bytea, p_token int8, p_fp bytea, p_result bytea, p_ret_us int8
) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    INSERT INTO dedup_records (scope, key, kt, state, owner, token, lease_until, attempts,
        fingerprint, result, created_at, updated_at, expires_at)
    VALUES (p_scope, p_key, dedup_kt(p_key), 'completed', NULL, p_token, NULL, 1, p_fp,
        p_result, statement_timestamp(), statement_timestamp(),
        statement_timestamp() + p_ret_us::float8 * interval '1 microsecond');
END
$$;

UPDATE dedup_schema SET generation = greatest(generation, 13);
