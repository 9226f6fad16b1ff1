"""The SLURM batch scripts: valid bash, one task per GPU in their headers, and the exact srun command
they run inside a (fake) allocation, recorded by a fake ``srun`` on PATH."""
import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = ["slurm_data_parallel.sh", "slurm_hybrid_split.sh", "slurm_pipeline.sh"]
DEFAULTS = {"slurm_data_parallel.sh": "torch_examples/data_parallel.py",
            "slurm_hybrid_split.sh": "torch_examples/hybrid.py",
            "slurm_pipeline.sh": "torch_examples/pipeline_processes.py"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_bash_syntax(name):
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_header_asks_one_task_per_gpu_before_any_command(name):
    lines = (ROOT / "scripts" / name).read_text().splitlines()
    sbatch = {m.group(1): m.group(2) for m in (re.match(r"#SBATCH --([\w-]+)=(\S+)", line) for line in lines) if m}
    assert sbatch["gres"] == f"gpu:{sbatch['ntasks-per-node']}"
    assert int(sbatch["cpus-per-task"]) >= 1
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    last_sbatch = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_sbatch < first_command, "sbatch ignores #SBATCH lines after the first command"
    assert lines[1].startswith("# ") and "sbatch scripts/" + name in "\n".join(lines[:first_command])


def _run(tmp_path, name, *args, tasks=8, nodes=2, extra_env=None):
    fake = tmp_path / "srun"
    fake.write_text(f'#!/bin/sh\necho "OMP_NUM_THREADS=$OMP_NUM_THREADS $*" > {tmp_path}/srun.args\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), PYTHON=sys.executable,
               SLURM_JOB_ID="1234", SLURM_SUBMIT_DIR=str(ROOT), SLURM_NTASKS=str(tasks), SLURM_NNODES=str(nodes),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS_PER_NODE=str(tasks // nodes), SLURM_CPUS_PER_TASK="8",
               **(extra_env or {}))
    result = subprocess.run(["bash", str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    recorded = (tmp_path / "srun.args").read_text().strip() if (tmp_path / "srun.args").exists() else None
    return result, recorded


@pytest.mark.parametrize("name", SCRIPTS)
def test_runs_srun_with_one_task_per_gpu_and_the_thread_count(tmp_path, name):
    result, recorded = _run(tmp_path, name, "--steps", "3")
    assert result.returncode == 0, result.stderr
    expected = (f"OMP_NUM_THREADS=8 --ntasks=8 --cpus-per-task=8 --ntasks-per-node=4 --kill-on-bad-exit=1 "
                f"{sys.executable} {DEFAULTS[name]} --steps 3")
    assert recorded == expected
    assert f"{tmp_path}/srun --ntasks=8" in result.stdout      # dualframe run printed the command it ran


def test_site_srun_options_and_another_script(tmp_path):
    result, recorded = _run(tmp_path, "slurm_data_parallel.sh", tasks=4, nodes=1,
                            extra_env={"SRUN_ARGS": "--mpi=pmix --gpu-bind=none", "SCRIPT": "tf_examples/data_parallel.py"})
    assert result.returncode == 0, result.stderr
    assert recorded == (f"OMP_NUM_THREADS=8 --ntasks=4 --cpus-per-task=8 --ntasks-per-node=4 --kill-on-bad-exit=1 "
                        f"--mpi=pmix --gpu-bind=none {sys.executable} tf_examples/data_parallel.py")


def test_hybrid_refuses_tasks_that_are_not_a_multiple_of_the_stages(tmp_path):
    result, recorded = _run(tmp_path, "slurm_hybrid_split.sh", tasks=6, nodes=2, extra_env={"STAGES": "4"})
    assert result.returncode == 2 and recorded is None
    assert "the number of tasks must be a multiple of STAGES (tasks: 6, STAGES: 4); ask for 8 tasks" in result.stderr
    result, recorded = _run(tmp_path, "slurm_hybrid_split.sh", tasks=8, nodes=2, extra_env={"STAGES": "4"})
    assert result.returncode == 0 and "# 2 replicas x 4 stages" in result.stdout


def test_outside_an_allocation_it_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(ROOT / "scripts/slurm_pipeline.sh")], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=60)
    assert result.returncode != 0 and "not inside a SLURM allocation (use sbatch)" in result.stderr
