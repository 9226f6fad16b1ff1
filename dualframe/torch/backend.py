"""The torch backend: the one object implementing the core's ``Backend`` protocol (``dualframe.backend``)."""
from __future__ import annotations

from typing import Optional

import torch

from dualframe.backend import AdapterBackend
from dualframe.torch.collectives import TorchBatchOps, TorchCaster, collectives
from dualframe.torch.pipeline.link import TorchWire, point_to_point, process_sets


class TorchPlacement:
    """torch's device for a stage (the core's ``Placement``): a ``torch.device``, the CPU by default.

    Example:
        >>> TorchPlacement().device(None)          # doctest: +SKIP
        device(type='cpu')
    """

    def device(self, name: Optional[str]) -> torch.device:
        """``torch.device(name)``; the CPU when ``name`` is None."""
        return torch.device(name if name else "cpu")


#: The torch adapter's one Backend (``dualframe.backend``).
BACKEND: AdapterBackend[torch.Tensor] = AdapterBackend(
    "torch", collectives, TorchCaster(), TorchBatchOps(), TorchPlacement(), TorchWire,
    point_to_point, process_sets, split_backward=True)
