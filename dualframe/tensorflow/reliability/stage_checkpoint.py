"""Keras 3 process-pipeline checkpoints: each stage saves its part, loads take it back, a merge makes the full model's.

The TensorFlow twin of ``dualframe.torch.reliability.stage_checkpoint``. Stage j's file, in
``{directory}/stage-{j}``, is an ``.npz`` in the Keras checkpoint format
(``dualframe.tensorflow.reliability.checkpoint``): the variables of the stage's layers (Dropout's seed
generators included) in the full model's order, the stage optimizer's variables, a JSON header and
the RNG states of the stage's ranks; written by the first rank of the stage's data-parallel group
through the core's :class:`~dualframe.reliability.checkpoint.CheckpointDir`. With virtual stages, j is the
rank's place in the pipeline and its file holds every stage the rank holds, each block's place in the
full model's variables in the header (``model_blocks``). ``merge_stage_checkpoints`` joins the parts
into one file that ``dualframe.tensorflow.keras.load_checkpoint`` loads into the full model.
"""
from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np

from dualframe.reliability.checkpoint import CheckpointError, TrainingState, atomic_write_bytes, read_newest
from dualframe.reliability.stage_checkpoint import NAME, check_directory, check_part, load_stage, read_common, save_stage
from dualframe.tensorflow.backend import BACKEND
from dualframe.tensorflow.collectives import collectives, hvd
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
from dualframe.tensorflow.reliability.checkpoint import FORMAT, SUFFIX, assign_variables, rng_state, set_rng_state

#: Path prefix of a sharded stage's optimizer arrays: the plain optimizer's ``variables`` values, in order.
STATE = "unsharded_state."


def _check(directory: Any, pipe: Any, optimizer: Any) -> str:
    path = check_directory(directory)
    if not isinstance(pipe, DistributedPipeline):
        raise CheckpointError(f"pipe must be a dualframe.tensorflow.DistributedPipeline (pipe: {type(pipe).__name__})")
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise CheckpointError(f"optimizer must be a keras.optimizers.Optimizer or None "
                              f"(optimizer: {type(optimizer).__name__})")
    if not all(layer.built for layer in pipe.layers):
        raise CheckpointError("the stage's layers are not built: give the keras.Sequential a keras.Input, or run a "
                              "step, before saving or loading a checkpoint")
    return path


def stage_variables(pipe: DistributedPipeline) -> List[Any]:
    """Every variable of the rank's stages' layers (weights and seed generators), stage by stage, each in the full
    model's ``variables`` order."""
    return [v for layer in pipe.layers for v in layer.variables]


def held_blocks(pipe: DistributedPipeline) -> List[List[int]]:
    """Per stage this rank holds, ``[offset, count]``: where its variables sit in the full model's ``variables``.

    One block per rank without virtual stages; with them (rank 0 of zb-v holds stages 0 and 3), the
    merge puts each block at its offset and a merged file's load takes each back from there.
    """
    counts = [len(stage.variables) for stage in pipe.all_layers]
    return [[sum(counts[:j]), counts[j]] for j in pipe.layer_indices]


def _snapshot(variables: Sequence[Any]) -> Tuple[List[str], List[np.ndarray]]:
    """The variables' paths and values."""
    return [v.path for v in variables], [np.asarray(v.numpy()) for v in variables]


