"""Every rank of a job spread over the test cluster's nodes: topology, data parallelism, pipeline, hybrid.

Run by every rank (tests/cluster/test_cluster.py starts it with mpirun -H, horovodrun -H or srun).
On 2 ranks (one per node) the pipeline's two stages sit on different nodes; on 4 ranks (2 nodes x 2)
the hybrid's 2 replicas x 2 stages are laid out as ``DUALFRAME_TEST_LAYOUT`` says: ``replicas``
(each node holds one whole replica) or ``stages`` (each node holds one stage of both replicas).
Every result is compared with one process training the same model on the global batch.
"""
import copy
import os
import socket

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.launch.topology import detect
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.torch.pipeline.distributed import DistributedPipeline
from tests.parallel.torch_cases import (check_pipeline_training, pipeline_batches, pipeline_model,  # PYTHONPATH: repo
                                        pipeline_reference)

TOPOLOGY = detect()  # read at collection, before init: every rank decides the same skips
NODES = int(os.environ.get("DUALFRAME_TEST_NODES", "2"))
LAYOUT = os.environ.get("DUALFRAME_TEST_LAYOUT", "replicas")
GLOO = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
STEPS, BATCH, TOL = 4, 8, 1e-5
#: A neighbour's silence this long is a lost stage (45 s by default; a loaded CI box can exceed it).
PEER_TIMEOUT = 150.0


@pytest.fixture(scope="module", autouse=True)
def started():
    sets = pipeline_process_sets(TOPOLOGY.size, 2) if TOPOLOGY.size == 4 else None
    hvd.init(process_sets=sets) if sets else hvd.init()
    assert hvd.size() == TOPOLOGY.size


def hosts():
    """Every rank's host name, by rank."""
    return horovod.allgather_object(socket.gethostname())


def test_ranks_are_spread_over_the_nodes_and_know_where_they_stand():
    names = hosts()
    assert len(set(names)) == NODES, names
    rank, mine = hvd.rank(), names[hvd.rank()]
    same_host = [r for r, name in enumerate(names) if name == mine]
    order = list(dict.fromkeys(names))  # hosts in the order of their first rank
    local_rank = same_host.index(rank)
    peers = [r for r in range(len(names)) if [q for q, n in enumerate(names) if n == names[r]].index(r) == local_rank]
    expected = {"local_rank": local_rank, "local_size": len(same_host), "cross_rank": peers.index(rank),
                "cross_size": len(order)}
    seen = {name: getattr(hvd, name)() for name in expected}
    assert seen == expected, f"rank {rank} on {mine}: Horovod says {seen}, the hosts {names} say {expected}"
    # The core reads the same from the launcher's variables, before any init.
    assert (TOPOLOGY.rank, TOPOLOGY.size, TOPOLOGY.local_rank, TOPOLOGY.local_size) == (
        rank, len(names), local_rank, len(same_host))
    assert (TOPOLOGY.cross_rank, TOPOLOGY.cross_size) == (order.index(mine), len(order))  # the node's index


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_data_parallel_equals_one_process():
    generator = torch.Generator().manual_seed(123)
    data = [(torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator))
            for _ in range(STEPS)]
    model = make_model(hvd.rank())  # rank 0's weights reach every rank by the broadcast
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = make_model(0)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        ((model(hvd.shard_batch(x)) - hvd.shard_batch(y)) ** 2).mean().backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_optimizer.step()
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        gathered = hvd.allgather(value.detach().unsqueeze(0), name=f"cluster.{name}")
        assert all(torch.equal(gathered[0], other) for other in gathered[1:]), f"{name} differs between ranks"
        torch.testing.assert_close(value, expected, atol=TOL, rtol=TOL)


TRANSPORTS = ["horovod"] if GLOO else ["mpi", "horovod"]


@pytest.mark.skipif(TOPOLOGY.size != 2, reason="the 2-stage pipeline runs on 2 ranks, one per node")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pipeline_stages_on_different_nodes_equal_one_process(transport, schedule, monkeypatch):
    names = hosts()
    assert names[0] != names[1], f"both stages on {names[0]}"
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", transport)
    model, data = pipeline_model(), pipeline_batches(10)
    losses, state = pipeline_reference(model, data)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=4, schedule=schedule, loss_fn=nn.MSELoss(),
                               timeout=PEER_TIMEOUT)
    assert (pipe.direct is not None) is (transport == "mpi")
    check_pipeline_training(pipe, data, (losses, state), atol=TOL)


@pytest.mark.skipif(TOPOLOGY.size != 4, reason="the 2 x 2 hybrid runs on 4 ranks, 2 per node")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_two_replicas_by_two_stages_equals_one_process(schedule):
    names = hosts()
    pipe = DistributedPipeline(pipeline_model(), balance=[3, 2], chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), data_parallel=2, timeout=PEER_TIMEOUT)
    where = {(r // 2, r % 2): names[r] for r in range(4)}  # (replica, stage) -> host
    if LAYOUT == "replicas":  # a replica's two stages share a node; the replicas' gradients cross nodes
        assert where[0, 0] == where[0, 1] != where[1, 0] == where[1, 1], where
    else:  # a stage's replicas share a node; every activation crosses nodes
        assert where[0, 0] == where[1, 0] != where[0, 1] == where[1, 1], where
    data = pipeline_batches(16)
    losses, state = pipeline_reference(pipeline_model(), data)
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9))
    for step, (x, y) in enumerate(data):
        shard = slice(pipe.replica * 8, (pipe.replica + 1) * 8)
        optimizer.zero_grad()
        loss = pipe.train_step(x[shard], y[shard])
        optimizer.step()
        assert loss == pytest.approx(losses[step], abs=TOL), f"step {step}"
    for key, value in pipe.state_dict().items():  # each replica of a stage holds the one-process weights
        torch.testing.assert_close(value, state[key], atol=TOL, rtol=0)
