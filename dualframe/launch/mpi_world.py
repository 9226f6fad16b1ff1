"""Who starts MPI: mpi4py, before Horovod, so that MPI lives until this process exits.

Horovod finalizes an MPI it started itself when its background thread stops, and that thread stops
on every rank as soon as one rank's Horovod shuts down: a rank that finished its script first ends
Horovod for the others. A pipeline stage still sending or receiving over MPI point-to-point
(``dualframe.pipeline.mpi_direct``) then ran on a finalized MPI: SIGSEGV ("Address not mapped") on
the rank that had steps left. Started by mpi4py, MPI belongs to mpi4py, which finalizes it when the
interpreter exits (``Py_AtExit``, after every ``atexit`` handler, Horovod's shutdown included), and
Horovod only uses it. This is the order Horovod documents for ``hvd.init(comm=...)``.

Only where the job runs on MPI (mpirun, srun, horovodrun without ``--gloo``): in a Gloo job or a lone
process, starting MPI would be a singleton MPI world Horovod does not use. mpi4py is imported only
then, so importing this module loads no MPI.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

#: "horovod" leaves MPI's start (and finalize) to Horovod, as before.
OWNER_VARIABLE = "DUALFRAME_MPI_INIT"

#: Variables an MPI launcher sets in every process it starts: Open MPI, MPICH / Intel MPI (PMI), PMIx (srun --mpi=pmix).
_MPI_LAUNCH = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def why_not(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why dualframe leaves MPI's start to Horovod in this process; None when mpi4py should start it.

    Example:
        >>> why_not({"OMPI_COMM_WORLD_SIZE": "2"}) is None
        True
        >>> why_not({"OMPI_COMM_WORLD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"})
        'the job runs on Gloo (horovodrun --gloo)'
        >>> why_not({})
        'no MPI launcher started this process'
    """
    env = os.environ if environ is None else environ
    if env.get(OWNER_VARIABLE, "").strip().lower() == "horovod":
        return f"{OWNER_VARIABLE}=horovod"
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or env.get("HOROVOD_CONTROLLER", "").lower() == "gloo":
        return "the job runs on Gloo (horovodrun --gloo)"
    if not any(name in env for name in _MPI_LAUNCH):
        return "no MPI launcher started this process"
    return None


def start_mpi(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Start MPI through mpi4py when the job runs on MPI (see ``why_not``); call it before ``hvd.init()``.

    Does nothing when MPI already runs (a script that imported ``mpi4py.MPI`` itself), when mpi4py is
    missing, or when the user told mpi4py not to initialize (``mpi4py.rc.initialize = False``).

    Returns:
        True when MPI runs now, owned by mpi4py.

    Example:
        >>> start_mpi({})   # no MPI launcher: nothing started
        False
    """
    if why_not(environ) is not None:
        return False
    try:
        import mpi4py
    except ImportError:
        return False
    if not mpi4py.rc.initialize:
        return False
    from mpi4py import MPI  # MPI_Init_thread, at mpi4py's thread level (MPI_THREAD_MULTIPLE unless the user chose)

    return bool(MPI.Is_initialized())
