"""Defaults for the MPI library and Horovod's controller, set in the environment before ``hvd.init()`` starts them.

Horovod's background thread coordinates the ranks every cycle (about a millisecond). Under Open MPI
its waits busy-poll by default unless the job is oversubscribed. A pipeline stage that waits for its
neighbour, or a data-parallel rank waiting for the slowest, then keeps a core spinning that the
other processes on the node need. On a 2-core box the background thread used 61% of a core, and
pipeline chunks=8 / chunks=1 fell from 1.69 to 1.15 (docs/benchmarks.md). ``mpi_yield_when_idle``
makes those waits give the core away. A busy poll saves a few microseconds per message when every
process has a core to itself, so the default only fills in what the user left unset.

Under Horovod's Gloo controller (``horovodrun --gloo`` sets ``HOROVOD_CONTROLLER=gloo``) that
coordination is a Gloo allreduce over TCP every cycle, whether or not anything is to be reduced,
and each wakeup takes a core from the computation. At Horovod's 1 ms, a 2-stage torch pipeline on
2 cores ran 1.22-1.30x faster with 8 micro-batches than without; at 5 ms, 1.57x (mpirun: 1.65x), and
data parallelism was not slower (docs/benchmarks.md). So a Gloo job runs at ``HOROVOD_CYCLE_TIME=5``
unless it sets its own: a Horovod operation may wait up to 5 ms longer to start. MPI jobs keep
Horovod's 1 ms: there the cycle's wait yields its core (above), and taking that wait off the core
altogether gained nothing measurable.

Set ``DUALFRAME_MPI_DEFAULTS=0`` to leave the environment alone. A value the user already set,
e.g. ``mpirun --mca mpi_yield_when_idle 0``, ``OMPI_MCA_mpi_yield_when_idle=0`` or
``HOROVOD_CYCLE_TIME=1``, always wins. Other MPI libraries ignore the Open MPI names.
"""
from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

#: Turns the defaults off when "0".
SWITCH_VARIABLE = "DUALFRAME_MPI_DEFAULTS"

#: Open MPI's MCA parameters, as its environment variables, with dualframe's default values.
DEFAULTS: Dict[str, str] = {"OMPI_MCA_mpi_yield_when_idle": "1"}

#: Horovod's variables under its Gloo controller (``HOROVOD_CONTROLLER=gloo``), with dualframe's default values.
GLOO_DEFAULTS: Dict[str, str] = {"HOROVOD_CYCLE_TIME": "5"}


def apply(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Fill in ``DEFAULTS`` (and ``GLOO_DEFAULTS`` under the Gloo controller) the environment does not set yet.

    Call it before MPI starts (``hvd.init()``); importing ``dualframe.torch`` or
    ``dualframe.tensorflow`` does.

    Args:
        environ: the environment to change; ``os.environ`` by default.

    Returns:
        The variables set by this call, by name (empty when all were set or the defaults are off).

    Example:
        >>> env = {"OMPI_COMM_WORLD_SIZE": "2"}
        >>> apply(env)
        {'OMPI_MCA_mpi_yield_when_idle': '1'}
        >>> apply({"OMPI_MCA_mpi_yield_when_idle": "0"})
        {}
        >>> apply({"OMPI_MCA_mpi_yield_when_idle": "0", "HOROVOD_CONTROLLER": "gloo"})
        {'HOROVOD_CYCLE_TIME': '5'}
    """
    env = os.environ if environ is None else environ
    if env.get(SWITCH_VARIABLE, "1") == "0":
        return {}
    wanted = dict(DEFAULTS, **(GLOO_DEFAULTS if env.get("HOROVOD_CONTROLLER", "").lower() == "gloo" else {}))
    added = {name: value for name, value in wanted.items() if name not in env}
    env.update(added)
    return added
