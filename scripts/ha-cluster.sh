#!/usr/bin/env bash
# A PostgreSQL high-availability cluster for tests: one etcd, two Patroni-managed PostgreSQL
# nodes and HAProxy, on loopback ports of its own, started from an empty directory and torn down
# by PID. It never touches another PostgreSQL (5432), Redis (6379) or etcd (2379/2380).
#
#   scripts/ha-cluster.sh up [--replication sync|async]   start it (or whatever of it is down);
#                                                          prints the endpoint URL
#   scripts/ha-cluster.sh kill-primary --postmaster|--node [--lag-ms N]
#                                                          SIGKILL the primary's postmaster, or the
#                                                          whole node (Patroni, postmaster,
#                                                          backends); prints the node's name and
#                                                          the time of the kill (Unix seconds)
#   scripts/ha-cluster.sh rejoin                           start a killed node, wait until it
#                                                          streams again (sync_standby in sync mode)
#   scripts/ha-cluster.sh wait-writable                    wait until a write goes through
#   scripts/ha-cluster.sh primary                          the primary's name (node1 or node2)
#   scripts/ha-cluster.sh status                           members, roles, replication, endpoint
#   scripts/ha-cluster.sh endpoint                         the endpoint URL
#   scripts/ha-cluster.sh down [--keep]                    stop everything, remove the directory
#                                                          (--keep: all but the data)
#
# Options (or environment):
#   --dir DIR         (HA_CLUSTER_DIR)   default ${TMPDIR:-/tmp}/idempotency-ha
#   --base-port N     (HA_BASE_PORT)     default: the first free block of ports from 15400
#   --replication M   (HA_REPLICATION)   sync (default: synchronous_mode, synchronous_commit=on)
#                                        or async
#   --timeout SECS    (HA_TIMEOUT)       bound of every wait, default 90
#   --lag-ms N        kill-primary only: stop the primary's walsenders (SIGSTOP) N ms before the
#                     kill, so that the standby is behind when the primary dies
#
# Ports from the base: +0 HAProxy read-write (the endpoint: always the primary), +1 HAProxy
# read-only (the standby), +2 etcd client, +3 etcd peer, +10/+11 PostgreSQL of node1/node2,
# +20/+21 Patroni REST API of node1/node2. The endpoint is
# postgres://postgres@127.0.0.1:BASE/postgres (trust authentication on loopback only).
#
# Needs patroni, etcd, haproxy, python3 and PostgreSQL's server binaries (Debian: `apt-get
# install --no-install-recommends patroni etcd-server etcd-client haproxy python3-psycopg2`).
# Run as root, it runs everything as the user idempotency-ha (created if absent): initdb
# refuses root. PostgreSQL runs with fsync=off: the tests kill processes, never the machine,
# and a killed process loses nothing the kernel already holds.
set -euo pipefail

readonly SCOPE=idempotency-ha
readonly HA_USER=idempotency-ha
readonly NODES=(node1 node2)
readonly FORBIDDEN_PORTS=(2379 2380 5432 6379)
readonly PORT_SPAN=30
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly ROOT

DIR=${HA_CLUSTER_DIR:-${TMPDIR:-/tmp}/idempotency-ha}
BASE_PORT=${HA_BASE_PORT:-}
REPLICATION=${HA_REPLICATION:-sync}
TIMEOUT=${HA_TIMEOUT:-90}
KILL_WHAT=""
LAG_MS=0
KEEP=false
RUN_AS=""
LAGGED=()

