"""torch process-pipeline checkpoints: each stage saves its part, loads take it back, a merge makes the full model's.

``save_stage_checkpoint`` writes, on the first rank of each stage's data-parallel group, that
stage's ``state_dict`` (the full model's keys), its optimizer's state, the progress and the RNG
states of the stage's ranks into ``{directory}/stage-{j}``, atomically through the core's
:class:`~dualframe.reliability.checkpoint.CheckpointDir`. ``load_stage_checkpoint`` takes every stage back at
the newest step all stages hold. The procedure is the core's (``dualframe.reliability.stage_checkpoint``);
this module gives its file format (``TorchStageCodec``). ``merge_stage_checkpoints`` joins
the parts into one file ``load_checkpoint`` loads into the unsplit ``nn.Sequential`` or a pipeline.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from dualframe.reliability.checkpoint import CheckpointError, TrainingState, atomic_write_bytes
from dualframe.reliability.stage_checkpoint import check_directory, load_stage, read_common, save_stage
from dualframe.torch.backend import BACKEND
from dualframe.torch.reliability.checkpoint import FORMAT, SUFFIX, from_bytes, load_checkpoint, rng_state, set_rng_state, to_bytes
from dualframe.torch.pipeline.distributed import DistributedPipeline


def _check(directory: Any, pipe: Any, optimizer: Any) -> str:
    path = check_directory(directory)
    if not isinstance(pipe, DistributedPipeline):
        raise CheckpointError(f"pipe must be a dualframe.torch.DistributedPipeline (pipe: {type(pipe).__name__})")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or None (optimizer: {type(optimizer).__name__})")
    return path


class TorchStageCodec:
    """A stage's ``torch.save`` file (the core's ``StageCodec``): its ``state_dict``, optimizer state and RNG states.

    Example:
        >>> save_stage(BACKEND, TorchStageCodec(pipe, optimizer), "ckpt", pipe, step=3)   # doctest: +SKIP
    """

    suffix = SUFFIX

    def __init__(self, pipe: DistributedPipeline, optimizer: Optional[torch.optim.Optimizer],
                 map_location: Any = "cpu") -> None:
        self.pipe, self.optimizer, self.map_location = pipe, optimizer, map_location
        self._states: Optional[Tuple[Dict[str, Any], Any]] = None

    def collect(self) -> None:
        """Take the stage's and its optimizer's state dicts now, on every rank: sharded among the stage's
        replicas (``shard=``), each is a collective of theirs, though only the stage's first rank writes."""
        self._states = (self.pipe.state_dict(), self.optimizer.state_dict() if self.optimizer is not None else None)

    def rng_bytes(self) -> bytes:
        return to_bytes(rng_state())

    def encode(self, header: Dict[str, Any], rngs: List[bytes]) -> bytes:
        assert self._states is not None, "save_stage calls collect() on every rank first"
        model, optimizer = self._states
        content = dict(header, format=FORMAT, data_position=json.dumps(header["data_position"]),
                       extra=json.dumps(header["extra"]), model=model, optimizer=optimizer,
                       rng=[from_bytes(blob) for blob in rngs])
        return to_bytes(content)

    def decode(self, data: bytes, where: str) -> Tuple[Dict[str, Any], List[Any], Any]:
        content = from_bytes(data, self.map_location)
        header = dict(content, data_position=json.loads(content["data_position"]), extra=json.loads(content["extra"]))
        return header, list(content.get("rng") or []), content

    def apply(self, content: Any) -> None:
        self.pipe.load_state_dict(content["model"])
        if self.optimizer is not None and content.get("optimizer") is not None:
            self.optimizer.load_state_dict(content["optimizer"])

    def set_rng(self, state: Any) -> None:
        set_rng_state(state)

    def load_merged(self, path: str) -> Optional[TrainingState]:
        return load_checkpoint(path, self.pipe, self.optimizer, restore_rng=False, map_location=self.map_location)


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
    path = _check(directory, pipe, optimizer)
    return save_stage(BACKEND, TorchStageCodec(pipe, optimizer), path, pipe, step=step, epoch=epoch,
                      data_position=data_position, extra=extra, keep=keep)


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
    return load_stage(BACKEND, TorchStageCodec(pipe, optimizer, map_location), path, pipe, restore_rng)


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
        CheckpointError: no common step, or two stages holding the same key with different values (a tied
            weight's copies are equal and merge into one entry per name).
    """
    output = check_directory(output)
    step, blobs = read_common(stages, SUFFIX)
    parts: List[Dict[str, Any]] = [from_bytes(blob) for blob in blobs]
    model: Dict[str, Any] = {}
    for j, part in enumerate(parts):
        # A tied weight: each holding stage has a copy, equal after every step; any other repeat is an error.
        overlap = sorted(key for key in set(model) & set(part["model"]) if not torch.equal(model[key], part["model"][key]))
        if overlap:
            raise CheckpointError(f"stage {j} repeats keys another stage holds, with other values (keys: {overlap[:5]})")
        model.update(part["model"])
    merged = {key: value for key, value in parts[0].items() if key not in ("stage", "stages")}
    merged.update(model=model, optimizer=None, rng=[], step=step)
    return atomic_write_bytes(output, to_bytes(merged))
