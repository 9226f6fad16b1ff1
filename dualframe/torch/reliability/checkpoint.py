"""torch checkpoints: rank 0 writes model, optimizer, progress and every rank's RNG atomically; loads broadcast.

Files are ``torch.save`` dictionaries of tensors and plain values, read back with
``torch.load(weights_only=True)``: loading never unpickles arbitrary objects. The folder, the atomic
write and keep-last-k are the core's :class:`dualframe.reliability.checkpoint.CheckpointDir`.
"""
from __future__ import annotations

import io
import json
import os
import random
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from dualframe.reliability.checkpoint import (CheckpointDir, CheckpointError, TrainingState,
                                  check_json_values, own_rng_state, read_newest)
from dualframe.torch.collectives import collectives, hvd

FORMAT = "dualframe-torch-checkpoint/1"
SUFFIX = ".pt"


def _distributed() -> bool:
    return bool(hvd.is_initialized()) and int(hvd.size()) > 1


def to_bytes(value: Any) -> bytes:
    """``value`` (tensors and plain values) as ``torch.save`` bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, map_location: Any = "cpu") -> Any:
    """What ``to_bytes`` made, read with ``weights_only=True`` (no arbitrary unpickling)."""
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def rng_state() -> Dict[str, Any]:
    """This process's torch, CUDA, numpy and Python RNG states, as tensors and plain values."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_common(directory: Any, model: Any, optimizer: Any, root_rank: Any) -> None:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise CheckpointError(f"directory must be a path (directory: {directory!r})")
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"model must be a torch.nn.Module (model: {type(model).__name__})")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or None (optimizer: {type(optimizer).__name__})")
    size = int(hvd.size()) if hvd.is_initialized() else 1
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise CheckpointError(f"root_rank must be a rank in [0, {size}) (root_rank: {root_rank!r})")


def save_checkpoint(directory: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, step: int, epoch: int = 0, data_position: Any = None, extra: Optional[Dict[str, Any]] = None,
                    keep: int = 3, root_rank: int = 0, writer: Optional[bool] = None) -> Optional[str]:
    """Save a checkpoint of ``step``; every rank calls it, rank ``root_rank`` writes.

    The file holds the model's and optimizer's ``state_dict``, ``step``, ``epoch``, ``data_position``
    and ``extra`` (JSON values: where the data loader stands), and every rank's RNG states (so each
    rank resumes its own random stream). It is written atomically into ``directory`` and only the
    newest ``keep`` checkpoints stay.

    Example:
        >>> save_checkpoint("ckpt", model, optimizer, step=step, epoch=epoch,   # doctest: +SKIP
        ...                 data_position={"batch": i})

    Args:
        writer: whether this rank writes (default: rank == root_rank). Pipeline stages pass their
            own ``directory`` (one per stage) and ``writer=True`` on one rank of each stage.

    Returns:
        The file written by this rank, or None on ranks that do not write.

    Raises:
        CheckpointError: a bad argument, found on every rank before any communication or write.
    """
    _check_common(directory, model, optimizer, root_rank)
    folder = CheckpointDir(os.fspath(directory), keep=keep, suffix=SUFFIX)
    folder.filename(step)  # validates step
    check_json_values(epoch=epoch, data_position=data_position, extra=extra)
    rngs = collectives.gather_bytes(to_bytes(rng_state()), "dualframe.reliability.checkpoint.rng")
    writes = (hvd.rank() if hvd.is_initialized() else 0) == root_rank if writer is None else writer
    path = None
    if writes:
        content = {
            "format": FORMAT, "step": step, "epoch": epoch, "data_position": json.dumps(data_position),
            "extra": json.dumps(extra or {}), "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": [from_bytes(blob) for blob in rngs],
        }
        path = folder.save(step, to_bytes(content), meta={"epoch": epoch})
    if _distributed():  # nobody runs ahead of a save in progress
        hvd.broadcast(torch.zeros(1), root_rank, name="dualframe.reliability.checkpoint.saved")
    return path



def load_checkpoint(directory: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, root_rank: int = 0, restore_rng: bool = True, map_location: Any = "cpu",
                    strict: bool = True) -> Optional[TrainingState]:
    """Load the newest checkpoint of ``directory`` (or the file ``directory``) on every rank.

    Rank ``root_rank`` reads and verifies the file and broadcasts its bytes; every rank then loads
    the model and optimizer state and, when the job has as many ranks as the one that saved, its own
    RNG states. Every rank calls it.

    Example:
        >>> state = load_checkpoint("ckpt", model, optimizer)   # doctest: +SKIP
        >>> start = state.step + 1 if state else 0               # doctest: +SKIP

    Returns:
        The TrainingState (step, epoch, data_position, extra), or None when there is no checkpoint.

    Raises:
        CheckpointError: a bad argument, a corrupt file, or a file that is not a dualframe checkpoint.
    """
    _check_common(directory, model, optimizer, root_rank)
    rank = int(hvd.rank()) if hvd.is_initialized() else 0
    data = read_newest(os.fspath(directory), SUFFIX) if rank == root_rank else None
    data = collectives.broadcast_bytes(data, root_rank, "dualframe.reliability.checkpoint.load")
    if not data:
        return None
    try:
        content = from_bytes(data, map_location)
    except Exception as error:  # torch refuses anything but tensors and plain values
        raise CheckpointError(f"{directory} is not a loadable dualframe torch checkpoint ({error})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a dualframe torch checkpoint (format must be {FORMAT!r})")
    model.load_state_dict(content["model"], strict=strict)
    if optimizer is not None and content.get("optimizer") is not None:
        optimizer.load_state_dict(content["optimizer"])
    _restore_rng(content.get("rng") or [], rank, restore_rng)
    return TrainingState(content["step"], content["epoch"], json.loads(content["data_position"]),
                         json.loads(content["extra"]))


def _restore_rng(states: Sequence[Dict[str, Any]], rank: int, restore: bool) -> None:
    if not restore or not states:
        return
    own = own_rng_state(list(states), rank, int(hvd.size()) if hvd.is_initialized() else 1)
    if own is not None:
        set_rng_state(own)
