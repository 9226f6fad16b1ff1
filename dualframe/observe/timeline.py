"""Pipeline timelines: forward/backward events per (micro-batch, stage), Chrome trace, PNG Gantt, bubble.

An event is one cell of the schedule run on one device: kind ``"F"`` (forward) or ``"B"`` (backward),
micro-batch ``i``, stage ``j``, device name, start and end in seconds (``time.perf_counter``).

Trace format (what ``write_chrome_trace`` writes and ``read_chrome_trace``/``render_png`` read), the
Chrome trace-event JSON that ``chrome://tracing`` and https://ui.perfetto.dev open::

    {"traceEvents": [
        {"name": "F3", "cat": "forward", "ph": "X", "pid": 0, "tid": 1,
         "ts": 1520.0, "dur": 830.5,                        # microseconds from the first event
         "args": {"kind": "F", "micro_batch": 3, "stage": 1, "device": "cuda:1"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "stage 1 (cuda:1)"}},
        ...],
     "displayTimeUnit": "ms",
     "otherData": {"dualframe": {"chunks": 4, "stages": 2}}}

One row (``tid``) per stage. Only ``"ph": "X"`` events with ``args.kind`` are read back.

Measured bubble: with ``span`` the time from the first start to the last end and ``busy_j`` the
summed event time of stage ``j``, ``bubble = 1 - sum(busy_j) / (n * span)``; for GPipe with equal
cells the theory is ``dualframe.pipeline.clock.gpipe_bubble`` (the idle share of a clock table is
``table_bubble`` there).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

from dualframe.errors import StrategyError
from dualframe.pipeline.clock import gpipe_bubble

KIND_NAMES = {"F": "forward", "B": "backward"}


@dataclass(frozen=True)
class Event:
    """One cell run: stage ``stage`` on micro-batch ``micro_batch``, forward ``"F"`` or backward ``"B"``."""

    kind: str
    micro_batch: int
    stage: int
    device: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """Seconds the cell took."""
        return self.end - self.start


class Timeline:
    """A thread-safe recorder of events, filled by a pipeline step and read afterwards.

    Example:
        >>> timeline = Timeline()
        >>> timeline.record("F", 0, 0, "cpu", 0.0, 1.0)
        >>> timeline.record("F", 0, 1, "cpu", 1.0, 2.0)
        >>> measured_bubble(timeline.events)
        0.5
    """

    def __init__(self) -> None:
        self._events: List[Event] = []
        self._lock = threading.Lock()

    def record(self, kind: str, micro_batch: int, stage: int, device: str, start: float, end: float) -> None:
        """Add one event (called from the stage threads)."""
        with self._lock:
            self._events.append(Event(kind, micro_batch, stage, device, start, end))

    @property
    def events(self) -> List[Event]:
        """The events so far, by start time."""
        with self._lock:
            return sorted(self._events, key=lambda e: (e.start, e.stage))

    def clear(self) -> None:
        """Forget every event."""
        with self._lock:
            self._events.clear()

    def summary(self) -> str:
        """One-paragraph text summary (see ``summary``)."""
        return summary(self.events)


class Recording:
    """Mixin for split models: ``with model.record() as timeline:`` records the steps run inside.

    Example:
        >>> with pipe.record() as timeline:       # doctest: +SKIP
        ...     train_step(pipe, batch)
        >>> print(timeline.summary())             # doctest: +SKIP
    """

    _recording: Optional[Timeline] = None

    @contextlib.contextmanager
    def record(self, timeline: Optional[Timeline] = None) -> Iterator[Timeline]:
        """Record every forward/backward cell run inside the block into ``timeline`` (a new one by default)."""
        recording = timeline if timeline is not None else Timeline()
        self._recording = recording
        try:
            yield recording
        finally:
            self._recording = None

    def recorder(self, devices: Sequence[str]) -> Optional[Callable[[str, int, int, float, float], None]]:
        """The callback the schedule walker calls after each cell, or None when not recording."""
        timeline = self._recording
        if timeline is None:
            return None
        names = [str(d) for d in devices]
        return lambda kind, i, j, start, end: timeline.record(kind, i, j, names[j], start, end)


def _check(events: Sequence[Event]) -> None:
    if not events:
        raise StrategyError("the timeline has no events; record a pipeline step first")


def shape(events: Sequence[Event]) -> "tuple[int, int]":
    """(micro-batches m, stages n) seen in the events."""
    _check(events)
    return max(e.micro_batch for e in events) + 1, max(e.stage for e in events) + 1


def measured_bubble(events: Sequence[Event]) -> float:
    """Measured idle fraction of the stages over the events' span (0 = always busy)."""
    _check(events)
    _, n = shape(events)
    span = max(e.end for e in events) - min(e.start for e in events)
    if span <= 0:
        return 0.0
    busy = sum(e.duration for e in events)
    return max(0.0, 1.0 - busy / (n * span))


def summary(events: Sequence[Event]) -> str:
    """Per stage busy time and the measured bubble beside the theoretical one."""
    _check(events)
    m, n = shape(events)
    start = min(e.start for e in events)
    span = max(e.end for e in events) - start
    lines = [f"timeline: {len(events)} events, {m} micro-batches x {n} stages, span {span * 1e3:.2f} ms"]
    for j in range(n):
        mine = [e for e in events if e.stage == j]
        device = mine[0].device if mine else "?"
        forward = sum(e.duration for e in mine if e.kind == "F")
        backward = sum(e.duration for e in mine if e.kind == "B")
        lines.append(f"  stage {j} on {device}: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms")
    lines.append(f"  bubble: measured {measured_bubble(events):.3f}, theoretical (n-1)/(m+n-1) = "
                 f"{gpipe_bubble(stages=n, chunks=m):.3f}")
    return "\n".join(lines)


