"""Tied weights of a Keras graph split: a layer (or variable) several stages call, its holders' copies kept equal.

A functional model may call one layer at its start and at its end (an embedding reused as the output
projection). Cut across processes, every stage that calls it holds a copy of its variables (each rank
builds the whole model): the copies start as the lowest holder's (a broadcast at build), each stage's
tape gives its share of the gradient, and the shares are summed over the holders before the optimizer
step (``dualframe.pipeline.tied``). ``get_weights()`` lists each variable once, where it is first called,
as the unsplit model does.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.tied import TiedPlan, TiedWeight, find_tied, sum_tied
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.graph.capture import KerasGraph, layers_called
from dualframe.tensorflow.pipeline.link import allreduce, broadcast


def find_layer_tied(captured: KerasGraph, split: GraphSplit) -> List[TiedWeight]:
    """The trainable variables that the layers of more than one stage read, named by their Keras ``path``.

    Example:
        >>> tied = find_layer_tied(capture(model), split)     # doctest: +SKIP
        >>> [(w.names, w.stages) for w in tied]                # doctest: +SKIP
        [(('shared/kernel',), (0, 1)), (('shared/bias',), (0, 1))]
    """
    per_stage = [[v for layer in layers_called(captured, split, j) for v in layer.trainable_weights]
                 for j in range(split.stages)]
    names = {id(v): [v.path] for variables in per_stage for v in variables}
    return find_tied([[id(v) for v in variables] for variables in per_stage], names)


class TiedVariables:
    """This rank's copies of a process pipeline's tied variables: equal at build, gradients summed each step.

    Args:
        plan: this rank's ``TiedPlan``.
        variables: the stage's trainable variables (its copies among them).
        sets: Horovod process sets by sorted ranks (``open_stage``'s).
        prefix: the pipeline's name, for Horovod's operation names.
        timeout: seconds to wait for the other holders.

    Example:
        >>> tied = TiedVariables(plan, pipe.trainable_variables, pipe.role.sets, "dpipe0", 45.0)  # doctest: +SKIP
        >>> tied.broadcast(); gradients = tied.sum_gradients(gradients)                          # doctest: +SKIP
    """

    def __init__(self, plan: TiedPlan, variables: Sequence[Any], sets: Mapping[Tuple[int, ...], Any], prefix: str,
                 timeout: float) -> None:
        self.plan, self.sets, self.prefix, self.timeout = plan, sets, prefix, timeout
        self.index = {v.path: k for k, v in enumerate(variables)}
        self.variables = list(variables)
        missing = [w.key for w in plan.mine if w.key not in self.index]
        assert not missing, f"stage holds no copy of tied variables {missing}"

    def _set(self, ranks: Tuple[int, ...]) -> Any:
        return self.sets.get(tuple(sorted(ranks)), hvd.global_process_set)

    def _wait(self, pending: Any, what: str) -> tf.Tensor:
        if not pending.done(self.timeout):
            raise TimeoutError(f"{what}: the other holders did not answer within {self.timeout:.0f} s")
        return pending.result()

    def broadcast(self) -> None:
        """Every holder's copy becomes the lowest holding stage's (a collective over each variable's holders)."""
        for weight in self.plan.mine:
            variable = self.variables[self.index[weight.key]]
            pending = broadcast(tf.convert_to_tensor(variable), self.plan.root_rank(weight),
                                f"{self.prefix}.tied_init.{weight.key}", self._set(self.plan.ranks(weight)))
            variable.assign(self._wait(pending, f"making the copies of {weight.key!r} equal"))

    def sum_gradients(self, gradients: Sequence[Optional[Any]]) -> List[Optional[Any]]:
        """``gradients`` (aligned with the stage's variables) with each tied one summed over its holders."""
        if not self.plan.mine:
            return list(gradients)
        out = list(gradients)
        shares = {}
        for weight in self.plan.mine:
            k = self.index[weight.key]
            shares[weight.key] = tf.zeros_like(self.variables[k]) if out[k] is None else tf.convert_to_tensor(out[k])

        def reduce(tensor: Any, name: str, ranks: Tuple[int, ...]) -> Any:
            return self._wait(allreduce(tensor, hvd.Sum, name, self._set(ranks)), f"summing {name}")

        for key, summed in sum_tied(self.plan, shares, reduce, self.prefix).items():
            out[self.index[key]] = summed
        return out
