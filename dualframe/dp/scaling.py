"""Learning-rate scaling for data parallelism: the linear scaling rule with a gradual warm-up."""
from __future__ import annotations

from dualframe.errors import StrategyError


def warmup_factor(step: int, warmup_steps: int, world_size: int) -> float:
    """Multiplier of the one-process learning rate at ``step``: 1 rising linearly to ``world_size``.

    With N ranks the global batch is N times larger, so the learning rate is scaled by N (Goyal et
    al., 2017); starting at the one-process value and reaching N after ``warmup_steps`` avoids the
    early instability of a large rate.

    Example:
        >>> [warmup_factor(k, 4, 3) for k in range(6)]
        [1.0, 1.5, 2.0, 2.5, 3.0, 3.0]

    Raises:
        StrategyError: a negative step or warm-up, or a world size below one.
    """
    for name, value, low in (("step", step, 0), ("warmup_steps", warmup_steps, 0), ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise StrategyError(f"{name} must be an int >= {low} ({name}: {value!r})")
    if step >= warmup_steps:
        return float(world_size)
    return 1.0 + (world_size - 1) * step / warmup_steps