def to_chrome_trace(events: Sequence[Event]) -> Dict[str, Any]:
    """The events as a Chrome trace-event document (see the module docstring)."""
    _check(events)
    m, n = shape(events)
    origin = min(e.start for e in events)
    trace: List[Dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e.start, e.stage)):
        trace.append({
            "name": f"{e.kind}{e.micro_batch}", "cat": KIND_NAMES.get(e.kind, e.kind), "ph": "X",
            "pid": 0, "tid": e.stage, "ts": (e.start - origin) * 1e6, "dur": e.duration * 1e6,
            "args": {"kind": e.kind, "micro_batch": e.micro_batch, "stage": e.stage, "device": e.device},
        })
    devices = {e.stage: e.device for e in events}
    for j in range(n):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": j,
                      "args": {"name": f"stage {j} ({devices.get(j, '?')})"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"dualframe": {"chunks": m, "stages": n}}}


def write_chrome_trace(events: Sequence[Event], path: Union[str, "os.PathLike[str]"]) -> str:
    """Write the Chrome trace JSON to ``path`` and return the path."""
    with open(path, "w") as handle:
        json.dump(to_chrome_trace(events), handle)
    return os.fspath(path)


def read_chrome_trace(path: Union[str, "os.PathLike[str]"]) -> List[Event]:
    """Read back the events of a trace written by ``write_chrome_trace``."""
    with open(path) as handle:
        document = json.load(handle)
    raw = document.get("traceEvents", document) if isinstance(document, dict) else document
    events = []
    for item in raw:
        args = item.get("args", {})
        if item.get("ph") != "X" or "kind" not in args:
            continue
        start = float(item["ts"]) / 1e6
        events.append(Event(args["kind"], int(args["micro_batch"]), int(args["stage"]), str(args.get("device", "?")),
                            start, start + float(item["dur"]) / 1e6))
    if not events:
        raise StrategyError(f"{os.fspath(path)} holds no dualframe pipeline events (\"ph\": \"X\" with args.kind)")
    return events


@dataclass(frozen=True)
class Bar:
    """One bar of a Gantt chart: ``row`` index, start and length in ms, colour, optional label."""

    row: int
    start: float
    length: float
    color: str
    label: str = ""
    height: float = 0.8


def draw_gantt(bars: Sequence[Bar], rows: Sequence[str], title: str, out_path: Union[str, "os.PathLike[str]"],
               legend: Optional[Dict[str, str]] = None) -> str:
    """Draw ``bars`` (one row per name in ``rows``, time in ms) to a PNG and return its path.

    The one renderer behind every dualframe timeline (pipelines here, Horovod timelines in
    ``dualframe.observe.horovod_timeline``). ``legend`` maps a label to a colour.
    """
    # The Agg canvas directly, not pyplot: no display needed and the caller's backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    figure = Figure(figsize=(10, 1.0 + min(0.6 * len(rows), 24.0)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for bar in bars:
        axes.barh(bar.row, bar.length, left=bar.start, height=bar.height, color=bar.color, edgecolor="black",
                  linewidth=0.5)
        if bar.label:
            axes.text(bar.start + bar.length / 2, bar.row, bar.label, ha="center", va="center", fontsize=7)
    axes.set_yticks(range(len(rows)), list(rows))
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    axes.set_title(title)
    if legend:
        axes.legend(handles=[Patch(color=c, label=name) for name, c in legend.items()], loc="upper right", fontsize=7)
    figure.tight_layout()
    figure.savefig(out_path, dpi=100)
    return os.fspath(out_path)


def render_png(trace_path_or_events: Union[str, "os.PathLike[str]", Sequence[Event]],
               out_path: Union[str, "os.PathLike[str]"]) -> str:
    """Draw a Gantt chart (one row per stage, forward blue, backward orange) to a PNG; return its path.

    Example:
        >>> render_png("trace.json", "timeline.png")   # doctest: +SKIP
    """
    if isinstance(trace_path_or_events, (str, os.PathLike)):
        events = read_chrome_trace(trace_path_or_events)
    else:
        events = list(trace_path_or_events)
    _check(events)
    m, n = shape(events)
    origin = min(e.start for e in events)
    colors = {"F": "#4C72B0", "B": "#DD8452"}
    bars = [Bar(e.stage, (e.start - origin) * 1e3, e.duration * 1e3, colors.get(e.kind, "grey"),
                f"{e.kind}{e.micro_batch}") for e in events]
    devices = {e.stage: e.device for e in events}
    title = (f"{m} micro-batches x {n} stages: bubble measured {measured_bubble(events):.3f}, "
             f"theoretical {gpipe_bubble(stages=n, chunks=m):.3f}")
    return draw_gantt(bars, [f"stage {j}\n{devices.get(j, '?')}" for j in range(n)], title, out_path)


def report(events: Sequence[Event], trace: Optional[str] = None, png: Optional[str] = None) -> str:
    """The summary, plus where the Chrome trace and the PNG Gantt chart were written when asked for.

    Example:
        >>> print(report(timeline.events, trace="step.json", png="step.png"))  # doctest: +SKIP
    """
    lines = [summary(events)]
    if trace:
        lines.append(f"trace: {write_chrome_trace(events, trace)}")
    if png:
        lines.append(f"timeline: {render_png(events, png)}")
    return "\n".join(lines)
