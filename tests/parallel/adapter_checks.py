"""Checks a rank runs the same way on either adapter's public module (``dualframe.torch``, ``dualframe.tensorflow``).

Framework-free: the adapter module is the argument. Worker files import it by its bare name (pytest
puts tests/parallel on sys.path); not a worker itself (its name does not start with ``mp_``).
"""
from dualframe.launch.topology import detect


def check_topology_matches(adapter, size=2):
    """``adapter.init()``, then its rank and size are what the launcher's variables said (read before init)."""
    topology = detect()
    adapter.init()
    assert (adapter.rank(), adapter.size()) == (topology.rank, topology.size)
    assert topology.size == size, f"launched on {topology.size} ranks, this file expects {size}"
