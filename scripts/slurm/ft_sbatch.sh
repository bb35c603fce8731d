#!/usr/bin/env bash
# ft_sbatch.sh - run ft_launcher inside a Slurm batch job, then finish, requeue or stop
# the job as the launcher's summary.json says. See scripts/slurm/README.md.
#
#   sbatch --open-mode=append --signal=B:USR1@120 [sbatch options] \
#       scripts/slurm/ft_sbatch.sh [--max-resubmissions N] [--run-dir DIR] [--rdzv-port P] \
#       [--nnodes MIN[:MAX]] [--] [ft_launcher options] TRAINING_SCRIPT [ARGS...]
#
# One node: ft_launcher runs right here with --rdzv-id $SLURM_JOB_ID and
# --ft-run-dir DIR/$SLURM_JOB_ID. Several nodes: `srun --ntasks-per-node=1` starts one
# ft_launcher per node with --ft-run-dir DIR/$SLURM_JOB_ID/$SLURMD_NODENAME and the c10d
# rendezvous store hosted here, in the batch shell (rdzv_store.py). --nnodes MIN:MAX below
# the allocation's node count makes the other nodes spares: a node that leaves (health
# check failed, died) is replaced, while at least MIN nodes are left.
# After the launcher exits, next_action.py turns the exit status and the summaries into
# one of: finished (exit 0), stop (exit with the launcher's code, reason printed) or
# requeue (`scontrol requeue`, then the bad nodes added to the job's ExcNodeList).
#
# Environment: FT_LAUNCHER (the ft_launcher to run; default: the one on PATH),
# FT_MAX_RESUBMISSIONS, FT_SLURM_RUN_DIR, FT_RDZV_PORT, FT_NNODES (defaults for the options),
# FT_SLURM_DIR (where next_action.py is; found by itself in most set-ups),
# FT_PYTHON (the Python for next_action.py), FAULT_TOL_FINISHED_FLAG_FILE (a file the
# training creates when it is done; with it set, exit 0 without the file means "requeue").
# Exit status: 0 finished; the launcher's code on a stop or requeue; 2 a usage error
# (nothing was run, nothing is requeued).
set -uo pipefail

log() { printf 'ft_sbatch: %s\n' "$*"; }          # stdout: the job's output file
die() { printf 'ft_sbatch: error: %s\n' "$*" >&2; exit 2; }

# Signals first, so that a USR1 during set-up is not fatal (bash's default for USR1 is
# to die). USR1 (sbatch --signal=B:USR1@N) is passed to the launcher, which passes it to
# every worker: the training checkpoints and exits. TERM (scancel, the time limit) is
# passed on too, and then the wrapper leaves the job to Slurm.
got_usr1=0 got_term=0 child="" child_name="the launcher" signalled=0
# shellcheck disable=SC2317  # handlers are called through trap
on_usr1() {
    got_usr1=1 signalled=1
    log "got USR1 (time limit near)${child:+: passing it to $child_name (pid $child)}"
    [[ -n $child ]] && kill -USR1 "$child" 2>/dev/null
}
# shellcheck disable=SC2317
on_term() {
    got_term=1 signalled=1
    log "got TERM${child:+: passing it to $child_name (pid $child)}"
    [[ -n $child ]] && kill -TERM "$child" 2>/dev/null
}
trap on_usr1 USR1
trap on_term TERM

