"""Which point-to-point transport a pipeline's messages take (MPI, ZeroMQ or none: Horovod broadcasts), agreed by every rank.

The ranks vote once, when the pipeline is built (``open_direct``): each says which transports it
can use and which one it asks for (the pipeline's ``transport=``, else ``DUALFRAME_PIPELINE_TRANSPORT``) (``dualframe.pipeline.link``'s
``transport_votes`` / ``agree_transport``), the votes are summed over every rank, and every rank
opens the same one: MPI point-to-point under an MPI world (``mpi_direct``), ZeroMQ point-to-point
elsewhere, ``horovodrun --gloo`` included (``zmq_direct``), else none (Horovod broadcasts).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from dualframe.pipeline import mpi_direct, zmq_direct
from dualframe.pipeline.link import TRANSPORT_VARIABLE, agree_transport, transport_choice, transport_votes

#: An open point-to-point transport (both are the core's ``PointToPoint``).
Direct = Union["mpi_direct.MPIDirect[Any]", "zmq_direct.ZMQDirect[Any]"]


def missing(on_cpu: str, horovod_on_mpi: bool, rank: int, size: int, chunks: int) -> Dict[str, Optional[str]]:
    """Why this rank cannot use each point-to-point transport (None where it can).

    Args:
        on_cpu: "" when the stage's tensors are on the host, else the device's name (both move host bytes).
        horovod_on_mpi, rank, size, chunks: see ``mpi_direct.missing``.
    """
    if on_cpu:
        device = f"the stage is on {on_cpu} (point-to-point moves host tensors here; device tensors go through Horovod)"
        return {"mpi": device, "zmq": device}
    return {"mpi": mpi_direct.missing("", horovod_on_mpi, rank, size, chunks), "zmq": zmq_direct.missing()}


def open_direct(on_cpu: str, horovod_on_mpi: bool, rank: int, size: int, chunks: int,
                vote: Callable[[List[int]], List[int]], gather: Callable[[Any], List[Any]],
                outgoing: mpi_direct.Outgoing, incoming: mpi_direct.Incoming,
                transport: Optional[str] = None) -> Optional[Direct]:
    """The point-to-point transport every rank agreed on, opened; None for Horovod broadcasts.

    A collective over every rank: ``vote`` (the adapter's sum over all ranks), then MPI_Comm_dup or
    ``gather`` (the adapter's allgather of an object: the ZeroMQ addresses); call it on all of them.

    Args:
        on_cpu, horovod_on_mpi, rank, size, chunks: see ``missing``.
        vote: sums a list of ints over every rank; ``gather``: every rank's object, in rank order.
        outgoing, incoming: the adapter's byte view of a tensor to send, and buffer for a receive.
        transport: the pipeline's ``transport=`` ("auto", "mpi", "zmq", "horovod"); None reads
            ``DUALFRAME_PIPELINE_TRANSPORT`` (``dualframe.pipeline.link.transport_choice``).

    Example:
        >>> direct = open_direct("", hvd.mpi_enabled(), hvd.rank(), hvd.size(), 8, vote, gather,   # doctest: +SKIP
        ...                      byte_view, receive_buffer)
        >>> direct.name if direct else "horovod"                                                  # doctest: +SKIP
        'zmq'

    Raises:
        StrategyError: a bad or uneven ``transport`` / ``DUALFRAME_PIPELINE_TRANSPORT``, or "mpi" / "zmq"
            where a rank lacks it (every rank raises alike: the vote is summed over all of them).
    """
    choice = transport_choice(transport=transport)
    lacking = {} if choice == "horovod" else missing(on_cpu, horovod_on_mpi, rank, size, chunks)
    asked_by = TRANSPORT_VARIABLE if transport is None else "transport"
    chosen = agree_transport(vote(transport_votes(choice, lacking)), size, choice, lacking, asked_by)
    if chosen == "mpi":
        from mpi4py import MPI

        return mpi_direct.MPIDirect(MPI.COMM_WORLD.Dup(), outgoing, incoming)
    if chosen == "zmq":
        return zmq_direct.open_zmq(rank, gather, outgoing, incoming)
    return None
