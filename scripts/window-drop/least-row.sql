-- The bytes a record takes on disk: today's row against the least row Postgres could hold the
-- same content in (docs/PERFORMANCE.md, "The least row"). Run in a scratch database:
--   psql -v n=2000000 -f scripts/window-drop/least-row.sql <scratch database>
-- Each table gets :n completed records of a 32-byte key (8 bytes of a time that grows, 24 random
-- bytes), a 32-byte fingerprint and a 16-byte result, no owner, a 6-character scope; written
-- once in the keys' order (time-ordered keys as they arrive) and once in random order.
--   today: a range of the partitioned table as `make_table` makes it (the columns of
--          `dedup_records`, the primary key led by the key, a BRIN on `expires_at`);
--   least: the scope as a 4-byte id, the state and the attempts in one integer, one timestamp,
--          an owner for a lease in flight: 8 columns, so a tuple's header with its null bitmap
--          stays 24 bytes, and no index but the primary key.
DROP TABLE IF EXISTS least_src, today_ordered, today_random, least_ordered, least_random;
CREATE UNLOGGED TABLE least_src AS
  SELECT int8send(1795000000000 + g * 300) || substring(decode(md5(random()::text) || md5(random()::text), 'hex') FROM 1 FOR 24) AS k, g
  FROM generate_series(1, :n) g;
CREATE TABLE today_ordered (scope text NOT NULL, key bytea NOT NULL, state text NOT NULL, owner text,
  token bigint NOT NULL, lease_until timestamptz, attempts integer NOT NULL, fingerprint bytea,
  result bytea, failure text, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
  expires_at timestamptz NOT NULL, pinned_ttl interval, kt date NOT NULL, PRIMARY KEY (key, scope));
CREATE INDEX ON today_ordered USING brin (expires_at);
CREATE TABLE today_random (LIKE today_ordered INCLUDING ALL);
CREATE TABLE least_ordered (scope_id int4 NOT NULL, state_attempts int4 NOT NULL, token int8 NOT NULL,
  at timestamptz NOT NULL, key bytea NOT NULL, fingerprint bytea, result bytea, owner text,
  PRIMARY KEY (key, scope_id));
CREATE TABLE least_random (LIKE least_ordered INCLUDING ALL);
INSERT INTO today_ordered SELECT 'window', k, 'completed', NULL, g, NULL, 1, sha256(k), substring(sha256(k || '\x00'::bytea) FROM 1 FOR 16), NULL, now(), now(), now() + interval '7 days', NULL, current_date FROM least_src ORDER BY k;
INSERT INTO today_random SELECT 'window', k, 'completed', NULL, g, NULL, 1, sha256(k), substring(sha256(k || '\x00'::bytea) FROM 1 FOR 16), NULL, now(), now(), now() + interval '7 days', NULL, current_date FROM least_src ORDER BY random();
INSERT INTO least_ordered SELECT 1, 4 * 1 + 2, g, now() + interval '7 days', k, sha256(k), substring(sha256(k || '\x00'::bytea) FROM 1 FOR 16), NULL FROM least_src ORDER BY k;
INSERT INTO least_random SELECT 1, 4 * 1 + 2, g, now() + interval '7 days', k, sha256(k), substring(sha256(k || '\x00'::bytea) FROM 1 FOR 16), NULL FROM least_src ORDER BY random();
VACUUM ANALYZE today_ordered, today_random, least_ordered, least_random;
SELECT c.relname AS "table",
       round(pg_relation_size(c.oid)::numeric / :n, 1) AS heap,
       round(pg_indexes_size(c.oid)::numeric / :n, 1) AS indexes,
       round(pg_total_relation_size(c.oid)::numeric / :n, 1) AS "bytes a record"
FROM pg_class c WHERE c.relname IN ('today_ordered', 'today_random', 'least_ordered', 'least_random')
ORDER BY 1;
SELECT 'today' AS "row", avg(pg_column_size(t.*)) AS tuple FROM (SELECT * FROM today_ordered LIMIT 1000) t
UNION ALL SELECT 'least', avg(pg_column_size(t.*)) FROM (SELECT * FROM least_ordered LIMIT 1000) t;
DROP TABLE least_src;
