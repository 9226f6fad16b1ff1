#!/usr/bin/env bash
# Data parallelism on a SLURM GPU cluster: one task (rank) per GPU, each holding the whole model;
# gradients are averaged with Horovod's ring-allreduce.
#
#   sbatch scripts/slurm_data_parallel.sh                         # torch_examples/data_parallel.py
#   sbatch --nodes=4 scripts/slurm_data_parallel.sh --epochs 5    # arguments go to the script
#   SCRIPT=tf_examples/data_parallel.py sbatch scripts/slurm_data_parallel.sh
#
# Inside the allocation it runs `dualframe run --launcher srun -np $SLURM_NTASKS $SCRIPT ...`, which
# prints and executes: srun --ntasks=N --cpus-per-task=C --ntasks-per-node=T --kill-on-bad-exit=1
# $PYTHON $SCRIPT ..., with OMP_NUM_THREADS (and MKL/TF thread counts) = --cpus-per-task.
# Every task sees all the node's GPUs; the adapters pin rank r to GPU local_rank (Horovod's rule).
# Change --gres and --ntasks-per-node together (one task per GPU). Variables: PYTHON (default
# .venv/bin/python), SCRIPT. Site options for srun (e.g. --mpi=pmix): SRUN_ARGS="--mpi=pmix".
#SBATCH --job-name=dualframe-dp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
PYTHON=${PYTHON:-.venv/bin/python}
SCRIPT=${SCRIPT:-torch_examples/data_parallel.py}
extra=()
for arg in ${SRUN_ARGS:-}; do extra+=("--launcher-arg=$arg"); done
exec "$PYTHON" -m dualframe run --launcher srun -np "${SLURM_NTASKS:?not inside a SLURM allocation (use sbatch)}" \
  ${extra[@]+"${extra[@]}"} "$SCRIPT" "$@"
