#!/usr/bin/env bash
# Horovod's own test files, run against the installed Horovod and against dualframe (only the import changed).
#
#   bash scripts/horovod_suite.sh                    # prints how to fetch the suite (it is not on PyPI)
#   FILES="test_torch.py test_tensorflow.py" bash scripts/horovod_suite.sh /tmp/horovod-v0.28.1
#   bash scripts/horovod_tf_suite.sh DIR             # the TF and Keras files (FILES preset)
#   bash scripts/horovod_torch_suite.sh DIR          # test_torch.py (FILES preset)
#   FILES=test_tensorflow2_keras.py LAUNCHERS=horovodrun bash scripts/horovod_suite.sh DIR
#
# DIR is a Horovod checkout (DIR/test/parallel/test_tensorflow.py, DIR/test/utils/common.py) or a
# folder holding those files side by side. Horovod's code is never copied into this repository: each
# run works on a scratch copy under $WORK (default: a new temporary folder). Every file runs once per
# target and launcher (horovodrun -np 2 --gloo, mpirun -np 2), one pytest per launcher call:
#   horovod     the files as published (import horovod.tensorflow[.keras] / horovod.torch / horovod.keras as hvd)
#   dualframe   only that import line changed to dualframe.tensorflow[.keras] / dualframe.torch / dualframe.keras
#   dualframe+  (test_tensorflow2_keras.py only) also the module-level Keras 2 imports
#               (keras.optimizers.legacy.optimizer_v2 / Optimizer), which stop Keras 3 from collecting
#               the file at all, set to None, so each test passes or fails on its own
# and a table of rank 0's pytest counts per run is printed; logs stay under $WORK/logs. Horovod's TF
# files run every test in graph and in eager mode as subtests: "passed" counts tests whose subtests all
# passed, "failed" counts failed subtests (one test failing in both modes counts 2).
# Needs: the suite's test dependencies (pip install pytest parameterized mock cloudpickle; PYTHONPATH may
# point at a --target folder holding them) and the launchers on PATH.
# Variables: PYTHON (.venv/bin/python), FILES, LAUNCHERS, TARGETS, NP (2), TIMEOUT (1500 s per run).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
FILES=${FILES:?name the test files: FILES="test_torch.py ..." (or run horovod_tf_suite.sh / horovod_torch_suite.sh)}
LAUNCHERS=${LAUNCHERS:-horovodrun mpirun}
TARGETS=${TARGETS:-horovod dualframe}
NP=${NP:-2}
TIMEOUT=${TIMEOUT:-1500}
SRC=${1:-}
if [ -z "$SRC" ]; then
  echo "Horovod's test suite is not in the PyPI sdist; fetch the tag this project builds, then rerun:"
  echo "  git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod.git /tmp/horovod-v0.28.1"
  echo "  bash $0 /tmp/horovod-v0.28.1"
  exit 2
fi
find_file() {  # $1: name -> path in a checkout or a flat folder
  for p in "$SRC/test/parallel/$1" "$SRC/test/utils/$1" "$SRC/$1"; do [ -f "$p" ] && { echo "$p"; return 0; }; done
  return 1
}
HELPERS="common.py"
case " $FILES " in *" test_tensorflow"*) HELPERS="$HELPERS base_test_tensorflow.py" ;; esac
for f in $HELPERS $FILES; do
  find_file "$f" >/dev/null || { echo "missing $f under $SRC (expected a Horovod checkout)" >&2; exit 2; }
done
"$PYTHON" -c "import parameterized, pytest, mock, cloudpickle" 2>/dev/null \
  || { echo "needs: $PYTHON -m pip install pytest parameterized mock cloudpickle" >&2; exit 2; }
WORK=${WORK:-$(mktemp -d /tmp/horovod_suite.XXXXXX)}
mkdir -p "$WORK/logs"
export PATH="$(dirname "$PYTHON"):$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=2 OMP_NUM_THREADS=1 TF_NUM_INTEROP_THREADS=1 TF_NUM_INTRAOP_THREADS=1 MKL_NUM_THREADS=1

prepare() {  # $1: target -> $WORK/$1/{parallel,utils} with the imports rewritten for the target
  mkdir -p "$WORK/$1/parallel" "$WORK/$1/utils"
  cp "$(find_file common.py)" "$WORK/$1/utils/"
  for f in ${HELPERS#common.py} $FILES; do cp "$(find_file "$f")" "$WORK/$1/parallel/"; done
  [ "$1" = horovod ] && return 0
  "$PYTHON" - "$1" "$WORK/$1/parallel" $FILES <<'EOF'
import pathlib, re, sys
target, folder, names = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
for name in names:
    path = folder / name
    text = re.sub(r"^import horovod\.(tensorflow(\.keras)?|torch|keras) as hvd$", r"import dualframe.\1 as hvd",
                  path.read_text(), flags=re.M)
    if target == "dualframe+" and name == "test_tensorflow2_keras.py":
        text = re.sub(r"^(\s*)from keras\.optimizers\.legacy import (optimizer_v2|Optimizer)$",
                      r"\1\2 = None  # Keras 2 only (module absent in Keras 3)", text, flags=re.M)
    path.write_text(text)
EOF
}

run() {  # $1 target, $2 launcher, $3 file -> one table row
  local log="$WORK/logs/${1}_${2}_${3%.py}.log" start=$SECONDS rc
  local pyt=("$PYTHON" -m pytest -q -p no:cacheprovider -rfEs "$3")
  cd "$WORK/$1/parallel" || return 1
  if [ "$2" = horovodrun ]; then
    timeout "$TIMEOUT" horovodrun -np "$NP" -H "localhost:$NP" --gloo "${pyt[@]}" > "$log" 2>&1
  else
    timeout "$TIMEOUT" mpirun --allow-run-as-root --oversubscribe --tag-output -np "$NP" -x PATH -x PYTHONPATH \
      -x TF_CPP_MIN_LOG_LEVEL -x OMP_NUM_THREADS "${pyt[@]}" > "$log" 2>&1
  fi
  rc=$?
  "$PYTHON" - "$log" "$1" "$2" "$3" "$rc" "$((SECONDS - start))" <<'EOF'
import re, sys
log, target, launcher, name, rc, secs = sys.argv[1:]
text = open(log, errors="replace").read()
# rank 0's closing line: horovodrun prefixes "[0]<stdout>:", mpirun (with --tag-output) "[1,0]<stdout>:"
lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l) and " in " in l]
rank0 = [l for l in lines if re.match(r"^\[(1,)?0\]", l)] or lines
counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", rank0[0] if rank0 else ""):
    counts[k.rstrip("s") if k.startswith("error") else k] = int(n)
sub = re.search(r"(\d+) subtests passed", rank0[0] if rank0 else "")
print(f"| {name} | {target} | {launcher} | {counts['passed']} | {counts['failed']} | {counts['skipped']} "
      f"| {counts['error']} | {sub.group(1) if sub else 0} | {rc} | {secs} s |")
EOF
}

for target in $TARGETS; do prepare "$target"; done
echo "Horovod test files, np=$NP, $(date -u +%Y-%m-%d), logs: $WORK/logs"
echo "| file | imports | launcher | passed | failed | skipped | errors | subtests passed | rc | time |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for f in $FILES; do
  for target in $TARGETS; do
    [ "$target" = "dualframe+" ] && [ "$f" != test_tensorflow2_keras.py ] && continue
    for launcher in $LAUNCHERS; do run "$target" "$launcher" "$f"; done
  done
done
