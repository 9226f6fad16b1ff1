"""Timeline events: bubble fraction, Chrome trace round trip, PNG Gantt chart, summary."""
import json

import pytest

from dualframe.errors import StrategyError
from dualframe.pipeline.clock import gpipe_bubble
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.observe.timeline import (
    Event, Timeline, measured_bubble, read_chrome_trace, render_png, summary, to_chrome_trace, write_chrome_trace,
)


def ideal_events(m, n, forward=1.0, backward=2.0):
    """Events of a perfect GPipe step with equal cells: forward ticks, then backward ticks."""
    events, t = [], 0.0
    for kind, length in (("F", forward), ("B", backward)):
        for tick in one_process_ticks("gpipe", m, n, kind):
            events += [Event(kind, i, j, f"cpu:{j}", t, t + length) for i, j in tick]
            t += length
    return events


@pytest.mark.parametrize("m, n", [(4, 2), (8, 4), (1, 3), (5, 1)])
def test_ideal_gpipe_bubble_equals_the_formula(m, n):
    assert measured_bubble(ideal_events(m, n)) == pytest.approx(gpipe_bubble(stages=n, chunks=m))
    assert gpipe_bubble(stages=n, chunks=m) == pytest.approx((n - 1) / (m + n - 1))


def test_sequential_cells_leave_the_other_stages_idle():
    events = [Event("F", 0, 0, "a", 0, 1), Event("F", 0, 1, "b", 1, 2), Event("B", 0, 1, "b", 2, 3),
              Event("B", 0, 0, "a", 3, 4)]
    assert measured_bubble(events) == pytest.approx(0.5)


def test_chrome_trace_round_trip(tmp_path):
    events = ideal_events(3, 2)
    path = write_chrome_trace(events, tmp_path / "trace.json")
    document = json.loads(open(path).read())
    first = document["traceEvents"][0]
    assert first["ph"] == "X" and first["name"] == "F0" and first["ts"] == 0 and first["dur"] == 1e6
    assert first["args"] == {"kind": "F", "micro_batch": 0, "stage": 0, "device": "cpu:0"}
    assert document["otherData"]["dualframe"] == {"chunks": 3, "stages": 2}
    names = [e["args"]["name"] for e in document["traceEvents"] if e["ph"] == "M"]
    assert names == ["stage 0 (cpu:0)", "stage 1 (cpu:1)"]
    back = read_chrome_trace(path)
    assert sorted((e.kind, e.micro_batch, e.stage, e.device, e.duration) for e in back) == \
        sorted((e.kind, e.micro_batch, e.stage, e.device, pytest.approx(e.duration)) for e in events)
    assert measured_bubble(back) == pytest.approx(measured_bubble(events))


def test_png_gantt_from_trace_file_and_from_events(tmp_path):
    events = ideal_events(4, 2)
    trace = write_chrome_trace(events, tmp_path / "t.json")
    for source, name in ((trace, "a.png"), (events, "b.png")):
        out = render_png(source, tmp_path / name)
        data = open(out, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_timeline_recorder_and_summary():
    timeline = Timeline()
    for e in ideal_events(2, 2):
        timeline.record(e.kind, e.micro_batch, e.stage, e.device, e.start, e.end)
    text = timeline.summary()
    assert "8 events, 2 micro-batches x 2 stages" in text
    assert "stage 1 on cpu:1: forward 2000.00 ms, backward 4000.00 ms" in text
    assert "bubble: measured 0.333, theoretical (n-1)/(m+n-1) = 0.333" in text
    timeline.clear()
    assert timeline.events == []


def test_empty_timeline_and_foreign_trace_refused(tmp_path):
    with pytest.raises(StrategyError, match="no events"):
        summary([])
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "x", "ts": 0, "dur": 1}]}))
    with pytest.raises(StrategyError, match="holds no dualframe pipeline events"):
        read_chrome_trace(path)
    assert to_chrome_trace(ideal_events(1, 1))["traceEvents"][0]["name"] == "F0"


def test_report_writes_the_trace_and_png_it_names(tmp_path):
    from dualframe.observe.timeline import Event, read_chrome_trace, report, summary

    events = [Event("F", 0, 0, "cpu", 0.0, 1.0), Event("F", 0, 1, "cpu", 1.0, 2.0),
              Event("B", 0, 1, "cpu", 2.0, 4.0), Event("B", 0, 0, "cpu", 4.0, 6.0)]
    text = report(events, trace=str(tmp_path / "t.json"), png=str(tmp_path / "t.png"))
    assert text.splitlines()[0] == summary(events).splitlines()[0]
    assert f"trace: {tmp_path / 't.json'}" in text and f"timeline: {tmp_path / 't.png'}" in text
    assert len(read_chrome_trace(tmp_path / "t.json")) == 4
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report(events) == summary(events)
