#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the tests, on 127.0.0.1 only, with its
# data under DIR (normally target/postgres). Trust authentication, no fsync:
# it holds nothing worth keeping.
#
#   scripts/test-postgres.sh start DIR   prints the URL to export as DEXA_TEST_POSTGRES
#   scripts/test-postgres.sh start-tls DIR
#                                        the same, but TLS only (a test CA in DIR/ca.crt,
#                                        a server certificate for 127.0.0.1; plain
#                                        connections are refused); needs openssl
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
    local dir=$1 port tls=""
    port=$(cat "$dir/port")
    [ ! -f "$dir/ca.crt" ] || tls="-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key"
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir/data -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=600 $tls" \
        start >/dev/null
}

# A test CA and a server certificate for 127.0.0.1 signed by it; only TLS
# connections accepted.
make_tls() {
    local dir=$1 data=$1/data
    openssl req -x509 -new -nodes -days 2 -subj /CN=dexa-test-ca \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" >/dev/null 2>&1
    openssl req -new -nodes -subj /CN=127.0.0.1 \
        -keyout "$data/server.key" -out "$dir/server.csr" >/dev/null 2>&1
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' >"$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -CAcreateserial -days 2 -extfile "$dir/server.ext" -out "$data/server.crt" >/dev/null 2>&1
    chmod 600 "$data/server.key"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$data/server.key" "$data/server.crt"
    printf 'local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n' >"$data/pg_hba.conf"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$data/pg_hba.conf"
}

case "$action" in
start|start-tls)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ "$(id -u)" -ne 0 ] || chown postgres: "$dir"
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    fi
    rm -rf "$dir/data" "$dir/ca.crt"
    as_owner "$bin/initdb" -D "$dir/data" -U dexa --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    # A free port, so that two checkouts on one machine do not collide.
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "$port" >"$dir/port"
    [ "$action" != start-tls ] || make_tls "$dir"
    serve "$dir"
    as_owner "$bin/createdb" -h "$dir/data" -p "$port" -U dexa dexa
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
    echo "usage: $0 start|start-tls|stop|pause|resume DIR" >&2
    exit 2
    ;;
esac
