"""Units of a model built around a stack of repeated blocks: what ``balance=``, ``stages=`` and the planner count."""
from __future__ import annotations

from typing import List, Sequence


def block_units(names: Sequence[str], blocks: Sequence[bool]) -> List[str]:
    """Per node (in execution order), the name of the unit it belongs to.

    Without blocks every node is its own unit. With blocks (a transformer's ``transformer.h.0`` ..
    ``transformer.h.23``, a keras_hub backbone's ``transformer_layer_N``) each block is a unit, and a
    node outside every block (embeddings, masks, the final norm, the head) joins the block before it,
    or the first block when it runs before any. The Keras split (``dualframe.tensorflow.graph.capture.block_units``)
    and the planner call it once they know which nodes are blocks; the torch split applies the same rule
    on module paths (``dualframe.torch.graph.capture.Modules.unit``).

    Example:
        >>> block_units(["wte", "h.0", "h.1", "ln_f", "lm_head"], [False, True, True, False, False])
        ['h.0', 'h.0', 'h.1', 'h.1', 'h.1']
    """
    if len(names) != len(blocks):
        raise ValueError(f"one block flag per node (names: {len(names)}, blocks: {len(blocks)})")
    if not any(blocks):
        return list(names)
    current = next(name for name, block in zip(names, blocks) if block)
    units = []
    for name, block in zip(names, blocks):
        current = name if block else current
        units.append(current)
    return units
