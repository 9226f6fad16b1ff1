#!/usr/bin/env bash
# The one-process torch tests on a machine with a CUDA GPU: stages on cuda:0 and cpu (tests/torch/test_cuda_devices.py
# runs only there; the others run again with a GPU visible). Such a machine may have torch and transformers but no
# Horovod (it cannot be built there); scripts/gpu_check/horovod then stands in for Horovod's import only: these
# tests are one process and call no collective (any call raises). Usage: bash scripts/gpu_check.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if "$PY" -c 'import horovod.torch' 2>/dev/null; then stub=""; else stub="$PWD/scripts/gpu_check:"; fi
PYTHONPATH="$stub$PWD" "$PY" -m pytest -q -p no:cacheprovider -rfs tests/torch/test_cuda_devices.py \
  tests/torch/test_tied_devices.py tests/torch/test_split.py tests/torch/test_pipeline.py \
  tests/torch/test_graph_split.py tests/torch/test_hf_split.py "$@"
