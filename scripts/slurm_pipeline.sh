#!/usr/bin/env bash
# A pipeline whose stages are processes, on a SLURM GPU cluster: one task per GPU, one stage per task,
# micro-batches flowing from rank to rank (GPipe or 1F1B; torch_examples/pipeline_processes.py).
# Use it when the model does not fit one GPU (`dualframe plan` says how many stages it needs).
#
#   sbatch scripts/slurm_pipeline.sh                          # 1 node, 2 GPUs = 2 stages
#   sbatch --ntasks-per-node=4 --gres=gpu:4 scripts/slurm_pipeline.sh --schedule 1f1b --chunks 16
#
# Inside the allocation it runs `dualframe run --launcher srun -np $SLURM_NTASKS $SCRIPT ...`
# (srun --ntasks=N --cpus-per-task=C --ntasks-per-node=T --kill-on-bad-exit=1 $PYTHON $SCRIPT ...);
# a stage that fails ends the step (--kill-on-bad-exit) instead of leaving its neighbours waiting.
# Variables: PYTHON (default .venv/bin/python), SCRIPT (default torch_examples/pipeline_processes.py),
# SRUN_ARGS (site options for srun).
#SBATCH --job-name=dualframe-pipeline
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
PYTHON=${PYTHON:-.venv/bin/python}
SCRIPT=${SCRIPT:-torch_examples/pipeline_processes.py}
extra=()
for arg in ${SRUN_ARGS:-}; do extra+=("--launcher-arg=$arg"); done
exec "$PYTHON" -m dualframe run --launcher srun -np "${SLURM_NTASKS:?not inside a SLURM allocation (use sbatch)}" \
  ${extra[@]+"${extra[@]}"} "$SCRIPT" "$@"
