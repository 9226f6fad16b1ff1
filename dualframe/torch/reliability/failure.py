"""The torch side of failure handling: dualframe's exception hooks, and Horovod's waits bounded by the stall watchdog."""
from __future__ import annotations

import functools
from typing import Any, Callable

import horovod.torch as _horovod_torch
from horovod.torch import mpi_ops as _mpi_ops

from dualframe.reliability import failure
from dualframe.reliability.failure import Watchdog


def _guarded(synchronize: Callable[[Any], Any], watchdog: Watchdog) -> Callable[[Any], Any]:
    @functools.wraps(synchronize)
    def guarded(handle: Any) -> Any:
        with watchdog.guard("a Horovod collective (synchronize)"):
            return synchronize(handle)

    guarded._dualframe_guarded = True  # type: ignore[attr-defined]
    return guarded


def install() -> Watchdog:
    """Install ``dualframe.reliability.failure``'s hooks and bound every wait on a Horovod collective (idempotent).

    Horovod's torch collectives and the gradient reductions of DistributedOptimizer all end in
    ``horovod.torch.mpi_ops.synchronize``; wrapping it there makes a stalled collective end the job
    after ``DUALFRAME_STALL_TIMEOUT`` seconds, under Gloo as under MPI. Called by ``dualframe.torch.init``.
    """
    watchdog = failure.install()
    if watchdog.timeout > 0 and not getattr(_mpi_ops.synchronize, "_dualframe_guarded", False):
        guarded = _guarded(_mpi_ops.synchronize, watchdog)
        _mpi_ops.synchronize = guarded
        _horovod_torch.synchronize = guarded
    return watchdog
