"""Pipeline stage checkpoints in the core: stage folders, the newest step every stage holds, bad input."""
import os

import pytest

from dualframe.reliability.checkpoint import CheckpointDir, CheckpointError
from dualframe.reliability.stage_checkpoint import (agreed_step, check_part, common_step, read_common, read_step, root_sees_file,
                                        stage_directories, stage_directory, verified_steps)


def test_common_step_is_the_newest_step_every_stage_holds():
    assert common_step([[3, 4], [3, 4]]) == 4
    assert common_step([[3, 4], [3]]) == 3  # stage 1 killed before it saved step 4
    assert common_step([[], []]) is None
    with pytest.raises(CheckpointError, match=r"stages \[1\] hold no checkpoint while others do"):
        common_step([[3], []])
    with pytest.raises(CheckpointError, match=r"no common step \(steps by stage: \[\[5\], \[3, 4\]\]\); keep >= 2"):
        common_step([[5], [3, 4]])


def test_stage_directories_of_a_folder_or_a_list(tmp_path):
    with pytest.raises(CheckpointError, match="holds no stage folders"):
        stage_directories(str(tmp_path))
    for j in (0, 1, 3):
        os.makedirs(stage_directory(str(tmp_path), j))
    with pytest.raises(CheckpointError, match=r"stage-0 \.\.\. stage-2 without gaps \(found: \[0, 1, 3\]\)"):
        stage_directories(str(tmp_path))
    os.makedirs(stage_directory(str(tmp_path), 2))
    assert stage_directories(str(tmp_path)) == [str(tmp_path / f"stage-{j}") for j in range(4)]
    assert stage_directories(["a", "b"]) == ["a", "b"]
    for bad in ([], 3, b"x", [None]):
        with pytest.raises(CheckpointError):
            stage_directories(bad)


def test_read_common_skips_a_corrupt_newest_part(tmp_path):
    folders = [CheckpointDir(stage_directory(str(tmp_path), j), suffix=".bin") for j in range(2)]
    for step in (1, 2):
        for j, folder in enumerate(folders):
            folder.save(step, b"stage %d step %d" % (j, step))
    with open(os.path.join(folders[1].directory, folders[1].filename(2)), "r+b") as handle:
        handle.write(b"X")  # a torn write of stage 1's newest part
    with pytest.warns(RuntimeWarning, match="is corrupt"):
        assert verified_steps(folders[1]) == [1]
    with pytest.warns(RuntimeWarning):
        assert read_common(str(tmp_path), ".bin") == (1, [b"stage 0 step 1", b"stage 1 step 1"])
    with pytest.raises(CheckpointError, match=r"holds no checkpoint of step 7 \(steps: \[1, 2\]\)"):
        read_step(folders[0], 7)


def test_a_part_of_another_pipeline_is_refused():
    check_part((1, 2), (1, 2), "ckpt/stage-1")
    with pytest.raises(CheckpointError, match=r"holds stage 1 of 3, this rank holds stage 1 of 2"):
        check_part((1, 3), (1, 2), "ckpt/stage-1")


def test_agreed_step_from_every_stage_writer(tmp_path):
    folders = [CheckpointDir(stage_directory(str(tmp_path), j), suffix=".bin") for j in range(2)]
    for j, steps in enumerate(([3, 4], [3])):
        for step in steps:
            folders[j].save(step, b"x")
    other = (1, verified_steps(folders[1]))  # what stage 1's writer contributes; a replica contributes None
    assert agreed_step(folders[0], 0, 2, True, lambda mine: [mine, other, None]) == 3
    with pytest.raises(CheckpointError, match=r"stages \[0\] hold no checkpoint"):  # nobody read stage 0
        agreed_step(folders[0], 0, 2, False, lambda mine: [mine, other])
    with pytest.raises(CheckpointError, match=r"stages \[1\] hold no checkpoint"):
        agreed_step(folders[0], 0, 2, True, lambda mine: [mine, None])


def test_every_rank_takes_rank_0s_view_of_file_or_folder(tmp_path):
    """A file rank 0 sees but another rank does not (yet): both take the file's branch, and the reverse."""
    merged = tmp_path / "full.pt"
    merged.write_bytes(b"x")
    sent = []

    def share(data):  # rank 0's bytes reach every rank
        sent.append(data)
        return sent[0]

    assert root_sees_file(str(merged), 0, share) is True
    assert root_sees_file(str(tmp_path / "missing"), 1, share) is True  # rank 1 follows rank 0's answer
    sent.clear()
    assert root_sees_file(str(tmp_path), 0, share) is False  # a folder
    assert root_sees_file(str(merged), 1, share) is False
    assert sent == [b"0", None]  # only rank 0 looked
