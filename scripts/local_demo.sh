#!/usr/bin/env bash
# The tools on this machine, in 2 processes: plan a model, launch a data-parallel job with a Horovod
# timeline, draw the timeline, and draw a pipeline's timeline. Outputs go to out/local_demo/.
#
#   bash scripts/local_demo.sh
#
# Steps (each command is printed before it runs):
#   1. dualframe plan on a small Transformer: what fits here, then the same model on 4 small devices;
#   2. dualframe run -np 2 (horovodrun, Gloo, one thread per process) of a data-parallel example,
#      with HOROVOD_TIMELINE set;
#   3. dualframe timeline: that Horovod timeline as a PNG Gantt chart with its idle fraction;
#   4. a 2-stage GPipe pipeline (torch_examples/pipeline.py) writes a Chrome trace; drawn the same way.
# scripts/demo.sh (the main demo) trains every example; this one shows plan, run and timeline.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
export PATH="$ROOT/.venv/bin:$PATH" PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
OUT=out/local_demo
mkdir -p "$OUT"

say() { echo; echo "################ $*"; "$@"; }

MODEL=tests/core/plan/plan_models/torch_models.py:transformer
say dualframe plan "$MODEL" --input-shape 64 --input-dtype int64 --batch-size 32
say dualframe plan "$MODEL" --input-shape 64 --input-dtype int64 --batch-size 8 \
  --memory-per-device 6MiB --devices-per-node 4 || true   # exit 1 would mean "nothing fits"

if [ -f torch_examples/data_parallel.py ]; then
  EXAMPLE=(torch_examples/data_parallel.py --epochs 1)
else
  EXAMPLE=(tf_examples/data_parallel.py --epochs 1 --samples 2048)
fi
export HOROVOD_TIMELINE="$ROOT/$OUT/horovod_timeline.json"
say dualframe run -np 2 --launcher horovodrun "${EXAMPLE[@]}"
unset HOROVOD_TIMELINE
say dualframe timeline "$OUT/horovod_timeline.json" -o "$OUT/horovod_timeline.png"

if [ -f torch_examples/pipeline.py ]; then
  say python torch_examples/pipeline.py --steps 3 --trace "$OUT/pipeline_trace.json"
  say dualframe timeline "$OUT/pipeline_trace.json" -o "$OUT/pipeline_timeline.png"
fi
echo
echo "local demo finished; pictures in $OUT/"
