#!/usr/bin/env bash
# slurm-up.sh - bring up a local Slurm 22.05 cluster (munge + slurmctld +
# one slurmd per node) on Debian 12 WITHOUT systemd and WITHOUT cgroups.
#
# Default: one node called "localhost". SLURM_UP_NODES=N (2..9) gives N nodes "node1"
# .. "nodeN", each served by its own slurmd on this machine (Debian's build has
# MULTIPLE_SLURMD=Yes), which makes --exclude / --nodelist and spare nodes testable.
#
# Idempotent: re-running it when everything is already up only re-checks state
# (packages installed, config unchanged, daemons alive, node(s) idle). If the
# generated slurm.conf differs from the one on disk, the slurm daemons are
# restarted so the new config is used. Saved jobs survive a restart unless
# SLURM_UP_CLEAN=1.
#
# Must run as root. Only talks to 127.0.0.1. Stop with slurm-down.sh.
# The project's tests (tests/slurm) run it with SLURM_UP_NODES=3; see README.md here.
#
# Environment knobs:
#   SLURM_UP_NODES=1       1 -> node "localhost"; N (2..9) -> nodes "node1" .. "nodeN"
#   SLURM_UP_NODENAMES="a b"  explicit node names (overrides SLURM_UP_NODES)
#   SLURM_UP_CLEAN=1       forget all saved jobs (slurmctld -c, wipe spool and
#                          jobcomp.log; job ids restart at 1)
#   SLURM_UP_TIMEOUT=60    seconds to wait for the node(s) to become idle
#   SLURM_UP_NODE_MEM=4096 RealMemory (MB) advertised per node
set -euo pipefail

T0=$(date +%s%N)
elapsed() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
log() { printf '[slurm-up %7ss] %s\n' "$(elapsed)" "$*"; }

[ "$(id -u)" -eq 0 ] || { echo "slurm-up.sh must run as root" >&2; exit 1; }

# Node names. NOTE: Slurm 22.05 treats a lone node called "localhost" as a
# catch-all (any unknown node name resolves to it, so --exclude=<anything>
# excludes it) and refuses "localhost" next to a second node ("Duplicated
# NodeHostName"). So: 1 node -> "localhost"; N nodes -> "node1 .. nodeN".
if [ -n "${SLURM_UP_NODENAMES:-}" ]; then
    read -r -a NODES <<<"$SLURM_UP_NODENAMES"
else
    case "${SLURM_UP_NODES:-1}" in
        1) NODES=(localhost) ;;
        [2-9]) read -r -a NODES <<<"$(seq -f 'node%g' -s ' ' 1 "$SLURM_UP_NODES")" ;;
        *) echo "SLURM_UP_NODES must be 1 to 9 (or set SLURM_UP_NODENAMES)" >&2; exit 1 ;; esac
