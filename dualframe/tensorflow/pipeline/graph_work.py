"""One process stage of a graph split in TensorFlow: one byte message per edge (the core's GraphStageWork).

The messages are ``pipeline/message.py``'s; an edge between two stages of one rank (ZB-V's turn) carries
the tensors themselves (``handed``).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import edge_values, stage_edges
from dualframe.tensorflow.graph.capture import KerasGraph
from dualframe.tensorflow.pipeline.graph import GraphStage
from dualframe.tensorflow.pipeline.compiled import Gradients, GraphStageFunction, summed
from dualframe.tensorflow.pipeline.graph_backward import GraphSplitPasses
from dualframe.tensorflow.pipeline.message import handed, pack, unpack
from dualframe.tensorflow.pipeline.recompute import StageRecompute
from dualframe.tensorflow.pipeline.sparse import SparseParts

_LOG = logging.getLogger(__name__)
_WARNED: List[bool] = []  # the no-split warning, once per process


class TFGraphStageWork:
    """Forward and backward of stage j of a graph split on micro-batch i, each micro-batch under its own tape.

    The last stage gathers the model's outputs (its own and those sent to it), rebuilds the model's
    output structure and turns it into the loss, weighted by the micro-batch's share of rows. The
    stage's variable gradients are summed over the step's micro-batches in ``gradients`` (aligned with
    ``stage.trainable_weights``). With ``function`` (a ``GraphStageFunction`` kept across steps), the
    stage's forward is that one compiled call under the tape; without, its layers run eagerly.

    With ``split_backward`` (the schedule has W actions, ``"zb-h1"``), backward computes only the gradients the
    source stages wait for and ``weight(i)`` the weights' later (``graph_split_backward``): F keeps
    every value a node reads, B keeps the gradients at the outputs of the nodes that own weights, W adds
    the weights' gradients to the sums; on the last stage F runs F and B in one call. A stage that is
    not ``splittable`` (a layer with state) runs B as the full backward and W only adds its weights' part.

    An edge to or from a stage in ``local`` (held by the same rank) carries the tensors themselves
    (``handed``) rather than a packed message.

    With ``recompute`` (activation checkpointing), a micro-batch it names runs its forward without a tape,
    keeping only the values the stage read, and again under a tape at the start of its backward (the
    last stage's F+B of a split backward keep nothing and run as before).

    On the last stage, a micro-batch in ``fused`` (its backward directly follows its forward in the
    schedule: all with 1F1B, the last one with GPipe) runs forward, loss and backward in one compiled
    call at forward time (``GraphStageFunction.last_step``), keeping only the received values' gradients
    until its backward sends them; the others are taped, so that GPipe's backward messages still flow
    one by one. With ``batch_weights`` too (GPipe with ``schedule.batched_weights``: a W action per
    micro-batch after the last B), the W actions wait until every micro-batch's has come and run as one
    ``batched_weight_pass`` over their rows.

    Example:
        >>> work = TFGraphStageWork(stage, split, 1, captured, loss, [y0], [1.0])   # doctest: +SKIP
        >>> messages = work.forward(0, {0: message}); work.backward(0, {})          # doctest: +SKIP
    """

    def __init__(self, stage: GraphStage, split: GraphSplit, j: int, captured: KerasGraph,
                 loss_fn: Optional[Callable[[Any, Any], Any]], targets: Sequence[Any], weights: Sequence[float],
                 device: Optional[str] = None, function: Optional[GraphStageFunction] = None,
                 split_backward: bool = False, recompute: Optional[StageRecompute] = None,
                 fused: Collection[int] = (), batch_weights: bool = False, local: Collection[int] = ()) -> None:
        self.stage, self.split, self.j, self.captured, self.device = stage, split, j, captured, device
        self.local = frozenset(local)
        self.function, self.recompute = function, recompute
        self.split_backward = split_backward and loss_fn is not None
        self.last = j == split.stages - 1
        self.fused = set(fused) if self.last and function is not None and not self.split_backward else set()
        # The compiled passes, or (no function: eager, as the stage's forward) their python bodies.
        self.bodies = function.passes if function is not None else GraphSplitPasses(stage, split, j, captured, loss_fn)
        self.passes: Any = function if function is not None else self.bodies
        self.split_passes = self.split_backward and self.bodies.splittable()
        if self.split_backward and not self.split_passes and not _WARNED:
            _WARNED.append(True)
            _LOG.warning("a layer of this graph stage has state (non-trainable variables), so its backward cannot be "
                         "re-run in two passes: B runs the whole backward, W only adds it (no zero-bubble gain)")
        # i -> what W i needs: ("sums", the weights' gradients) or ("split", owners' inputs, their output gradients)
        self._pending: Dict[int, Tuple[Any, ...]] = {}
        self.batch_weights = batch_weights and self.split_passes and function is not None
        self._weights_due: List[int] = []  # W actions come, waiting for the batched pass
        self.loss_fn, self.targets, self.weights = loss_fn, list(targets), list(weights)
        edges = stage_edges(split, j)
        self.incoming = {p: edge_values(split, p, j) for p in edges.sources}
        self.outgoing = {c: edge_values(split, j, c) for c in edges.targets}
        # i -> (tape, received tensors by source, sent tensors by target, loss or None)
        self._saved: Dict[int, Tuple[Any, Dict[int, List[Any]], Dict[int, List[Any]], Any]] = {}
        self.gradients: Gradients = []  # the dense sums; IndexedSlices (embeddings) kept apart in ``sparse``
        self.sparse = SparseParts()
        self.outputs: List[List[Any]] = []
        self.loss_sum = 0.0
        self.peak_live = 0

    def forward(self, i: int, received: Mapping[int, Any]) -> Dict[int, Any]:
        training = self.loss_fn is not None
        values: Dict[str, Any] = dict(received.get(-1, {}))
        held: Dict[int, List[Any]] = {p: self._values(p, received[p]) for p in self.incoming}
        if self.split_passes and not (self.recompute is not None and i in self.recompute and not self.last):
            return self._forward_split(i, values, held)
        if training and i in self.fused:  # keeps nothing a checkpoint would save
            return self._last_step(i, values, held)
        if not training or self.recompute is None or i not in self.recompute:
            return self._forward_taped(i, values, held, training)
        self.recompute.forward(i)  # checkpointed: no tape, only what the stage read is kept
        for p, names in self.incoming.items():
            values.update(zip(names, held[p]))
        with tf.device(self.device):
            sent, loss, _ = self._stage(i, dict(values), True)
        if loss is not None:
            self.loss_sum += float(loss)
        self._keep(i, ("replay", held, values))
        return self._messages(sent)

    def _forward_taped(self, i: int, values: Dict[str, Any], held: Dict[int, List[Any]],
                       training: bool) -> Dict[int, Any]:
        """F i under its own tape (training), kept until B i."""
        tape = tf.GradientTape() if training else None
        with tf.device(self.device), (tape if tape is not None else nullcontext()):
            for p, names in self.incoming.items():
                if tape is not None:
                    tape.watch([t for t in held[p] if t.dtype.is_floating])
                values.update(zip(names, held[p]))
            sent, loss, outputs = self._stage(i, values, training)
        messages = self._messages(sent)
        if not training:
            if self.last:
                self.outputs.append(outputs)
            return messages
        if loss is not None:
            self.loss_sum += float(loss)
        self._keep(i, (tape, held, sent, loss))
        return messages

    def _last_step(self, i: int, values: Dict[str, Any], held: Dict[int, List[Any]]) -> Dict[int, Any]:
        """F and B i of the last stage in one compiled call: the loss, the sums, the received values' gradients kept."""
        assert self.function is not None
        for p, names in self.incoming.items():
            values.update(zip(names, held[p]))
        with tf.device(self.device):
            loss, sums, grads = self.function.last_step(
                values, self.targets[i], tf.constant(self.weights[i], tf.float64), self.gradients or None)
        self.gradients = self.sparse.keep(sums)
        self.loss_sum += float(loss)
        self._keep(i, ("done", held, grads))
        return {}

    def _messages(self, sent: Mapping[int, Sequence[Any]]) -> Dict[int, Any]:
        return {c: self._message(c, sent[c], names) for c, names in self.outgoing.items()}

    def _message(self, peer: int, tensors: Sequence[Any], names: Sequence[str]) -> Any:
        """What goes to stage ``peer``: the tensors handed over on this rank, else packed."""
        return handed(tensors, names) if peer in self.local else pack(tensors, names)

    def _values(self, peer: int, message: Any) -> List[Any]:
        """The tensors of a message from stage ``peer``."""
        return list(message) if peer in self.local else unpack(message)

    def _replay(self, i: int, held: Dict[int, List[Any]], values: Dict[str, Any]) -> Tuple[Any, ...]:
        """A checkpointed micro-batch's forward again, keeping what its backward needs (as F i would have)."""
        assert self.recompute is not None
        with self.recompute.replaying(i):
            if self.split_passes:
                with tf.device(self.device):
                    _, kept = self.passes.forward_kept(dict(values))
                return ("split", held, kept)
            with tf.device(self.device), tf.GradientTape() as tape:
                tape.watch([t for tensors in held.values() for t in tensors if t.dtype.is_floating])
                sent, loss, _ = self._stage(i, dict(values), True)
        return (tape, held, sent, loss)

    def _keep(self, i: int, saved: Tuple[Any, ...]) -> None:
        self._saved[i] = saved
        self.peak_live = max(self.peak_live, len(set(self._saved) | set(self._pending)))

    def _forward_split(self, i: int, values: Dict[str, Any], held: Dict[int, List[Any]]) -> Dict[int, Any]:
        """F i of a split backward: keep what B needs (the last stage: run B now, keep the inputs' gradients)."""
        for p, names in self.incoming.items():
            values.update(zip(names, held[p]))
        with tf.device(self.device):
            if not self.last:
                sent, kept = self.passes.forward_kept(values)
                self._keep(i, ("split", held, kept))
                return self._messages(sent)
            loss, grads, inputs, owner_grads = self.passes.last_input_pass(
                values, self.targets[i], tf.constant(self.weights[i], tf.float64))
        self.loss_sum += float(loss)
        self._pending[i] = ("split", inputs, owner_grads)
        self._keep(i, ("done", held, grads))
        return {}

    def _stage(self, i: int, values: Dict[str, Any], training: bool) -> Tuple[Dict[int, List[Any]], Any, Any]:
        """(values sent to each later stage, the weighted loss or None, the model's outputs or None) of micro-batch i."""
        target = self.targets[i] if self.last and training else None
        weight = tf.constant(self.weights[i], tf.float64) if self.last and training else None
        if self.function is not None:
            return self.function.call(values, training, target, weight)  # type: ignore[no-any-return]
        self.stage.run(values, training)
        sent = {c: [values[v] for v in names] for c, names in self.outgoing.items()}
        flat = [values[v] for v in self.split.graph.outputs] if self.last else None
        if flat is None or not training:
            return sent, None, flat
        assert self.loss_fn is not None
        loss = tf.reduce_mean(self.loss_fn(target, self.captured.pack_outputs(flat)))
        return sent, loss * tf.cast(weight, loss.dtype), None

    def backward(self, i: int, grads: Mapping[int, Any]) -> Dict[int, Any]:
        saved = self._saved.pop(i)
        if saved[0] == "replay":
            saved = self._replay(i, saved[1], saved[2])  # type: ignore[arg-type]  # ("replay", held, values)
        if isinstance(saved[0], str):  # "split" or "done": a split backward's F kept it
            return self._backward_split(i, saved, grads)
        tape, held, sent, loss = saved
        roots: Dict[int, Tuple[Any, Any]] = {}  # a value sent to two stages: both gradients add up
        for c, message in grads.items():
            for t, g in zip(sent[c], self._values(c, message)):
                if t.dtype.is_floating:
                    root, total = roots.get(id(t), (t, None))
                    roots[id(t)] = (root, g if total is None else total + g)
        sources = [t for tensors in held.values() for t in tensors if t.dtype.is_floating]
        variables = list(self.stage.trainable_weights)
        with tf.device(self.device):
            if loss is not None:
                found = tape.gradient(loss, variables + sources)
            elif roots:
                found = tape.gradient([r for r, _ in roots.values()], variables + sources,
                                      output_gradients=[tf.cast(g, r.dtype) for r, g in roots.values()])
            else:  # nothing this stage sends carries a gradient
                found = [None] * (len(variables) + len(sources))
        if self.split_backward:  # a stage that cannot split: W i adds what B computed
            self._pending[i] = ("sums", found[:len(variables)])
        else:
            self._add(found[:len(variables)])
        by_id = {id(t): g for t, g in zip(sources, found[len(variables):])}
        return {p: self._message(p, [tf.zeros_like(t) if by_id.get(id(t)) is None
                                     else tf.convert_to_tensor(by_id[id(t)]) for t in tensors], self.incoming[p])
                for p, tensors in held.items()}

    def _backward_split(self, i: int, saved: Tuple[Any, ...], grads: Mapping[int, Any]) -> Dict[int, Any]:
        """B i of a split backward: the received values' gradients only (the last stage: computed in F i)."""
        kind, held, found = saved
        if kind == "split":
            roots: Dict[str, Any] = {}  # a value sent to two stages: both gradients add up
            for c, message in grads.items():
                for name, g in zip(self.outgoing[c], self._values(c, message)):
                    if g.dtype.is_floating:
                        roots[name] = g if name not in roots else roots[name] + g
            with tf.device(self.device):
                found, owner_grads = self.passes.input_pass(found, roots)
            self._pending[i] = ("split", self.bodies.owner_inputs(saved[2]), owner_grads)
        return {p: self._message(p, [tf.zeros_like(t) if found.get(name) is None else tf.convert_to_tensor(found[name])
                                     for name, t in zip(self.incoming[p], tensors)], self.incoming[p])
                for p, tensors in held.items()}

    def weight(self, i: int) -> None:
        """W i: micro-batch i's weights' gradient added to the step's sums (after its backward)."""
        if self.batch_weights:
            self._weights_due.append(i)
            if len(self._weights_due) == len(self.weights):
                self._batched_weights()
            return
        pending = self._pending.pop(i)
        if pending[0] == "sums":
            self._add(pending[1])
            return
        with tf.device(self.device):
            self.gradients = self.sparse.keep(self.passes.weight_pass(pending[1], pending[2], self.gradients or None))

    def _add(self, gradients: Sequence[Any]) -> None:
        """Add one micro-batch's variable gradients to the step's sums (None: not connected to the loss)."""
        sums, new = self.gradients or None, self.sparse.keep(gradients)
        if sums is not None and self.function is not None:  # one compiled call, not one eager add per variable
            self.gradients = self.function.accumulate(sums, new)
        else:
            self.gradients = summed(sums, new)

    def _batched_weights(self) -> None:
        """Every micro-batch's W in one pass over their rows, added to the step's sums."""
        assert self.function is not None
        parts = [self._pending.pop(i) for i in sorted(self._weights_due)]
        self._weights_due = []
        for part in [p for p in parts if p[0] == "sums"]:  # a micro-batch whose B ran whole
            self._add(part[1])
        split = [p for p in parts if p[0] == "split"]
        if split:
            with tf.device(self.device):
                self.gradients = self.sparse.keep(self.function.batched_weight_pass(
                    [p[1] for p in split], [p[2] for p in split], self.gradients or None))

    def step_gradients(self) -> List[Any]:
        """The step's gradient sums, aligned with ``stage.trainable_weights``: an Embedding's one IndexedSlices
        listing every micro-batch's rows (as the full batch's gradient, what Keras's optimizers update), others dense."""
        return self.sparse.joined(self.gradients)
