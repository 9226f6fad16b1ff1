"""``dualframe timeline FILE -o out.png``: recognise what FILE holds and draw it as a PNG.

Three kinds of file:

- a dualframe pipeline trace (``{"traceEvents": [...]}``, ``dualframe.observe.timeline``): a Gantt chart of
  the stages with the measured and theoretical bubble;
- a Horovod timeline (``HOROVOD_TIMELINE=file.json``, a bare event array): a Gantt chart per tensor
  with the idle fraction (``dualframe.observe.horovod_timeline``);
- scaling results: lines of JSON objects, each with ``np`` and numbers, optionally prefixed by
  ``RESULT `` as the benchmark scripts print them (``{"np": 2, "img_per_sec_per_rank": 41.3}``) and
  with a ``"series"`` name: a line chart of the metric against ``np`` beside ideal scaling (flat for a
  ``*_per_rank`` metric, linear otherwise), each point labelled with its efficiency.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

from dualframe.errors import DualframeError

PathLike = Union[str, "os.PathLike[str]"]
KINDS = ("pipeline", "horovod", "scaling")


class ChartError(DualframeError, ValueError):
    """A file is none of the kinds ``dualframe timeline`` draws, or lacks what the chart needs."""


def kind_of(path: PathLike) -> str:
    """``"pipeline"``, ``"horovod"`` or ``"scaling"``, from the file's first characters."""
    with open(path) as handle:
        head = handle.read(4096).lstrip()
    if head.startswith("["):
        return "horovod"
    if head.startswith("{") and '"traceEvents"' in head:
        return "pipeline"
    if '"np"' in head:
        return "scaling"
    raise ChartError(f"{os.fspath(path)} is neither a dualframe pipeline trace, a Horovod timeline nor scaling "
                     f"results (JSON lines with \"np\")")


def read_scaling(path: PathLike) -> List[Dict[str, Any]]:
    """The result records of a scaling file (see the module docstring); other lines are skipped."""
    records = []
    with open(path) as handle:
        for line in handle:
            text = line.strip()
            text = text[len("RESULT "):] if text.startswith("RESULT ") else text
            if not text.startswith("{"):
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("np"), int):
                records.append(record)
    if not records:
        raise ChartError(f"{os.fspath(path)} has no result line with an integer \"np\"")
    return records


def _metric(records: List[Dict[str, Any]], metric: Optional[str]) -> str:
    numeric = [k for k, v in records[0].items()
               if k != "np" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    if metric is None:
        if not numeric:
            raise ChartError(f"the results have no number besides np (keys: {sorted(records[0])})")
        return numeric[0]
    if metric not in numeric:
        raise ChartError(f"metric {metric!r} is not in the results; choose one of {', '.join(numeric)}")
    return metric


def scaling_series(records: List[Dict[str, Any]], metric: str) -> Dict[str, List[Tuple[int, float]]]:
    """Per series, (np, median of the metric) in order of np."""
    grouped: Dict[str, Dict[int, List[float]]] = {}
    for record in records:
        if metric in record:
            by_np = grouped.setdefault(str(record.get("series", metric)), {})
            by_np.setdefault(record["np"], []).append(float(record[metric]))
    return {name: sorted((np, statistics.median(values)) for np, values in by_np.items())
            for name, by_np in grouped.items()}


def efficiency(points: List[Tuple[int, float]], per_rank: bool) -> List[float]:
    """Each point's value over ideal scaling from the smallest np (1.0 = perfect).

    Example:
        >>> efficiency([(1, 100.0), (2, 180.0)], per_rank=False)
        [1.0, 0.9]
    """
    base_np, base = points[0]
    return [value / (base if per_rank else base * np / base_np) for np, value in points]


def render_scaling(path: PathLike, out_path: PathLike, metric: Optional[str] = None) -> str:
    """Draw the scaling chart of ``path`` to ``out_path`` (PNG) and return its path."""
    records = read_scaling(path)
    metric = _metric(records, metric)
    series = scaling_series(records, metric)
    per_rank = metric.endswith("per_rank")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, points in series.items():
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        line, = axes.plot(xs, ys, marker="o", label=name)
        ideal = [ys[0] if per_rank else ys[0] * x / xs[0] for x in xs]
        axes.plot(xs, ideal, linestyle="--", color=line.get_color(), alpha=0.5, label=f"{name} (ideal)")
        for x, y, e in zip(xs, ys, efficiency(points, per_rank)):
            axes.annotate(f"{e:.0%}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axes.set_xlabel("processes (np)")
    axes.set_ylabel(metric)
    axes.set_xticks(sorted({p[0] for points in series.values() for p in points}))
    axes.set_ylim(bottom=0)
    axes.set_title(f"scaling of {metric}: efficiency vs ideal ({'flat' if per_rank else 'linear'})")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_path, dpi=100)
    return os.fspath(out_path)


def render(path: PathLike, out_path: PathLike, kind: Optional[str] = None, metric: Optional[str] = None) -> str:
    """Draw ``path`` as the chart its kind calls for (``kind`` overrides the guess); return the PNG path."""
    kind = kind or kind_of(path)
    if kind == "pipeline":
        from dualframe.observe import timeline

        return timeline.render_png(path, out_path)
    if kind == "horovod":
        from dualframe.observe import horovod_timeline

        return horovod_timeline.render_png(path, out_path)
    if kind == "scaling":
        return render_scaling(path, out_path, metric)
    raise ChartError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")


def summary(path: PathLike, kind: Optional[str] = None) -> str:
    """A few lines about the file: its bubble, idle fraction or scaling efficiency."""
    kind = kind or kind_of(path)
    if kind == "pipeline":
        from dualframe.observe import timeline

        return timeline.summary(timeline.read_chrome_trace(path))
    if kind == "horovod":
        from dualframe.observe import horovod_timeline

        activities = horovod_timeline.read(path)
        return (f"Horovod timeline: {len(activities)} activities, "
                f"idle (bubble) {horovod_timeline.idle_fraction(activities):.3f}")
    records = read_scaling(path)
    metric = _metric(records, None)
    lines = []
    for name, points in scaling_series(records, metric).items():
        effs = efficiency(points, metric.endswith("per_rank"))
        lines.append(f"{name}: " + ", ".join(f"np={np} {v:.4g} ({e:.0%})" for (np, v), e in zip(points, effs)))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``timeline`` subcommand's arguments."""
    parser.add_argument("file", help="a dualframe pipeline trace, a Horovod timeline or scaling results")
    parser.add_argument("-o", "--output", default=None, help="the PNG to write (default: FILE with .png)")
    parser.add_argument("--kind", choices=KINDS, default=None, help="default: recognised from the file")
    parser.add_argument("--metric", default=None, help="scaling results: the number to draw (default: the first)")


def main(args: argparse.Namespace) -> int:
    """Draw the file, print what it shows and where the PNG went; 2 on a file it cannot read."""
    output = args.output or os.path.splitext(args.file)[0] + ".png"
    try:
        text = summary(args.file, args.kind)
        render(args.file, output, args.kind, args.metric)
    except (OSError, DualframeError) as error:
        print(f"dualframe timeline: {error}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {output}")
    return 0
