"""The hardware a plan is made for: memory per device, devices per node, nodes, with defaults read here."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

from dualframe.errors import StrategyError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"80GB"``, ``"512M"`` or a plain number of bytes, as an int.

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise StrategyError(f"cannot read a memory size from {text!r}; write e.g. 16GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(value: float) -> str:
    """Bytes as a short readable figure: ``1.5 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


@dataclass(frozen=True)
class Hardware:
    """Devices to plan for; ``headroom`` is the share of each device kept for the runtime.

    Example:
        >>> gpus = Hardware(memory_per_device=16 * 2**30, devices_per_node=4, nodes=2, kind="gpu")
        >>> gpus.devices, gpus.usable_memory / 2**30
        (8, 14.4)
    """

    memory_per_device: float
    devices_per_node: int = 1
    nodes: int = 1
    kind: str = "cpu"
    headroom: float = 0.1

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StrategyError(f"{name} must be an int >= 1 ({name}: {value!r})")
        if not self.memory_per_device > 0:
            raise StrategyError(f"memory per device must be > 0 bytes (memory_per_device: {self.memory_per_device!r})")
        if not 0 <= self.headroom < 1:
            raise StrategyError(f"headroom must be in [0, 1) (headroom: {self.headroom!r})")
        if self.kind not in ("cpu", "gpu"):
            raise StrategyError(f"device kind must be 'cpu' or 'gpu' (kind: {self.kind!r})")

    @property
    def devices(self) -> int:
        """All devices in the job."""
        return self.devices_per_node * self.nodes

    @property
    def usable_memory(self) -> float:
        """Bytes per device a plan may fill."""
        return self.memory_per_device * (1 - self.headroom)

    def device_names(self, count: int, framework: str) -> Sequence[str]:
        """Names of the first ``count`` devices of one node, in the framework's spelling."""
        if self.kind == "cpu":
            return ["cpu" if framework == "torch" else "/CPU:0"] * count
        return [f"cuda:{j}" if framework == "torch" else f"/GPU:{j}" for j in range(count)]


def physical_memory() -> int:
    """This machine's RAM in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def nvidia_smi_memory() -> List[int]:
    """Total memory of each NVIDIA GPU in bytes, from ``nvidia-smi`` (empty without it)."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return []
    try:
        result = subprocess.run([path, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [int(float(line)) * 2**20 for line in result.stdout.split() if line.strip()]


def detect(devices: Sequence[Mapping[str, Any]] = (), environ: Optional[Mapping[str, str]] = None,
           memory_per_device: Optional[float] = None, devices_per_node: Optional[int] = None,
           nodes: Optional[int] = None, kind: Optional[str] = None, headroom: float = 0.1) -> Hardware:
    """Hardware from the accelerators a probe saw (``[{"name", "memory"}]``), SLURM and overrides.

    Without accelerators the plan is for the CPU (one device per node with the machine's RAM),
    unless memory or devices are given: then it is for GPUs elsewhere, e.g. a cluster.
    """
    env = os.environ if environ is None else environ
    overridden = memory_per_device is not None or devices_per_node is not None
    kind = kind or ("gpu" if devices or overridden else "cpu")
    seen_memory = min(float(d["memory"]) for d in devices) if devices else float(physical_memory())
    slurm_nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    return Hardware(
        memory_per_device=memory_per_device if memory_per_device is not None else seen_memory,
        devices_per_node=devices_per_node if devices_per_node is not None else max(1, len(devices)),
        nodes=nodes if nodes is not None else int(slurm_nodes) if slurm_nodes.isdigit() else 1,
        kind=kind,
        headroom=headroom,
    )
