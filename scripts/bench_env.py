"""What benchmark scripts do before torch, TensorFlow or dualframe loads: one thread a process, the repo on sys.path.

The standard library only: torch and TensorFlow read the thread variables once, when they load, and
``dualframe`` must be found in this checkout rather than in the venv's editable install of another.

    import bench_env  # scripts/ is sys.path[0] when a script runs as ``python scripts/X.py``

    bench_env.one_thread_per_process()

    import keras  # noqa: E402
"""
import os
import pathlib
import sys

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
