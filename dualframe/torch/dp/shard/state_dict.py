"""A sharded optimizer's state as the unsharded optimizer's state dict: gathered from the slices, scattered back.

A state entry of a flat slice is either per element (``exp_avg``, ``momentum_buffer`` ...: as many
elements as the slice) or a scalar shared by the bucket's parameters (``step``, ASGD's ``eta`` and
``mu``). Per-element entries are allgathered into the bucket's flat buffer and cut per parameter;
scalars are copied to each parameter. Loading does the reverse for the current number of ranks, so a
dict saved at one size (or by a plain optimizer) loads at another.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from dualframe.torch.dp import checks as dp_checks
from dualframe.torch.collectives import hvd

if TYPE_CHECKING:
    from dualframe.torch.dp.shard.optimizer import ShardedOptimizer

#: State keys that hold one value for the whole tensor even when the tensor has a single element.
SCALAR_STATE = frozenset({"step", "eta", "mu"})


def _per_element(key: str, value: Any, elements: int) -> bool:
    return isinstance(value, torch.Tensor) and key not in SCALAR_STATE and value.numel() == elements


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _index(optimizer: "ShardedOptimizer") -> Dict[torch.Tensor, int]:
    # torch numbers parameters across groups in order: the plain optimizer's state_dict keys.
    return {p: i for i, p in enumerate(dp_checks.optimizer_params(optimizer.optimizer))}


def gather(optimizer: "ShardedOptimizer") -> Dict[str, Any]:
    """The full state dict, on every rank of the process set (one allgather per bucket and state entry)."""
    index = _index(optimizer)
    state: Dict[int, Dict[str, Any]] = {}
    for slot in optimizer._slots:
        own = optimizer.inner.state.get(slot.flat, {})
        for key in sorted(own):  # every rank steps every slice: the same keys everywhere, in this order
            value = own[key]
            if _per_element(key, value, slot.flat.numel()):
                full = hvd.allgather(value.detach().reshape(-1), name=f"dualframe.shard.state.{slot.name}.{key}",
                                     process_set=optimizer.process_set)
                parts: Dict[torch.Tensor, torch.Tensor] = {}
                slot.gather_into(full, parts)
                for p, part in parts.items():
                    state.setdefault(index[p], {})[key] = part.clone()
            else:
                for p in slot.members:
                    state.setdefault(index[p], {})[key] = _copy(value)
    groups = []
    for group in optimizer.optimizer.param_groups:
        packed = {k: _copy(v) for k, v in group.items() if k != "params"}
        packed["params"] = [index[p] for p in group["params"]]
        groups.append(packed)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def scatter(optimizer: "ShardedOptimizer", state_dict: Dict[str, Any]) -> None:
    """Set the inner optimizer's state to this rank's slice of a full ``state_dict`` (no communication)."""
    index = _index(optimizer)
    states = state_dict.get("state", {})
    for slot in optimizer._slots:
        found: List[Optional[Dict[str, Any]]] = [states.get(index[p]) for p in slot.members]
        keys = next((list(entry) for entry in found if entry), None)
        if keys is None:
            continue
        own: Dict[str, Any] = {}
        for key in keys:
            p, sample = next((p, entry[key]) for p, entry in zip(slot.members, found) if entry and key in entry)
            if not _per_element(key, sample, p.numel()):
                own[key] = _copy(sample)
                continue
            flat = torch.zeros(slot.bucket.padded, dtype=sample.dtype, device=slot.flat.device)
            for member, offset, size, entry in zip(slot.members, slot.bucket.offsets, slot.bucket.sizes, found):
                if entry and key in entry:
                    flat[offset:offset + size].copy_(entry[key].reshape(-1))
            own[key] = flat[slot.start:slot.start + slot.bucket.shard].clone()
        optimizer.inner.state[slot.flat] = own
