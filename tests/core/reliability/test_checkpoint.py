"""Checkpoint folders: atomic saves, the manifest, keep-last-k, corruption found, writers killed mid-save."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dualframe.reliability.checkpoint import MANIFEST, CheckpointDir, CheckpointError, atomic_write_bytes


def test_save_keeps_the_last_k_and_reads_back(tmp_path):
    folder = CheckpointDir(str(tmp_path), keep=2, suffix=".pt")
    for step in (1, 2, 3):
        folder.save(step, b"data %d" % step, meta={"epoch": step // 2})
    assert [e.step for e in folder.entries()] == [2, 3]
    assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, "checkpoint-00000002.pt", "checkpoint-00000003.pt"])
    latest = folder.latest()
    assert latest is not None and latest.meta == {"epoch": 1}
    assert folder.read(latest) == b"data 3"


def test_saving_a_step_again_replaces_it(tmp_path):
    folder = CheckpointDir(str(tmp_path), keep=3)
    folder.save(5, b"first")
    folder.save(5, b"second")
    assert [e.step for e in folder.entries()] == [5]
    assert folder.read(folder.latest()) == b"second"


def test_empty_folder_has_no_checkpoint(tmp_path):
    folder = CheckpointDir(str(tmp_path / "missing"))
    assert folder.latest() is None and folder.read_latest() is None


def test_a_corrupt_file_is_detected_and_the_previous_one_used(tmp_path):
    folder = CheckpointDir(str(tmp_path), keep=3)
    folder.save(1, b"good" * 100)
    path = folder.save(2, b"newer" * 100)
    with open(path, "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(CheckpointError, match=r"is corrupt \(bytes: 10, manifest: 500"):
        folder.read(folder.latest())
    with pytest.warns(RuntimeWarning, match="trying the previous checkpoint"):
        entry, data = folder.read_latest()
    assert entry.step == 1 and data == b"good" * 100


@pytest.mark.parametrize("kwargs, message", [
    ({"keep": 0}, r"keep must be an int >= 1 \(keep: 0\)"),
    ({"keep": True}, r"keep must be an int >= 1 \(keep: True\)"),
    ({"prefix": "../x"}, r"prefix must be a plain file-name part"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        CheckpointDir(str(tmp_path), **kwargs)


def test_bad_step_data_and_manifest_are_refused(tmp_path):
    folder = CheckpointDir(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"step must be an int >= 0 \(step: -1\)"):
        folder.save(-1, b"x")
    with pytest.raises(CheckpointError, match=r"data must be bytes \(data: str\)"):
        folder.save(1, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        folder.save(1, b"x", meta={"bad": object()})
    assert os.listdir(tmp_path) == []
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="is not a valid manifest"):
        folder.entries()


def test_atomic_write_replaces_whole_file(tmp_path):
    target = str(tmp_path / "f")
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new contents")
    assert open(target, "rb").read() == b"new contents"
    assert os.listdir(tmp_path) == ["f"]


# The child saves step 1, then dies (SIGKILL) at a chosen point of saving step 2.
_CHILD = textwrap.dedent("""
    import os, signal, sys
    import dualframe.reliability.checkpoint as ck
    folder = ck.CheckpointDir(sys.argv[1], keep=2)
    folder.save(1, b"one" * 1000)
    point, calls = sys.argv[2], []
    def dying(real, when):
        def call(*args):
            calls.append(1)
            if len(calls) == when:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args)
        return call
    if point == "write":          # half-written temporary file
        ck.CHUNK_BYTES = 1024
        os.write = dying(os.write, 3)
    elif point == "rename":       # complete temporary file, not renamed
        os.replace = dying(os.replace, 1)
    elif point == "manifest":     # new file in place, manifest not updated
        os.replace = dying(os.replace, 2)
    folder.save(2, b"two" * 100000)
""")


@pytest.mark.parametrize("point", ["write", "rename", "manifest"])
def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path, point):
    result = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), point], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    folder = CheckpointDir(str(tmp_path), keep=2)
    assert [e.step for e in folder.entries()] == [1]
    assert folder.read(folder.latest()) == b"one" * 1000
    folder.save(3, b"three")
    assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, "checkpoint-00000001.bin", "checkpoint-00000003.bin"])


_LOOP = textwrap.dedent("""
    import sys
    from dualframe.reliability.checkpoint import CheckpointDir
    folder = CheckpointDir(sys.argv[1], keep=2)
    step = 0
    while True:
        step += 1
        folder.save(step, bytes([step % 256]) * (4 << 20))
        print(step, flush=True)
""")


def test_writer_killed_at_random_instants_always_leaves_a_valid_checkpoint(tmp_path):
    rng = random.Random(8)
    for attempt in range(4):
        folder_path = str(tmp_path / str(attempt))
        child = subprocess.Popen([sys.executable, "-c", _LOOP, folder_path], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        child.stdout.readline()  # at least one save completed
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.communicate()
        folder = CheckpointDir(folder_path, keep=2)
        entry, data = folder.read_latest()
        assert data == bytes([entry.step % 256]) * (4 << 20)
