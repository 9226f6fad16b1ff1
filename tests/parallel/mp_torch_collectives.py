"""Foundation check under a launcher: dualframe.torch starts Horovod and reduces tensors across ranks."""
import pytest
import torch

import dualframe.torch as hvd
from adapter_checks import check_topology_matches  # tests/parallel is on sys.path (pytest rootdir import)


def test_topology_matches_horovod():
    check_topology_matches(hvd, size=2)


def test_allreduce_sum_and_average():
    hvd.init()
    value = torch.tensor([float(hvd.rank() + 1), 10.0])
    total = hvd.allreduce(value, op=hvd.Sum, name="foundation.sum")
    expected = sum(range(1, hvd.size() + 1))
    assert torch.equal(total, torch.tensor([float(expected), 10.0 * hvd.size()]))
    mean = hvd.collectives.allreduce(value, op="average", name="foundation.avg")
    assert torch.allclose(mean, torch.tensor([expected / hvd.size(), 10.0]))


def test_unknown_op_refused_before_communication():
    from dualframe.errors import StrategyError
    with pytest.raises(StrategyError, match="unknown op 'median'"):
        hvd.collectives.allreduce(torch.ones(1), op="median")


def test_backend_conformance_across_ranks(tmp_path):
    # The Backend conformance suite at size 2: collectives' numbers, the wire, bytes and the core's
    # stage-checkpoint procedure across ranks (point-to-point to itself under mpirun).
    from dualframe.torch.backend import BACKEND
    from dualframe.testing.conformance import check_backend

    check_backend(BACKEND, str(tmp_path))
