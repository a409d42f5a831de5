-- The other statements that join dedup_records to a batch's arrays, as functions whose plans find
-- each key through the primary key whatever the table's statistics say (issue 27; migration
-- 20261127000001 did this for batch completions).
--
-- Each statement below was prepared once per pooled connection and planned, like the completion
-- before it, on whatever the statistics said at the time. On a fresh database, after a TRUNCATE,
-- or after a VACUUM of an emptied table, they say "empty", and the cached plan is a hash join (or a
-- nested loop) over a sequential scan of dedup_records, which the connection keeps while the table
-- grows, until autovacuum next analyzes the table. Transaction mode's fresh check took 10.1 ms a
-- batch instead of 0.57 ms, and the first run of the bench's transaction mode on a fresh database
-- ran at 14,910 events/s instead of 52,514. A batch heartbeat planned that way reads the whole
-- table at every beat.
--
-- The functions run under settings that rule out sequential scans, hash joins and merge joins, so
-- the only plans left probe the primary key once per key. The state a heartbeat and a re-grant
-- compare is a value the planner cannot see, so that the partial index on IN_PROGRESS owners
-- (which a full scan could use) does not apply. dedup_fresh_batch and dedup_get_many are PL/pgSQL:
-- their plans are made under those settings and then kept per connection, so a call pays no
-- planning (transaction mode's fresh check is on its hot path). dedup_extend_batch and
-- dedup_regrant_batch update and answer what they updated, so they are SQL functions, planned at
-- each call (as dedup_complete_batch). Each reads and writes what the statement it replaces did,
-- and runs as its caller (SECURITY INVOKER), on the caller's search path.
--
-- dedup_claim_batch (the batch claim) and the rewritten dedup_complete_batch are below, after
-- the four reads and updates.
--
-- Generation 4: binaries of generation 4 call these functions. It only adds, so the floor stays 1.

CREATE FUNCTION dedup_fresh_batch(p_scopes text[], p_keys bytea[])
RETURNS TABLE (n int8, fresh boolean, token int8, now_us int8)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT q.n, r.key IS NULL,
        CASE WHEN r.key IS NULL THEN nextval('dedup_token_seq') END,
        (extract(epoch FROM statement_timestamp()) * 1000000)::int8
    FROM unnest(p_scopes, p_keys) WITH ORDINALITY AS q(scope, key, n)
    LEFT JOIN dedup_records r ON r.scope = q.scope AND r.key = q.key
    ORDER BY q.n;
END
$$;

CREATE FUNCTION dedup_get_many(p_scopes text[], p_keys bytea[])
RETURNS SETOF dedup_records
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
BEGIN
    RETURN QUERY
    SELECT r.* FROM unnest(p_scopes, p_keys) AS q(scope, key)
    JOIN dedup_records r ON r.scope = q.scope AND r.key = q.key;
END
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

-- The batch completion as PL/pgSQL: the same UPDATE under the same settings, its plan now made once
-- per connection and kept, instead of at each call (about 0.6 ms a batch). RETURN QUERY of an
-- UPDATE ... RETURNING needs Postgres 14 or later.
CREATE OR REPLACE FUNCTION dedup_complete_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_results bytea[], p_rets int8[]
) RETURNS TABLE (done_scope text, done_key bytea)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
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
    RETURNING r.scope, r.key;
END
$$;

-- The batch claim. Its new keys are inserted (ON CONFLICT goes through the unique index whatever
-- the plan), but the keys that already have a row are read and taken over through joins: after a
-- VACUUM of an emptied table their cached plan was a hash join over a sequential scan, and
-- transaction mode, whose repeats of done keys all come here, ran at 9,722 events/s instead of
-- about 48,000. The same statement, under the same settings, its plan kept per connection. Each
-- row answers the branch (src), the statement's clock (now_us), the clock after the writes
-- (done_us) and the record as it now stands.
CREATE FUNCTION dedup_claim_batch(
    p_scopes text[], p_keys bytea[], p_owners text[], p_fps bytea[], p_leases int8[],
    p_rets int8[], p_maxes int4[]
) RETURNS TABLE (src text, now_us int8, done_us int8, scope text, key bytea, state text,
    owner text, token int8, lease_until timestamptz, attempts int4, fingerprint bytea,
    result bytea, failure text, created_at timestamptz, updated_at timestamptz,
    expires_at timestamptz, pinned_ttl interval)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS (SELECT statement_timestamp() AS t),
    q AS (SELECT * FROM unnest(p_scopes, p_keys, p_owners, p_fps, p_leases, p_rets, p_maxes)
        AS q(scope, key, owner, fp, lease_us, ret_us, max_attempts)),
    ins AS (
        INSERT INTO dedup_records AS r (scope, key, state, owner, token, lease_until, attempts,
            fingerprint, created_at, updated_at, expires_at)
        SELECT q.scope, q.key, 'in_progress', q.owner, nextval('dedup_token_seq'),
            c.t + q.lease_us::float8 * interval '1 microsecond', 1, q.fp, c.t, c.t,
            c.t + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond'
        FROM q, clock c
        ORDER BY q.scope, q.key
        ON CONFLICT (scope, key) DO NOTHING RETURNING r.*),
    qc AS (SELECT q.* FROM q WHERE NOT EXISTS
        (SELECT 1 FROM ins WHERE ins.scope = q.scope AND ins.key = q.key)),
    cur AS (SELECT r.* FROM dedup_records r JOIN qc ON r.scope = qc.scope AND r.key = qc.key),
    upd AS (
        UPDATE dedup_records AS r SET state = 'in_progress', owner = q.owner,
            token = nextval('dedup_token_seq'),
            lease_until = c.t + q.lease_us::float8 * interval '1 microsecond',
            attempts = CASE WHEN r.expires_at <= c.t THEN 1 ELSE r.attempts + 1 END,
            fingerprint = CASE WHEN r.expires_at <= c.t THEN q.fp
                ELSE coalesce(r.fingerprint, q.fp) END,
            result = NULL,
            failure = CASE WHEN r.expires_at <= c.t THEN NULL ELSE r.failure END,
            created_at = CASE WHEN r.expires_at <= c.t THEN c.t ELSE r.created_at END,
            updated_at = c.t,
            expires_at = CASE WHEN r.expires_at = 'infinity' THEN r.expires_at
                ELSE c.t + (q.lease_us + q.ret_us)::float8 * interval '1 microsecond' END
        FROM clock c, qc q
        WHERE r.scope = q.scope AND r.key = q.key AND (r.expires_at <= c.t
            OR (r.attempts < q.max_attempts
                AND (q.fp IS NULL OR r.fingerprint IS NULL OR r.fingerprint = q.fp)
                AND (r.state = 'released'
                    OR (r.state = 'in_progress' AND r.lease_until <= c.t))))
        RETURNING r.*)
    SELECT 'ins'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, ins.*
    FROM ins
    UNION ALL SELECT 'upd'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, upd.*
    FROM upd
    UNION ALL SELECT 'cur'::text, (extract(epoch FROM (SELECT t FROM clock)) * 1000000)::int8,
        (extract(epoch FROM clock_timestamp()) * 1000000)::int8, cur.*
    FROM cur
    WHERE NOT EXISTS (SELECT 1 FROM upd WHERE upd.scope = cur.scope AND upd.key = cur.key);
END
$$;

UPDATE dedup_schema SET generation = 4;
