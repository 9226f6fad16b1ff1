"""What benchmark scripts do before torch, TensorFlow or dualframe loads: one thread a process, the repo on sys.path.

The standard library only: torch and TensorFlow read the thread variables once, when they load, and
``dualframe`` must be found in this checkout rather than in the venv's editable install of another.

    import bench_env  # scripts/ is sys.path[0] when a script runs as ``python scripts/X.py``

    bench_env.one_thread_per_process()

    import keras  # noqa: E402
"""
import json
import os
import pathlib
import subprocess
import sys
from typing import Any, Dict, List

ROOT = pathlib.Path(__file__).resolve().parent.parent
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def one_thread_per_process(tensorflow: bool = True) -> None:
    """One thread per process unless the environment says otherwise, TensorFlow's logs quiet, the repo on sys.path.

    Args:
        tensorflow: also TensorFlow's two thread pools and its log level; False sets OMP_NUM_THREADS only.
    """
    for name in THREAD_VARIABLES if tensorflow else THREAD_VARIABLES[:1]:
        os.environ.setdefault(name, "1")
    if tensorflow:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    repo_on_path()


def repo_on_path() -> None:
    """This checkout first on sys.path: ``import dualframe`` finds it, not the venv's editable install of another."""
    sys.path.insert(0, str(ROOT))


def mpirun_result(np: int, program: List[str], mmap_threshold: bool = True) -> Dict[str, Any]:
    """Run ``program`` on ``np`` ranks under mpirun (oversubscribed, one thread each); the JSON its rank 0 printed after ``RESULT ``.

    Args:
        np: ranks.
        program: the worker's command line.
        mmap_threshold: ``MALLOC_MMAP_THRESHOLD_=131072``: glibc returns freed large blocks to the system
            (otherwise it keeps freed 16 MiB blocks in its heap and a high-water mark measures that retention).
    """
    from dualframe.launch.commands import mpirun_command, thread_env
    bindir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), **thread_env(1))
    exported = ("PATH", "PYTHONPATH", *thread_env(1))
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        exported += ("MALLOC_MMAP_THRESHOLD_",)
    command = mpirun_command(np, program, oversubscribe=True, export=exported)
    output = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800).stdout
    lines = [line.split("RESULT ", 1)[1] for line in output.splitlines() if "RESULT " in line]
    if not lines:
        raise SystemExit(f"{' '.join(command)} printed no result:\n{output[-3000:]}")
    return json.loads(lines[0])  # type: ignore[no-any-return]
