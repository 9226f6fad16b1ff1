"""Keras 3 checkpoints: rank 0 writes model, optimizer, progress and every rank's RNG atomically; loads broadcast.

A checkpoint is an ``.npz`` of arrays (every model variable, Dropout's seed generators included,
every optimizer variable, a JSON header, every rank's numpy, Python and TensorFlow global-generator
RNG states) read back with ``np.load(allow_pickle=False)``: loading never unpickles arbitrary objects.
The folder, the atomic write and keep-last-k are the core's :class:`dualframe.reliability.checkpoint.CheckpointDir`.

Not saved, for want of a public API: the state behind TensorFlow's stateful op-level random ops
(``tf.random.uniform`` without a ``Generator``, ``Dataset.shuffle``) and Keras's global
``SeedGenerator`` (``keras.random.*`` called without a seed). Draw from ``tf.random.get_global_generator()``
or a layer's own ``keras.random.SeedGenerator`` (a model variable) for an exact resume.
"""
from __future__ import annotations

import io
import json
import os
import random
from typing import Any, Dict, List, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf

from dualframe.reliability.checkpoint import (CheckpointDir, CheckpointError, TrainingState, check_json_values, own_rng_state,
                                  read_newest)
from dualframe.tensorflow.collectives import collectives, hvd
from dualframe.tensorflow.reliability.failure import eager_guard, guard_train_function

FORMAT = "dualframe-keras-checkpoint/1"
SUFFIX = ".npz"


def _distributed() -> bool:
    return bool(hvd.is_initialized()) and int(hvd.size()) > 1


def _rank() -> int:
    return int(hvd.rank()) if hvd.is_initialized() else 0


def _size() -> int:
    return int(hvd.size()) if hvd.is_initialized() else 1


