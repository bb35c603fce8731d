#!/usr/bin/env bash
# A 3-member etcd cluster on loopback with the v2 API enabled, for ft_launcher's
# --rdzv-backend etcd-v2 (torch's etcd rendezvous speaks the v2 API only).
#
#   scripts/etcd_cluster.sh start [DIR]   start 3 members, wait for a leader, print endpoints
#   scripts/etcd_cluster.sh stop DIR      stop every member by the pid it wrote
#   scripts/etcd_cluster.sh status DIR    one line per member: name pid client-url alive|dead
#
# DIR (default: a new temp dir) holds per-member data dirs (m0.etcd ...), logs (m0.log),
# pid files (m0.pid) and `endpoints` (host:port,host:port,host:port for --rdzv-endpoint).
# Ports: ETCD_CLIENT_PORTS and ETCD_PEER_PORTS (comma-separated, 3 each) or, by default,
# ETCD_BASE_PORT (23790) .. +5. ETCD_EXTRA_ARGS is added to every member's command line.
# Needs the `etcd` binary (Debian: apt-get install etcd-server). Loopback only.
set -euo pipefail

MEMBERS=3
HOST=127.0.0.1

die() { echo "etcd_cluster.sh: $*" >&2; exit 1; }

ports() {  # ports NAME DEFAULT_OFFSET -> three ports
    local given=$1 offset=$2 base=${ETCD_BASE_PORT:-23790}
    if [[ -n $given ]]; then
        IFS=, read -r -a out <<<"$given"
        [[ ${#out[@]} -eq $MEMBERS ]] || die "expected $MEMBERS ports, got '$given'"
    else
        out=($((base + offset)) $((base + offset + 2)) $((base + offset + 4)))
    fi
    echo "${out[@]}"
}

healthy() {  # healthy PORT: the member answers /health with a leader elected
    local body
    if command -v curl >/dev/null; then
        body=$(curl -fsS --max-time 1 "http://$HOST:$1/health" 2>/dev/null) || return 1
    else
        body=$(timeout 1 bash -c "exec 3<>/dev/tcp/$HOST/$1; printf 'GET /health HTTP/1.0\r\n\r\n' >&3; cat <&3" 2>/dev/null) || return 1
    fi
    [[ $body == *'"health":"true"'* ]]
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    local dir=${1:-}
    command -v etcd >/dev/null || die "etcd not found; install it: apt-get install -y etcd-server"
    if [[ -z $dir ]]; then dir=$(mktemp -d -t etcd_cluster.XXXXXX); fi
    mkdir -p "$dir"
    chmod 700 "$dir"
    read -r -a client <<<"$(ports "${ETCD_CLIENT_PORTS:-}" 0)"
    read -r -a peer <<<"$(ports "${ETCD_PEER_PORTS:-}" 1)"
    local cluster="" endpoints="" i
    for i in $(seq 0 $((MEMBERS - 1))); do
        cluster+="${cluster:+,}m$i=http://$HOST:${peer[$i]}"
        endpoints+="${endpoints:+,}$HOST:${client[$i]}"
    done
    local token="ft-$$-$RANDOM"
    for i in $(seq 0 $((MEMBERS - 1))); do
        alive "$dir/m$i.pid" && die "member m$i already runs (pid $(cat "$dir/m$i.pid"))"
        # shellcheck disable=SC2086  # ETCD_EXTRA_ARGS is a list of words
        setsid etcd --name "m$i" --data-dir "$dir/m$i.etcd" \
            --listen-client-urls "http://$HOST:${client[$i]}" \
            --advertise-client-urls "http://$HOST:${client[$i]}" \
            --listen-peer-urls "http://$HOST:${peer[$i]}" \
            --initial-advertise-peer-urls "http://$HOST:${peer[$i]}" \
            --initial-cluster "$cluster" --initial-cluster-token "$token" \
            --initial-cluster-state new --enable-v2=true ${ETCD_EXTRA_ARGS:-} \
            >"$dir/m$i.log" 2>&1 </dev/null &
        echo $! >"$dir/m$i.pid"
        echo "$HOST:${client[$i]}" >"$dir/m$i.endpoint"
    done
    echo "$endpoints" >"$dir/endpoints"
    local deadline=$((SECONDS + ${ETCD_START_TIMEOUT:-30}))
    for i in $(seq 0 $((MEMBERS - 1))); do
        until healthy "${client[$i]}"; do
            if ! alive "$dir/m$i.pid"; then
                stop "$dir" >/dev/null
                die "member m$i exited; last log lines:$(printf '\n'; tail -5 "$dir/m$i.log")"
            fi
            if ((SECONDS > deadline)); then
                stop "$dir" >/dev/null
                die "no healthy cluster within ${ETCD_START_TIMEOUT:-30} s (see $dir/m$i.log)"
            fi
            sleep 0.1
        done
    done
    echo "dir=$dir"
    echo "endpoints=$endpoints"
}

stop() {
    local dir=${1:-} i pid
    [[ -n $dir && -d $dir ]] || die "stop: give the cluster's DIR"
    for i in $(seq 0 $((MEMBERS - 1))); do
        [[ -f $dir/m$i.pid ]] || continue
        pid=$(cat "$dir/m$i.pid")
        # Only an etcd process: a stale pid file must not kill whatever reuses the pid.
        if kill -0 "$pid" 2>/dev/null && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == etcd ]]; then
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
        rm -f "$dir/m$i.pid"
        echo "stopped m$i (pid $pid)"
    done
}

status() {
    local dir=${1:-} i state
    [[ -n $dir && -d $dir ]] || die "status: give the cluster's DIR"
    for i in $(seq 0 $((MEMBERS - 1))); do
        state=dead
        alive "$dir/m$i.pid" && state=alive
        echo "m$i $(cat "$dir/m$i.pid" 2>/dev/null || echo -) $(cat "$dir/m$i.endpoint") $state"
    done
}

case ${1:-} in
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    status) status "${2:-}" ;;
    *) die "usage: $0 start [DIR] | stop DIR | status DIR" ;;
esac