fi
if [ ${#NODES[@]} -gt 1 ] && printf '%s\n' "${NODES[@]}" | grep -qx localhost; then
    echo "a node named 'localhost' only works as the only node" >&2; exit 1
fi
NODE_MEM=${SLURM_UP_NODE_MEM:-4096}
TIMEOUT=${SLURM_UP_TIMEOUT:-60}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf             # default path: sbatch/squeue/... need no SLURM_CONF
SPOOL=/var/spool/slurm-local          # ctld state + one slurmd spool per node
LOGDIR=/var/log/slurm-local           # slurmctld.log, slurmd-<node>.log, jobcomp.log
RUNDIR=/run/slurm-local               # pid files of the slurm daemons started here
MUNGE_RUN=/run/munge                  # munged's default socket + pid dir
MUNGE_PID=$MUNGE_RUN/munged.pid
CTLD_PID=$RUNDIR/slurmctld.pid
CTLD=/usr/sbin/slurmctld
SLURMD=/usr/sbin/slurmd
MUNGED=/usr/sbin/munged

# ---------------------------------------------------------------- packages
need_pkgs=()
for p in munge slurmctld slurmd slurm-client; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
    log "installing: ${need_pkgs[*]}"
    # Without systemd the postinst 'start' is skipped (policy-rc.d / no runlevel): fine.
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need_pkgs[@]}" >/tmp/slurm-up-apt.log 2>&1 || { cat /tmp/slurm-up-apt.log; exit 1; }
fi
log "packages present (slurm $(dpkg-query -W -f='${Version}' slurmctld))"

# ------------------------------------------------------------ helpers
# running PID: process exists and is not a zombie (PID 1 here reaps late)
running() { [ -r /proc/"$1"/stat ] && [ "$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null)" != Z ]; }
# alive PIDFILE EXE: the pid in PIDFILE is running binary EXE (guards against pid reuse)
alive() {
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && running "$pid" || return 1
    [ "$(readlink -f /proc/"$pid"/exe 2>/dev/null)" = "$(readlink -f "$2")" ]
}
stop_pidfile() {  # stop_pidfile PIDFILE EXE
    local pf=$1 exe=$2 pid
    if alive "$pf" "$exe"; then
        pid=$(cat "$pf")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do running "$pid" || break; sleep 0.1; done
        if running "$pid"; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
        log "stopped $(basename "$exe") (pid $pid)"
    fi
    rm -f "$pf"
}
stop_slurm() {
    local pf
    for pf in "$RUNDIR"/slurmd-*.pid; do [ -e "$pf" ] && stop_pidfile "$pf" "$SLURMD"; done
    stop_pidfile "$CTLD_PID" "$CTLD"
}

mkdir -p "$SPOOL/ctld" "$LOGDIR" "$RUNDIR" "$CONF_DIR"
for n in "${NODES[@]}"; do mkdir -p "$SPOOL/d/$n"; done
if [ "${SLURM_UP_CLEAN:-0}" = 1 ]; then
    stop_slurm
    rm -rf "${SPOOL:?}"/ctld/* "${SPOOL:?}"/d/*/* "$LOGDIR/jobcomp.log"
fi

# ------------------------------------------------------------ slurm.conf
# CPU topology exactly as slurmd detects it (a mismatch would DRAIN the node)
NODE_HW=$("$SLURMD" -C | head -1 | tr ' ' '\n' \
    | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | paste -sd' ')
new_conf=$(mktemp)
cat >"$new_conf" <<EOF
# Generated by slurm-up.sh - local test cluster, no systemd, no cgroups.
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs stay PENDING (Reason=BeginTime) for cred_expire s (default 120)
AuthInfo=cred_expire=5
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# no slurmdbd: finished jobs are appended here; read with 'sacct -c'
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
MailProg=/bin/true
SchedulerType=sched/backfill
# re-evaluate pending jobs often (defaults: sched_interval=60, bf_interval=30)
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# 1: a node set DOWN by hand stays DOWN until State=RESUME (lets tests fake a node failure)
ReturnToService=1
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUNDIR/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
EOF
port=6818
for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeAddr=127.0.0.1 NodeHostname=localhost Port=$port $NODE_HW RealMemory=$NODE_MEM State=UNKNOWN" >>"$new_conf"
    port=$((port + 1))
done
echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$new_conf"
if ! cmp -s "$new_conf" "$CONF"; then
    install -m 0644 "$new_conf" "$CONF"
    log "wrote $CONF"
    stop_slurm     # daemons started with an older config must pick up the new one
fi
rm -f "$new_conf"

# ------------------------------------------------------------ munge
if [ ! -s /etc/munge/munge.key ]; then          # the munge postinst normally made one
    mkdir -p /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key
    log "created munge key"
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 0700 /etc/munge
chmod 0400 /etc/munge/munge.key
mkdir -p "$MUNGE_RUN" /var/log/munge /var/lib/munge
chown munge:munge "$MUNGE_RUN" /var/log/munge /var/lib/munge
chmod 0755 "$MUNGE_RUN"
if alive "$MUNGE_PID" "$MUNGED"; then
    log "munged already running (pid $(cat "$MUNGE_PID"))"
else
    rm -f "$MUNGE_PID"
    # --force: start even if a stale socket/lock from a killed munged is left behind
    runuser -u munge -- "$MUNGED" --force      # daemonizes, writes $MUNGE_PID
    log "started munged (pid $(cat "$MUNGE_PID"))"
fi
munge -n | unmunge >/dev/null || { echo "munge self-test failed" >&2; exit 1; }

# ------------------------------------------------------------ slurmctld
if alive "$CTLD_PID" "$CTLD"; then
    log "slurmctld already running (pid $(cat "$CTLD_PID"))"
else
    rm -f "$CTLD_PID"
    ctld_args=()
    [ "${SLURM_UP_CLEAN:-0}" = 1 ] && ctld_args+=(-c)
    "$CTLD" ${ctld_args[@]+"${ctld_args[@]}"}  # daemonizes, writes SlurmctldPidFile
    for _ in $(seq 1 50); do [ -s "$CTLD_PID" ] && break; sleep 0.1; done
    log "started slurmctld (pid $(cat "$CTLD_PID" 2>/dev/null || echo '?'))"
fi
for _ in $(seq 1 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
scontrol ping | grep -q 'is UP' || { echo "slurmctld not answering" >&2; tail -20 "$LOGDIR/slurmctld.log" >&2; exit 1; }

# ------------------------------------------------------------ slurmd(s)
for n in "${NODES[@]}"; do
    pf=$RUNDIR/slurmd-$n.pid
    if alive "$pf" "$SLURMD"; then
        log "slurmd $n already running (pid $(cat "$pf"))"
    else
        rm -f "$pf"
        "$SLURMD" -N "$n"                        # daemonizes, writes SlurmdPidFile
        for _ in $(seq 1 50); do [ -s "$pf" ] && break; sleep 0.1; done
        log "started slurmd $n (pid $(cat "$pf" 2>/dev/null || echo '?'))"
    fi
done

# ------------------------------------------------------------ wait for idle
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
    ok=1
    for n in "${NODES[@]}"; do
        state=$(sinfo -h -N -n "$n" -o '%T' 2>/dev/null | head -1)
        case "$state" in
            idle|mixed|allocated|completing) ;;
            drain*|down*|fail*)
                # leftover DRAIN/DOWN from an earlier run: put it back in service
                ok=0; scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true ;;
            *) ok=0 ;;
        esac
    done
    [ $ok = 1 ] && break
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "node(s) not idle after ${TIMEOUT}s:" >&2; sinfo -N -l >&2
        tail -20 "$LOGDIR"/slurmctld.log "$LOGDIR"/slurmd-*.log >&2; exit 1
    fi
    sleep 0.2
done
sinfo -N
log "slurm up (${NODES[*]}); total $(elapsed)s"
