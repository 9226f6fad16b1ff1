"""A Keras process pipeline's loss and training metrics as ``compile`` takes them (names, functions, objects)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

from dualframe.errors import StrategyError
from dualframe.tensorflow.pipeline.compiled import GraphStageFunction


def keras_metric(spec: Any) -> keras.metrics.Metric:
    """A Keras metric object from what ``keras.Model.compile`` takes (a name, a function or a Metric), named as Keras names it."""
    metric = spec if isinstance(spec, keras.metrics.Metric) else keras.metrics.get(spec)
    if not isinstance(metric, keras.metrics.Metric):
        return keras.metrics.MeanMetricWrapper(metric, name=spec if isinstance(spec, str) else metric.__name__)
    if isinstance(spec, str) and metric.name != spec:  # "mae" logs as "mae", as in Keras
        metric = type(metric).from_config({**metric.get_config(), "name": spec})
    return metric


class MeteredLoss:
    """The loss, also adding each micro-batch's (targets, outputs) to the training metrics.

    The last stage calls the loss once per micro-batch inside its compiled forward pass (every schedule),
    so the metrics' states add up over the step's rows as Keras's do over the batch's.
    """

    def __init__(self, loss: Callable[[Any, Any], Any], metrics: Sequence[keras.metrics.Metric]) -> None:
        self.loss, self.metrics = loss, list(metrics)

    def __call__(self, targets: Any, outputs: Any) -> Any:
        for metric in self.metrics:
            metric.update_state(targets, outputs)
        return self.loss(targets, outputs)


def keras_loss(loss: Any) -> Any:
    """A loss given by name (``"mse"``) as Keras's function; a callable as it is."""
    if not isinstance(loss, str):
        return loss
    try:
        return keras.losses.get(loss)
    except ValueError:
        raise StrategyError(f"unknown Keras loss {loss!r}; use a name such as 'mse' or a callable") from None


def use_loss(pipe: Any, loss: Any) -> None:
    """Make ``loss`` the pipeline's loss: its stage functions are made again around it (traced at the next step)."""
    if loss is pipe.loss_fn:
        return
    pipe.loss_fn = loss
    pipe._graph_functions = {j: GraphStageFunction(old.stage, old.split, j, old.captured, loss, old.call.jit_compile)
                             for j, old in pipe._graph_functions.items()}
