-- :n records of :scopes scopes (`s0`, `s1`, ...) whose UUIDv7 keys are times of the span
-- [:lo_ms, :lo_ms + :span_ms), written in the order of those times, the scopes interleaved as
-- a live stream of several consumer groups writes them: what packs a range's primary key as the
-- window's keys arrive (docs/PERFORMANCE.md, "A range's primary key led by the key"). Run it
-- :slices times with :slice 0, 1, ... so that each run writes the next slice of the span.
INSERT INTO dedup_records (scope, key, kt, state, owner, token, lease_until, attempts, fingerprint, result, created_at, updated_at, expires_at)
SELECT g.scope, g.k, dedup_kt(g.k), 'completed', NULL, nextval('dedup_token_seq'), NULL, 1, sha256(g.k), substring(sha256(g.k || '\x00'::bytea) FROM 1 FOR 16), now(), now(), now() + interval '7 days'
FROM (SELECT 's' || (i % :scopes) AS scope, convert_to(lpad(to_hex(m >> 16), 8, '0') || '-' || lpad(to_hex(m & 65535), 4, '0') || '-7' || substr(u, 16, 3) || substr(u, 19), 'UTF8') AS k, m
      FROM (SELECT i, :lo_ms::int8 + (:span_ms::int8 * (:slice * :n / :slices + i)) / :n AS m, gen_random_uuid()::text AS u
            FROM generate_series(0, :n / :slices - 1) i) s) g
ORDER BY g.m, g.scope
ON CONFLICT DO NOTHING;