def rng_state() -> Dict[str, Any]:
    """This process's numpy, Python and TensorFlow global-generator RNG states as JSON values."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, py_gauss = random.getstate()
    generator = tf.random.get_global_generator()
    return {"numpy": {"keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                      "gauss": float(gauss)},
            "python": {"version": int(version), "state": list(state), "gauss": py_gauss},
            "tensorflow": {"algorithm": int(generator.algorithm), "state": [int(v) for v in generator.state.numpy()]}}


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    numpy = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(numpy["keys"], dtype=np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "tensorflow" in state:  # checkpoints written before it was saved have none
        _set_global_generator(state["tensorflow"]["algorithm"], state["tensorflow"]["state"])


def _set_global_generator(algorithm: int, values: Sequence[int]) -> None:
    # Reset in place: tf.functions and datasets that captured the global generator keep drawing from it.
    generator = tf.random.get_global_generator()
    saved = np.asarray(values, dtype=np.int64)
    if int(generator.algorithm) == algorithm and tuple(generator.state.shape) == saved.shape:
        generator.reset(saved)
    else:
        tf.random.set_global_generator(tf.random.Generator.from_state(saved, algorithm))


def _check_common(directory: Any, model: Any, root_rank: Any) -> None:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise CheckpointError(f"directory must be a path (directory: {directory!r})")
    if not isinstance(model, keras.Model):
        raise CheckpointError(f"model must be a keras.Model (model: {type(model).__name__})")
    if not model.built:
        raise CheckpointError(f"model {model.name!r} is not built: build it (an Input, or model.build) before "
                              "saving or loading a checkpoint")
    if getattr(getattr(model, "optimizer", None), "shard", None) == "parameters":
        raise CheckpointError("a shard='parameters' (ZeRO-3) model holds no values in its variables; save it with "
                              "model.save_weights (every rank calls) and load it with model.load_weights")
    size = _size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise CheckpointError(f"root_rank must be a rank in [0, {size}) (root_rank: {root_rank!r})")


def _optimizer_variables(model: keras.Model, build: bool) -> List[Any]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not optimizer.built:
        if not build:
            return []
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


def _optimizer_state(model: keras.Model) -> "tuple[List[str], List[np.ndarray]]":
    """(paths, values) of the optimizer's state; a sharded optimizer's is gathered (every rank calls this)."""
    optimizer: Any = getattr(model, "optimizer", None)
    if hasattr(optimizer, "state_arrays") and optimizer.built:
        # The plain optimizer's layout (non-slot variables, then each variable's slots), loadable without sharding.
        values = optimizer.state_arrays()
        return [f"{optimizer.name}/{i}" for i in range(len(values))], values
    variables = _optimizer_variables(model, False)
    return [v.path for v in variables], [np.asarray(v.numpy()) for v in variables]


def _encode(model: keras.Model, header: Dict[str, Any], rngs: Sequence[bytes],
            optimizer_state: "tuple[List[str], List[np.ndarray]]") -> bytes:
    arrays: Dict[str, np.ndarray] = {"format": np.array(FORMAT)}
    model_state = ([v.path for v in model.variables], [np.asarray(v.numpy()) for v in model.variables])
    for prefix, (paths, values) in (("model", model_state), ("optimizer", optimizer_state)):
        header[f"{prefix}_paths"] = paths
        for i, value in enumerate(values):
            arrays[f"{prefix}.{i}"] = value
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    arrays["rng"] = np.frombuffer(json.dumps([json.loads(r) for r in rngs]).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy stubs read **kwds as allow_pickle
    return buffer.getvalue()


def save_checkpoint(directory: str, model: keras.Model, *, step: int, epoch: int = 0, data_position: Any = None,
                    extra: Optional[Dict[str, Any]] = None, keep: int = 3, root_rank: int = 0) -> Optional[str]:
    """Save a checkpoint of ``step``; every rank calls it, rank ``root_rank`` writes.

    The file holds the model's variables (Dropout's seed generators included), its optimizer's
    variables (iterations, slots), ``step``, ``epoch``, ``data_position``, ``extra`` (JSON values) and
    every rank's numpy, Python and TensorFlow global-generator RNG states. It is written atomically;
    the newest ``keep`` stay.

    Example:
        >>> save_checkpoint("ckpt", model, step=int(model.optimizer.iterations), epoch=3)  # doctest: +SKIP

    Returns:
        The file written by this rank, or None on the others.

    Raises:
        CheckpointError: a bad argument, found on every rank before any communication or write.
    """
    _check_common(directory, model, root_rank)
    folder = CheckpointDir(os.fspath(directory), keep=keep, suffix=SUFFIX)
    folder.filename(step)  # validates step
    check_json_values(epoch=epoch, data_position=data_position, extra=extra)
    rngs = collectives.gather_bytes(json.dumps(rng_state()).encode(), "dualframe.keras_checkpoint.rng")
    optimizer_state = _optimizer_state(model)
    path = None
    if _rank() == root_rank:
        header = {"step": step, "epoch": epoch, "data_position": data_position, "extra": extra or {}}
        path = folder.save(step, _encode(model, header, rngs, optimizer_state), meta={"epoch": epoch})
    if _distributed():  # nobody runs ahead of a save in progress
        with eager_guard("dualframe.keras_checkpoint.saved"):
            hvd.broadcast(tf.zeros([1]), root_rank, name="dualframe.keras_checkpoint.saved")
    return path



def assign_variables(what: str, variables: Sequence[Any], arrays: Any, paths: Sequence[str]) -> None:
    """Assign ``arrays[f"{what}.{i}"]`` to ``variables``, every count and shape checked before the first assignment."""
    if len(variables) != len(paths):
        raise CheckpointError(f"the checkpoint holds {len(paths)} {what} variables, this model has {len(variables)} "
                              f"(checkpoint: {list(paths)[:4]}..., model: {[v.path for v in variables][:4]}...)")
    for i, variable in enumerate(variables):
        value = arrays[f"{what}.{i}"]
        if tuple(value.shape) != tuple(variable.shape):
            raise CheckpointError(f"{what} variable {variable.path!r} has shape {tuple(variable.shape)}, the "
                                  f"checkpoint's {paths[i]!r} has {tuple(value.shape)}")
    for i, variable in enumerate(variables):
        variable.assign(arrays[f"{what}.{i}"])


def load_checkpoint(directory: str, model: keras.Model, *, root_rank: int = 0,
                    restore_rng: bool = True) -> Optional[TrainingState]:
    """Load the newest checkpoint of ``directory`` (or the file ``directory``) into ``model`` on every rank.

    Rank ``root_rank`` reads and verifies the file and broadcasts its bytes; every rank assigns the
    model's and (after building it) the optimizer's variables and, when the job has as many ranks
    as the one that saved, takes back its own RNG states. Compile the model first.

    Example:
        >>> state = load_checkpoint("ckpt", model)                                  # doctest: +SKIP
        >>> model.fit(x, y, epochs=10, initial_epoch=state.epoch if state else 0)   # doctest: +SKIP

    Returns:
        The TrainingState (step, epoch, data_position, extra), or None when there is no checkpoint.

    Raises:
        CheckpointError: a bad argument, a corrupt file, or one that does not fit this model.
    """
    _check_common(directory, model, root_rank)
    data = read_newest(os.fspath(directory), SUFFIX) if _rank() == root_rank else None
    data = collectives.broadcast_bytes(data, root_rank, "dualframe.keras_checkpoint.load")
    if not data:
        return None
    try:
        arrays = np.load(io.BytesIO(data), allow_pickle=False)
        header = json.loads(arrays["header"].tobytes())
        kind = str(arrays["format"])
    except Exception as error:  # not an npz, or one holding pickled objects
        raise CheckpointError(f"{directory} is not a loadable dualframe Keras checkpoint ({error})") from None
    if kind != FORMAT:
        raise CheckpointError(f"{directory} is not a dualframe Keras checkpoint (format must be {FORMAT!r})")
    assign_variables("model", list(model.variables), arrays, header["model_paths"])
    optimizer: Any = getattr(model, "optimizer", None)
    if header["optimizer_paths"] and hasattr(optimizer, "load_state_arrays"):  # sharded: each rank takes its slices
        _optimizer_variables(model, True)
        optimizer.load_state_arrays([arrays[f"optimizer.{i}"] for i in range(len(header["optimizer_paths"]))])
    elif header["optimizer_paths"]:
        assign_variables("optimizer", _optimizer_variables(model, True), arrays, header["optimizer_paths"])
    own = own_rng_state(json.loads(arrays["rng"].tobytes()), _rank(), _size()) if restore_rng else None
    if own is not None:
        set_rng_state(own)
    return TrainingState(header["step"], header["epoch"], header["data_position"], header["extra"])


class CheckpointCallback(keras.callbacks.Callback):
    """Save a checkpoint at every epoch's end (or every ``save_freq`` batches) during ``fit``.

    Give it to ``fit`` on EVERY rank (it gathers the ranks' RNG states; rank ``root_rank`` writes).
    The step is the optimizer's ``iterations``; ``data_position`` is ``{"epoch": e, "batch": b}``,
    the next batch to train, and ``epoch`` the next epoch: resume with ``initial_epoch=state.epoch``.

    Example:
        >>> state = hvd.load_checkpoint("ckpt", model)                        # doctest: +SKIP
        >>> model.fit(x, y, epochs=10, initial_epoch=state.epoch if state else 0,   # doctest: +SKIP
        ...           callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        ...                      hvd.CheckpointCallback("ckpt", keep=3)])

    Args:
        directory: the checkpoint folder.
        keep: how many checkpoints to keep.
        save_freq: ``"epoch"`` or a number of batches.
        root_rank: the rank that writes.
    """

    def __init__(self, directory: str, keep: int = 3, save_freq: Union[str, int] = "epoch",
                 root_rank: int = 0) -> None:
        super().__init__()
        CheckpointDir(os.fspath(directory) if isinstance(directory, (str, os.PathLike)) else directory, keep=keep)
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise CheckpointError(f"save_freq must be 'epoch' or an int >= 1 (save_freq: {save_freq!r})")
        self.directory, self.keep, self.save_freq, self.root_rank = directory, keep, save_freq, root_rank
        self.epoch = 0

    def _save(self, epoch: int, position: Dict[str, int]) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        step = int(optimizer.iterations.numpy()) if optimizer is not None else position["batch"]
        save_checkpoint(self.directory, self.model, step=step, epoch=epoch, data_position=position,
                        keep=self.keep, root_rank=self.root_rank)

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        guard_train_function(self.model)  # a stalled step ends the job (DUALFRAME_STALL_TIMEOUT)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.save_freq != "epoch" and (batch + 1) % int(self.save_freq) == 0:
            self._save(self.epoch, {"epoch": self.epoch, "batch": batch + 1})

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, {"epoch": epoch + 1, "batch": 0})
