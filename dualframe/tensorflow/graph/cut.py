"""Where a captured Keras model is cut (split points, balance, or stages from measured costs), and the cut described."""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.errors import SplitPointError, StrategyError
from dualframe.pipeline.graph import GraphSplit, cut_graph, graph_units
from dualframe.tensorflow.graph.capture import KerasGraph

BY = ("time", "memory")


def split_model(captured: KerasGraph, *, split_points: Optional[Sequence[str]] = None,
                balance: Optional[Sequence[int]] = None, stages: Optional[int] = None, sample: Any = None,
                by: str = "time", measure: bool = True) -> GraphSplit:
    """Cut ``captured`` by exactly one of ``split_points``, ``balance`` (units per stage) or ``stages``.

    With ``stages=n`` the cut balances per-node costs measured on ``sample`` (``by="time"``: forward and
    backward seconds; ``by="memory"``: parameter plus activation bytes, from static shapes when no
    sample is given), preferring, among near-even cuts, the one where the fewest bytes cross. Every
    argument is checked before anything is measured; ``measure=False`` only checks (the cut it returns
    for ``stages=`` is by layer count).

    Raises:
        SplitPointError: a split point naming nothing (with close names), a layer inside a nested model,
            a shared layer, points out of order or the model's first layer.
        BalanceError: a bad balance, no or several ways given, more stages than layers.
        StrategyError: ``by`` unknown, or ``by="time"`` without a sample.
    """
    if split_points is not None and not isinstance(split_points, str):
        for index, point in enumerate(split_points):
            _refuse_inside_nested(captured, point, index)
    split = cut_graph(captured.graph, split_points=split_points, balance=balance, stages=stages)
    if by not in BY:
        raise StrategyError(f"by must be one of {', '.join(map(repr, BY))} (by: {by!r})")
    if stages is not None and by == "time" and sample is None:
        raise StrategyError("stages= with by='time' measures each layer on a sample batch: pass sample=<a batch> "
                            "(or by='memory', or balance=/split_points=)")
    if stages is None or split.stages == 1 or not measure:
        return split
    costs, sizes = node_costs(captured, sample, by)
    return cut_graph(captured.graph, stages=stages, costs=costs, sizes=sizes)


def _refuse_inside_nested(captured: KerasGraph, point: str, index: int) -> None:
    if any(node.scope == point for node in captured.graph.nodes):
        return
    for outer, inner in captured.nested.items():
        if point in inner:
            raise SplitPointError(f"split point {point!r} (split_points[{index}]) is a layer inside the nested model "
                                  f"{outer!r}, which runs as one piece; cut before or after {outer!r}, or build the "
                                  "model without nesting")


def node_costs(captured: KerasGraph, sample: Any, by: str = "time",
               repeats: int = 3) -> Tuple[List[float], Dict[str, float]]:
    """Per node its cost (seconds of forward + backward, or bytes), and per value its bytes per sample.

    The model runs node by node, eagerly, on ``sample`` in training mode; its non-trainable variables
    (BatchNormalization's moving statistics) are put back afterwards. ``by="memory"`` without a
    sample: parameter bytes plus one sample's output bytes from the static shapes.
    """
    graph = captured.graph
    first_call = _first_calls(captured)
    if sample is None:
        sizes = {v: float(b) for v in captured.specs if (b := captured.bytes_per_sample(v)) is not None}
        return [first_call[k] + sum(sizes.get(v, 0.0) for v in node.outputs)
                for k, node in enumerate(graph.nodes)], sizes
    variables = [v for layer in captured.layers for v in layer.non_trainable_weights]
    kept = [v.numpy() for v in variables]
    times: List[List[float]] = [[] for _ in graph.nodes]
    sizes, outputs_bytes = {}, [0.0] * len(graph.nodes)
    for repeat in range(repeats + 1):  # the first pass warms up (allocations, kernels) and is not counted
        values = dict(zip(graph.inputs, [tf.convert_to_tensor(x) for x in captured.flat_inputs(sample)]))
        rows = float(values[graph.inputs[0]].shape[0] or 1)
        for k in range(len(graph.nodes)):
            start = time.perf_counter()
            _timed_node(captured, k, values)
            if repeat:
                times[k].append(time.perf_counter() - start)
        for value, tensor in values.items():
            sizes[value] = tensor.shape.num_elements() * tensor.dtype.size / rows
    for variable, value in zip(variables, kept):
        variable.assign(value)
    if by == "memory":
        for k, node in enumerate(graph.nodes):
            outputs_bytes[k] = first_call[k] + sum(sizes[v] * rows for v in node.outputs)
        return outputs_bytes, sizes
    return [statistics.median(t) for t in times], sizes


