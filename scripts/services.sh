# shellcheck shell=bash
# Sourced by the project's commands. Installs (when root) and starts the servers dedup's tests and
# demo need, on loopback, in private data directories, and exports their URLs.
#
#   ensure_postgres   -> DATABASE_URL (superuser on a private cluster; tests create a database each)
#                        and PG_BINDIR (tests start throwaway servers of their own from it)
#   ensure_redis      -> REDIS_URL (a private redis-server) and REDIS_SERVER_BIN (tests spawn
#                        servers of their own from it)
#   ensure_redis_cluster -> REDIS_CLUSTER_URLS (three masters on loopback, comma-separated;
#                        ports of at most 55535, since each bus port is 10000 higher)
#   ensure_nisshi     -> NISSHI_BIN: a Kafka-compatible broker (nisshi) the Kafka tests start per
#                        test. Built once with cargo and cached in $DEDUP_CACHE (15 to 25 minutes
#                        on two cores the first time; seconds after).
#
# A server that cannot be started is an error: nothing is skipped. Sourcing this file changes no
# shell options; the scripts that source it set their own.

DEDUP_PG_PORT="${DEDUP_PG_PORT:-55432}"
DEDUP_PG_DIR="${DEDUP_PG_DIR:-/tmp/dedup-pg-$DEDUP_PG_PORT}"
DEDUP_REDIS_PORT="${DEDUP_REDIS_PORT:-56379}"
DEDUP_REDIS_DIR="${DEDUP_REDIS_DIR:-/tmp/dedup-redis-$DEDUP_REDIS_PORT}"
DEDUP_REDIS_CLUSTER_PORTS="${DEDUP_REDIS_CLUSTER_PORTS:-46401 46402 46403}"
DEDUP_CACHE="${DEDUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dedup}"
# nisshi 0.7 and later need rustc 1.96 (through rama 0.4); 0.6.0 builds with our 1.95. Its
# in-memory storage needs `dynostore`; `postgres` storage lets a broker restart keep its data.
NISSHI_VERSION="${NISSHI_VERSION:-0.6.0}"
NISSHI_FEATURES="postgres,dynostore"

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }

is_root() { [ "$(id -u)" -eq 0 ]; }