say() { printf 'ha-cluster: %s\n' "$*" >&2; }
die() {
    say "$*"
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# --- configuration -----------------------------------------------------------------------------

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --dir) DIR=$2; shift ;;
            --base-port) BASE_PORT=$2; shift ;;
            --replication) REPLICATION=$2; shift ;;
            --timeout) TIMEOUT=$2; shift ;;
            --postmaster) KILL_WHAT=postmaster ;;
            --node) KILL_WHAT=node ;;
            --lag-ms) LAG_MS=$2; shift ;;
            --keep) KEEP=true ;;
            -h | --help) usage ;;
            *) die "unknown option $1 (--help lists them)" ;;
        esac
        shift
    done
    case $REPLICATION in sync | async) ;; *) die "--replication is sync or async, not $REPLICATION" ;; esac
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout is a number of seconds"
    [[ $LAG_MS =~ ^[0-9]+$ ]] || die "--lag-ms is a number of milliseconds"
    DIR=$(realpath -m "$DIR")
    # Inside the repository only under target/: never among tracked files.
    if [[ $DIR/ == "$ROOT"/* && $DIR/ != "$ROOT"/target/* ]]; then
        die "$DIR is inside the repository; use a directory under target/ or elsewhere"
    fi
    if [ "$(id -u)" = 0 ]; then RUN_AS=$HA_USER; fi
}

# Ports of a base: the endpoint, the read-only endpoint, etcd, and each node's (see the top).
set_ports() {
    HAPROXY_RW=$BASE_PORT
    HAPROXY_RO=$((BASE_PORT + 1))
    ETCD_CLIENT=$((BASE_PORT + 2))
    ETCD_PEER=$((BASE_PORT + 3))
}
pg_port() { echo $((BASE_PORT + 10 + $1)); }
api_port() { echo $((BASE_PORT + 20 + $1)); }
ports_from() {
    local base=$1 i
    echo "$base $((base + 1)) $((base + 2)) $((base + 3))"
    for i in "${!NODES[@]}"; do echo "$((base + 10 + i)) $((base + 20 + i))"; done
}

port_in_use() {
    if command -v ss >/dev/null; then
        [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]
    else
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
    fi
}

# A base whose whole block is free and holds no port of another service.
block_is_free() {
    local base=$1 port forbidden
    for port in $(ports_from "$base"); do
        for forbidden in "${FORBIDDEN_PORTS[@]}"; do
            [ "$port" != "$forbidden" ] || return 1
        done
        ! port_in_use "$port" || return 1
    done
}

choose_ports() {
    if [ -n "$BASE_PORT" ]; then
        if ! [[ $BASE_PORT =~ ^[0-9]+$ ]] || [ "$BASE_PORT" -lt 1024 ] || [ "$BASE_PORT" -gt 65000 ]; then
            die "--base-port is a port from 1024 to 65000"
        fi
        block_is_free "$BASE_PORT" || die "ports $BASE_PORT-$((BASE_PORT + PORT_SPAN - 1)) are not all free (or hold 2379, 2380, 5432 or 6379)"
    else
        local base
        for base in $(seq 15400 100 25300); do
            if block_is_free "$base"; then BASE_PORT=$base; break; fi
        done
        [ -n "$BASE_PORT" ] || die "no free block of $PORT_SPAN ports from 15400 to 25400"
    fi
    set_ports
}

load_state() {
    [ -f "$DIR/cluster.env" ] || die "no cluster in $DIR (run: $0 up --dir $DIR)"
    # shellcheck source=/dev/null
    . "$DIR/cluster.env"
    set_ports
}

endpoint() { echo "postgres://postgres@127.0.0.1:$HAPROXY_RW/postgres?sslmode=disable"; }

# --- processes ---------------------------------------------------------------------------------

pg_bin() {
    local dir
    if [ -n "${HA_PG_BIN:-}" ]; then echo "$HA_PG_BIN"; return; fi
    for dir in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r); do
        if [ -x "$dir/postgres" ] && [ -x "$dir/pg_rewind" ]; then echo "$dir"; return; fi
    done
    die "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (set HA_PG_BIN)"
}

require_tools() {
    local tool missing=()
    for tool in patroni etcd haproxy python3 psql; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} = 0 ] || die "missing: ${missing[*]} (apt-get install --no-install-recommends patroni etcd-server etcd-client haproxy python3-psycopg2 postgresql-client)"
}

ensure_user() {
    [ -n "$RUN_AS" ] || return 0
    id -u "$RUN_AS" >/dev/null 2>&1 && return 0
    say "creating the user $RUN_AS (initdb refuses root)"
    useradd --system --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin "$RUN_AS"
}

# Whether $1 is a live process of this cluster (its command line names the directory).
ours() {
    local pid=$1 cmdline
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || return 1
    [[ $cmdline == *"$DIR/"* ]]
}

pid_of() { cat "$DIR/pids/$1.pid" 2>/dev/null || true; }
postmaster_of() { head -n 1 "$DIR/$1/data/postmaster.pid" 2>/dev/null || true; }

# Starts "$@" in a session of its own (a Ctrl-C aimed at the caller does not reach it), as the
# cluster's user, output to logs/NAME.log; its PID goes to pids/NAME.pid.
launch() {
    local name=$1
    shift
    if [ -n "$RUN_AS" ]; then
        set -- setpriv --reuid="$RUN_AS" --regid="$RUN_AS" --init-groups -- "$@"
    fi
    HOME=$DIR setsid "$@" </dev/null >>"$DIR/logs/$name.log" 2>&1 &
    echo $! >"$DIR/pids/$name.pid"
}

# Waits until none of the PIDs is alive, at most $1 seconds; 1 if some still are.
wait_gone() {
    local limit=$1 pid alive
    shift
    for _ in $(seq 1 $((limit * 10))); do
        alive=false
        for pid in "$@"; do
            if kill -0 "$pid" 2>/dev/null; then alive=true; fi
        done
        $alive || return 0
        sleep 0.1
    done
    return 1
}

# Polls "$@" every 0.25 s until it succeeds, at most $TIMEOUT seconds.
poll() {
    local what=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@" 2>/dev/null; do
        [ $SECONDS -lt $deadline ] || die "timed out after $TIMEOUT s waiting for $what (logs: $DIR/logs)"
        sleep 0.25
    done
}

# --- queries -----------------------------------------------------------------------------------

sql_at() {
    PGCONNECT_TIMEOUT=2 psql -X -q -A -t -w \
        "host=127.0.0.1 port=$1 user=postgres dbname=postgres application_name=ha-cluster" -c "$2"
}

writable() { [ -n "$(sql_at "$HAPROXY_RW" 'SELECT txid_current()')" ]; }

# The cluster as Patroni's REST API tells it (`/cluster`), from the first node that answers:
# one line per member, "name role state host:port".
members() {
    local ports=() i
    for i in "${!NODES[@]}"; do ports+=("$(api_port "$i")"); done
    python3 - "${ports[@]}" <<'EOF'
import json, sys, urllib.request
for port in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster", timeout=2) as r:
            cluster = json.load(r)
    except Exception:
        continue
    for m in cluster.get("members", []):
        print(m["name"], m.get("role", "-"), m.get("state", "-"), f'{m.get("host")}:{m.get("port")}')
    sys.exit(0)
sys.exit(1)
EOF
}

primary_name() { members | awk '$2 == "leader" && $3 == "running" { print $1 }'; }

# Whether every standby streams from the primary (pg_stat_replication: Patroni 3.0 shows a
# replica as `running`), and, in sync mode, Patroni lists a sync_standby: before it does, a
# two-node cluster has no node it would promote.
replicated() {
    local streaming
    streaming=$(sql_at "$HAPROXY_RW" "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")
    [ "$streaming" -ge $((${#NODES[@]} - 1)) ] || return 1
    if [ "$REPLICATION" = sync ]; then
        members | awk '$2 == "sync_standby" && $3 ~ /running|streaming/ { found = 1 } END { exit !found }'
    fi
}

# --- configuration files -----------------------------------------------------------------------

write_patroni_config() {
    local i=$1 name=${NODES[$1]} sync=false
    [ "$REPLICATION" = sync ] && sync=true
    cat >"$DIR/$name/patroni.yml" <<EOF
scope: $SCOPE
namespace: /service/
name: $name
restapi:
  listen: 127.0.0.1:$(api_port "$i")
  connect_address: 127.0.0.1:$(api_port "$i")
etcd3:
  host: 127.0.0.1:$ETCD_CLIENT
bootstrap:
  dcs:
    # Patroni requires loop_wait + 2 * retry_timeout <= ttl.
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    # With the default (300 s) Patroni restarts a crashed postmaster in place rather than fail over.
    primary_start_timeout: 0
    synchronous_mode: $sync
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        synchronous_commit: "on"
        wal_level: replica
        hot_standby: "on"
        max_connections: 300
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - data-checksums
    - auth: trust
postgresql:
  listen: 127.0.0.1:$(pg_port "$i")
  connect_address: 127.0.0.1:$(pg_port "$i")
  data_dir: $DIR/$name/data
  bin_dir: $PG_BIN
  pgpass: $DIR/$name/pgpass
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  parameters:
    unix_socket_directories: $DIR/$name
    fsync: "off"
    logging_collector: "on"
    log_directory: $DIR/logs
    log_filename: $name-postgresql.log
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
EOF
}

write_haproxy_config() {
    local i servers=""
    for i in "${!NODES[@]}"; do
        servers+="    server ${NODES[$i]} 127.0.0.1:$(pg_port "$i") check port $(api_port "$i")"$'\n'
    done
    cat >"$DIR/haproxy.cfg" <<EOF
global
    maxconn 1000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
    default-server inter 500ms fastinter 250ms downinter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
# The endpoint: whichever node Patroni says is the primary.
listen primary
    bind 127.0.0.1:$HAPROXY_RW
    option httpchk
    http-check send meth OPTIONS uri /primary
    http-check expect status 200
$servers
# Read-only: the standby (never for idempotency records: a replica may be behind).
listen replicas
    bind 127.0.0.1:$HAPROXY_RO
    balance roundrobin
    option httpchk
    http-check send meth OPTIONS uri /replica
    http-check expect status 200
$servers
EOF
}

# --- commands ----------------------------------------------------------------------------------

start_etcd() {
    ours "$(pid_of etcd)" && return 0
    launch etcd etcd --name "$SCOPE" --data-dir "$DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
        --initial-cluster "$SCOPE=http://127.0.0.1:$ETCD_PEER" \
        --initial-cluster-state new --log-level warn
    poll "etcd" python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$ETCD_CLIENT/health', timeout=1)"
}

start_node() {
    local name=$1
    ours "$(pid_of "$name")" && return 0
    # A postmaster that outlived its Patroni (re-parented to PID 1) would hold the data
    # directory: Patroni must find it stopped.
    kill_postmaster "$name" KILL
    say "starting $name"
    launch "$name" patroni "$DIR/$name/patroni.yml"
}

start_haproxy() {
    ours "$(pid_of haproxy)" && return 0
    launch haproxy haproxy -db -f "$DIR/haproxy.cfg"
}

cmd_up() {
    require_tools
    PG_BIN=$(pg_bin)
    if [ -f "$DIR/cluster.env" ]; then
        load_state
        PG_BIN=$(pg_bin)
    else
        if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR")" ]; then
            die "$DIR is not empty and holds no cluster"
        fi
        choose_ports
        ensure_user
        mkdir -p "$DIR"
        mkdir "$DIR/pids" "$DIR/logs"
        local name
        for name in "${NODES[@]}"; do mkdir -m 700 "$DIR/$name"; done
        printf 'BASE_PORT=%s\nREPLICATION=%s\n' "$BASE_PORT" "$REPLICATION" >"$DIR/cluster.env"
        for i in "${!NODES[@]}"; do write_patroni_config "$i"; done
        write_haproxy_config
        if [ -n "$RUN_AS" ]; then
            chown -R "$RUN_AS:$RUN_AS" "$DIR"
            setpriv --reuid="$RUN_AS" --regid="$RUN_AS" --init-groups -- test -w "$DIR" \
                || die "$RUN_AS cannot write $DIR (a parent directory closed to it?)"
        fi
        say "starting in $DIR: $REPLICATION replication, ports $BASE_PORT-$((BASE_PORT + PORT_SPAN - 1))"
    fi
    local started=$SECONDS name
    start_etcd
    for name in "${NODES[@]}"; do start_node "$name"; done
    start_haproxy
    poll "a primary writable through HAProxy" writable
    say "primary writable through 127.0.0.1:$HAPROXY_RW after $((SECONDS - started)) s"
    poll "the standby to stream$([ "$REPLICATION" = sync ] && echo ' and be sync_standby')" replicated
    say "up in $((SECONDS - started)) s: $(members | awk '{ printf "%s%s %s", sep, $1, $2; sep = ", " }')"
    endpoint
}

cmd_rejoin() {
    load_state
    cmd_up
}

# Stops the walsenders of the primary for LAG_MS, so that the standby falls behind; their PIDs
# go to LAGGED (the caller resumes them after the kill, so that they see their postmaster gone).
lag_standby() {
    local name=$1
    mapfile -t LAGGED < <(sql_at "$(pg_port "$(node_index "$name")")" \
        "SELECT pid FROM pg_stat_replication" || true)
    [ ${#LAGGED[@]} -gt 0 ] || return 0
    say "stopping $name's walsender(s) ${LAGGED[*]} for $LAG_MS ms"
    kill -STOP "${LAGGED[@]}" 2>/dev/null || true
    sleep "$(awk -v ms="$LAG_MS" 'BEGIN { printf "%.3f", ms / 1000 }')"
}

node_index() {
    local i
    for i in "${!NODES[@]}"; do [ "${NODES[$i]}" != "$1" ] || { echo "$i"; return; }; done
    die "no node $1"
}

cmd_kill_primary() {
    load_state
    [ -n "$KILL_WHAT" ] || die "kill-primary needs --postmaster or --node"
    local name postmaster killed_at children=() victims=()
    name=$(primary_name) || true
    [ -n "$name" ] || die "no running primary to kill"
    postmaster=$(postmaster_of "$name")
    ours "$postmaster" || die "$name's postmaster is not running"
    [ "$LAG_MS" = 0 ] || lag_standby "$name"
    if [ "$KILL_WHAT" = node ]; then
        # Patroni first, so that it cannot restart the postmaster in between.
        mapfile -t children < <(pgrep -P "$postmaster" || true)
        victims=("$(pid_of "$name")" "$postmaster" "${children[@]}")
    else
        victims=("$postmaster")
    fi
    kill -KILL "${victims[@]}" 2>/dev/null || true
    killed_at=$EPOCHREALTIME
    [ ${#LAGGED[@]} = 0 ] || kill -CONT "${LAGGED[@]}" 2>/dev/null || true
    wait_gone 10 "${victims[@]}" || die "$name's processes outlived SIGKILL"
    say "killed $name's $KILL_WHAT (pids ${victims[*]})"
    echo "$name $killed_at"
}

cmd_wait_writable() {
    load_state
    poll "a primary writable through HAProxy" writable
}

cmd_status() {
    load_state
    local name pid
    echo "endpoint   $(endpoint)"
    echo "read-only  postgres://postgres@127.0.0.1:$HAPROXY_RO/postgres?sslmode=disable"
    echo "directory  $DIR ($REPLICATION replication)"
    for name in etcd haproxy "${NODES[@]}"; do
        pid=$(pid_of "$name")
        if ours "$pid"; then echo "$name pid $pid"; else echo "$name not running"; fi
    done
    members || echo "no Patroni node answers"
    sql_at "$HAPROXY_RW" "SELECT 'replication ' || application_name || ' ' || state || ' ' || sync_state FROM pg_stat_replication" || true
}

# SIGKILLs (or signals $2) the postmaster of node $1 and its backends, if they run.
kill_postmaster() {
    local name=$1 signal=${2:-KILL} postmaster children=()
    postmaster=$(postmaster_of "$name")
    ours "$postmaster" || return 0
    mapfile -t children < <(pgrep -P "$postmaster" || true)
    kill "-$signal" "$postmaster" "${children[@]}" 2>/dev/null || true
    wait_gone 10 "$postmaster" "${children[@]}" || true
}

# Every process whose command line names this cluster's files: postmasters re-parented to
# PID 1 after their Patroni went, and their backends.
strays() {
    local proc pid cmdline
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        if [ "$pid" = $$ ] || [ "$pid" = "$PPID" ]; then continue; fi
        cmdline=$(tr '\0' ' ' 2>/dev/null <"$proc/cmdline") || continue
        case $cmdline in
            *"$DIR/node"* | *"$DIR/etcd"* | *"$DIR/haproxy.cfg"*) echo "$pid" ;;
        esac
    done
}

cmd_down() {
    [ -d "$DIR" ] || { say "nothing in $DIR"; return 0; }
    [ -f "$DIR/cluster.env" ] || [ -z "$(ls -A "$DIR")" ] \
        || die "$DIR holds no cluster: not touching it"
    local name pid left=()
    pid=$(pid_of haproxy)
    if ours "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
    for name in "${NODES[@]}"; do
        pid=$(pid_of "$name")
        if ours "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    for name in "${NODES[@]}"; do kill_postmaster "$name" QUIT; done
    for name in "${NODES[@]}"; do kill_postmaster "$name" KILL; done
    pid=$(pid_of etcd)
    if ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        wait_gone 10 "$pid" || kill -KILL "$pid" 2>/dev/null || true
    fi
    mapfile -t left < <(strays)
    if [ ${#left[@]} -gt 0 ]; then
        say "killing leftover processes ${left[*]}"
        kill -KILL "${left[@]}" 2>/dev/null || true
    fi
    mapfile -t left < <(strays)
    [ ${#left[@]} = 0 ] || wait_gone 10 "${left[@]}" || die "processes ${left[*]} outlived SIGKILL"
    if $KEEP; then
        rm -rf "$DIR/etcd" "$DIR"/node*/data
        say "stopped; kept $DIR (logs in $DIR/logs), its data removed"
    else
        rm -rf "$DIR"
        say "stopped and removed $DIR"
    fi
}

main() {
    [ $# -gt 0 ] || usage
    local command=$1
    shift
    parse_args "$@"
    case $command in
        up) cmd_up ;;
        rejoin) cmd_rejoin ;;
        kill-primary) cmd_kill_primary ;;
        wait-writable) cmd_wait_writable ;;
        primary) load_state; primary_name | grep . || die "no running primary" ;;
        status) cmd_status ;;
        endpoint) load_state; endpoint ;;
        down) cmd_down ;;
        -h | --help | help) usage ;;
        *) die "unknown command $command (--help lists them)" ;;
    esac
}

main "$@"
