"""torch process-pipeline checkpoints: each stage saves its part, loads take it back, a merge makes the full model's.

``save_stage_checkpoint`` writes, on the first rank of each stage's data-parallel group, that
stage's ``state_dict`` (the full model's keys), its optimizer's state, the progress and the RNG
states of the stage's ranks into ``{directory}/stage-{j}``, atomically through the core's
:class:`~dualframe.reliability.checkpoint.CheckpointDir`. ``load_stage_checkpoint`` takes every stage back at
the newest step all stages hold (``dualframe.reliability.stage_checkpoint``). ``merge_stage_checkpoints`` joins
the parts into one file ``load_checkpoint`` loads into the unsplit ``nn.Sequential`` or a pipeline.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from dualframe.reliability.checkpoint import CheckpointDir, CheckpointError, TrainingState, atomic_write_bytes, check_json_values
from dualframe.reliability.stage_checkpoint import (agreed_step, check_directory, check_part, read_common, read_step,
                                        root_sees_file, stage_directory)
from dualframe.torch.checkpoint import (FORMAT, SUFFIX, _broadcast_bytes, _from_bytes, _gather_bytes, _to_bytes,
                                        load_checkpoint, rng_state, set_rng_state)
from dualframe.torch.collectives import hvd
from dualframe.torch.distributed_pipeline import DistributedPipeline


def _check(directory: Any, pipe: Any, optimizer: Any) -> str:
    path = check_directory(directory)
    if not isinstance(pipe, DistributedPipeline):
        raise CheckpointError(f"pipe must be a dualframe.torch.DistributedPipeline (pipe: {type(pipe).__name__})")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or None (optimizer: {type(optimizer).__name__})")
    return path


def _writes(pipe: DistributedPipeline) -> bool:
    """The first rank of the stage's data-parallel group writes and reads the stage's folder."""
    return int(hvd.rank()) == pipe.stage_ranks[0]


def save_stage_checkpoint(directory: str, pipe: DistributedPipeline, optimizer: Optional[torch.optim.Optimizer] = None,
                          *, step: int, epoch: int = 0, data_position: Any = None,
                          extra: Optional[Dict[str, Any]] = None, keep: int = 3) -> Optional[str]:
    """Save this pipeline's stages at ``step``: every rank calls it, one rank per stage writes its part.

    Stage j's file, in ``{directory}/stage-{j}``, holds the stage's ``state_dict`` under the full
    model's keys, ``optimizer``'s state (the stage's), ``step``, ``epoch``, ``data_position``,
    ``extra`` (JSON values) and the RNG states of the ranks holding stage j. The save ends with a
    barrier, so once any rank returns every stage's file of ``step`` is complete.

    Example:
        >>> hvd.save_stage_checkpoint("ckpt", pipe, optimizer, step=step,          # doctest: +SKIP
        ...                           data_position={"next_step": step + 1}, keep=2)

    Returns:
        The file this rank wrote, or None on ranks that do not write.

    Raises:
        CheckpointError: a bad argument, found on every rank before any communication or write.
    """
    folder = CheckpointDir(stage_directory(_check(directory, pipe, optimizer), pipe.stage_index), keep=keep,
                           suffix=SUFFIX)
    folder.filename(step)  # validates step
    check_json_values(epoch=epoch, data_position=data_position, extra=extra)
    rngs = _gather_bytes(_to_bytes(rng_state()), "dualframe.reliability.stage_checkpoint.rng", pipe.stage_process_set) \
        if pipe.stage_process_set is not None else [_to_bytes(rng_state())]
    path = None
    if _writes(pipe):
        content = {
            "format": FORMAT, "step": step, "epoch": epoch, "data_position": json.dumps(data_position),
            "extra": json.dumps(extra or {}), "model": pipe.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": [_from_bytes(blob) for blob in rngs], "stage": pipe.stage_index, "stages": pipe.stages,
        }
        path = folder.save(step, _to_bytes(content), meta={"epoch": epoch, "stage": pipe.stage_index})
    if int(hvd.size()) > 1:  # nobody runs ahead while a stage is still writing
        hvd.broadcast(torch.zeros(1), 0, name="dualframe.reliability.stage_checkpoint.saved")
    return path


def _agreed_step(pipe: DistributedPipeline, folder: CheckpointDir) -> Optional[int]:
    """The newest step every stage's folder holds, the same on every rank (one allgather of step lists)."""
    def gather(mine: Any) -> List[Any]:
        return list(hvd.allgather_object(mine, name="dualframe.reliability.stage_checkpoint.steps")) if int(hvd.size()) > 1 else [mine]

    return agreed_step(folder, pipe.stage_index, pipe.stages, _writes(pipe), gather)


def load_stage_checkpoint(directory: str, pipe: DistributedPipeline, optimizer: Optional[torch.optim.Optimizer] = None,
                          *, restore_rng: bool = True, map_location: Any = "cpu") -> Optional[TrainingState]:
    """Load every stage's part of the newest step all stages hold; every rank calls it.

    The ranks agree on the step (a save interrupted on some stages is skipped), the first rank of
    each stage reads and verifies its part and hands it to the stage's other replicas; each rank
    loads its stage's tensors, ``optimizer``'s state and its own RNG states. Given a file (a merged
    checkpoint, ``merge_stage_checkpoints``), each stage takes its part of the full model's tensors
    (``load_checkpoint``; no optimizer state nor RNG there). Whether ``directory`` is a file is
    rank 0's view, shared with every rank.

    Example:
        >>> state = hvd.load_stage_checkpoint("ckpt", pipe, optimizer)            # doctest: +SKIP
        >>> start = state.data_position["next_step"] if state else 0               # doctest: +SKIP

    Returns:
        The TrainingState (step, epoch, data_position, extra), or None when no stage holds a checkpoint.

    Raises:
        CheckpointError: a bad argument (before any communication), stages without a common step,
            or a part of a pipeline with another number of stages.
    """
    path = _check(directory, pipe, optimizer)
    if root_sees_file(path, int(hvd.rank()), lambda data: _broadcast_bytes(data, 0, "dualframe.reliability.stage_checkpoint.kind")):
        return load_checkpoint(path, pipe, optimizer, restore_rng=False, map_location=map_location)
    folder = CheckpointDir(stage_directory(path, pipe.stage_index), suffix=SUFFIX)
    step = _agreed_step(pipe, folder)
    if step is None:
        return None
    data = read_step(folder, step) if _writes(pipe) else None
    if pipe.stage_process_set is not None:
        data = _broadcast_bytes(data, pipe.stage_ranks[0], "dualframe.reliability.stage_checkpoint.load", pipe.stage_process_set)
    content = _from_bytes(data or b"", map_location)
    check_part((content.get("stage"), content.get("stages")), (pipe.stage_index, pipe.stages), folder.directory)
    pipe.load_state_dict(content["model"])
    if optimizer is not None and content.get("optimizer") is not None:
        optimizer.load_state_dict(content["optimizer"])
    states = content.get("rng") or []
    if restore_rng and len(states) == len(pipe.stage_ranks):
        set_rng_state(states[pipe.stage_ranks.index(int(hvd.rank()))])
    return TrainingState(content["step"], content["epoch"], json.loads(content["data_position"]),
                         json.loads(content["extra"]))


def merge_stage_checkpoints(stages: Union[str, Sequence[str]], output: str) -> str:
    """Merge a pipeline's stage parts (the newest step all stages hold) into the full model's checkpoint file.

    Each stage's ``state_dict`` uses the full model's keys, so the parts join into the full model's
    ``state_dict``; ``load_checkpoint(output, model)`` loads it into the unsplit ``nn.Sequential``
    (or a pipeline). Optimizer states and RNG stay in the stage files. One process, no Horovod.

    Example:
        >>> merge_stage_checkpoints("ckpt", "full.pt")                 # doctest: +SKIP
        >>> hvd.load_checkpoint("full.pt", nn.Sequential(...))          # doctest: +SKIP

    Args:
        stages: a pipeline checkpoint folder (``stage-0`` ... inside), or a list of stage folders in order.
        output: the merged file's path (written atomically).

    Raises:
        CheckpointError: no common step, or two stages holding the same key.
    """
    output = check_directory(output)
    step, blobs = read_common(stages, SUFFIX)
    parts: List[Dict[str, Any]] = [_from_bytes(blob) for blob in blobs]
    model: Dict[str, Any] = {}
    for j, part in enumerate(parts):
        overlap = sorted(set(model) & set(part["model"]))
        if overlap:
            raise CheckpointError(f"stage {j} repeats keys another stage holds (keys: {overlap[:5]})")
        model.update(part["model"])
    merged = {key: value for key, value in parts[0].items() if key not in ("stage", "stages")}
    merged.update(model=model, optimizer=None, rng=[], step=step)
    return atomic_write_bytes(output, _to_bytes(merged))
