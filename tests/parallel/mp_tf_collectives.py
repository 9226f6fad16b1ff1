"""Foundation check under a launcher: dualframe.tensorflow starts Horovod and reduces tensors across ranks."""
import numpy as np
import tensorflow as tf

import dualframe.tensorflow as hvd
from adapter_checks import check_topology_matches  # tests/parallel is on sys.path (pytest rootdir import)


def test_topology_matches_horovod():
    check_topology_matches(hvd, size=2)


def test_allreduce_sum_and_average():
    hvd.init()
    value = tf.constant([float(hvd.rank() + 1), 10.0])
    total = hvd.allreduce(value, op=hvd.Sum, name="foundation.sum")
    expected = sum(range(1, hvd.size() + 1))
    np.testing.assert_array_equal(total.numpy(), [expected, 10.0 * hvd.size()])
    mean = hvd.collectives.allreduce(value, op="average", name="foundation.avg")
    np.testing.assert_allclose(mean.numpy(), [expected / hvd.size(), 10.0])


def test_barrier_through_the_protocol():
    hvd.init()
    hvd.collectives.barrier()
    gathered = hvd.collectives.allgather(tf.constant([[float(hvd.rank())]]), name="foundation.gather")
    np.testing.assert_array_equal(gathered.numpy().ravel(), np.arange(hvd.size(), dtype=np.float32))


def test_backend_conformance_across_ranks(tmp_path):
    # The Backend conformance suite at size 2: collectives' numbers, the wire, bytes and the core's
    # stage-checkpoint procedure across ranks (point-to-point to itself under mpirun).
    from dualframe.tensorflow.backend import BACKEND
    from dualframe.testing.conformance import check_backend

    check_backend(BACKEND, str(tmp_path))
