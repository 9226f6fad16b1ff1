"""A one-process model split: the layers of each group, one checked device per group, chunks, checkpointing, schedule.

Both adapters build their ``ModelParallel``/``Pipeline`` from ``validate_split``; they only hand it the
layer count, the devices their framework can see and how to spell a device name canonically.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from dualframe.errors import DeviceError
from dualframe.pipeline.microbatch import recomputed
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.pipeline.partition import partition_ranges, validate_balance
from dualframe.strategy import Pipeline as PipelineStrategy
from dualframe.launch.topology import Topology, detect


@dataclass(frozen=True)
class Split:
    """A validated split: ``ranges[j]`` are the layer indices of group j, placed on ``devices[j]``.

    ``schedule`` is a registered schedule that one process can run (``dualframe.pipeline.schedule``).

    Example:
        >>> split = validate_split(4, [1, 3], ["cpu", "cpu"], chunks=4, checkpoint="except_last",
        ...                        available=["cpu"])
        >>> split.ranges, [split.checkpointed(i) for i in range(4)], split.schedule
        ((range(0, 1), range(1, 4)), [True, True, True, False], 'gpipe')
    """

    ranges: Tuple[range, ...]
    devices: Tuple[str, ...]
    chunks: int = 1
    checkpoint: str = "never"
    schedule: str = "gpipe"

    @property
    def stages(self) -> int:
        """Number of groups n."""
        return len(self.ranges)

    @property
    def balance(self) -> List[int]:
        """Layers per group."""
        return [len(r) for r in self.ranges]

    def checkpointed(self, i: int) -> bool:
        """Whether micro-batch ``i`` keeps only its stage inputs and recomputes in backward.

        ``"always"``: every micro-batch; ``"except_last"``: all but the last (its backward comes first,
        so recomputing it saves no memory); ``"never"``: none.
        """
        return i in recomputed(self.checkpoint, self.chunks)


def default_devices(groups: int, accelerators: Sequence[str], cpu: str,
                    topology: Optional[Topology] = None) -> List[str]:
    """Devices for ``groups`` groups when none are named.

    The visible accelerators, or under a launcher with ``local_size`` ranks on this node the local
    rank's share of them (``len(accelerators) // local_size`` each, in rank order); when a rank sees
    fewer accelerators than there are local ranks, the launcher is taken to have already restricted
    what it sees, and it uses them all. Groups fill the devices in contiguous blocks
    (4 groups on 2 GPUs: ``[g0, g0, g1, g1]``). No accelerator: ``cpu`` repeated.

    Example:
        >>> default_devices(2, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], "cpu", Topology(1, 2, 1, 2))
        ['cuda:2', 'cuda:3']
    """
    topo = topology if topology is not None else detect()
    share = list(accelerators)
    per = len(share) // topo.local_size
    if per >= 1:
        share = share[topo.local_rank * per:(topo.local_rank + 1) * per]
    if not share:
        return [cpu] * groups
    return [share[j * len(share) // groups] for j in range(groups)]


def validate_split(
    num_layers: int,
    balance: Sequence[int],
    devices: Optional[Sequence[str]],
    chunks: int = 1,
    checkpoint: str = "never",
    available: Sequence[str] = ("cpu",),
    canonical: Callable[[str], str] = str,
    accelerators: Sequence[str] = (),
    hint: str = "",
    schedule: str = "gpipe",
) -> Split:
    """Validate every argument of a split before anything runs, and return the split.

    Args:
        num_layers: how many layers the model has; ``balance`` must sum to it.
        balance: layers per group.
        devices: one device per group, or None for ``default_devices``.
        chunks: micro-batches per mini-batch (1 for a plain split).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        available: device names usable here, canonical spelling, first one the CPU.
        canonical: the framework's canonical spelling of a device name; raises DeviceError when
            the name cannot be parsed.
        accelerators: the accelerators among ``available``, for the default.
        hint: appended to the "not available" message (how to get more devices).
        schedule: a registered schedule name; one that one process cannot run (``"1f1b"``) is
            refused with the reason and what to use instead.

    Raises:
        BalanceError, DeviceError, ChunksError, StrategyError, ScheduleError: the rule broken, with
            the values.
    """
    balance = validate_balance(balance, num_layers)
    if devices is None:
        devices = default_devices(len(balance), accelerators, available[0])
    strategy = PipelineStrategy(balance=balance, devices=devices, chunks=chunks, checkpoint=checkpoint,
                                schedule=schedule)
    one_process_ticks(strategy.schedule, strategy.chunks, strategy.stages, "F")  # refuses, or proves it finishes
    assert strategy.devices is not None
    names = []
    for j, device in enumerate(strategy.devices):
        name = canonical(device)
        if name not in available:
            raise DeviceError(
                f"device {device!r} (devices[{j}]) is not available here; available: {', '.join(available)}{hint}"
            )
        names.append(name)
    return Split(tuple(partition_ranges(balance, num_layers)), tuple(names), strategy.chunks, strategy.checkpoint,
                 strategy.schedule)
