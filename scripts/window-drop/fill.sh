#!/bin/bash
# Fills database $1 with 10,000,000 expired records with UUIDv7 keys of 2026-11-09 to -16, three
# of them made live. Needs PGURL.
D=$(dirname "$0")
U=$PGURL/$1
start=$(date +%s)
for i in $(seq 1 10); do psql -q "$U" -v lo_ms=1794182400000 -v span_ms=604800000 -f "$D/fill.sql"; done
psql -q "$U" -c "UPDATE dedup_records SET expires_at = now() + interval '1 day' WHERE (scope, key, kt) IN (SELECT scope, key, kt FROM dedup_records WHERE kt >= '2026-11-09' AND kt < '2026-11-16' LIMIT 3)"
psql -q "$U" -c "VACUUM ANALYZE" -c "CHECKPOINT"
echo "fill $1: $(( $(date +%s) - start )) s"
