#!/usr/bin/env bash
# A 3-member etcd cluster on loopback, for ft_launcher's --rdzv-backend etcd (etcd v3
# through the JSON gateway every member serves at /v3/, checked at start) and etcd-v2
# (torch's etcd rendezvous speaks the v2 API only: enabled on etcd before 3.6, which
# removed it).
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

http() {  # http PORT PATH [BODY]: a GET, or a POST of BODY; prints the answer's body
    local port=$1 path=$2 body=${3:-}
    if command -v curl >/dev/null; then
        if [[ -n $body ]]; then
            curl -fsS --max-time 1 -X POST -d "$body" "http://$HOST:$port$path" 2>/dev/null
        else
            curl -fsS --max-time 1 "http://$HOST:$port$path" 2>/dev/null
        fi
    elif [[ -n $body ]]; then
        timeout 1 bash -c "exec 3<>/dev/tcp/$HOST/$port; printf 'POST $path HTTP/1.0\r\nContent-Length: ${#body}\r\n\r\n%s' '$body' >&3; cat <&3" 2>/dev/null
    else
        timeout 1 bash -c "exec 3<>/dev/tcp/$HOST/$port; printf 'GET $path HTTP/1.0\r\n\r\n' >&3; cat <&3" 2>/dev/null
    fi
}

healthy() {  # healthy PORT: a leader is elected and the v3 gateway answers
    local body
    body=$(http "$1" /health) || return 1
    [[ $body == *'"health":"true"'* ]] || return 1
    body=$(http "$1" /v3/maintenance/status '{}') || return 1
    [[ $body == *'"leader":"'* ]]
}

v2_flag() {  # --enable-v2=true where this etcd still has the v2 API (before 3.6)
    local version major minor
    version=$(etcd --version 2>/dev/null | sed -n 's/^etcd Version: *//p')
    IFS=. read -r major minor _ <<<"$version"
    if [[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] && ((major == 3 && minor < 6)); then
        echo --enable-v2=true
    fi
}

alive() { [[ -f $1 ]] && running "$(cat "$1")"; }

running() {  # running PID: the process exists and is not a zombie waiting for its reaper
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}

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
    local token="ft-$$-$RANDOM" v2
    v2=$(v2_flag)
    for i in $(seq 0 $((MEMBERS - 1))); do
        alive "$dir/m$i.pid" && die "member m$i already runs (pid $(cat "$dir/m$i.pid"))"
        # shellcheck disable=SC2086  # $v2 and ETCD_EXTRA_ARGS are lists of words
        setsid etcd --name "m$i" --data-dir "$dir/m$i.etcd" \
            --listen-client-urls "http://$HOST:${client[$i]}" \
            --advertise-client-urls "http://$HOST:${client[$i]}" \
            --listen-peer-urls "http://$HOST:${peer[$i]}" \
            --initial-advertise-peer-urls "http://$HOST:${peer[$i]}" \
            --initial-cluster "$cluster" --initial-cluster-token "$token" \
            --initial-cluster-state new $v2 ${ETCD_EXTRA_ARGS:-} \
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

stop() {  # the followers, then the leader: a leader stopped beside its followers hands its
    # leadership to one of them, which then waits seconds for a quorum that is gone.
    local dir=${1:-} i pid leader=""
    local -a followers=() names=()
    [[ -n $dir && -d $dir ]] || die "stop: give the cluster's DIR"
    for i in $(seq 0 $((MEMBERS - 1))); do
        [[ -f $dir/m$i.pid ]] || continue
        pid=$(cat "$dir/m$i.pid")
        # Only an etcd process: a stale pid file must not kill whatever reuses the pid.
        if running "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == etcd ]]; then
            if [[ -z $leader ]] && is_leader "$(cat "$dir/m$i.endpoint")"; then
                leader=$pid
            else
                followers+=("$pid")
            fi
        fi
        names+=("m$i (pid $pid)")
    done
    terminate ${followers[@]+"${followers[@]}"}
    terminate ${leader:+"$leader"}
    for i in $(seq 0 $((MEMBERS - 1))); do rm -f "$dir/m$i.pid"; done
    for i in "${names[@]}"; do echo "stopped $i"; done
}

is_leader() {  # is_leader HOST:PORT: the member's own status names it the leader
    local body id
    body=$(http "${1##*:}" /v3/maintenance/status '{}') || return 1
    id=$(sed -n 's/.*"member_id":"\([0-9]*\)".*/\1/p' <<<"$body")
    [[ -n $id && $body == *"\"leader\":\"$id\""* ]]
}

terminate() {  # terminate PID...: SIGTERM them all, SIGKILL what still runs after 5 s
    local pid
    (($#)) || return 0
    kill "$@" 2>/dev/null || true
    for pid in "$@"; do
        for _ in $(seq 50); do running "$pid" || break; sleep 0.1; done
        if running "$pid"; then kill -9 "$pid"; fi
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
