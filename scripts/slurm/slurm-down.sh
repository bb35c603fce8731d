#!/usr/bin/env bash
# slurm-down.sh - stop the daemons started by slurm-up.sh, by PID file only
# (never by process name): every slurmd, then slurmctld, then munged.
# Idempotent: a missing or stale PID file is reported and removed.
#
# Job processes are children of slurmstepd, not of slurmd, so they would outlive
# the daemons: by default every job is scancel'ed first (while slurmctld is up)
# and we wait up to 30 s for them to finish.
#   SLURM_DOWN_KEEP_JOBS=1    don't cancel jobs (running ones keep running and are
#                             re-attached by the next slurm-up.sh; state is saved)
#   SLURM_DOWN_KEEP_MUNGE=1   leave munged running
#   SLURM_DOWN_PURGE=1        also delete saved job state + spool + jobcomp.log (next
#                             start is clean; job ids restart at 1, so the old
#                             jobcomp.log would otherwise mix with new records)
set -uo pipefail

[ "$(id -u)" -eq 0 ] || { echo "slurm-down.sh must run as root" >&2; exit 1; }

RUNDIR=/run/slurm-local
SPOOL=/var/spool/slurm-local

running() { [ -r /proc/"$1"/stat ] && [ "$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null)" != Z ]; }

stop() {  # stop PIDFILE EXE NAME
    local pf=$1 exe=$2 name=$3 pid
    if [ ! -s "$pf" ]; then echo "[slurm-down] $name: no pid file ($pf)"; rm -f "$pf"; return 0; fi
    pid=$(cat "$pf")
    if ! running "$pid" || [ "$(readlink -f /proc/"$pid"/exe 2>/dev/null)" != "$(readlink -f "$exe")" ]; then
        echo "[slurm-down] $name: pid $pid from $pf is not running $exe (stale pid file removed)"
        rm -f "$pf"; return 0
    fi
    kill -TERM "$pid"
    for _ in $(seq 1 100); do running "$pid" || break; sleep 0.1; done
    if running "$pid"; then
        echo "[slurm-down] $name: pid $pid still alive after 10s, sending KILL"
        kill -KILL "$pid" 2>/dev/null
        for _ in $(seq 1 20); do running "$pid" || break; sleep 0.1; done
    fi
    rm -f "$pf"
    echo "[slurm-down] stopped $name (pid $pid)"
}

ctld_pid=$(cat "$RUNDIR/slurmctld.pid" 2>/dev/null || true)
if [ "${SLURM_DOWN_KEEP_JOBS:-0}" != 1 ] && [ -n "$ctld_pid" ] && running "$ctld_pid" \
        && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    ids=$(squeue -h -o %A 2>/dev/null | paste -sd' ')
    if [ -n "$ids" ]; then
        echo "[slurm-down] cancelling jobs: $ids"
        # shellcheck disable=SC2086
        scancel $ids
        for _ in $(seq 1 150); do
            [ -z "$(squeue -h -t PD,R,CG,CF,S,RQ,RS,SO,SE,RF,RH 2>/dev/null)" ] && break; sleep 0.2
        done
        left=$(squeue -h -o '%A:%T' 2>/dev/null | paste -sd' ')
        [ -n "$left" ] && echo "[slurm-down] WARNING: jobs still not finished after 30s: $left"
    fi
fi

found=0
for pf in "$RUNDIR"/slurmd-*.pid; do
    [ -e "$pf" ] || continue
    found=1
    n=${pf##*/slurmd-}; stop "$pf" /usr/sbin/slurmd "slurmd ${n%.pid}"
done
[ $found = 1 ] || echo "[slurm-down] slurmd: no pid files in $RUNDIR"
stop "$RUNDIR/slurmctld.pid" /usr/sbin/slurmctld slurmctld
if [ "${SLURM_DOWN_KEEP_MUNGE:-0}" != 1 ]; then
    stop /run/munge/munged.pid /usr/sbin/munged munged
fi
if [ "${SLURM_DOWN_PURGE:-0}" = 1 ]; then
    rm -rf "${SPOOL:?}" /var/log/slurm-local/jobcomp.log
    echo "[slurm-down] removed $SPOOL and /var/log/slurm-local/jobcomp.log"
fi
exit 0