def _first_calls(captured: KerasGraph) -> List[float]:
    """Parameter bytes per node, counted at a layer's first call only."""
    seen, costs = set(), []
    for call in captured.calls:
        op = call.operation if call is not None else None
        if op is None or id(op) in seen or not hasattr(op, "weights"):
            costs.append(0.0)
            continue
        seen.add(id(op))
        costs.append(float(sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in op.weights)))
    return costs


def _timed_node(captured: KerasGraph, k: int, values: Dict[str, Any]) -> None:
    node = captured.graph.nodes[k]
    call = captured.calls[k]
    if call is None:
        return
    inputs = [values[v] for v in node.inputs if values[v].dtype.is_floating]
    op = call.operation
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        captured.run(range(k, k + 1), values, training=True)
    outputs = [values[v] for v in node.outputs if values[v].dtype.is_floating]
    weights = list(getattr(op, "trainable_weights", []))
    if outputs and (inputs or weights):
        grads = tape.gradient(outputs, inputs + weights)
        # wait for the work; an Embedding's gradient is IndexedSlices, which has no numpy()
        _ = [tf.convert_to_tensor(g).numpy() for g in grads if g is not None]
    for v in node.outputs:
        values[v] = tf.stop_gradient(values[v])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _value_line(captured: KerasGraph, split: GraphSplit, value: str, after: int,
                sizes: Optional[Dict[str, float]]) -> Tuple[str, Optional[float]]:
    spec = captured.specs.get(value)
    shape = str(tuple(spec.shape)) if spec is not None else "?"
    dtype = str(spec.dtype) if spec is not None else ""
    size = sizes.get(value) if sizes else captured.bytes_per_sample(value)
    readers = [k for k in split.consumers.get(value, ()) if k > after]
    to = ", ".join("output" if k == split.stages else f"stage {k}" for k in readers)
    text = f"{_size(size)}/sample" if size is not None else "? bytes/sample"
    return f"    {value:<28} {shape:<22} {dtype:<8} {text:>16}  -> {to}", None if size is None else float(size)


def describe_split(captured: KerasGraph, split: GraphSplit, devices: Sequence[str],
                   sizes: Optional[Dict[str, float]] = None) -> str:
    """Stages with their devices and layer ranges, and per boundary every tensor crossing it (shape, bytes).

    Example:
        >>> print(describe_split(captured, split, ["/GPU:0", "/GPU:1"]))   # doctest: +SKIP
        2 stages, split points: conv4_block1_1_conv
        stage 0 on /GPU:0: 81 layers, input_layer .. conv3_block4_out, 1.5 MiB parameters
          boundary 0|1: 1 tensor, 32.0 KiB/sample
            conv3_block4_out   (None, 4, 4, 512)  float32  32.0 KiB/sample  -> stage 1
        ...
    """
    units = graph_units(split.graph)
    params = _first_calls(captured)
    lines = [f"{split.stages} stage{'s' if split.stages > 1 else ''}, split points: "
             + (", ".join(split.split_points) or "(none)")]
    for j in range(split.stages):
        r = split.stage_range(j)
        count = sum(1 for u in units if r.start <= u.start < r.stop)
        nodes = split.stage_nodes(j)
        held = f"{count} layer{'s' if count != 1 else ''}"
        if len(units) < len(captured.layers):  # a stack of blocks: balance= counts blocks
            held = f"{len({node.scope for node in nodes})} layers ({count} block{'s' if count != 1 else ''})"
        lines.append(f"stage {j} on {devices[j]}: {held}, {nodes[0].scope} .. "
                     f"{nodes[-1].scope}, {_size(sum(params[k] for k in r))} parameters")
        if j + 1 < split.stages:
            rows = [_value_line(captured, split, v, j, sizes) for v in split.crossing(j)]
            total = None if any(size is None for _, size in rows) else sum(size or 0.0 for _, size in rows)
            lines.append(f"  boundary {j}|{j + 1}: {len(rows)} tensor{'s' if len(rows) != 1 else ''}, "
                         f"{'?' if total is None else _size(total)}/sample")
            lines.extend(text for text, _ in rows)
    outs = [f"{v} from stage {split.producer[v]}" if split.producer[v] >= 0 else f"{v} (a model input)"
            for v in split.graph.outputs]
    lines.append("outputs: " + ", ".join(outs))
    return "\n".join(lines)
