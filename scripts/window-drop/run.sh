#!/bin/bash
# Claims by pgbench (2 clients, batches of 128 new UUIDv7 keys, every latency logged) on
# database $1 for $2 s; `dedup purge` started $3 s in; then `lat.py $4` gives the claims'
# rate, p50, p99 and longest wait before, while and after it. Needs PGURL and DEDUP.
D=$(cd "$(dirname "$0")" && pwd)
U=$PGURL/$1
OUT=${OUT:-/tmp/window-drop}
mkdir -p "$OUT"; rm -f "$OUT/$4"_log*
cd "$OUT"
pgbench -n -c 2 -j 2 -T "$2" -l --log-prefix="$OUT/$4_log" -f "$D/claim.sql" "$U" > "$OUT/$4_pgbench.out" 2>&1 &
PB=$!
sleep "$3"
s=$(date +%s%3N)
RUST_LOG=info "$DEDUP" purge --database-url "$U" > "$OUT/$4_purge.out" 2>&1
e=$(date +%s%3N)
echo "$s $e" > "$OUT/$4_window"
v0=$(date +%s%3N); psql -q "$U" -c "VACUUM dedup_records"; v1=$(date +%s%3N)
echo "purge $((e - s)) ms, vacuum after $((v1 - v0)) ms" >> "$OUT/$4_purge.out"
wait $PB
OUT=$OUT python3 "$D/lat.py" "$4"
