"""A Keras graph stage's backward in two passes, for zero-bubble schedules: the inputs' gradients now, the weights' later.

TensorFlow cannot keep a tape across two compiled (XLA) calls, and the tape's gradient of a compiled call
runs that call's whole backward whatever was asked, so a persistent tape gives no split; the passes work
node by node instead (a chain's node is one layer). A graph stage runs a range of the functional model's nodes (``distributed_graph.GraphStage``);
a node is one call of a layer (or a Keras op) on named values, and may read values made by earlier
nodes of the stage, values received from earlier stages, and model inputs. For the same reason as
there (a tape cannot live across two compiled calls, and a tape over a compiled call runs its whole
backward whatever is asked), the passes re-run nodes from kept values:

* ``F i`` (``forward_kept``): the stage's nodes, returning what each later stage reads *and every value
  a node of the stage reads* (its inputs: what a tape would keep, about the same bytes);
* ``B i`` (``input_pass``): node by node from the last, each node re-run from its kept inputs under a
  tape that asks only for the gradients of its floating inputs, given the gradients of its outputs.
  Gradients of a value read by several nodes of the stage, or sent to several later stages, add up
  before its producer runs (execution order is a topological order). B keeps the gradients at the
  outputs of every node whose layer owns weights of this stage, and returns the received values'
  gradients. XLA drops what those gradients do not need: a ``Dense`` without activation re-runs no
  product, an ``Add`` or an activation re-runs an elementwise op; a node whose input's gradient needs
  its own output (``Dense(activation=...)``, attention) re-runs its forward;
* ``W i`` (``weight_pass``): per node that owns weights, its weights' gradient from its kept inputs and
  B's output gradients, added to the step's sums in the same call.

On the last stage ``F i`` and ``B i`` are one call (``last_input_pass``: forward, loss, the received
values' gradients and the owners' output gradients from one tape, no weight product), since
zero-bubble schedules run them back to back there. Re-running a node is exact only for a node without
state: a stage calling a layer with non-trainable variables (``BatchNormalization``'s moving
statistics, ``Dropout``'s seed) is not ``splittable``; ``TFGraphStageWork`` then runs B as the full
backward and W only adds it (equal results, no gain, logged once). An implicit Keras mask is a value
of the graph like any other (``graph.Call``): it is kept with the tensor it belongs to and put back on
it when a node re-runs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import edge_values, stage_edges
from dualframe.tensorflow.graph.capture import KerasGraph
from dualframe.tensorflow.pipeline.sparse import added

Gradients = List[Optional[tf.Tensor]]
#: Per owner node (in ``owners`` order), the gradient of each of its outputs (None: no gradient reached it).
OwnerGradients = List[List[Optional[tf.Tensor]]]


def _summed(a: Optional[tf.Tensor], b: Any) -> Optional[tf.Tensor]:
    if b is None:
        return a
    b = tf.convert_to_tensor(b)  # IndexedSlices (a gather's gradient) made dense
    return b if a is None else a + b


class GraphSplitPasses:
    """The python bodies of one graph stage's split passes (compiled by ``compiled.GraphStageFunction``).

    Args:
        stage: the ``GraphStage`` (its nodes, its trainable weights in the gradients' order).
        split: the model's cut; ``j``: this stage.
        captured: the model's ``KerasGraph`` (what runs each node, the values' symbolic specs).
        loss_fn: ``loss_fn(targets, outputs)`` (used on the last stage).

    Example:
        >>> passes = GraphSplitPasses(stage, split, 0, captured, loss_fn)        # doctest: +SKIP
        >>> sent, kept = passes.forward_kept({"x": x})                          # doctest: +SKIP
        >>> grads, owner_grads = passes.input_pass(kept, {"h": grad_h})         # doctest: +SKIP
        >>> sums = passes.weight_pass(passes.owner_inputs(kept), owner_grads, None)  # doctest: +SKIP
    """

    def __init__(self, stage: Any, split: GraphSplit, j: int, captured: KerasGraph,
                 loss_fn: Optional[Callable[[Any, Any], Any]]) -> None:
        self.stage, self.split, self.j, self.captured, self.loss_fn = stage, split, j, captured, loss_fn
        self.nodes = [k for k in split.stage_range(j) if captured.calls[k] is not None]
        self.variables = list(stage.trainable_weights)
        position = {id(v): p for p, v in enumerate(self.variables)}
        #: (node index, positions in ``variables`` of the weights it owns, those weights), in node order.
        self.owners: List[Tuple[int, List[int], List[Any]]] = []
        for k in self.nodes:
            weights = [v for v in getattr(captured.calls[k].operation, "trainable_weights", [])  # type: ignore[union-attr]
                       if id(v) in position]
            if weights:
                self.owners.append((k, [position[id(v)] for v in weights], weights))
        graph = captured.graph
        self.reads = list(dict.fromkeys(v for k in self.nodes for v in graph.nodes[k].inputs))
        self.made = {v for k in self.nodes for v in graph.nodes[k].outputs}
        #: What the stage receives from earlier stages, by name: what its nodes read and, on the last
        #: stage, the model outputs earlier stages made (read by the loss only).
        self.received = [v for p in stage_edges(split, j).sources for v in edge_values(split, p, j)]
        self.outgoing = {c: edge_values(split, j, c) for c in stage_edges(split, j).targets}

    def splittable(self) -> bool:
        """Whether re-running each node from its kept inputs gives the forward's values (no layer with state).

        A layer not built yet (a chain's first step) has no weights to split yet: not splittable either.

        Example:
            >>> GraphSplitPasses(stage, split, 1, captured, None).splittable()   # doctest: +SKIP
            True
        """
        operations = [self.captured.calls[k].operation for k in self.nodes]  # type: ignore[union-attr]
        return all(getattr(op, "built", True) and not getattr(op, "non_trainable_variables", None) for op in operations)

    def reruns_cheaply(self) -> bool:
        """Whether each node that owns weights owns them itself (a ``Dense``), none through sublayers (a block).

        B re-runs every node and W every owner: for a ``Dense`` the re-run product is dead code, but a
        block with weighted sublayers re-runs its whole forward in B and again in W (its weights' gradient
        needs its whole backward). A ``keras_hub.layers.TransformerEncoder`` stage split so computed 1.5x
        the taped step (``scripts/bench_stage_cpu_tf.py``), so GPipe does not batch its W passes there.
        """
        return not any(inner.trainable_weights for k, _, _ in self.owners
                       for inner in self.captured.calls[k].operation._flatten_layers(  # type: ignore[union-attr]
                           include_self=False, recursive=True))

    def batchable(self) -> bool:
        """Whether W of several micro-batches is one W over their rows: every owner's values batch-first.

        A chain's values are (each layer takes and returns one tensor, batch first); a functional model's
        must have an unknown first dimension in the model's symbolic specs.
        """
        if not self.captured.functional:
            return True
        graph = self.captured.graph
        values = [v for k, _, _ in self.owners for v in graph.nodes[k].inputs + graph.nodes[k].outputs]
        specs = [self.captured.specs.get(v) for v in values]
        return all(spec is not None and len(spec.shape) > 0 and spec.shape[0] is None for spec in specs)

    def _run(self, values: Dict[str, Any]) -> Dict[str, Any]:
        values = dict(values)
        self.stage.run(values, True)
        return values

    def forward_kept(self, values: Dict[str, Any]) -> Tuple[Dict[int, List[Any]], Dict[str, Any]]:
        """F: the values for each later stage, by stage, and every value a node of the stage reads, by name."""
        values = self._run(values)
        return ({c: [values[v] for v in names] for c, names in self.outgoing.items()},
                {v: values[v] for v in self.reads})

    def input_pass(self, kept: Dict[str, Any], roots: Dict[str, Any]) -> Tuple[Dict[str, Any], OwnerGradients]:
        """B: the gradients of the values the stage received, by name, and each owner's output gradients.

        ``roots`` are the gradients of the values later stages read (summed over the stages that read one).
        """
        grads: Dict[str, Any] = {v: g for v, g in roots.items()}
        owner_grads: Dict[int, List[Optional[tf.Tensor]]] = {}
        owned = {k for k, _, _ in self.owners}
        for k in reversed(self.nodes):
            node = self.captured.graph.nodes[k]
            outs = [grads.get(v) for v in node.outputs]
            if k in owned:
                owner_grads[k] = outs
            wanted = [v for v in node.inputs if kept[v].dtype.is_floating and self.wanted(v)]
            if all(g is None for g in outs) or not wanted:
                continue
            found = self._node_gradients(k, kept, outs, [kept[v] for v in wanted])
            for v, g in zip(wanted, found):
                grads[v] = _summed(grads.get(v), g)
        return {v: grads.get(v) for v in self.received}, [owner_grads[k] for k, _, _ in self.owners]

    def wanted(self, value: str) -> bool:
        """Whether B needs the gradient of ``value``: made in the stage, or received (model inputs never need one)."""
        return value in self.made or value not in self.split.graph.inputs

    def _node_gradients(self, k: int, kept: Dict[str, Any], outs: Sequence[Any], sources: List[Any]) -> List[Any]:
        """Node k re-run from ``kept`` under a tape: the gradients of ``sources`` (None: not connected)."""
        node, call = self.captured.graph.nodes[k], self.captured.calls[k]
        assert call is not None
        with tf.GradientTape() as tape:
            tape.watch(sources)
            outputs = call({v: kept[v] for v in node.inputs}, node, True)
        pairs = [(o, g) for o, g in zip(outputs, outs) if g is not None and o.dtype.is_floating]
        if not pairs:
            return [None] * len(sources)
        return list(tape.gradient([o for o, _ in pairs], sources,
                                  output_gradients=[tf.cast(g, o.dtype) for o, g in pairs]))

    def owner_inputs(self, kept: Dict[str, Any]) -> Dict[str, Any]:
        """What W reads of F's kept values: the inputs of the nodes that own weights."""
        graph = self.captured.graph
        return {v: kept[v] for k, _, _ in self.owners for v in graph.nodes[k].inputs}

    def last_input_pass(self, values: Dict[str, Any], target: Any, weight: Any
                        ) -> Tuple[Any, Dict[str, Any], Dict[str, Any], OwnerGradients]:
        """F and B of the last stage in one tape: weighted loss, received values' gradients, owners' inputs and output gradients."""
        assert self.loss_fn is not None
        sources = [v for v in self.received if values[v].dtype.is_floating and self.wanted(v)]
        with tf.GradientTape() as tape:
            tape.watch([values[v] for v in sources])
            values = self._run(values)
            flat = [values[v] for v in self.split.graph.outputs]
            loss = tf.reduce_mean(self.loss_fn(target, self.captured.pack_outputs(flat)))
            loss = loss * tf.cast(weight, loss.dtype)
        graph = self.captured.graph
        owned = [(k, [v for v in graph.nodes[k].outputs if values[v].dtype.is_floating]) for k, _, _ in self.owners]
        watched = [values[v] for v in sources] + [values[v] for _, outs in owned for v in outs]
        found = tape.gradient(loss, watched) if watched else []
        grads = dict(zip(sources, found[:len(sources)]))
        by_output = dict(zip([v for _, outs in owned for v in outs], found[len(sources):]))
        owner_grads = [[by_output.get(v) for v in graph.nodes[k].outputs] for k, _, _ in self.owners]
        return loss, {v: grads.get(v) for v in self.received}, self.owner_inputs(values), owner_grads

    def weight_pass(self, inputs: Dict[str, Any], owner_grads: OwnerGradients, sums: Optional[Gradients]) -> Gradients:
        """W: each owner node's weights' gradient from its kept inputs and B's output gradients, added to ``sums``."""
        gradients: Gradients = [None] * len(self.variables)
        for (k, positions, weights), outs in zip(self.owners, owner_grads):
            if all(g is None for g in outs):
                continue
            node, call = self.captured.graph.nodes[k], self.captured.calls[k]
            assert call is not None
            with tf.GradientTape() as tape:
                outputs = call({v: inputs[v] for v in node.inputs}, node, True)
            pairs = [(o, g) for o, g in zip(outputs, outs) if g is not None and o.dtype.is_floating]
            found = tape.gradient([o for o, _ in pairs], weights, output_gradients=[tf.cast(g, o.dtype) for o, g in pairs])
            for p, g in zip(positions, found):
                gradients[p] = added(gradients[p], g)  # an Embedding's stays IndexedSlices
        if sums is None:
            return gradients
        return [added(a, b) for a, b in zip(sums, gradients)]

    def batched_weight_pass(self, inputs: Sequence[Dict[str, Any]], owner_grads: Sequence[OwnerGradients],
                            sums: Optional[Gradients]) -> Gradients:
        """W of several micro-batches at once: their owners' inputs and output gradients concatenated by rows.

        A weight's gradient is a sum over rows (``x.T @ dy`` for a ``Dense``), so one pass over the rows of
        every micro-batch gives the sum of their W passes, as one product of the mini-batch's rows.
        ``inputs[i]``, ``owner_grads[i]``: micro-batch i's ``owner_inputs`` and B's output gradients; an
        output whose gradient some micro-batches lack (None) makes the passes run one by one.
        """
        mixed = any(len({g is None for g in column}) > 1
                    for per_owner in zip(*owner_grads) for column in zip(*per_owner))
        if len(inputs) == 1 or mixed:
            for one, grads in zip(inputs, owner_grads):
                sums = self.weight_pass(one, grads, sums)
            return sums  # type: ignore[return-value]
        joined = {v: tf.concat([one[v] for one in inputs], 0) for v in inputs[0]}
        joined_grads = [[None if column[0] is None else tf.concat(list(column), 0) for column in zip(*per_owner)]
                        for per_owner in zip(*owner_grads)]
        return self.weight_pass(joined, joined_grads, sums)
