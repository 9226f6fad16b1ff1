"""Defaults for the MPI library under Horovod, set in the environment before ``hvd.init()`` starts MPI.

Horovod's background thread coordinates the ranks every cycle (about a millisecond). Under Open MPI
its waits busy-poll by default unless the job is oversubscribed. A pipeline stage that waits for its
neighbour, or a data-parallel rank waiting for the slowest, then keeps a core spinning that the
other processes on the node need. On a 2-core box the background thread used 61% of a core, and
pipeline chunks=8 / chunks=1 fell from 1.69 to 1.15 (docs/benchmarks.md). ``mpi_yield_when_idle``
makes those waits give the core away. A busy poll saves a few microseconds per message when every
process has a core to itself, so the default only fills in what the user left unset.

Set ``DUALFRAME_MPI_DEFAULTS=0`` to leave the environment alone. A value the user already set,
e.g. ``mpirun --mca mpi_yield_when_idle 0`` or ``OMPI_MCA_mpi_yield_when_idle=0``, always wins.
Other MPI libraries ignore these names.
"""
from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

#: Turns the defaults off when "0".
SWITCH_VARIABLE = "DUALFRAME_MPI_DEFAULTS"

#: Open MPI's MCA parameters, as its environment variables, with dualframe's default values.
DEFAULTS: Dict[str, str] = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def apply(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Fill in ``DEFAULTS`` the environment does not set yet; return the ones set now.

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
    """
    env = os.environ if environ is None else environ
    if env.get(SWITCH_VARIABLE, "1") == "0":
        return {}
    added = {name: value for name, value in DEFAULTS.items() if name not in env}
    env.update(added)
    return added
