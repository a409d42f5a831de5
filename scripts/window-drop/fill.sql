-- :lo_ms, :span_ms: keys of that span, expired over the day before the last hour (at steady
-- state a range is dropped a day after its last record expired); 1M rows a statement
INSERT INTO dedup_records (scope, key, kt, state, owner, token, lease_until, attempts, fingerprint, result, created_at, updated_at, expires_at)
SELECT 'window', g.k, dedup_kt(g.k), 'completed', NULL, nextval('dedup_token_seq'), NULL, 1, sha256(g.k), substring(sha256(g.k || '\x00'::bytea) FROM 1 FOR 16), now() - interval '8 days', now() - interval '8 days', now() - interval '1 hour' - random() * interval '1 day'
FROM (SELECT convert_to(lpad(to_hex(m >> 16), 8, '0') || '-' || lpad(to_hex(m & 65535), 4, '0') || '-7' || substr(u, 16, 3) || substr(u, 19), 'UTF8') AS k
      FROM (SELECT :lo_ms::int8 + floor(random() * :span_ms)::int8 AS m, gen_random_uuid()::text AS u FROM generate_series(1, 1000000)) s) g
ON CONFLICT DO NOTHING;
