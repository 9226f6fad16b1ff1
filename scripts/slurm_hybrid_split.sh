#!/usr/bin/env bash
# Hybrid on a SLURM GPU cluster: the model split into STAGES parts, one part per rank (one task per
# GPU), and the job's ranks laid out as replicas x STAGES (rank = replica * STAGES + stage); each
# stage's gradients are averaged over its replicas (dualframe.Hybrid(..., stages_as_processes=True)).
#
#   sbatch scripts/slurm_hybrid_split.sh                  # 2 nodes x 4 GPUs = 4 replicas x 2 stages
#   STAGES=4 sbatch scripts/slurm_hybrid_split.sh         # 2 replicas x 4 stages (the script must build 4)
#   sbatch --nodes=4 scripts/slurm_hybrid_split.sh --chunks 8
#
# The task count must be a multiple of STAGES; the script refuses otherwise, before starting anything.
# Inside the allocation it runs `dualframe run --launcher srun -np $SLURM_NTASKS $SCRIPT ...`
# (srun --ntasks=N --cpus-per-task=C --ntasks-per-node=T --kill-on-bad-exit=1 $PYTHON $SCRIPT ...),
# threads per task = --cpus-per-task. `dualframe plan` recommends the stages and chunks for a model.
# Variables: PYTHON (default .venv/bin/python), SCRIPT (default torch_examples/hybrid.py), STAGES
# (default 2), SRUN_ARGS (site options for srun).
#SBATCH --job-name=dualframe-hybrid
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
PYTHON=${PYTHON:-.venv/bin/python}
SCRIPT=${SCRIPT:-torch_examples/hybrid.py}
STAGES=${STAGES:-2}
tasks=${SLURM_NTASKS:?not inside a SLURM allocation (use sbatch)}
if (( tasks % STAGES != 0 )); then
  echo "slurm_hybrid_split.sh: the number of tasks must be a multiple of STAGES (tasks: $tasks, STAGES: $STAGES);" \
       "ask for $(( (tasks / STAGES + 1) * STAGES )) tasks or set STAGES to a divisor of $tasks" >&2
  exit 2
fi
echo "# $(( tasks / STAGES )) replicas x $STAGES stages"
extra=()
for arg in ${SRUN_ARGS:-}; do extra+=("--launcher-arg=$arg"); done
exec "$PYTHON" -m dualframe run --launcher srun -np "$tasks" ${extra[@]+"${extra[@]}"} "$SCRIPT" "$@"
