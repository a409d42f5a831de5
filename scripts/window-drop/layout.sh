#!/bin/bash
# A fresh database $1 with dedup's schema: the single table ($2 = single), or the table
# partitioned by the key's time as `maintain_ranges` leaves it four weeks after a switch on
# 2026-11-01 (ranges 2026-11-01 to 2026-12-07, each with its BRIN index on expires_at, then
# `future`). `dedup_kt`'s T0 is set to
# 2026-11-01 by hand: the only thing here the product does not make.
# The dates are those of the sitting of 2026-11-28 (the 10M range is due for dropping from
# 2026-11-24, and the ranges reach 2026-12-07): shift them to measure on another day.
# Needs PGURL (a server, e.g. postgres://postgres@127.0.0.1:55432) and DEDUP (the binary).
# RANGE_PK: the ranges' primary key columns, "key, scope" as the retention makes them since the
# twenty-seventh session (the default), or "scope, key" as before.
set -e
DB=$1
U=$PGURL/$DB
psql "$PGURL/postgres" -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
"$DEDUP" migrate --database-url "$U" > /dev/null
[ "$2" = "single" ] && exit 0
"$DEDUP" migrate --database-url "$U" --partition-by-key-time > /dev/null
psql -v ON_ERROR_STOP=1 -v pk="${RANGE_PK:-key, scope}" -q "$U" <<'SQL'
DO $d$
DECLARE def text; t0 text;
BEGIN
  def := pg_get_functiondef('dedup_kt(bytea)'::regprocedure);
  t0 := (regexp_match(def, 'GREATEST\(dedup_key_ms_v1\(p_key\), \(?''?(\d+)'))[1];
  IF t0 IS NULL THEN RAISE EXCEPTION 'no T0 in %', def; END IF;
  EXECUTE replace(def, t0, (20758::int8 * 86400000 - 1)::text);
END $d$;
DO $x$ DECLARE r record; BEGIN
  FOR r IN SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'dedup_records'::regclass AND c.relname ~ '^dedup_records_[0-9]{8}$'
  LOOP EXECUTE format('ALTER TABLE dedup_records DETACH PARTITION %I', r.relname);
       EXECUTE format('DROP TABLE %I', r.relname); END LOOP;
  ALTER TABLE dedup_records DETACH PARTITION dedup_records_future;
  ALTER TABLE dedup_records ATTACH PARTITION dedup_records_future FOR VALUES FROM ('2026-12-07') TO (MAXVALUE);
END $x$;
CREATE TABLE dedup_records_20261101 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-01') TO ('2026-11-02');
CREATE INDEX dedup_records_20261101_expires_at_brin ON dedup_records_20261101 USING brin (expires_at);
CREATE TABLE dedup_records_20261102 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-02') TO ('2026-11-09');
CREATE INDEX dedup_records_20261102_expires_at_brin ON dedup_records_20261102 USING brin (expires_at);
CREATE TABLE dedup_records_20261109 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-09') TO ('2026-11-16');
CREATE INDEX dedup_records_20261109_expires_at_brin ON dedup_records_20261109 USING brin (expires_at);
CREATE TABLE dedup_records_20261116 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-16') TO ('2026-11-23');
CREATE INDEX dedup_records_20261116_expires_at_brin ON dedup_records_20261116 USING brin (expires_at);
CREATE TABLE dedup_records_20261123 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-23') TO ('2026-11-30');
CREATE INDEX dedup_records_20261123_expires_at_brin ON dedup_records_20261123 USING brin (expires_at);
CREATE TABLE dedup_records_20261130 PARTITION OF dedup_records (PRIMARY KEY (:pk)) FOR VALUES FROM ('2026-11-30') TO ('2026-12-07');
CREATE INDEX dedup_records_20261130_expires_at_brin ON dedup_records_20261130 USING brin (expires_at);
SQL
psql -Atc "SELECT pg_get_functiondef('dedup_kt(bytea)'::regprocedure)" "$U" | grep -o "GREATEST([^)]*)[^)]*)"
