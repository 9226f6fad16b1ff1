#!/usr/bin/env bash
# Run dualframe's whole test suite, bootstrapping whatever is missing first.
#
# Five pytest runs, because TensorFlow and torch never load in the same process:
#   tests/core        framework-neutral logic (no framework imported)
#   tests/torch       single-process PyTorch tests
#   tests/tensorflow  single-process TensorFlow/Keras tests
#   tests/parallel    multi-process tests, each file under horovodrun --gloo and under mpirun
#   tests/cluster     jobs across the nodes of a test cluster on this machine (scripts/cluster.sh):
#                     as root it installs the cluster's Debian packages when missing, brings the
#                     cluster up, and takes it down on exit even when tests fail; without root, or
#                     where network namespaces cannot be made, it is skipped with the reason
# Extra arguments go to every pytest run (e.g. -k pipeline).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh || exit 1
export PATH="$ROOT/.venv/bin:$PATH" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
failed=()
passed=0
failed_n=0
log=$(mktemp)
cluster_up=0
trap 'rm -f "$log"; [ $cluster_up = 0 ] || bash scripts/cluster.sh down' EXIT
trap 'exit 130' INT TERM
for suite in core torch tensorflow parallel cluster; do
  [ -d "tests/$suite" ] || continue
  if [ $suite = cluster ]; then
    if [ "$(id -u)" != 0 ]; then
      echo "=== tests/cluster: skipped: not root (the test cluster needs network namespaces: run as root) ==="
      continue
    fi
    if ! bash scripts/cluster.sh install; then
      echo "=== tests/cluster: its Debian packages could not be installed (above) ==="
      failed+=(cluster); continue
    fi
    if ! why=$(bash scripts/cluster.sh probe); then
      echo "=== tests/cluster: skipped: $why ==="
      continue
    fi
    cluster_up=1
    if ! bash scripts/cluster.sh up; then
      echo "=== tests/cluster: the test cluster did not come up (above) ==="
      failed+=(cluster); continue
    fi
    export DUALFRAME_CLUSTER_REQUIRED=1   # from here a cluster that stops answering fails, never skips
  fi
  echo "=== tests/$suite ==="
  .venv/bin/python -m pytest -p no:cacheprovider -q -ra "tests/$suite" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  summary=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)
  read -r p f < <(echo "$summary" | awk '{for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i;
    if ($(i+1) ~ /^(failed|errors?)/) f += $i } } END { print p + 0, f + 0 }')
  passed=$((passed + p)); failed_n=$((failed_n + f))
  # 5: nothing collected (e.g. a -k that matches nothing here), not a failure.
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then failed+=("$suite"); fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED suites: ${failed[*]}"
  echo "total: $passed passed, $failed_n failed"
  exit 1
fi
echo "total: $passed passed, $failed_n failed"