apt_updated=""
apt_install() {
  is_root || die "missing packages: $* (run once as root, or install them: apt-get install $*)"
  if [ -z "$apt_updated" ]; then
    log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    apt_updated=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# rdkafka builds librdkafka from source: a C compiler and make.
ensure_build_tools() {
  local missing=()
  command -v cc >/dev/null || missing+=(gcc libc6-dev)
  command -v make >/dev/null || missing+=(make)
  command -v perl >/dev/null || missing+=(perl)
  # librdkafka's TLS and SASL SCRAM link the system's OpenSSL; tests make certificates with openssl.
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
  command -v openssl >/dev/null || missing+=(openssl)
  [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
}

pg_bindir() {
  local d
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
  [ -n "$d" ] && [ -x "$d/postgres" ] && printf '%s' "$d"
}

# Runs a command as the cluster's owner: `postgres` when we are root (initdb and postgres refuse
# to run as root), ourselves otherwise.
as_pg_owner() {
  if is_root; then runuser -u postgres -- "$@"; else "$@"; fi
}

ensure_postgres() {
  local bin
  bin="$(pg_bindir)" || true
  if [ -z "$bin" ]; then
    apt_install postgresql
    bin="$(pg_bindir)" || die "postgresql installed but no server binary found under /usr/lib/postgresql"
  fi
  if ! "$bin/pg_isready" -q -h 127.0.0.1 -p "$DEDUP_PG_PORT"; then
    if [ ! -f "$DEDUP_PG_DIR/PG_VERSION" ]; then
      log "initdb $DEDUP_PG_DIR"
      mkdir -p "$DEDUP_PG_DIR"
      is_root && chown postgres:postgres "$DEDUP_PG_DIR"
      chmod 700 "$DEDUP_PG_DIR"
      # trust on loopback only: a throwaway cluster for tests and the demo.
      as_pg_owner "$bin/initdb" -D "$DEDUP_PG_DIR" -U postgres --auth=trust -E UTF8 --no-locale >/dev/null
      cat >>"$DEDUP_PG_DIR/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $DEDUP_PG_PORT
unix_socket_directories = '$DEDUP_PG_DIR'
max_connections = 300
shared_buffers = 256MB
# durability stays on: dedup's ledger must survive a crash.
fsync = on
synchronous_commit = on
CONF
    fi
    if [ -f "$DEDUP_PG_DIR/postgresql.conf" ] && ! grep -q '^wal_compression' "$DEDUP_PG_DIR/postgresql.conf"; then
      # Write-heavy tuning that keeps every guarantee: fewer checkpoints, so fewer full-page
      # images in the WAL, and those compressed (lz4 where the server has it: cheaper than pglz).
      local compression=on
      ldd "$bin/postgres" 2>/dev/null | grep -q liblz4 && compression=lz4
      cat >>"$DEDUP_PG_DIR/postgresql.conf" <<CONF
wal_compression = $compression
max_wal_size = 4GB
checkpoint_timeout = 15min
CONF
    fi
    if [ -f "$DEDUP_PG_DIR/postgresql.conf" ] && ! grep -q '^shared_preload_libraries' "$DEDUP_PG_DIR/postgresql.conf"; then
      # `dedup bench` counts the statements the server ran per unique key (BEGIN and COMMIT too).
      cat >>"$DEDUP_PG_DIR/postgresql.conf" <<CONF
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track_utility = on
CONF
    fi
    log "starting postgres on 127.0.0.1:$DEDUP_PG_PORT"
    as_pg_owner "$bin/pg_ctl" -D "$DEDUP_PG_DIR" -l "$DEDUP_PG_DIR/server.log" -w -t 60 start >/dev/null \
      || { tail -n 20 "$DEDUP_PG_DIR/server.log" >&2 || true; die "postgres did not start"; }
  fi
  export DATABASE_URL="postgres://postgres@127.0.0.1:$DEDUP_PG_PORT/postgres"
  # Tests that crash and restart a Postgres of their own (pg_ctl -m immediate) start it from here.
  export PG_BINDIR="$bin"
  log "DATABASE_URL=$DATABASE_URL"
}

stop_postgres() {
  local bin
  bin="$(pg_bindir)" || return 0
  [ -f "$DEDUP_PG_DIR/PG_VERSION" ] && as_pg_owner "$bin/pg_ctl" -D "$DEDUP_PG_DIR" -m fast stop >/dev/null 2>&1 || true
}

ensure_redis() {
  command -v redis-server >/dev/null || apt_install redis-server redis-tools
  command -v openssl >/dev/null || apt_install openssl   # the TLS test makes its certificates
  command -v redis-server >/dev/null || die "redis-server installed but not on PATH"
  if ! redis-cli -h 127.0.0.1 -p "$DEDUP_REDIS_PORT" ping >/dev/null 2>&1; then
    mkdir -p "$DEDUP_REDIS_DIR"
    log "starting redis on 127.0.0.1:$DEDUP_REDIS_PORT"
    # No persistence: Redis is a cache here; losing it costs speed, never a second effect.
    redis-server --bind 127.0.0.1 --port "$DEDUP_REDIS_PORT" --dir "$DEDUP_REDIS_DIR" \
      --save "" --appendonly no --daemonize yes --databases 1024 \
      --pidfile "$DEDUP_REDIS_DIR/redis.pid" --logfile "$DEDUP_REDIS_DIR/redis.log" >/dev/null
    for _ in $(seq 1 50); do
      redis-cli -h 127.0.0.1 -p "$DEDUP_REDIS_PORT" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
    redis-cli -h 127.0.0.1 -p "$DEDUP_REDIS_PORT" ping >/dev/null 2>&1 \
      || { tail -n 20 "$DEDUP_REDIS_DIR/redis.log" >&2 || true; die "redis did not start"; }
  fi
  export REDIS_URL="redis://127.0.0.1:$DEDUP_REDIS_PORT"
  REDIS_SERVER_BIN="$(command -v redis-server)"
  export REDIS_SERVER_BIN
  log "REDIS_URL=$REDIS_URL"
}

stop_redis() {
  redis-cli -h 127.0.0.1 -p "$DEDUP_REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
}

ensure_redis_cluster() {
  ensure_redis
  local port nodes="" urls=""
  for port in $DEDUP_REDIS_CLUSTER_PORTS; do
    nodes="$nodes 127.0.0.1:$port"
    urls="${urls:+$urls,}redis://127.0.0.1:$port"
    if ! redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1; then
      local dir="/tmp/dedup-redis-cluster-$port"
      rm -rf "$dir" && mkdir -p "$dir"
      redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --cluster-enabled yes \
        --cluster-config-file "$dir/nodes.conf" --save "" --appendonly no --daemonize yes \
        --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" >/dev/null
    fi
  done
  for port in $DEDUP_REDIS_CLUSTER_PORTS; do
    for _ in $(seq 1 50); do
      redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
  done
  local first="${DEDUP_REDIS_CLUSTER_PORTS%% *}"
  if ! redis-cli -h 127.0.0.1 -p "$first" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
    log "creating a 3-master redis cluster on$nodes"
    # shellcheck disable=SC2086
    redis-cli --cluster create $nodes --cluster-replicas 0 --cluster-yes >/dev/null \
      || die "redis-cli --cluster create failed"
    for _ in $(seq 1 100); do
      redis-cli -h 127.0.0.1 -p "$first" cluster info | grep -q 'cluster_state:ok' && break
      sleep 0.1
    done
    redis-cli -h 127.0.0.1 -p "$first" cluster info | grep -q 'cluster_state:ok' \
      || die "the redis cluster did not reach cluster_state:ok"
  fi
  export REDIS_CLUSTER_URLS="$urls"
  log "REDIS_CLUSTER_URLS=$REDIS_CLUSTER_URLS"
}

stop_redis_cluster() {
  local port
  for port in $DEDUP_REDIS_CLUSTER_PORTS; do
    redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true
  done
}

ensure_nisshi() {
  local root="$DEDUP_CACHE/nisshi-$NISSHI_VERSION-${NISSHI_FEATURES//,/-}"
  if [ ! -x "$root/bin/nisshi" ]; then
    log "building nisshi $NISSHI_VERSION once (cached in $root; 15 to 25 minutes on two cores)"
    ensure_build_tools
    cargo install "nisshi@$NISSHI_VERSION" --locked --features "$NISSHI_FEATURES" \
      --root "$root" >&2 || die "cargo install nisshi@$NISSHI_VERSION failed"
  fi
  export NISSHI_BIN="$root/bin/nisshi"
  log "NISSHI_BIN=$NISSHI_BIN"
}
