"""The torch backend: the one object implementing the core's ``Backend`` protocol (``dualframe.backend``)."""
from __future__ import annotations

from typing import List, Optional

import torch

from dualframe.backend import AdapterBackend
from dualframe.torch.collectives import TorchBatchOps, TorchCaster, collectives
from dualframe.torch.pipeline_transport import TorchWire, point_to_point, process_sets


class TorchPlacement:
    """torch's devices for a stage (the core's ``Placement``): ``"cpu"`` then each CUDA device.

    Example:
        >>> TorchPlacement().device(None)          # doctest: +SKIP
        device(type='cpu')
    """

    def available_devices(self) -> List[str]:
        """``"cpu"`` then every visible CUDA device (``"cuda:0"`` ...)."""
        from dualframe.torch.model_parallel import available_devices

        return available_devices()

    def device(self, name: Optional[str]) -> torch.device:
        """``torch.device(name)``; the CPU when ``name`` is None."""
        return torch.device(name if name else "cpu")


#: The torch adapter's one Backend (``dualframe.backend``).
BACKEND: AdapterBackend[torch.Tensor] = AdapterBackend(
    "torch", collectives, TorchCaster(), TorchBatchOps(), TorchPlacement(), TorchWire,
    point_to_point, process_sets)