def _encode(groups: Dict[str, Tuple[List[str], List[np.ndarray]]], header: Dict[str, Any], rngs: Sequence[Any]) -> bytes:
    """An ``.npz`` in the Keras checkpoint format: ``{group}.{i}`` arrays, the header with each group's paths, rng."""
    arrays: Dict[str, np.ndarray] = {"format": np.array(FORMAT)}
    for prefix, (paths, values) in groups.items():
        header[f"{prefix}_paths"] = list(paths)
        arrays.update((f"{prefix}.{i}", value) for i, value in enumerate(values))
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    arrays["rng"] = np.frombuffer(json.dumps(list(rngs)).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy stubs read **kwds as allow_pickle
    return buffer.getvalue()


def _decode(data: bytes, where: str) -> Tuple[Any, Dict[str, Any]]:
    try:
        arrays = np.load(io.BytesIO(data), allow_pickle=False)
        header, kind = json.loads(arrays["header"].tobytes()), str(arrays["format"])
    except Exception as error:  # not an npz, or one holding pickled objects
        raise CheckpointError(f"{where} is not a loadable dualframe Keras checkpoint ({error})") from None
    if kind != FORMAT:
        raise CheckpointError(f"{where} is not a dualframe Keras checkpoint (format must be {FORMAT!r})")
    return arrays, header


class KerasStageCodec:
    """A stage's ``.npz`` in the Keras checkpoint format (the core's ``StageCodec``): variables, optimizer, RNG states.

    Example:
        >>> save_stage(BACKEND, KerasStageCodec(pipe, optimizer), "ckpt", pipe, step=3)   # doctest: +SKIP
    """

    suffix = SUFFIX

    def __init__(self, pipe: DistributedPipeline, optimizer: Optional[keras.optimizers.Optimizer]) -> None:
        self.pipe, self.optimizer = pipe, optimizer
        #: A sharded stage's (``shard="parameters"``) variables and optimizer state, gathered by ``collect``.
        self._collected: Optional[Dict[str, Tuple[List[str], List[np.ndarray]]]] = None

    def rng_bytes(self) -> bytes:
        return json.dumps(rng_state()).encode()

    def collect(self) -> None:
        """A stage sharded among its replicas (``shard="parameters"``) gathers its values and optimizer state in
        the unsharded layout, on every rank (collectives of the replicas); other stages are whole on each."""
        sharded = self.pipe.sharded
        if sharded is None:
            return
        with sharded.gathered():
            model = _snapshot(stage_variables(self.pipe))
        saved = self.optimizer is not None and id(self.optimizer) == id(sharded)  # the stage's own, sharded
        state = sharded.state_arrays() if saved else []
        self._collected = {"model": model, "optimizer": ([f"{STATE}{i}" for i in range(len(state))], state)}

    def encode(self, header: Dict[str, Any], rngs: List[bytes]) -> bytes:
        optimizer = self.optimizer
        optimizer_variables = list(optimizer.variables) if optimizer is not None and optimizer.built else []
        groups = self._collected or {"model": _snapshot(stage_variables(self.pipe)),
                                     "optimizer": _snapshot(optimizer_variables)}
        return _encode(groups, dict(header, model_blocks=held_blocks(self.pipe)), [json.loads(blob) for blob in rngs])

    def decode(self, data: bytes, where: str) -> Tuple[Dict[str, Any], List[Any], Any]:
        arrays, header = _decode(data, where)
        return header, json.loads(arrays["rng"].tobytes()), (arrays, header)

    def apply(self, content: Any) -> None:
        arrays, header = content
        assign_variables("model", stage_variables(self.pipe), arrays, header["model_paths"])
        optimizer, sharded = self.optimizer, self.pipe.sharded
        if sharded is not None:  # this rank keeps its slices of the values (and of the state: unsharded layout)
            sharded.reload()
            if optimizer is not None and id(optimizer) == id(sharded) and header["optimizer_paths"]:
                sharded.load_state_arrays([arrays[f"optimizer.{i}"] for i in range(len(header["optimizer_paths"]))])
            return
        if optimizer is not None and header["optimizer_paths"]:
            if not optimizer.built:
                optimizer.build(self.pipe.trainable_variables)
            assign_variables("optimizer", list(optimizer.variables), arrays, header["optimizer_paths"])

    def set_rng(self, state: Any) -> None:
        set_rng_state(state)

    def load_merged(self, path: str) -> TrainingState:
        """Each stage takes its layers' variables from a merged full-model file (rank 0 reads it and broadcasts)."""
        pipe = self.pipe
        mine = read_newest(path, SUFFIX) if int(hvd.rank()) == 0 else None
        data = collectives.broadcast_bytes(mine, 0, f"{NAME}.merged")
        arrays, header = _decode(data, path)
        positions = [offset + i for offset, count in held_blocks(pipe) for i in range(count)]
        paths = header["model_paths"]
        if positions and positions[-1] >= len(paths):
            raise CheckpointError(f"{path} holds {len(paths)} model variables, this pipeline's stages "
                                  f"{pipe.held_stages} reach variable {positions[-1]}; is it this model's?")
        chosen = {f"model.{i}": arrays[f"model.{k}"] for i, k in enumerate(positions)}
        assign_variables("model", stage_variables(pipe), chosen, [paths[k] for k in positions])
        if pipe.sharded is not None:  # this rank keeps its slices of them (no communication)
            pipe.sharded.reload()
        return TrainingState(header["step"], header["epoch"], header["data_position"], header["extra"])


def save_stage_checkpoint(directory: str, pipe: DistributedPipeline, optimizer: Optional[keras.optimizers.Optimizer] = None,
                          *, step: int, epoch: int = 0, data_position: Any = None,
                          extra: Optional[Dict[str, Any]] = None, keep: int = 3) -> Optional[str]:
    """Save this pipeline's stages at ``step``: every rank calls it, one rank per stage writes its part.

    Stage j's file holds its layers' variables, ``optimizer``'s variables (the stage's: iterations,
    slots), ``step``, ``epoch``, ``data_position``, ``extra`` (JSON values) and the numpy/Python RNG
    states of the ranks holding stage j. The save ends with a barrier, so once any rank returns
    every stage's file of ``step`` is complete.

    Example:
        >>> hvd.save_stage_checkpoint("ckpt", pipe, optimizer, step=step,         # doctest: +SKIP
        ...                           data_position={"next_step": step + 1}, keep=2)

    Returns:
        The file this rank wrote, or None on ranks that do not write.

    Raises:
        CheckpointError: a bad argument, found on every rank before any communication or write.
    """
    path = _check(directory, pipe, optimizer)
    return save_stage(BACKEND, KerasStageCodec(pipe, optimizer), path, pipe, step=step, epoch=epoch,
                      data_position=data_position, extra=extra, keep=keep)


def load_stage_checkpoint(directory: str, pipe: DistributedPipeline, optimizer: Optional[keras.optimizers.Optimizer] = None,
                          *, restore_rng: bool = True) -> Optional[TrainingState]:
    """Load every stage's part of the newest step all stages hold; every rank calls it.

    The ranks agree on the step (a save interrupted on some stages is skipped), the first rank of
    each stage reads and verifies its part and hands it to the stage's other replicas; each rank
    assigns its stage's variables, ``optimizer``'s (building it on the stage's trainable variables
    first) and takes back its own numpy/Python RNG states. Every check of the file's shapes runs
    before any variable is assigned. Given a file (a merged checkpoint, ``merge_stage_checkpoints``),
    each stage takes its layers' variables from it (no optimizer state nor RNG there); whether
    ``directory`` is a file is rank 0's view, shared with every rank.

    Example:
        >>> state = hvd.load_stage_checkpoint("ckpt", pipe, optimizer)            # doctest: +SKIP
        >>> start = state.data_position["next_step"] if state else 0               # doctest: +SKIP

    Returns:
        The TrainingState (step, epoch, data_position, extra), or None when no stage holds a checkpoint.

    Raises:
        CheckpointError: a bad argument (before any communication), stages without a common step,
            or a part that does not fit this stage.
    """
    path = _check(directory, pipe, optimizer)
    state = load_stage(BACKEND, KerasStageCodec(pipe, optimizer), path, pipe, restore_rng)
    pipe.tied.broadcast()  # a tied layer's variables are saved once, by its first stage: its copies follow
    return state


def merge_stage_checkpoints(stages: Union[str, Sequence[str]], output: str) -> str:
    """Merge a pipeline's stage parts (the newest step all stages hold) into the full model's Keras checkpoint.

    The stages' variables, in stage order, are the full model's ``variables``; the output is a
    Keras checkpoint file (``.npz``) that ``dualframe.tensorflow.keras.load_checkpoint(output, model,
    restore_rng=False)`` loads into the unsplit model. Optimizer states and RNG stay in the stage
    files. One process, no Horovod.

    Example:
        >>> merge_stage_checkpoints("ckpt", "full.npz")                                  # doctest: +SKIP
        >>> hvd_keras.load_checkpoint("full.npz", model, restore_rng=False)               # doctest: +SKIP

    Args:
        stages: a pipeline checkpoint folder (``stage-0`` ... inside), or a list of stage folders in order.
        output: the merged file's path (written atomically).

    Raises:
        CheckpointError: no common step, or a part that is not a stage of the same pipeline.
    """
    output = check_directory(output)
    step, blobs = read_common(stages, SUFFIX)
    blocks: List[Tuple[int, List[str], List[np.ndarray]]] = []
    header: Dict[str, Any] = {}
    for j, blob in enumerate(blobs):
        arrays, header = _decode(blob, f"stage {j}")
        check_part((header.get("stage"), header.get("stages")), (j, len(blobs)), f"stage folder {j}")
        blocks += _blocks(arrays, header, sum(len(paths) for _, paths, _ in blocks))
    merged = {key: header[key] for key in ("epoch", "data_position", "extra")}
    merged["step"] = step
    return atomic_write_bytes(output, _encode({"model": _join(blocks), "optimizer": ([], [])}, merged, []))


def _blocks(arrays: Any, header: Dict[str, Any], before: int) -> List[Tuple[int, List[str], List[np.ndarray]]]:
    """A part's variables cut into its held stages' blocks ``(offset, paths, values)``; a part without
    ``model_blocks`` (one stage per rank) is one block after the parts before it."""
    paths = header["model_paths"]
    start, found = 0, []
    for offset, count in header.get("model_blocks", [[before, len(paths)]]):
        found.append((offset, paths[start:start + count], [arrays[f"model.{start + i}"] for i in range(count)]))
        start += count
    return found


def _join(blocks: List[Tuple[int, List[str], List[np.ndarray]]]) -> Tuple[List[str], List[np.ndarray]]:
    """The blocks in the full model's order, which they must cover exactly (no gap, no overlap)."""
    paths: List[str] = []
    values: List[np.ndarray] = []
    for offset, block_paths, block_values in sorted(blocks, key=lambda block: block[0]):
        if offset != len(paths):
            raise CheckpointError(f"the stages' variables do not join into one model (a block at variable {offset}, "
                                  f"{len(paths)} joined before it); are the stage folders of one pipeline?")
        paths += block_paths
        values += block_values
    return paths, values
