"""A loss the model computes itself (a Hugging Face model called with ``labels=``): where its output holds it.

A ``transformers`` model given ``labels`` among its inputs returns its loss as ``output.loss``, a 0-d
mean. A split or a pipeline of such a model takes the labels like any other input (they go to the
stage that reads them) and takes the loss from the output: ``DistributedPipeline(..., loss_fn=None)``
trains on it; with micro-batches, the step's loss is the micro-batches' losses weighted by their
rows, as ``loss_fn`` losses are.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from dualframe.errors import StrategyError
from dualframe.torch.graph.capture import Captured

#: The key (or attribute) of a model's output that holds the loss it computed.
LOSS_KEY = "loss"


def output_loss(output: Any) -> Optional[Any]:
    """The loss in a model's output: ``output["loss"]`` (a dict, Hugging Face's ``ModelOutput``) or
    ``output.loss``; None where it holds none.

    Example:
        >>> output_loss({"loss": 1.5, "logits": None}), output_loss((1, 2))
        (1.5, None)
    """
    if isinstance(output, Mapping):
        return output.get(LOSS_KEY)
    return getattr(output, LOSS_KEY, None)


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The ``loss_fn`` of a model that returns its loss: the loss in ``output`` (``target`` is not read).

    Raises:
        StrategyError: the output holds no loss (the labels were not among the inputs).
    """
    loss = output_loss(output)
    if not isinstance(loss, torch.Tensor):
        raise StrategyError(f"the model's output ({type(output).__name__}) holds no loss; pass labels among its "
                            "inputs (and in sample=), or give a loss_fn")
    return loss


def loss_value(captured: Captured) -> Optional[str]:
    """The name of the captured graph's output value that is the model's loss (None: the output holds none).

    Found by building the model's return value with one marker per output value and reading its loss.
    """
    markers = {name: torch.zeros(()) for name in captured.graph.outputs}
    found = output_loss(captured.unflatten(markers))
    return next((name for name, marker in markers.items() if marker is found), None)
