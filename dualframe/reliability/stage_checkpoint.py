"""Pipeline stage checkpoints, framework-neutral: one folder per stage, and the newest step every stage holds.

A process pipeline saves each stage's part into ``{directory}/stage-{j}`` (one writer per stage: the
first rank of the stage's data-parallel group), each folder a :class:`CheckpointDir` with its own
manifest. A job killed in the middle of a save can leave some stages one checkpoint ahead of others,
so loads and merges use the newest step that EVERY stage holds and that verifies, never each
folder's newest alone. This module owns the procedure (``save_stage``, ``load_stage``: folders,
steps, who writes, RNG gathering, barriers) over the adapter's ``Backend``; the adapters
(``dualframe.torch.reliability.stage_checkpoint``, ``dualframe.tensorflow.reliability.stage_checkpoint``) hand in a
``StageCodec`` that serialises the tensors.

Index names: ``j`` stage, ``n`` stages.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from dualframe.backend import Backend, StageCodec, StagePart
from dualframe.reliability.checkpoint import (CheckpointDir, CheckpointEntry, CheckpointError, TrainingState,
                                              check_json_values)

#: Name of stage j's folder inside a pipeline checkpoint folder.
STAGE_FOLDER = "stage-{j}"
#: Prefix of the Horovod operations of a stage checkpoint.
NAME = "dualframe.reliability.stage_checkpoint"
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


def writes(part: StagePart, rank: int) -> bool:
    """Whether ``rank`` writes and reads its stage's folder: the first rank of the stage's data-parallel group."""
    return rank == part.stage_ranks[0]


def save_stage(backend: "Backend[Any]", codec: StageCodec, directory: str, part: StagePart, *, step: int,
               epoch: int = 0, data_position: Any = None, extra: Optional[Dict[str, Any]] = None,
               keep: int = 3) -> Optional[str]:
    """Save stage ``part.stage_index`` at ``step``: every rank calls it, one rank per stage writes its file.

    Checks the step and the JSON values on every rank before any communication, gathers the RNG
    states of the stage's replicas, writes ``{directory}/stage-{j}`` atomically on the stage's first
    rank and ends with a barrier, so once any rank returns every stage's file of ``step`` is complete.

    Args:
        backend: the adapter's Backend; ``codec``: the stage's file format.
        directory: the pipeline checkpoint folder (checked by the adapter with ``check_directory``).
        part: the pipeline (its stage, stages, stage ranks and stage process set).

    Returns:
        The file this rank wrote, or None on ranks that do not write.

    Raises:
        CheckpointError: a bad step or a value that is not JSON, before any communication.
    """
    j = part.stage_index
    folder = CheckpointDir(stage_directory(directory, j), keep=keep, suffix=codec.suffix)
    folder.filename(step)  # validates step
    check_json_values(epoch=epoch, data_position=data_position, extra=extra)
    collectives = backend.collectives
    codec.collect()  # on every rank: only the writer encodes, but a sharded stage gathers among its replicas
    mine = codec.rng_bytes()
    rngs = collectives.gather_bytes(mine, f"{NAME}.rng", part.stage_process_set) \
        if part.stage_process_set is not None else [mine]
    path = None
    if writes(part, collectives.rank()):
        header = {"step": step, "epoch": epoch, "data_position": data_position, "extra": extra or {},
                  "stage": j, "stages": part.stages}
        path = folder.save(step, codec.encode(header, rngs), meta={"epoch": epoch, "stage": j})
    if collectives.size() > 1:  # nobody runs ahead while a stage is still writing
        collectives.barrier()
    return path


def load_stage(backend: "Backend[Any]", codec: StageCodec, directory: str, part: StagePart,
               restore_rng: bool = True) -> Optional[TrainingState]:
    """Load stage ``part.stage_index``'s file of the newest step all stages hold; every rank calls it.

    The ranks agree on the step (a save interrupted on some stages is skipped), the stage's first
    rank reads and verifies its file and hands it to the stage's other replicas; each rank loads it
    (``codec.apply``) and takes back its own RNG states. Given a file (a merged checkpoint; rank 0's
    view, shared with every rank), ``codec.load_merged`` takes the stage's part of it.

    Returns:
        The TrainingState (step, epoch, data_position, extra), or None when no stage holds a checkpoint.

    Raises:
        CheckpointError: stages without a common step, or a file of another stage or pipeline.
    """
    collectives = backend.collectives
    rank = collectives.rank()
    if root_sees_file(directory, rank, lambda data: backend.collectives.broadcast_bytes(data, 0, f"{NAME}.kind")):
        return codec.load_merged(directory)  # type: ignore[no-any-return]
    folder = CheckpointDir(stage_directory(directory, part.stage_index), suffix=codec.suffix)

    def gather(mine: Any) -> List[Any]:
        return collectives.allgather_object(mine, name=f"{NAME}.steps")

    step = agreed_step(folder, part.stage_index, part.stages, writes(part, rank), gather)
    if step is None:
        return None
    data = read_step(folder, step) if writes(part, rank) else None
    if part.stage_process_set is not None:
        data = backend.collectives.broadcast_bytes(data, part.stage_ranks[0], f"{NAME}.load", part.stage_process_set)
    header, states, content = codec.decode(data or b"", folder.directory)
    check_part((header.get("stage"), header.get("stages")), (part.stage_index, part.stages), folder.directory)
    codec.apply(content)
    if restore_rng and len(states) == len(part.stage_ranks):
        codec.set_rng(states[part.stage_ranks.index(rank)])
    return TrainingState(header["step"], header["epoch"], header["data_position"], header["extra"])
