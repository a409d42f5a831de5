-- The record's partition day, kt, written and read by every statement: the second piece of the
-- window partitioned by the key's own time (issue 26; docs/design/window-partitions.md).
--
-- kt is dedup_kt(key): a function of the key's bytes alone. On the single table every key's kt is
-- '-infinity', which is also the column's default, so this migration changes no row and no
-- answer. What it changes is who computes kt: every statement that writes a record writes
-- dedup_kt(key) of the key it was given, every statement that finds a record by its key also
-- asks for kt = dedup_kt(key), and every insert's conflict clause names no index (ON CONFLICT DO
-- NOTHING checks every unique index; the primary key on (scope, key) is the only one). That is
-- what a table partitioned by kt needs: a key then has exactly one partition, the one dedup_kt
-- names, so each partition's own primary key on (scope, key) holds the key once in the whole
-- table, and a lookup that names kt is pruned to that partition.
--
-- dedup_kt is replaced once, by the switch to the partitioned layout, in the transaction that
-- makes it, under that transaction's lock, with a body that gives a day only to keys made after
-- every key stored then (so every stored record keeps kt = '-infinity' under both bodies).
-- After that it is never replaced: a change of the mapping is a migration that moves the rows it
-- maps differently. Binaries never compute kt themselves. The statements compute it from the key
-- they were given, and the planner inlines the call (a plain expression, not STRICT).
--
-- dedup_key_ms_v1 (below) is the key's time the switch's dedup_kt takes the day from.
--
-- The functions below are the ones migrations 20261127000001, 20261128000001 and
-- 20261129000001 made, with kt added where they find or write a record; their signatures do not
-- change. The column comes with a default and no check, so binaries of generation 6 and older,
-- which neither write nor ask for kt, still work against this schema: the floor stays 1.
-- Generation 7.

ALTER TABLE dedup_records ADD COLUMN kt date NOT NULL DEFAULT '-infinity';

CREATE FUNCTION dedup_kt(p_key bytea) RETURNS date
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN '-infinity'::date;

-- The time the partitioned layout gives a key its day by: the 48-bit millisecond time of a key
-- shaped like a UUIDv7 (36 bytes with '-' at 8 and 13 and the version digit '7' at 14, its time
-- read from the 12 hex digits before; or 16 raw bytes with version 7), NULL for any other.
-- Laxer than dedup_uuid7_ms_v1 (the digits are not checked, nor the variant: a malformed key
-- gets some time, the same every time, which is all a partition key needs) and about a tenth of
-- its size once inlined: it is planned into every statement that names kt, and evaluated in the
-- parent's check of every row written. For every UUIDv7 it is the same time
-- (tests/it/pg_key_time.rs). Total, byte and integer arithmetic only, never replaced (a change is
-- a _v2). A hex digit's value is (b & 15) + 9 * (b >> 6) for '0'-'9', 'a'-'f' and 'A'-'F'.
CREATE FUNCTION dedup_key_ms_v1(k bytea) RETURNS int8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE octet_length(k)
    WHEN 36 THEN CASE WHEN get_byte(k, 8) = 45 AND get_byte(k, 13) = 45 AND get_byte(k, 14) = 55 THEN
        (((((((((((((get_byte(k, 0) & 15) + 9 * (get_byte(k, 0) >> 6))::int8 * 16 + ((get_byte(k, 1) & 15) + 9 * (get_byte(k, 1) >> 6))) * 16 + ((get_byte(k, 2) & 15) + 9 * (get_byte(k, 2) >> 6))) * 16 + ((get_byte(k, 3) & 15) + 9 * (get_byte(k, 3) >> 6))) * 16 + ((get_byte(k, 4) & 15) + 9 * (get_byte(k, 4) >> 6))) * 16 + ((get_byte(k, 5) & 15) + 9 * (get_byte(k, 5) >> 6))) * 16 + ((get_byte(k, 6) & 15) + 9 * (get_byte(k, 6) >> 6))) * 16 + ((get_byte(k, 7) & 15) + 9 * (get_byte(k, 7) >> 6))) * 16 + ((get_byte(k, 9) & 15) + 9 * (get_byte(k, 9) >> 6))) * 16 + ((get_byte(k, 10) & 15) + 9 * (get_byte(k, 10) >> 6))) * 16 + ((get_byte(k, 11) & 15) + 9 * (get_byte(k, 11) >> 6))) * 16 + ((get_byte(k, 12) & 15) + 9 * (get_byte(k, 12) >> 6))) END
    WHEN 16 THEN CASE WHEN get_byte(k, 6) >> 4 = 7 THEN ((((get_byte(k, 0)::int8 * 256 + get_byte(k, 1)) * 256 + get_byte(k, 2)) * 256 + get_byte(k, 3)) * 256 + get_byte(k, 4)) * 256 + get_byte(k, 5) END
END;

-- Hash joins are ruled out here too now: over a partitioned table, a hash join of the batch to
-- every partition's whole primary key was the completion's plan (9 ms a batch instead of 1.6).
CREATE OR REPLACE FUNCTION dedup_complete_batch(
    p_scopes text[], p_keys bytea[], p_tokens int8[], p_results bytea[], p_rets int8[]
) RETURNS TABLE (done_scope text, done_key bytea)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_hashjoin = off
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
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key) AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.scope, r.key
$$;

CREATE OR REPLACE FUNCTION dedup_get_many(p_scopes text[], p_keys bytea[])
RETURNS SETOF dedup_records
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    SELECT r.* FROM unnest(p_scopes, p_keys) AS q(scope, key)
    JOIN dedup_records r ON r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key)
$$;

CREATE OR REPLACE FUNCTION dedup_extend_batch(
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
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key) AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*
$$;

CREATE OR REPLACE FUNCTION dedup_regrant_batch(
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
    WHERE r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key) AND r.token = q.token
        AND r.state = (SELECT 'in_progress'::text)
    RETURNING r.*
$$;

CREATE OR REPLACE FUNCTION dedup_fresh_batch(p_scopes text[], p_keys bytea[])
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
        WHERE r.scope = q.scope AND r.key = q.key AND r.kt = dedup_kt(q.key) OFFSET 0) x ON true
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
            qc.ret_us AS q_ret_us, qc.max_attempts AS q_max, x.*
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

UPDATE dedup_schema SET generation = 7;
