"""The SLURM batch scripts for real: ``sbatch --wait`` on the test cluster's 2 nodes, output files checked.

The scripts' ``#SBATCH`` lines ask for GPUs and 8 CPUs per task; the test cluster has neither, so
sbatch's own options override them (``--gres=none --cpus-per-task=1`` and the task layout), as a site
would, and ``SRUN_ARGS=--mpi=pmix`` is the site option for srun. The pipeline's and the hybrid's final
losses are compared with one process training the same model (torch, in this test's process).
"""
from __future__ import annotations

import concurrent.futures
import re

import pytest
import torch
from torch import nn

from _cluster import ROOT, SHARED, on_node, require, wait_slurm_idle, worker_env

TIMEOUT = 300
#: Per script: sbatch's overrides of its #SBATCH lines, and the script's own arguments.
JOBS = {
    "slurm_data_parallel.sh": (["--nodes=2", "--ntasks-per-node=1"], ["--epochs", "1", "--samples", "1024"]),
    "slurm_pipeline.sh": (["--nodes=2", "--ntasks-per-node=1"],
                          ["--steps", "6", "--batch", "32", "--width", "16", "--blocks", "2", "--chunks", "4"]),
    "slurm_hybrid_split.sh": (["--nodes=2", "--ntasks-per-node=2"],
                              ["--steps", "6", "--global-batch", "32", "--width", "16", "--chunks", "4"]),
}


@pytest.fixture(scope="module")
def outputs():
    """The three jobs submitted at once (4 CPUs a node fit them all): sbatch --wait polls the job's
    state about every 10 s or more, so one after the other costs ~40 s each however short the job."""
    require()
    wait_slurm_idle()
    with concurrent.futures.ThreadPoolExecutor(len(JOBS)) as pool:
        futures = {script: pool.submit(sbatch, script, script.split(".")[0]) for script in JOBS}
    return {script: future.exception() or future.result() for script, future in futures.items()}


def output_of(outputs, script: str) -> str:
    result = outputs[script]
    if isinstance(result, BaseException):
        raise result
    return result


def sbatch(script: str, tmp_name: str) -> str:
    """Submit ``script`` from dfn1 with ``--wait``; return its output file's text."""
    options, arguments = JOBS[script]
    output = SHARED / f"{tmp_name}-%j.out"
    command = ["sbatch", "--wait", *options, "--cpus-per-task=1", "--gres=none", "--time=10",
               f"--output={output}", str(ROOT / "scripts" / script), *arguments]
    code, printed, _ = on_node("dfn1", command, worker_env(SRUN_ARGS="--mpi=pmix"), TIMEOUT)
    job = re.search(r"Submitted batch job (\d+)", printed)
    assert job, f"sbatch did not submit {script}:\n{printed}"
    text = pathlib_text(str(output).replace("%j", job.group(1)))
    assert code == 0, f"sbatch --wait {script} exited {code}:\n{printed}\n--- job output:\n{text[-6000:]}"
    return text


def pathlib_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return "(no output file)"


def srun_line(text: str, tasks: int, per_node: int) -> None:
    # What `dualframe run --launcher srun` printed and ran inside the allocation.
    assert re.search(rf"srun --ntasks={tasks} --cpus-per-task=1 --ntasks-per-node={per_node} --kill-on-bad-exit=1 "
                     rf"--mpi=pmix \S+python", text), text[:2000]


def final_loss(text: str) -> float:
    match = re.search(r"final loss ([\d.]+)", text)
    assert match, text[-3000:]
    return float(match.group(1))


def reference_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, momentum: float = 0.0) -> float:
    """One process, the whole model, the whole batch: the loss of the last step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def test_data_parallel_script_on_two_nodes(outputs):
    text = output_of(outputs, "slurm_data_parallel.sh")
    srun_line(text, 2, 1)
    assert "training on 2 process(es)" in text, text[-3000:]
    accuracy = float(re.search(r"final test accuracy: ([\d.]+)", text).group(1))
    assert accuracy > 0.4, text[-3000:]  # 10 classes: chance is 0.1


def test_pipeline_script_stages_on_two_nodes_equal_one_process(outputs):
    text = output_of(outputs, "slurm_pipeline.sh")
    srun_line(text, 2, 1)
    torch.manual_seed(0)  # torch_examples/pipeline_processes.py's model and data, width 16, 2 blocks
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    assert final_loss(text) == pytest.approx(reference_loss(model, x, x[:, :1].sin(), 6), abs=2e-5), text[-3000:]


def test_hybrid_script_two_replicas_by_two_stages_equal_one_process(outputs):
    text = output_of(outputs, "slurm_hybrid_split.sh")
    srun_line(text, 4, 2)
    assert "# 2 replicas x 2 stages" in text and "2 replicas x 2 stages, 1f1b" in text, text[-3000:]
    torch.manual_seed(0)  # torch_examples/hybrid.py's model and data, width 16
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 1))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    assert final_loss(text) == pytest.approx(reference_loss(model, x, x[:, :1].cos(), 6, momentum=0.9), abs=2e-5), text[-3000:]


def test_dualframe_run_chooses_srun_inside_an_allocation():
    require()
    command = ["srun", "--nodes=1", "--ntasks=1", "python", "-m", "dualframe", "run", "--dry-run", "-np", "4", "train.py"]
    code, printed, _ = on_node("dfn1", command, worker_env(), 120)
    assert code == 0, printed
    assert re.search(r"\S*srun --ntasks=4 .*--kill-on-bad-exit=1 \S+ train.py", printed), printed
