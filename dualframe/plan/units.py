"""A probe's nodes merged into the units a split counts (a transformer's blocks), values and shared parameters with them."""
from __future__ import annotations

from typing import Dict, List, Sequence

from dualframe.errors import StrategyError
from dualframe.plan.profile import LayerProfile, ModelProfile, Shared, Value


def merge_units(profile: ModelProfile, units: Sequence[str]) -> ModelProfile:
    """``profile`` with consecutive nodes of one unit (``dualframe.pipeline.units.block_units``) made one node.

    A unit's parameters, frozen elements and saved activations add up; its output is its last node's,
    its largest tensor the largest of its nodes', its split point its first node's (``transformer.h.5``).
    Values made and last read inside one unit disappear; shared parameters read by one unit only are
    no longer shared.

    Example:
        >>> nodes = ModelProfile("torch", "m", (4,), [LayerProfile(n, 10, output=4.0) for n in ("wte", "h.0", "h.1")])
        >>> [layer.name for layer in merge_units(nodes, ["h.0", "h.0", "h.1"]).layers]
        ['h.0', 'h.1']
    """
    if len(units) != profile.num_layers:
        raise StrategyError(f"one unit per node (units: {len(units)}, nodes: {profile.num_layers})")
    index: List[int] = []
    groups: List[List[LayerProfile]] = []
    names: List[str] = []
    for layer, unit in zip(profile.layers, units):
        if not names or names[-1] != unit:
            if unit in names:
                raise StrategyError(f"unit {unit!r} runs in two separate places; its nodes must be consecutive")
            names.append(unit)
            groups.append([])
        groups[-1].append(layer)
        index.append(len(names) - 1)
    if len(names) == profile.num_layers:
        return profile
    count = len(names)
    where: Dict[int, int] = {j: index[j] for j in range(profile.num_layers)}
    where.update({-1: -1, profile.num_layers: count})
    layers = [LayerProfile(name, sum(n.parameters for n in group), sum(n.frozen for n in group),
                           sum(n.activations for n in group), group[-1].output, max(n.largest for n in group),
                           group[0].split_point) for name, group in zip(names, groups)]
    values = [Value(where[v.producer], where[v.last_reader], v.elements) for v in profile.values
              if where[v.producer] < where[v.last_reader]]
    shared = [Shared(s.elements, tuple(sorted({where[r] for r in s.readers}))) for s in profile.shared
              if len({where[r] for r in s.readers}) > 1]
    return ModelProfile(profile.framework, profile.source, profile.input_shape, layers, profile.input_elements,
                        profile.dtype, profile.notes, values if profile.values else [], shared)