usage() { sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# ------------------------------------------------------------------ options
max_resub=${FT_MAX_RESUBMISSIONS:-3}
run_base=${FT_SLURM_RUN_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/ft_runs}
rdzv_port=${FT_RDZV_PORT:-}
want_nnodes=${FT_NNODES:-}
while (($#)); do
    case $1 in
        --max-resubmissions|--run-dir|--rdzv-port|--nnodes)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --max-resubmissions) max_resub=$2 ;;
                --run-dir) run_base=$2 ;;
                --rdzv-port) rdzv_port=$2 ;;
                --nnodes) want_nnodes=$2 ;;
            esac
            shift 2 ;;
        --max-resubmissions=*) max_resub=${1#*=}; shift ;;
        --run-dir=*) run_base=${1#*=}; shift ;;
        --rdzv-port=*) rdzv_port=${1#*=}; shift ;;
        --nnodes=*) want_nnodes=${1#*=}; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
(($#)) || die "no training script given: ft_sbatch.sh [options] [--] [ft_launcher options] SCRIPT [ARGS...]"
[[ $max_resub =~ ^[0-9]+$ ]] \
    || die "--max-resubmissions (or FT_MAX_RESUBMISSIONS) must be a non-negative integer, got '$max_resub'"
[[ -z $rdzv_port || $rdzv_port =~ ^[0-9]+$ ]] || die "--rdzv-port must be a port number, got '$rdzv_port'"
[[ -z $want_nnodes || $want_nnodes =~ ^[0-9]+(:[0-9]+)?$ ]] \
    || die "--nnodes (or FT_NNODES) must be N or MIN:MAX, got '$want_nnodes'"
[[ -n ${SLURM_JOB_ID:-} ]] || die "SLURM_JOB_ID is not set: submit this script with sbatch"

launcher=${FT_LAUNCHER:-ft_launcher}
launcher_path=$(command -v "$launcher") \
    || die "cannot find '$launcher' (put ft_launcher on the job's PATH or set FT_LAUNCHER)"

# sbatch runs a copy of the batch script from the spool directory, so next_action.py is
# looked for in FT_SLURM_DIR, beside this file (when exec'ed from a job script), or under
# the submit directory.
helper=""
for d in "${FT_SLURM_DIR:-}" "$(dirname "${BASH_SOURCE[0]}")" "${SLURM_SUBMIT_DIR:-.}/scripts/slurm"; do
    if [[ -n $d && -f $d/next_action.py ]]; then helper=$d/next_action.py; break; fi
done
[[ -n $helper ]] || die "cannot find next_action.py: set FT_SLURM_DIR to the scripts/slurm folder"
python=${FT_PYTHON:-}
if [[ -z $python ]]; then  # the interpreter beside ft_launcher (its venv), else python3
    python=$(dirname "$(readlink -f "$launcher_path")")/python3
    [[ -x $python ]] || python=$(command -v python3) || die "no python3 for next_action.py (set FT_PYTHON)"
fi

# ------------------------------------------------------------------ the job
restart=${SLURM_RESTART_COUNT:-0}                 # unset on the first run
nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
node=${SLURMD_NODENAME:-$(hostname -s)}
# --nnodes MIN:MAX: the rendezvous' sizes. The default is every node of the allocation;
# nodes beyond MAX wait as hot spares, and up to (allocation - MIN) nodes may leave.
min_nodes=${want_nnodes%%:*} max_nodes=${want_nnodes##*:}
min_nodes=$((10#${min_nodes:-$nnodes})) max_nodes=$((10#${max_nodes:-$nnodes}))
((1 <= min_nodes && min_nodes <= max_nodes)) \
    || die "--nnodes: expected 1 <= MIN <= MAX, got '$want_nnodes'"
((min_nodes <= nnodes)) \
    || die "--nnodes $want_nnodes needs at least $min_nodes nodes; the job has $nnodes (sbatch --nodes)"
((nnodes > 1 || max_nodes == 1)) \
    || die "--nnodes $want_nnodes needs a job of several nodes (sbatch --nodes); this one has 1"
spares=$((nnodes - min_nodes))
job_dir=$run_base/$SLURM_JOB_ID
mkdir -p "$job_dir" || die "cannot create the run directory $job_dir"

summaries=()
if ((nnodes > 1)); then
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    for n in "${nodes[@]}"; do summaries+=("$n=$job_dir/$n/summary.json"); done
else
    summaries=("$node=$job_dir/summary.json")
fi
# A summary left by an earlier run of this job must not be read as this run's verdict.
for s in "${summaries[@]}"; do
    f=${s#*=}
    [[ -f $f ]] && mv -f "$f" "${f%.json}.before-restart$restart.json"
done
departed=$job_dir/departed  # one file per node that left this run (see node_task below)
rm -rf "$departed"

# One node's task under srun (several nodes). It runs the launcher and passes USR1 and
# TERM on. When the launcher fails, the node leaves the job: the task exits 0 while at most
# $spares nodes have left (a spare takes the place, the others go on: srun's
# --kill-on-bad-exit must not end them), else with the launcher's code, which makes srun
# end the other nodes (they would only wait for a round that cannot form). A launcher that
# asked not to be requeued (a stop) ends the job at once, too. Its run directory is named
# after its Slurm node: that is how the verdict knows which node a summary is about.
# shellcheck disable=SC2016  # expanded by the per-node bash, not here
node_task='
dir=$FT_SBATCH_JOB_DIR/$SLURMD_NODENAME child="" sig=0 termed=0
pass() { sig=1; [[ -n $child ]] && kill "-$1" "$child" 2>/dev/null; }
trap "pass USR1" USR1
trap "termed=1; pass TERM" TERM
"$FT_SBATCH_LAUNCHER" --ft-run-dir "$dir" "$@" &
child=$! last=""
while :; do
    sig=0; wait "$child"; rc=$?
    if ((rc == 127)) && [[ -n $last ]]; then rc=$last; break; fi
    if ((sig)); then last=$rc; continue; fi
    break
done
((rc == 0)) && exit 0
((termed)) && exit "$rc"  # srun passed TERM on: the job is ending, be quick
stop=0
[[ -e $dir/summary.json ]] && ! grep -Eq "\"requeue\": *true" "$dir/summary.json" && stop=1
mkdir -p "$FT_SBATCH_DEPARTED" && echo "$rc" >"$FT_SBATCH_DEPARTED/$SLURMD_NODENAME"
gone=$(find "$FT_SBATCH_DEPARTED" -maxdepth 1 -type f | wc -l)
if ((!stop && gone <= FT_SBATCH_SPARES)); then
    echo "ft_sbatch: $SLURMD_NODENAME: the launcher exited $rc; the node leaves the job ($gone of $FT_SBATCH_SPARES spare places used)"
    exit 0
fi
exit "$rc"'

store_pid="" store_opts=()
# shellcheck disable=SC2317  # called after the launch and at exit
stop_store() {
    [[ -n $store_pid ]] || return 0
    kill -TERM "$store_pid" 2>/dev/null
    wait "$store_pid"
    (($? == 1)) && log "warning: the rendezvous store did not serve: $(tail -1 "$job_dir/rdzv_store.err")"
    store_pid=""
}
# Host the c10d store, and coordinate the rounds, in the batch shell (see rdzv_store.py).
# It imports torch while srun
# starts the launchers (they retry connecting for read_timeout, 60 s), so it costs no wait,
# only CPU: it is started only where a node may leave while the job goes on (spares > 0).
# Without spares, any node that leaves ends the job, and the store may go with it.
start_store() {  # start_store PORT: sets store_pid and the launchers' store_opts
    rm -f "$job_dir/rdzv_store.ready"
    "$python" "$(dirname "$helper")/rdzv_store.py" "$1" "$job_dir/rdzv_store.ready" \
        "$min_nodes:$max_nodes" "$SLURM_JOB_ID" 2>"$job_dir/rdzv_store.err" &
    store_pid=$!
    store_opts=(--rdzv-conf is_host=false)
}

if ((nnodes > 1)); then
    # The store is hosted here, so the endpoint is this (the batch) node. NodeAddr is how
    # the nodes reach each other (the host name on most clusters).
    addr=$(scontrol -o show node "$node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    port=${rdzv_port:-$((29400 + SLURM_JOB_ID % 1000))}
    # The user's own --rdzv-conf (one option only) would replace ours: keep theirs, and
    # let the first launcher host the store as torch does.
    if ((spares > 0)) && ! printf '%s\n' "$@" | grep -qE '^--rdzv[-_]conf(=|$)'; then
        trap stop_store EXIT
        start_store "$port"
    fi
    export FT_SBATCH_LAUNCHER=$launcher_path FT_SBATCH_JOB_DIR=$job_dir
    export FT_SBATCH_SPARES=$spares FT_SBATCH_DEPARTED=$departed
    # --kill-on-bad-exit: once a node has given up and no spare can take its place, the
    # others would only wait in the rendezvous; node_task decides which exits are that.
    child_name="the launchers through srun"  # srun passes USR1 and TERM to its tasks
    cmd=(srun --ntasks-per-node=1 --ntasks="$nnodes" --kill-on-bad-exit=1
         bash -c "$node_task"
         ft_sbatch --nnodes "$min_nodes:$max_nodes" --rdzv-backend c10d
         --rdzv-endpoint "${addr:-$node}:$port" --rdzv-id "$SLURM_JOB_ID"
         ${store_opts[@]+"${store_opts[@]}"} "$@")
else
    cmd=("$launcher_path" --rdzv-id "$SLURM_JOB_ID" --ft-run-dir "$job_dir" "$@")
fi

log "job $SLURM_JOB_ID run $restart (SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT-unset}, at most $max_resub requeues) on ${SLURM_JOB_NODELIST:-$node}"
rc=0 not_started=0
if ((got_term)); then
    log "stop: got TERM before the launch; nothing was started"
    exit 143
elif ((got_usr1)); then
    not_started=1
    log "USR1 came before the launch: not starting the launcher"
else
    log "running: ${cmd[*]//"$node_task"/'<node_task>'}"
    "${cmd[@]}" &
    child=$!
    # a USR1 between the fork and this line found no child to pass it to
    ((got_usr1)) && kill -USR1 "$child" 2>/dev/null
    last=""
    while :; do
        signalled=0
        wait "$child"; rc=$?
        # wait returns early (>128) when a trapped signal arrives; the handler has run.
        if ((rc == 127)) && [[ -n $last ]]; then rc=$last; break; fi  # already reaped
        if ((signalled)); then last=$rc; continue; fi
        break
    done
    child=""
    stop_store
    log "launcher exited with $rc"
fi

# ------------------------------------------------------------------ the verdict
job_info=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null)
field() { grep -o "\\b$1=[^ ]*" <<<"$job_info" | head -1 | cut -d= -f2-; }
exc=$(field ExcNodeList)
[[ $exc == "(null)" ]] && exc=""
[[ -n $exc ]] && exc=$(scontrol show hostnames "$exc" | paste -sd,)
partition=$(field Partition)
part_nodes=""
[[ -n $partition ]] && part_nodes=$(sinfo -h -N -p "$partition" -o %N 2>/dev/null | sort -u | paste -sd,)

args=(--launcher-exit "$rc" --restart-count "$restart" --max-resubmissions "$max_resub"
      --excluded "$exc" --partition-nodes "$part_nodes" --nnodes "$nnodes"
      --finished-flag-file "${FAULT_TOL_FINISHED_FLAG_FILE:-}" --record "$job_dir/verdicts.jsonl")
((not_started)) || for s in "${summaries[@]}"; do args+=(--summary "$s"); done
((got_usr1)) && args+=(--got-usr1)
((got_term)) && args+=(--got-term)
((not_started)) && args+=(--not-started)
verdict=$("$python" "$helper" "${args[@]}") || { log "stop: next_action.py failed; not requeued"; exit "$((rc ? rc : 2))"; }

action="" code=$rc exclude="" why="" check_nodes=""
while IFS= read -r line; do
    case $line in
        action=*) action=${line#action=} ;;
        exit_code=*) code=${line#exit_code=} ;;
        exclude=*) exclude=${line#exclude=} ;;
        why=*) why=${line#why=} ;;
        check_nodes=*) check_nodes=${line#check_nodes=} ;;
        note=*) log "node left the job: ${line#note=}" ;;
    esac
done <<<"$verdict"
# Nodes that left the job (sick, dead): worth an admin's look whatever happens next.
[[ -n $check_nodes ]] && log "check these nodes before they run jobs again: $check_nodes (scontrol update NodeName=$check_nodes State=DRAIN Reason=...)"

case $action in
    finished)
        log "finished: $why"
        exit 0 ;;
    requeue)
        # Requeueing makes Slurm TERM this job; ignore it (children inherit the ignore,
        # so scontrol survives too) and finish the two calls within KillWait.
        trap '' TERM USR1
        log "requeue: $why"
        if ! out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
            log "stop: scontrol requeue failed: $out"
            exit "$code"
        fi
        # ExcNodeList can only change while the job is pending, i.e. after the requeue;
        # it cannot start again before cred_expire has passed, so this lands in time.
        if [[ -n $exclude && $exclude != "$exc" ]]; then
            if out=$(scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude" 2>&1); then
                log "ExcNodeList=$exclude"
            else
                log "warning: could not set ExcNodeList=$exclude: $out"
            fi
        fi
        exit "$code" ;;
    stop)
        log "stop: $why"
        exit "$code" ;;
    *)
        log "stop: no decision from next_action.py: $verdict"
        exit "$((rc ? rc : 2))" ;;
esac
