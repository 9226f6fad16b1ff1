#!/usr/bin/env bash
# Take a fresh Linux machine to a working dualframe: Debian packages, .venv, torch, TF, mpi4py, pyzmq, Horovod.
#
# Idempotent: every step checks before it acts, and a finished bootstrap is recorded in
# .venv/.dualframe-bootstrap, so a second run returns in about a second.
#
# Settings (environment variables, all optional):
#   DUALFRAME_TORCH_SPEC   pip requirement for torch        (default: torch==2.13.0, CPU build here)
#   DUALFRAME_TF_SPEC      pip requirement for TensorFlow   (default: tensorflow-cpu==2.21.0)
#   DUALFRAME_CACHE        where the built Horovod wheel is kept (default: ~/.cache/dualframe)
#   DUALFRAME_USE_INSTALLED_HOROVOD=1  keep a Horovod already importable in .venv, build nothing
#   HOROVOD_GPU_OPERATIONS, HOROVOD_CUDA_HOME, ...  passed through to the Horovod build (GPU clusters)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
HOROVOD_VERSION=0.28.1
HOROVOD_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# Bumped whenever the patch applied to the Horovod sdist changes, so cached wheels are rebuilt.
HOROVOD_PATCH_LEVEL=1
TORCH_SPEC=${DUALFRAME_TORCH_SPEC:-torch==2.13.0}
TF_SPEC=${DUALFRAME_TF_SPEC:-tensorflow-cpu==2.21.0}
# The real clients the tests split (models built from small configs, nothing downloaded).
TRANSFORMERS_SPEC=transformers==5.24.0
KERAS_HUB_SPEC=keras-hub==0.32.0
CACHE=${DUALFRAME_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dualframe}
STAMP="$VENV/.dualframe-bootstrap"
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-none}

say() { echo "[bootstrap] $*" >&2; }
die() { echo "[bootstrap] error: $*" >&2; exit 1; }

wanted_stamp() {
  printf 'horovod=%s.%s torch=%s tf=%s gpu=%s clients=%s,%s setup=%s\n' "$HOROVOD_VERSION" "$HOROVOD_PATCH_LEVEL" \
    "$TORCH_SPEC" "$TF_SPEC" "$GPU_OPS" "$TRANSFORMERS_SPEC" "$KERAS_HUB_SPEC" \
    "$(cat "$ROOT/setup.cfg" 2>/dev/null | sha256sum | cut -c1-16)"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(wanted_stamp)" ] && [ -x "$PY" ] \
   && command -v mpirun >/dev/null 2>&1; then
  exit 0
fi

# --- 1. Debian packages ------------------------------------------------------------------------
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
[ -n "$(command -v mpicxx 2>/dev/null)" ] || missing+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    die "missing system packages: ${missing[*]}. Install them first: sudo apt-get install -y ${missing[*]}"
  fi
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get: install them with your package manager"
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. The virtual environment and the frameworks ------------------------------------------------
if [ ! -x "$PY" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
has() { "$PY" - "$@" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    if not req.specifier.contains(version(req.name).split("+")[0], prereleases=True):
        sys.exit(1)
PYEOF
}
pip install setuptools wheel packaging
# torch first and pinned: an unpinned torch pulled in by something else would bring CUDA packages.
has "$TORCH_SPEC" || { say "installing $TORCH_SPEC"; pip install "$TORCH_SPEC"; }
has "$TF_SPEC" || { say "installing $TF_SPEC"; pip install "$TF_SPEC"; }
has mpi4py || { say "installing mpi4py"; pip install mpi4py; }
has pyzmq || { say "installing pyzmq"; pip install pyzmq; }  # pipeline point-to-point under horovodrun --gloo
# Hugging Face transformers and keras-hub for the tests that split their models. keras-hub without its
# dependencies: its tensorflow-text would pull the full tensorflow wheel over tensorflow-cpu, and keras_hub
# imports without it; the few packages it does import come next.
has "$TRANSFORMERS_SPEC" || { say "installing $TRANSFORMERS_SPEC"; pip install "$TRANSFORMERS_SPEC"; }
if ! has "$KERAS_HUB_SPEC"; then
  say "installing $KERAS_HUB_SPEC (without tensorflow-text)"
  pip install --no-deps "$KERAS_HUB_SPEC"
  pip install absl-py regex rich kagglehub sentencepiece tokenizers
fi
say "installing dualframe (editable) with its test tools"
pip install -e "$ROOT[test]"

# --- 3. Horovod, built from its sdist with the fixes current frameworks need -----------------------
horovod_ok() {
  "$PY" -c 'import horovod.torch, horovod.tensorflow' >/dev/null 2>&1
}
if [ "${DUALFRAME_USE_INSTALLED_HOROVOD:-0}" = 1 ]; then
  horovod_ok || die "DUALFRAME_USE_INSTALLED_HOROVOD=1 but horovod.torch/horovod.tensorflow do not import in $VENV"
else
  pyver=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  torchver=$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')
  tfver=$("$PY" -c 'from importlib.metadata import version as v
for n in ("tensorflow", "tensorflow-cpu"):
    try: print(v(n)); break
    except Exception: pass')
  key="horovod-$HOROVOD_VERSION.p$HOROVOD_PATCH_LEVEL-torch$torchver-tf$tfver-$pyver-gpu$GPU_OPS"
  wheeldir="$CACHE/wheels/$key"
  wheel=$(ls "$wheeldir"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    say "building Horovod $HOROVOD_VERSION for torch $torchver and TensorFlow $tfver (about 10 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    sdist="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
    mkdir -p "$CACHE/sdist"
    if [ ! -f "$sdist" ]; then
      pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work/dl"
      mv "$work/dl/horovod-$HOROVOD_VERSION.tar.gz" "$sdist"
    fi
    echo "$HOROVOD_SHA256  $sdist" | sha256sum -c --quiet - \
      || { rm -f "$sdist"; die "the Horovod sdist does not match its pinned sha256 ($HOROVOD_SHA256); removed it, run again"; }
    tar -xzf "$sdist" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    "$PY" "$ROOT/scripts/patch_horovod.py" "$src"
    mkdir -p "$wheeldir"
    (
      cd "$src"
      export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
      export HOROVOD_WITHOUT_MXNET=1
      export MAKEFLAGS="-j$(nproc)"
      "$PY" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps -w "$work/whl" . > "$work/build.log" 2>&1 \
        || { tail -n 60 "$work/build.log" >&2; die "the Horovod build failed (log above)"; }
    )
    cp "$work"/whl/horovod-*.whl "$wheeldir/"
    wheel=$(ls "$wheeldir"/horovod-*.whl | head -n 1)
  fi
  if ! horovod_ok || [ "$("$PY" -c 'import horovod; print(horovod.__version__)' 2>/dev/null)" != "$HOROVOD_VERSION" ]; then
    say "installing $(basename "$wheel")"
    pip install --force-reinstall --no-deps "$wheel"
    pip install cloudpickle psutil pyyaml cffi
  fi
  horovod_ok || die "Horovod was installed but horovod.torch / horovod.tensorflow do not import"
fi

wanted_stamp > "$STAMP"
say "ready: $VENV"
