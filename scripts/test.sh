#!/usr/bin/env bash
# Run dualframe's whole test suite, bootstrapping whatever is missing first.
#
# Four pytest runs, because TensorFlow and torch never load in the same process:
#   tests/core        framework-neutral logic (no framework imported)
#   tests/torch       single-process PyTorch tests
#   tests/tensorflow  single-process TensorFlow/Keras tests
#   tests/parallel    multi-process tests, each file under horovodrun --gloo and under mpirun
# Extra arguments go to every pytest run (e.g. -k pipeline).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh || exit 1
export PATH="$ROOT/.venv/bin:$PATH" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
failed=()
for suite in core torch tensorflow parallel; do
  [ -d "tests/$suite" ] || continue
  echo "=== tests/$suite ==="
  .venv/bin/python -m pytest -p no:cacheprovider -q -ra "tests/$suite" "$@"
  rc=$?
  # 5: nothing collected (e.g. a -k that matches nothing here), not a failure.
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed+=("$suite"); fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED suites: ${failed[*]}"
  exit 1
fi
echo "all suites passed"
