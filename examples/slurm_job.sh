#!/bin/bash
# A Slurm job script for examples/train_ddp.py under ft_launcher, with automatic requeue.
# Submit it from the repository root with the virtualenv activated (the job inherits PATH):
#     sbatch examples/slurm_job.sh
# See scripts/slurm/README.md for what the wrapper decides after the launcher exits.
#SBATCH --job-name=ft-train-ddp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --open-mode=append
#SBATCH --requeue
# To checkpoint before the time limit, uncomment the next line, but only once the training
# script catches SIGUSR1 and saves and exits on it (the "USR1 contract" in
# scripts/slurm/README.md). Otherwise SIGUSR1 would kill the workers.
##SBATCH --time=60 --signal=B:USR1@120

# train_ddp.py writes ckpt/result.json when it has run all its steps: an exit 0 without it
# means "not finished", and the job is requeued.
export FAULT_TOL_FINISHED_FLAG_FILE="$SLURM_SUBMIT_DIR/ft_runs/$SLURM_JOB_ID/ckpt/result.json"

# exec: the wrapper must be the batch shell itself to receive --signal=B:USR1
exec "$SLURM_SUBMIT_DIR/scripts/slurm/ft_sbatch.sh" --max-resubmissions 3 -- \
    --nproc-per-node 2 --max-restarts 2 \
    examples/train_ddp.py --steps 200 --ckpt-every 20 --step-time 0.05
