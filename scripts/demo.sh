#!/usr/bin/env bash
# The main job: bootstrap if needed, then short 2-process trainings on this machine, one per idea,
# for PyTorch and TensorFlow/Keras, each printing what it did and its result.
#
#   bash scripts/demo.sh            # everything below
#   bash scripts/demo.sh torch      # only the PyTorch examples (or: tf)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
export PATH="$ROOT/.venv/bin:$PATH" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1
which=${1:-all}

run() {  # run LAUNCHER NP SCRIPT ARGS...: one example, announced with its exact command
  local launcher=$1 np=$2; shift 2
  local cmd
  if [ "$launcher" = horovodrun ]; then
    cmd=(horovodrun -np "$np" -H "localhost:$np" --gloo python "$@")
  elif [ "$launcher" = mpirun ]; then
    cmd=(mpirun -np "$np" --oversubscribe --bind-to none -x PATH -x OMP_NUM_THREADS -x TF_NUM_INTRAOP_THREADS
         -x TF_NUM_INTEROP_THREADS -x TF_CPP_MIN_LOG_LEVEL python "$@")
    [ "$(id -u)" = 0 ] && cmd=(mpirun --allow-run-as-root "${cmd[@]:1}")
  else
    cmd=(python "$@")
  fi
  echo
  echo "################ ${cmd[*]}"
  "${cmd[@]}" < /dev/null  # launchers read stdin: keep them off the list below
}

# Each line: framework launcher np script args. Examples not yet in the repo are skipped.
while read -r framework launcher np script args; do
  [ -z "$framework" ] && continue
  [ "$which" != all ] && [ "$which" != "$framework" ] && continue
  [ -f "$script" ] || continue
  # shellcheck disable=SC2086
  run "$launcher" "$np" "$script" $args
done <<'LIST'
torch horovodrun 2 torch_examples/data_parallel.py --epochs 2
torch mpirun     2 torch_examples/sharded_optimizer.py --epochs 2
torch mpirun     2 torch_examples/sharded_parameters.py --epochs 1
tf    mpirun     2 tf_examples/data_parallel.py --epochs 2
tf    mpirun     2 tf_examples/sharded_optimizer.py --epochs 2
tf    mpirun     2 tf_examples/sharded_parameters.py --epochs 2
torch single     1 torch_examples/model_split.py
torch single     1 torch_examples/pipeline.py
tf    single     1 tf_examples/model_split.py
tf    single     1 tf_examples/pipeline.py
torch single     1 torch_examples/model_split_resnet.py
tf    single     1 tf_examples/model_split_resnet.py
torch mpirun     2 torch_examples/model_split_resnet.py
tf    mpirun     2 tf_examples/model_split_resnet.py
torch mpirun     2 torch_examples/pipeline_processes.py
torch mpirun     4 torch_examples/hybrid.py
torch mpirun     4 torch_examples/hybrid.py --shard parameters
tf    mpirun     2 tf_examples/pipeline_processes.py
tf    mpirun     4 tf_examples/hybrid.py --shard parameters
torch single     1 torch_examples/transformer_split.py
torch mpirun     2 torch_examples/transformer_split.py
torch mpirun     2 torch_examples/hf_pipeline.py
tf    single     1 tf_examples/transformer_split.py
tf    mpirun     2 tf_examples/transformer_split.py
tf    mpirun     2 tf_examples/keras_hub_pipeline.py
LIST
echo
echo "demo finished"
