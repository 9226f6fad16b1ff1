"""Pipeline stage checkpoints, framework-neutral: one folder per stage, and the newest step every stage holds.

A process pipeline saves each stage's part into ``{directory}/stage-{j}`` (one writer per stage: the
first rank of the stage's data-parallel group), each folder a :class:`CheckpointDir` with its own
manifest. A job killed in the middle of a save can leave some stages one checkpoint ahead of others,
so loads and merges use the newest step that EVERY stage holds and that verifies, never each
folder's newest alone. The adapters (``dualframe.torch.stage_checkpoint``,
``dualframe.tensorflow.stage_checkpoint``) serialise the tensors; this module picks folders and steps.

Index names: ``j`` stage, ``n`` stages.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from dualframe.reliability.checkpoint import CheckpointDir, CheckpointEntry, CheckpointError

#: Name of stage j's folder inside a pipeline checkpoint folder.
STAGE_FOLDER = "stage-{j}"
_STAGE_RE = re.compile(r"^stage-(\d+)$")


def check_directory(directory: object) -> str:
    """``directory`` as a string path, or CheckpointError when it is not a non-empty path."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise CheckpointError(f"directory must be a path (directory: {directory!r})")
    return str(os.fspath(directory))


def stage_directory(directory: str, j: int) -> str:
    """The folder of stage ``j`` inside the pipeline checkpoint folder ``directory``.

    Example:
        >>> stage_directory("ckpt", 1)
        'ckpt/stage-1'
    """
    return os.path.join(check_directory(directory), STAGE_FOLDER.format(j=j))


def stage_directories(stages: Union[str, Sequence[str]]) -> List[str]:
    """The stage folders, in stage order: those of a pipeline checkpoint folder, or a list given as is.

    Args:
        stages: a pipeline checkpoint folder holding ``stage-0`` ... ``stage-{n-1}``, or a list of
            stage folders in stage order.

    Raises:
        CheckpointError: no stage folder, a gap in the numbering, or a list that is empty or holds
            something other than paths.
    """
    if isinstance(stages, (str, os.PathLike)):
        root = check_directory(stages)
        found = sorted(int(m.group(1)) for m in map(_STAGE_RE.match, os.listdir(root) if os.path.isdir(root) else [])
                       if m)
        if not found:
            raise CheckpointError(f"{root} holds no stage folders (stage-0, stage-1 ...); is it a pipeline checkpoint?")
        if found != list(range(len(found))):
            raise CheckpointError(f"{root} must hold stage-0 ... stage-{len(found) - 1} without gaps (found: {found})")
        return [stage_directory(root, j) for j in found]
    if isinstance(stages, bytes) or not isinstance(stages, Sequence) or not stages:
        raise CheckpointError(f"stages must be a pipeline checkpoint folder or a non-empty list of stage folders "
                              f"(stages: {stages!r})")
    return [check_directory(folder) for folder in stages]


def verified_steps(folder: CheckpointDir) -> List[int]:
    """The steps of ``folder``'s checkpoints whose files verify (size, sha256), oldest first; warns about the others."""
    steps = []
    for entry in folder.entries():
        try:
            folder.read(entry)
        except CheckpointError as error:
            warnings.warn(f"{error}; that step is not used", RuntimeWarning, stacklevel=2)
            continue
        steps.append(entry.step)
    return steps


def common_step(steps_by_stage: Sequence[Sequence[int]]) -> Optional[int]:
    """The newest step every stage holds (None when no stage holds any checkpoint).

    Example:
        >>> common_step([[3, 4], [3]])       # stage 1 was killed before saving step 4
        3

    Raises:
        CheckpointError: some stages hold checkpoints and others none, or they share no step.
    """
    if not any(steps_by_stage):
        return None
    empty = [j for j, steps in enumerate(steps_by_stage) if not steps]
    if empty:
        raise CheckpointError(f"stages {empty} hold no checkpoint while others do "
                              f"(steps by stage: {[list(s) for s in steps_by_stage]}); save every stage together")
    shared = set(steps_by_stage[0]).intersection(*steps_by_stage[1:])
    if not shared:
        raise CheckpointError(f"the stages hold no common step (steps by stage: {[list(s) for s in steps_by_stage]}); "
                              "keep >= 2 checkpoints so a save interrupted on some stages leaves a common one")
    return max(shared)


def agreed_step(folder: CheckpointDir, j: int, n: int, writes: bool, gather: Callable[[Any], List[Any]]) -> Optional[int]:
    """The newest step every stage's folder holds, the same on every rank.

    Args:
        folder: this rank's stage folder (read only where ``writes``).
        j: this rank's stage; n: stages.
        writes: whether this rank reads its stage's folder (one rank per stage).
        gather: the framework's allgather of a small Python object over every rank.
    """
    mine = (j, verified_steps(folder)) if writes else None
    by_stage = {stage: steps for stage, steps in (item for item in gather(mine) if item is not None)}
    return common_step([by_stage.get(stage, []) for stage in range(n)])


def root_sees_file(path: str, rank: int, share: Callable[[Optional[bytes]], bytes]) -> bool:
    """Whether ``path`` is a file (a merged checkpoint) as rank 0 sees it, the same answer on every rank.

    Each rank looking for itself could split the ranks between a file's load and a folder's (a file
    rank 0 is still writing, or one on rank 0's disk alone), leaving each half waiting on another
    collective; rank 0 reads the file anyway.

    Args:
        path: the checkpoint folder or merged file.
        rank: this rank.
        share: the framework's broadcast of rank 0's bytes to every rank (given None elsewhere).
    """
    return share((b"1" if os.path.isfile(path) else b"0") if rank == 0 else None) == b"1"


def read_common(stages: Union[str, Sequence[str]], suffix: str) -> Tuple[int, List[bytes]]:
    """The newest step all stage folders hold, and each stage's bytes of it (one process: for merges).

    Raises:
        CheckpointError: as ``stage_directories`` and ``common_step``, or when no stage holds a checkpoint.
    """
    folders = [CheckpointDir(path, suffix=suffix) for path in stage_directories(stages)]
    step = common_step([verified_steps(folder) for folder in folders])
    if step is None:
        raise CheckpointError(f"no stage folder holds a checkpoint ({[f.directory for f in folders]})")
    return step, [read_step(folder, step) for folder in folders]


def read_step(folder: CheckpointDir, step: int) -> bytes:
    """The verified bytes of ``folder``'s checkpoint of ``step``.

    Raises:
        CheckpointError: the manifest does not name that step, or its file does not verify.
    """
    by_step: Dict[int, CheckpointEntry] = {entry.step: entry for entry in folder.entries()}
    entry = by_step.get(step)
    if entry is None:
        raise CheckpointError(f"{folder.directory} holds no checkpoint of step {step} (steps: {sorted(by_step)})")
    return folder.read(entry)


def check_part(saved: Tuple[Optional[int], Optional[int]], expected: Tuple[int, int], where: str) -> None:
    """Refuse stage ``(j, n)`` of a saved pipeline where stage ``(j, n)`` of this pipeline is expected."""
    if tuple(saved) != tuple(expected):
        raise CheckpointError(f"{where} holds stage {saved[0]} of {saved[1]}, this rank holds stage {expected[0]} "
                              f"of {expected[1]}; load a pipeline with the same number of stages")
