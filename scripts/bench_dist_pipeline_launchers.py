"""Process pipelines under horovodrun --gloo against mpirun: chunks=8 / chunks=1 for torch and Keras, launchers alternated.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_dist_pipeline_launchers.py --pairs 3

Runs ``bench_dist_pipeline.py --only-ratios`` (torch) and ``bench_dist_pipeline_tf.py --only-ratios``
(Keras) under each launcher in turn (gloo, mpi, gloo, mpi ...: a change of load hits both alike), two
processes of one thread each, and prints for each framework and launcher every run's median
chunks=8 / chunks=1 (point-to-point: ZeroMQ under gloo, MPI under mpirun; and Horovod broadcasts;
for Keras also GPipe and 1F1B over its chunks=1 with one backward per stage, ``bench_dist_pipeline_tf.py``),
their median, and the load average before each run. One launcher cannot be interleaved with the
other inside one job, so the runs are what alternates here; each run's own ratio is already the
median of its interleaved rounds.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
SCRIPTS = {"torch": "scripts/bench_dist_pipeline.py", "keras": "scripts/bench_dist_pipeline_tf.py"}
THREADS = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
LINES = {"point-to-point": re.compile(r"throughput chunks=8 / chunks=1: median ([0-9.]+)"),
         "Horovod broadcasts": re.compile(r"throughput chunks=8 / chunks=1, Horovod broadcasts: median ([0-9.]+)"),
         "over one-backward chunks=1": re.compile(r"throughput chunks=8 / chunks=1 one backward: median ([0-9.]+)"),
         "1F1B over one-backward chunks=1": re.compile(r"throughput chunks=8 1f1b / chunks=1 one backward: median ([0-9.]+)")}


def command(launcher: str, script: str, extra: List[str]) -> List[str]:
    if launcher == "gloo":
        return [os.path.join(ROOT, ".venv", "bin", "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                PYTHON, script, "--only-ratios", *extra]
    exports = [arg for name in [*THREADS, "PATH", "PYTHONPATH"] for arg in ("-x", name)]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none", *exports,
            PYTHON, script, "--only-ratios", *extra]


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="runs per launcher and framework, alternated")
    parser.add_argument("--frameworks", default="torch,keras")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("extra", nargs="*", help="passed to the benchmark scripts (after --), e.g. --rounds 5")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT, **THREADS)
    for framework in args.frameworks.split(","):
        found: Dict[str, Dict[str, List[float]]] = {}
        for pair in range(args.pairs):
            for launcher in ("gloo", "mpi"):
                before = load()
                run = subprocess.run(command(launcher, SCRIPTS[framework], args.extra), cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=args.timeout)
                ratios = {name: float(m.group(1)) for name, line in LINES.items() if (m := line.search(run.stdout))}
                print(f"{framework} {launcher} run {pair + 1}: load {before} -> {load()}, "
                      + (", ".join(f"{name} {value:.2f}" for name, value in ratios.items())
                         or f"no ratio (exit {run.returncode}): {(run.stdout + run.stderr)[-400:]!r}"), flush=True)
                for name, value in ratios.items():
                    found.setdefault(launcher, {}).setdefault(name, []).append(value)
        for launcher, lines in found.items():
            for name, values in lines.items():
                print(f"{framework} chunks=8 / chunks=1 under {'horovodrun --gloo' if launcher == 'gloo' else 'mpirun'}, "
                      f"{name}: median {statistics.median(values):.2f} (runs: {' '.join(f'{v:.2f}' for v in values)})",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
