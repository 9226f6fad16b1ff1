"""Horovod timelines (``HOROVOD_TIMELINE=file.json``): read them, measure idle time, draw them as PNG.

Horovod's coordinator (rank 0) writes Chrome trace events while the job runs: one "process" per
tensor (``process_name`` metadata, e.g. ``allreduce.fc1.weight``), and on it nested ``"B"``/``"E"``
pairs: ``NEGOTIATE_ALLREDUCE`` while ranks report the tensor ready, then the operation
(``ALLREDUCE``) with its steps inside (``MEMCPY_IN_FUSION_BUFFER``, ``GLOO_ALLREDUCE`` or
``MPI_ALLREDUCE``, ``MEMCPY_OUT_FUSION_BUFFER``). Timestamps are microseconds. The file is often left
without its closing ``]`` when the job ends, so it is read leniently.

The span is from the first operation that moves data to the last end: the wait for every rank to
start (the first negotiation) is left out, as it says nothing about training. The idle ("bubble")
fraction is the share of that span during which no operation moves data:
``1 - |union of top-level operation intervals| / span``, negotiations not counted.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple, Union

from dualframe.errors import DualframeError
from dualframe.observe.timeline import Bar, draw_gantt

PathLike = Union[str, "os.PathLike[str]"]
_COLORS = {"NEGOTIATE": "#BBBBBB", "operation": "#4C72B0", "MEMCPY": "#DD8452", "transfer": "#55A868"}


class HorovodTimelineError(DualframeError, ValueError):
    """A file is not a Horovod timeline, or holds no activity."""


@dataclass(frozen=True)
class Activity:
    """One ``B``/``E`` interval: what ran on which tensor, how deeply nested, from when to when (s)."""

    tensor: str
    name: str
    depth: int
    start: float
    end: float

    @property
    def negotiation(self) -> bool:
        """True while ranks only report the tensor ready (no data moves)."""
        return self.name.startswith("NEGOTIATE")


def _events(text: str, path: str) -> List[Dict[str, Any]]:
    body = text.strip().rstrip(",")
    if not body.startswith("["):
        raise HorovodTimelineError(f"{path} is not a Horovod timeline (it does not start with '[')")
    for candidate in (body, body + "]", body.rstrip(",\n ]") + "]"):
        try:
            events = json.loads(candidate)
            break
        except json.JSONDecodeError:
            continue
    else:
        raise HorovodTimelineError(f"{path} is not valid JSON, even closed with ']'")
    return [e for e in events if isinstance(e, dict)]


def is_horovod_timeline(path: PathLike) -> bool:
    """True when ``path`` holds a bare event array, as Horovod writes (dualframe's traces are objects)."""
    with open(path) as handle:
        return handle.read(4096).lstrip().startswith("[")


def read(path: PathLike) -> List[Activity]:
    """The activities in a Horovod timeline file, by start time.

    Raises:
        HorovodTimelineError: not a timeline, or no finished activity in it.
    """
    with open(path) as handle:
        events = _events(handle.read(), os.fspath(path))
    names: Dict[int, str] = {}
    open_: Dict[int, List[Tuple[str, float]]] = {}
    found: List[Activity] = []
    for event in events:
        pid, phase = event.get("pid", 0), event.get("ph")
        if phase == "M" and event.get("name") == "process_name" and "name" in event.get("args", {}):
            names[pid] = str(event["args"]["name"])
        elif phase == "B":
            open_.setdefault(pid, []).append((str(event.get("name", "?")), float(event["ts"]) / 1e6))
        elif phase == "E" and open_.get(pid):
            name, start = open_[pid].pop()
            found.append(Activity(names.get(pid, f"tensor {pid}"), name, len(open_[pid]), start,
                                  float(event["ts"]) / 1e6))
    if not found:
        raise HorovodTimelineError(f"{os.fspath(path)} holds no finished Horovod activity (no B/E pair)")
    return sorted(found, key=lambda a: (a.start, a.depth))


def window(activities: Sequence[Activity]) -> List[Activity]:
    """The activities from the first data-moving operation on, clipped to start there."""
    operations = [a.start for a in activities if a.depth == 0 and not a.negotiation]
    begin = min(operations) if operations else min(a.start for a in activities)
    return [Activity(a.tensor, a.name, a.depth, max(a.start, begin), a.end) for a in activities if a.end >= begin]


def idle_fraction(activities: Sequence[Activity]) -> float:
    """Share of the span in which no top-level operation moves data (see the module docstring)."""
    activities = window(activities)
    start = min(a.start for a in activities)
    span = max(a.end for a in activities) - start
    if span <= 0:
        return 0.0
    busy, reach = 0.0, start
    for a in sorted((a for a in activities if a.depth == 0 and not a.negotiation), key=lambda a: a.start):
        if a.end > reach:
            busy += a.end - max(a.start, reach)
            reach = a.end
    return max(0.0, 1.0 - busy / span)


def _color(activity: Activity) -> str:
    if activity.negotiation:
        return _COLORS["NEGOTIATE"]
    if activity.depth == 0:
        return _COLORS["operation"]
    return _COLORS["MEMCPY"] if activity.name.startswith("MEMCPY") else _COLORS["transfer"]


def _label(tensor: str, width: int = 32) -> str:
    """A row label: long names (Keras' ``allreduce.DistributedOptimizer_Allreduce/...``) keep their end."""
    return tensor if len(tensor) <= width else "..." + tensor[-(width - 3):]


def render_png(activities_or_path: Union[PathLike, Sequence[Activity]], out_path: PathLike) -> str:
    """A Gantt chart of the timeline, one row per tensor, via ``dualframe.observe.timeline.draw_gantt``.

    Example:
        >>> render_png("horovod_timeline.json", "horovod.png")   # doctest: +SKIP
    """
    if isinstance(activities_or_path, (str, os.PathLike)):
        activities = read(activities_or_path)
    else:
        activities = list(activities_or_path)
    idle = idle_fraction(activities)
    activities = window(activities)
    tensors = list(dict.fromkeys(a.tensor for a in activities))
    origin = min(a.start for a in activities)
    span = max(a.end for a in activities) - origin
    bars = [Bar(tensors.index(a.tensor), (a.start - origin) * 1e3, max((a.end - a.start) * 1e3, span * 1e3 / 2000),
                _color(a), height=0.8 / (1 + a.depth)) for a in activities]
    title = f"Horovod timeline: {len(tensors)} tensors, span {span * 1e3:.1f} ms, idle (bubble) {idle:.3f}"
    legend = {"negotiate": _COLORS["NEGOTIATE"], "operation": _COLORS["operation"],
              "fusion-buffer copy": _COLORS["MEMCPY"], "transfer (Gloo/MPI/NCCL)": _COLORS["transfer"]}
    return draw_gantt(bars, [_label(t) for t in tensors], title, out_path, legend)
