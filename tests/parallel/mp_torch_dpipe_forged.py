"""A DistributedPipeline over ZeroMQ trains as one process does while a process outside the job sends forged frames to its ports.

Rank 0 starts tests/parallel/dpipe_workers/stranger.py (no part of the job: it knows the ports, the
frame layout and the message sizes, not the secret) against every rank's pipeline socket, waits until
its first round of garbage, unsealed and forged-MAC messages left, and both ranks train while it goes
on sending. Losses and weights must equal one process's; every rank must have dropped the stranger's
messages (counted, one warning), and listened on the loopback only, never on every interface; under
horovodrun --gloo the pipeline's socket is the only one a rank listens on, so the stranger reached
every port the ranks listen on.
"""
# timeout: 300
import copy
import os
import pathlib
import subprocess
import sys

import horovod.torch as horovod
import psutil
import pytest
import torch
import zmq
from torch import nn

import dualframe.torch as hvd
from dualframe.torch.pipeline.distributed import DistributedPipeline
from torch_cases import pipeline_batches, pipeline_model, pipeline_reference  # tests/parallel is on sys.path

STEPS, BATCH, CHUNKS = 6, 10, 4
STRANGER = pathlib.Path(__file__).resolve().parent / "dpipe_workers" / "stranger.py"
#: Every message size up to 256 bytes in steps of 8: this pipeline's activations (3 or 2 rows x 16 float32),
#: gradients, shape headers and control messages among them.
SIZES = ",".join(str(size) for size in range(8, 257, 8))


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 2


def listening_ports():
    """(address, port) of every TCP socket this process listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def start_stranger(endpoints):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMIX_", "PMI_"))}
    stranger = subprocess.Popen([sys.executable, str(STRANGER), "--sizes", SIZES, *endpoints], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = stranger.stdout.readline()
    assert first.startswith("round 1: "), first + stranger.stdout.read()
    return stranger, int(first.split()[2])


def test_forged_frames_from_outside_the_job_change_nothing():
    model, data = pipeline_model(), pipeline_batches(BATCH, STEPS)
    expected_losses, expected_state = pipeline_reference(model, data)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=CHUNKS, loss_fn=nn.MSELoss(),
                               transport="zmq")
    endpoint = pipe.direct.inbox.getsockopt(zmq.LAST_ENDPOINT).decode()
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint  # the job is on one host: the loopback only
    port = int(endpoint.rsplit(":", 1)[1])
    assert {address for address, at in listening_ports() if at == port} == {"127.0.0.1"}, listening_ports()
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:  # horovodrun --gloo: the pipeline's is the ranks' only port
        assert listening_ports() == {("127.0.0.1", port)}, listening_ports()  # (mpirun's own: docs/reliability.md)
    stranger, first_round = start_stranger(pipe.direct.peers) if hvd.rank() == 0 else (None, 0)
    first_round = horovod.broadcast_object(first_round, root_rank=0)  # rank 1 starts once the round left
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(RuntimeWarning, match="pipeline socket dropped a message that is not from this job's ranks"):
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
            assert loss == pytest.approx(expected_losses[step], abs=1e-5), f"step {step}"
            optimizer.step()
    per_rank = first_round // 2 - 1  # the 1 MiB body may still be on its way: every other message was read
    assert pipe.direct.dropped >= per_rank, (pipe.direct.dropped, pipe.direct.seal.reasons)
    assert set(pipe.direct.seal.reasons) <= {"not two frames", "a header of another size", "a MAC that does not match",
                                             "a body of another length than its header says"}
    if stranger is not None:
        stranger.kill()
        stranger.wait()
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        merged.update(part)
    for key, value in expected_state.items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0)
