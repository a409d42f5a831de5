-- The time of a UUIDv7 key, as Postgres reads it: the first piece of the window partitioned by the
-- key's own time (issue 26; docs/design/window-partitions.md). No statement calls it yet.
--
-- dedup_uuid7_ms_v1(key) is the key's 48-bit millisecond time if the key is a UUIDv7 (RFC 9562:
-- version 7, variant 10), as 36 bytes of canonical text (8-4-4-4-12 hex digits, either case) or
-- as its 16 raw bytes; NULL for every other byte string. It is the same function of the bytes as
-- IdempotencyKey::uuid7_millis in dedup-core, and tests/it/pg_key_time.rs holds the two together
-- (every single-byte change of a text key and of a raw key, and a random corpus).
--
-- A partition key built on it must never change for a stored row, so both functions are:
--   * total: no byte string raises. No text conversion (which fails on bytes that are not
--     UTF-8), no decode(..., 'hex') (which fails on a bad digit); get_byte only inside the CASE
--     arm whose length makes every index valid, and the arms nest, so that constant folding of
--     a literal never evaluates an arm whose guard is false;
--   * immutable in fact, not only in name: byte and integer arithmetic only, no time zone, no
--     DateStyle, no collation; and SQL-standard bodies (RETURN ...), parsed when created, so the
--     helper is bound by its identity, not looked up on the caller's search_path (a string body
--     failed under search_path = '', as pg_dump and maintenance commands set it), and cannot be
--     dropped while dedup_uuid7_ms_v1 needs it;
--   * never replaced: a change is a new function under a new name (_v2), with a migration that
--     moves what it maps differently.
-- They are plain expressions (not STRICT, no subquery, no SET), so the planner inlines them into
-- the statement that calls them on a column or a parameter: about 2-4 us a key. (A call on a
-- volatile expression is not inlined, and a form with a scalar subquery cost 380 us.)
--
-- They only add, so the floor stays 1. Generation 6: a binary of generation 6 in verify mode
-- wants this migration applied; one of generation 5 does not call it.

CREATE FUNCTION dedup_hex_digit_v1(b int4) RETURNS int8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN b BETWEEN 48 AND 57 THEN b - 48
    WHEN b BETWEEN 97 AND 102 THEN b - 87
    WHEN b BETWEEN 65 AND 70 THEN b - 55
    ELSE -1
END::int8;

CREATE FUNCTION dedup_uuid7_ms_v1(k bytea) RETURNS int8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE octet_length(k)
    WHEN 16 THEN CASE WHEN get_byte(k, 6) >> 4 = 7 AND get_byte(k, 8) >> 6 = 2 THEN
        ((((get_byte(k, 0)::int8 * 256 + get_byte(k, 1)) * 256 + get_byte(k, 2)) * 256
            + get_byte(k, 3)) * 256 + get_byte(k, 4)) * 256 + get_byte(k, 5)
        END
    WHEN 36 THEN CASE WHEN get_byte(k, 8) = 45 AND get_byte(k, 13) = 45
        AND get_byte(k, 18) = 45 AND get_byte(k, 23) = 45
        AND get_byte(k, 14) = 55 AND get_byte(k, 19) IN (56, 57, 97, 98, 65, 66)
        AND least(
            dedup_hex_digit_v1(get_byte(k, 0)), dedup_hex_digit_v1(get_byte(k, 1)), dedup_hex_digit_v1(get_byte(k, 2)),
            dedup_hex_digit_v1(get_byte(k, 3)), dedup_hex_digit_v1(get_byte(k, 4)), dedup_hex_digit_v1(get_byte(k, 5)),
            dedup_hex_digit_v1(get_byte(k, 6)), dedup_hex_digit_v1(get_byte(k, 7)), dedup_hex_digit_v1(get_byte(k, 9)),
            dedup_hex_digit_v1(get_byte(k, 10)), dedup_hex_digit_v1(get_byte(k, 11)), dedup_hex_digit_v1(get_byte(k, 12)),
            dedup_hex_digit_v1(get_byte(k, 14)), dedup_hex_digit_v1(get_byte(k, 15)), dedup_hex_digit_v1(get_byte(k, 16)),
            dedup_hex_digit_v1(get_byte(k, 17)), dedup_hex_digit_v1(get_byte(k, 19)), dedup_hex_digit_v1(get_byte(k, 20)),
            dedup_hex_digit_v1(get_byte(k, 21)), dedup_hex_digit_v1(get_byte(k, 22)), dedup_hex_digit_v1(get_byte(k, 24)),
            dedup_hex_digit_v1(get_byte(k, 25)), dedup_hex_digit_v1(get_byte(k, 26)), dedup_hex_digit_v1(get_byte(k, 27)),
            dedup_hex_digit_v1(get_byte(k, 28)), dedup_hex_digit_v1(get_byte(k, 29)), dedup_hex_digit_v1(get_byte(k, 30)),
            dedup_hex_digit_v1(get_byte(k, 31)), dedup_hex_digit_v1(get_byte(k, 32)), dedup_hex_digit_v1(get_byte(k, 33)),
            dedup_hex_digit_v1(get_byte(k, 34)), dedup_hex_digit_v1(get_byte(k, 35))) >= 0
        THEN
            (((((((((((dedup_hex_digit_v1(get_byte(k, 0))) * 16
            + dedup_hex_digit_v1(get_byte(k, 1))) * 16
            + dedup_hex_digit_v1(get_byte(k, 2))) * 16
            + dedup_hex_digit_v1(get_byte(k, 3))) * 16
            + dedup_hex_digit_v1(get_byte(k, 4))) * 16
            + dedup_hex_digit_v1(get_byte(k, 5))) * 16
            + dedup_hex_digit_v1(get_byte(k, 6))) * 16
            + dedup_hex_digit_v1(get_byte(k, 7))) * 16
            + dedup_hex_digit_v1(get_byte(k, 9))) * 16
            + dedup_hex_digit_v1(get_byte(k, 10))) * 16
            + dedup_hex_digit_v1(get_byte(k, 11))) * 16
            + dedup_hex_digit_v1(get_byte(k, 12))
        END
END;

UPDATE dedup_schema SET generation = 6;
