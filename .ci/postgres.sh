#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the database tests.
#
#   source <(bash .ci/postgres.sh)        # start; exports FLASHTUNE_TEST_PG_URL and FLASHTUNE_TEST_PG_DIR
#   bash .ci/postgres.sh stop             # stop the server named by FLASHTUNE_TEST_PG_DIR, delete its files
#
# Installs PostgreSQL from Debian packages when no server binaries are found, initialises a
# cluster in a fresh temporary directory (as the `postgres` OS user when run as root, since
# PostgreSQL refuses to run as root), starts it on 127.0.0.1 on a free port with trust
# authentication (loopback only, throwaway data) and creates the database `flashtune_test`.
# Only the `export ...` lines go to stdout, so the output can be sourced; progress goes to stderr.
# On failure nothing is exported and the exit status is non-zero; the PostgreSQL tests then
# skip and say why.
set -euo pipefail

log() { echo "postgres.sh: $*" >&2; }

as_owner() {
    # Run a command as the cluster's owner: `postgres` when we are root, else ourselves.
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

if [ "${1:-start}" = stop ]; then
    dir=${FLASHTUNE_TEST_PG_DIR:?FLASHTUNE_TEST_PG_DIR is not set: nothing to stop}
    bin=$(cat "$dir/bindir")
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >&2 || log "server was not running"
    rm -rf "$dir"
    exit 0
fi

find_bin() {
    local candidates
    candidates=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V || true)
    for d in $candidates; do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then bin=$d; fi
    done
}

bin=""
find_bin
if [ -z "$bin" ]; then
    if [ "$(id -u)" != 0 ]; then
        log "PostgreSQL is not installed and we are not root; install the 'postgresql' package"
        exit 1
    fi
    log "installing PostgreSQL from Debian packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
    find_bin
    [ -n "$bin" ] || { log "no initdb/pg_ctl found after installing postgresql"; exit 1; }
fi

# A free port from the kernel; without python3, a random high port.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
       2>/dev/null || echo $((20000 + RANDOM % 30000)))

dir=$(mktemp -d /tmp/flashtune-pg.XXXXXX)
echo "$bin" >"$dir/bindir"
if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || { log "no 'postgres' OS user; install the postgresql package"; exit 1; }
    chown postgres "$dir"
fi
chmod 700 "$dir"

log "initialising a cluster in $dir with $bin"
as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; exit 1; }

# Durability is pointless for throwaway test data; turning it off makes the tests faster.
opts="-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off"
opts="$opts -c full_page_writes=off -c max_connections=100"
if ! as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -o "$opts" -w -t 60 start >&2; then
    cat "$dir/server.log" >&2
    exit 1
fi
as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres flashtune_test

log "PostgreSQL listening on 127.0.0.1:$port"
echo "export FLASHTUNE_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:$port/flashtune_test"
echo "export FLASHTUNE_TEST_PG_DIR=$dir"
