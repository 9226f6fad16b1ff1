"""``dualframe timeline``: Horovod timelines (one made here by a real 2-process horovodrun job),
dualframe pipeline traces and scaling results, each drawn to a PNG."""
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from dualframe.observe import charts, horovod_timeline
from dualframe.observe.timeline import Event, write_chrome_trace

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(sys.executable).parent

# A literal Horovod timeline as Horovod leaves it: no closing bracket. Times in microseconds.
LITERAL = """[
{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.fc.weight"}},
{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 1000, "pid": 1},
{"ph": "X", "name": "0", "ts": 1000, "pid": 1, "dur": 0},
{"ph": "E", "ts": 1100, "pid": 1},
{"ph": "B", "name": "ALLREDUCE", "ts": 1200, "pid": 1},
{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1210, "pid": 1},
{"ph": "E", "ts": 1290, "pid": 1},
{"ph": "E", "ts": 1300, "pid": 1},
{"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "allreduce.fc.bias"}},
{"ph": "B", "name": "ALLREDUCE", "ts": 1250, "pid": 2},
{"ph": "E", "ts": 1400, "pid": 2},
{"ph": "B", "name": "ALLREDUCE", "ts": 1600, "pid": 2},
{"ph": "E", "ts": 1700, "pid": 2},
"""


def png_size(path) -> tuple:
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_literal_horovod_timeline_is_read_and_its_idle_time_measured(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text(LITERAL)
    activities = horovod_timeline.read(path)
    assert [(a.tensor, a.name, a.depth) for a in activities] == [
        ("allreduce.fc.weight", "NEGOTIATE_ALLREDUCE", 0), ("allreduce.fc.weight", "ALLREDUCE", 0),
        ("allreduce.fc.weight", "GLOO_ALLREDUCE", 1), ("allreduce.fc.bias", "ALLREDUCE", 0),
        ("allreduce.fc.bias", "ALLREDUCE", 0)]
    # Span from the first operation (1200) to the end (1700) = 500 us; busy 1200-1400 and 1600-1700 = 300 us.
    assert horovod_timeline.idle_fraction(activities) == pytest.approx(0.4)
    assert charts.kind_of(path) == "horovod"


def _horovod_job(tmp_path) -> pathlib.Path:
    script = tmp_path / "train.py"
    script.write_text(
        "import time, torch, horovod.torch as hvd\n"
        "hvd.init()\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n"
        "optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "                                     named_parameters=model.named_parameters())\n"
        "hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "for step in range(4):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.randn(8, 32)).pow(2).mean().backward()\n"
        "    optimizer.step()\n"
        "hvd.allreduce(torch.zeros(1), name='closing')\n"
        "time.sleep(1)  # Horovod's timeline writer drains its queue on its own clock\n"
        "hvd.shutdown()  # flushes the timeline\n")
    timeline = tmp_path / "horovod_timeline.json"
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), HOROVOD_TIMELINE=str(timeline))
    result = subprocess.run([sys.executable, "-m", "dualframe", "run", "-np", "2", "--launcher", "horovodrun",
                             str(script)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return timeline


def test_real_horovod_timeline_from_two_processes_to_png(tmp_path):
    timeline = _horovod_job(tmp_path)
    activities = horovod_timeline.read(timeline)
    tensors = {a.tensor for a in activities}
    assert {"allreduce.0.weight", "allreduce.0.bias", "allreduce.2.weight", "allreduce.2.bias"} <= tensors
    operations = [a for a in activities if a.name == "ALLREDUCE"]
    # 4 steps x 4 gradient tensors (+ the closing allreduce); Horovod's writer thread may still drop
    # events at shutdown on a loaded machine (seen once in CI: fewer than 3 steps), so at least 2 steps.
    gradients = [a for a in operations if "closing" not in a.tensor]
    assert 2 * 4 <= len(gradients) <= 4 * 4, len(gradients)
    assert any(a.name == "GLOO_ALLREDUCE" and a.depth == 1 for a in activities)
    assert 0 < horovod_timeline.idle_fraction(activities) < 1
    out = tmp_path / "horovod.png"
    result = subprocess.run([sys.executable, "-m", "dualframe", "timeline", str(timeline), "-o", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Horovod timeline:" in result.stdout and f"wrote {out}" in result.stdout
    width, height = png_size(out)
    assert width == 1000 and height > 400                        # 8 tensor rows
    if os.environ.get("DUALFRAME_KEEP_PNG"):                      # to look at it: DUALFRAME_KEEP_PNG=dir
        (pathlib.Path(os.environ["DUALFRAME_KEEP_PNG"]) / "horovod.png").write_bytes(out.read_bytes())


def test_pipeline_trace_to_png_with_its_bubble(tmp_path):
    # GPipe, 4 micro-batches x 2 stages, 1 s cells: forward staircase, then backward in reverse.
    events = [Event("F", i, j, f"cpu:{j}", i + j, i + j + 1) for i in range(4) for j in range(2)]
    events += [Event("B", i, j, f"cpu:{j}", 5 + (3 - i) + (1 - j), 6 + (3 - i) + (1 - j)) for i in range(4) for j in range(2)]
    trace = write_chrome_trace(events, tmp_path / "trace.json")
    assert charts.kind_of(trace) == "pipeline"
    assert "bubble: measured 0.200, theoretical (n-1)/(m+n-1) = 0.200" in charts.summary(trace)
    assert png_size(charts.render(trace, tmp_path / "pipe.png"))[0] == 1000


def test_scaling_results_to_png_with_efficiency(tmp_path):
    results = tmp_path / "bench.txt"
    results.write_text('np=1 warming up\nRESULT {"np": 1, "img_per_sec_per_rank": 50.0}\n'
                       'RESULT {"np": 2, "img_per_sec_per_rank": 41.0}\nRESULT {"np": 2, "img_per_sec_per_rank": 43.0}\n'
                       '{"np": 4, "img_per_sec_per_rank": 35.0}\n')
    assert charts.kind_of(results) == "scaling"
    assert charts.summary(results) == "img_per_sec_per_rank: np=1 50 (100%), np=2 42 (84%), np=4 35 (70%)"
    assert charts.efficiency([(1, 10.0), (4, 30.0)], per_rank=False) == [1.0, 0.75]
    assert png_size(charts.render(results, tmp_path / "scaling.png")) == (700, 450)


def test_unknown_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    result = subprocess.run([sys.executable, "-m", "dualframe", "timeline", str(path)], capture_output=True,
                            text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2
    assert "is neither a dualframe pipeline trace, a Horovod timeline nor scaling results" in result.stderr
