#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the tests, on 127.0.0.1 only, with its
# data under DIR (normally target/postgres). Trust authentication, no fsync:
# it holds nothing worth keeping.
#
#   scripts/test-postgres.sh start DIR   prints the URL to export as DEXA_TEST_POSTGRES
#   scripts/test-postgres.sh stop DIR    stops it (and is safe to call twice)
#   scripts/test-postgres.sh pause DIR   stops the server, keeping its data and port
#   scripts/test-postgres.sh resume DIR  starts it again (a restart, for outage tests)
#
# Needs Debian's postgresql package (ci.sh installs it). As root, the
# cluster runs as the `postgres` user, since PostgreSQL refuses root.
set -euo pipefail

action=${1:?start or stop}
dir=${2:?the data directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
[ -n "$bin" ] || { echo "PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1; }

as_owner() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# Starts the server of DIR on the port saved in DIR/port.
serve() {
    local dir=$1 port
    port=$(cat "$dir/port")
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir/data -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=600" \
        start >/dev/null
}

case "$action" in
start)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ "$(id -u)" -ne 0 ] || chown postgres: "$dir"
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    fi
    rm -rf "$dir/data"
    as_owner "$bin/initdb" -D "$dir/data" -U dexa --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    # A free port, so that two checkouts on one machine do not collide.
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "$port" >"$dir/port"
    serve "$dir"
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U dexa dexa
    echo "postgres://dexa@127.0.0.1:$port/dexa"
    ;;
pause)
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    ;;
resume)
    serve "$(cd "$dir" && pwd)"
    ;;
stop)
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 \
            || as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    fi
    ;;
*)
    echo "usage: $0 start|stop|pause|resume DIR" >&2
    exit 2
    ;;
esac
