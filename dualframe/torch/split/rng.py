"""The random state a checkpointed stage replays: its own device's generator only.

In one process, stages on different devices run at the same time (a thread per device). torch's checkpoint
keeps and resets the global CPU generator around every recomputation, also of a stage on a GPU, so a CPU
stage drawing Dropout masks in the same tick would draw from a state reset under it (seen on an H200: a
GPT-2 cut across ``cpu`` and ``cuda:0`` with ``checkpoint="always"`` got gradients unlike ``"never"``'s).
A stage here keeps and replays only the generator of the device it runs on, which no other lane uses.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

Contexts = Callable[[], Tuple[ContextManager[None], ContextManager[None]]]


def replay_on(device: torch.device) -> Contexts:
    """A ``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False, preserve_rng_state=False)``: the
    forward notes ``device``'s generator state, the recomputation runs from it and puts back the state after.

    Example:
        >>> checkpoint(stage, x, use_reentrant=False, preserve_rng_state=False,
        ...            context_fn=replay_on(torch.device("cuda:1")))   # doctest: +SKIP
    """

    def contexts() -> Tuple[ContextManager[None], ContextManager[None]]:
        kept: Dict[str, Optional[torch.Tensor]] = {}

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            kept["state"] = _state(device)
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            now = _state(device)
            _set_state(device, kept["state"])
            try:
                yield
            finally:
                _set_state(device, now)

        return forward(), recompute()

    return contexts


def _state(device: torch.device) -> Optional[torch.Tensor]:
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_state(device: torch.device, state: Optional[torch.Tensor]) -> None:
    if state is None:
        return
    if device.type == "cpu":
        torch.set_rng_state(state)
    elif device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def checkpointed(stage: Callable[..., Any], device: torch.device, *args: Any) -> Any:
    """``stage(*args)`` under activation checkpointing, its recomputation replaying ``device``'s generator only.

    Example:
        >>> y = checkpointed(stage, torch.device("cpu"), x)   # doctest: +SKIP
    """
    return checkpoint(stage, *args, use_reentrant=False, preserve_rng_state=False, context_fn=replay_on(device))
