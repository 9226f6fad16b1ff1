"""ZeRO-3 for torch: ``DistributedOptimizer(..., shard="parameters", model=model)`` keeps 1/N of the parameters per rank.

The core's ``dualframe.dp.zero3`` picks the blocks (the root, and each module reached from it through
``Sequential``/``ModuleList``/``ModuleDict`` only) and cuts each block's parameters among the ranks
of the process set. Here each block's parameters become views of flat buffers whose storage is
freed between uses (``shard_blocks.BlockGather``); the rank keeps its slice of each buffer as a
parameter of the inner optimizer. In backward, as soon as a block's gradients are all accumulated
they are reduced into the owners' slices (``shard_gradients``, every backward pass) and the block is
freed; ``step()`` updates the slices only: the next forward gathers them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from dualframe.dp.precision import SlicePrecision
from dualframe.dp.shard import check_shard
from dualframe.dp.zero3 import ZERO3, ParameterShardPlan, block_paths, check_keep_gathered, check_unshared
from dualframe.errors import StrategyError
from dualframe.torch.collectives import hvd
from dualframe.torch.dp.shard.blocks import BlockGather, BlockRun
from dualframe.torch.dp.shard.buckets import Slot, adopt, make_inner, master_slice, precision_of
from dualframe.torch.dp.shard.optimizer import ShardedOptimizer

#: Modules that only hold other modules: a block is found below them, never at them.
CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def check_model(model: object, optimizer: torch.optim.Optimizer) -> Dict[int, str]:
    """Each optimizer parameter's name in ``model`` (by id), refusing what ZeRO-3 cannot shard, before communication.

    Raises:
        StrategyError: no model, a parameter held by two modules, an optimizer parameter not in the model.
    """
    if not isinstance(model, torch.nn.Module):
        raise StrategyError(
            f"shard='parameters' gathers each block's parameters in the model's forward hooks, so it needs the model "
            f"(model: {type(model).__name__}); DistributedOptimizer(opt, model.named_parameters(), "
            f"shard='parameters', model=model)")
    holders: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    check_unshared({names[0]: names for names in holders.values()})
    names = {key: value[0] for key, value in holders.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in names:
                raise StrategyError(f"shard='parameters' shards the model's parameters; the optimizer holds one that "
                                    f"is not in the model (shape {tuple(p.shape)}); give it model.parameters()")
    return names


def own_slice(view: torch.Tensor, precision: SlicePrecision) -> torch.nn.Parameter:
    """The slice a rank keeps of a block's buffer: an fp32 master for float16/bfloat16 weights, else a copy.

    A copy, not a view: the buffer's storage is freed between uses, the slice is not.
    """
    return master_slice(view, precision) if precision.has_master else torch.nn.Parameter(view.detach().clone())


class ParameterShardedOptimizer(ShardedOptimizer):
    """``DistributedOptimizer(..., shard="parameters", model=model)``: parameters, gradients and optimizer state 1/N per rank.

    Built by ``DistributedOptimizer`` when ``shard="parameters"``; the other arguments are those of
    ``ShardedOptimizer`` (``clip_grad_norm_``, ``state_dict()`` of the optimizer in the unsharded
    format). Between steps the model's parameters hold no memory: use ``model_state_dict()`` (a
    collective) and ``load_model_state_dict()`` for checkpoints, not ``model.state_dict()``.
    ``backward_passes_per_step`` reduces every pass into the slices (the sum is the same).
    ``keep_gathered=k`` (default 1): from the second step on, the last ``k`` blocks of the forward stay
    gathered until their backward instead of being freed and gathered again (each costs its full
    size in memory meanwhile; 0: every block freed after its forward).

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters(),
        ...                                shard="parameters", model=model)                     # doctest: +SKIP
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()                      # doctest: +SKIP
        >>> full = opt.model_state_dict()   # every rank calls it; torch.save on rank 0        # doctest: +SKIP

    Raises:
        StrategyError: as ``ShardedOptimizer``, and: no ``model``, parameters shared between modules,
            optimizer parameters outside the model, elastic Horovod (all before any communication).
    """

    _allow = False  # model.state_dict() allowed (inside model_state_dict, every block gathered)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *args: Any,
                 shard: Optional[str] = ZERO3, model: Optional[torch.nn.Module] = None, keep_gathered: int = 1,
                 **kwargs: Any) -> None:
        if check_shard(shard) != ZERO3:
            raise StrategyError(f"ParameterShardedOptimizer is shard='parameters' (shard: {shard!r})")
        self.keep_gathered = check_keep_gathered(keep_gathered)
        if os.environ.get("HOROVOD_ELASTIC") == "1":
            raise StrategyError("shard='parameters' cannot re-cut parameters at an elastic reset (the full weights "
                                "live on no rank); use shard='gradients' with elastic Horovod")
        self._model_names = check_model(model, optimizer)
        self._model: torch.nn.Module = model  # type: ignore[assignment]  # checked above
        self._gather: Optional[BlockGather] = None
        super().__init__(optimizer, named_parameters, *args, shard=ZERO3, **kwargs)
        self._refusals = [self._model.register_state_dict_pre_hook(self._refuse_state_dict),
                          self._model.register_load_state_dict_pre_hook(self._refuse_state_dict)]
        assert self._gather is not None
        self._gather.free_all()

    def __repr__(self) -> str:
        return f"DistributedOptimizer(shard='parameters', op={self.op_name}, {self._optimizer!r})"

    def _build(self) -> None:
        """Cut each block among the ranks once (parameters are not re-cut: the full weights live nowhere)."""
        if self._gather is not None:
            if (self.process_set.size(), self.process_set.rank()) != (self.ranks, self.rank):
                raise StrategyError("shard='parameters' cannot re-cut for a process set whose size changed")
            return
        self.ranks, self.rank = self.process_set.size(), self.process_set.rank()
        self._spare = {}
        self._slots, self._slot_of, self._group_of = [], {}, []
        params, groups = [], []
        for g, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    params.append(p)
                    groups.append(g)
        modules = [(path, isinstance(m, CONTAINERS)) for path, m in self._model.named_modules() if path]
        paths = block_paths(modules)
        plan = ParameterShardPlan.build([self._model_names[id(p)] for p in params], [p.numel() for p in params],
                                        paths, self.ranks, dtypes=[f"{p.dtype}|{g}" for p, g in zip(params, groups)])
        flats: Dict[int, List[torch.nn.Parameter]] = {}
        blocks = []
        for b, block in enumerate(plan.blocks):
            local = [params[t] for t in block.tensors]
            slots = []
            for k, bucket in enumerate(block.layout.buckets):
                members = [local[t] for t in bucket.tensors]
                buffer = adopt(members, bucket)
                start, precision = self.rank * bucket.shard, precision_of(buffer.dtype)
                flat = own_slice(buffer[start:start + bucket.shard], precision)
                slot = Slot(f"zero3.{b}.{k}", bucket, local, buffer, flat, start, members=members, precision=precision)
                slots.append(slot)
                self._slots.append(slot)
                for p in members:
                    self._slot_of[p] = slot
                flats.setdefault(groups[block.tensors[bucket.tensors[0]]], []).append(flat)
            blocks.append(BlockRun(b, block.path, self._model.get_submodule(block.path), slots))
        self._blocks = blocks
        self._block_of_slot = {id(slot): run for run in blocks for slot in run.slots}
        inner_groups: List[Dict[str, Any]] = []
        for g, group in enumerate(self._optimizer.param_groups):
            if g in flats:
                self._group_of.append((g, len(inner_groups)))
                inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": flats[g]})
        self._inner = make_inner(type(self._optimizer), inner_groups, self._optimizer.defaults)
        self._gather = BlockGather(blocks, self.process_set, self.keep_gathered)

    # -- gradients: reduced every pass, the block freed once all its buckets are sent -----------------
    def _on_gradient(self, p: torch.Tensor) -> None:
        slot = self._slot_of.get(p)
        if slot is None:
            return
        slot.ready += 1
        if slot.ready == len(slot.members):
            self._send(slot)

    def _send(self, slot: Slot) -> None:
        if slot.pending is not None and not slot.done:
            self._finish_bucket(slot)  # the previous backward pass's slice, before this one adds to it
        self._reduce_bucket(slot)
        slot.ready = 0
        block = self._block_of_slot[id(slot)]
        block.sent += 1
        if block.sent == len(block.slots):
            block.backward_done = True
            assert self._gather is not None
            self._gather.free(block)

    def synchronize(self) -> None:
        """Reduce what backward left (parameters without gradients: zeros), wait for every slice, free every block."""
        for slot in self._slots:
            if slot.ready or slot.pending is None:
                self._send(slot)
        for slot in self._slots:
            if not slot.done:
                self._finish_bucket(slot)
            slot.pending, slot.ready, slot.done = None, 0, False
        for block in self._blocks:
            block.sent = 0
        assert self._gather is not None
        self._gather.free_all()
        self._gather.order.settled = True  # a whole forward and backward ran: every block is in the order
        self._versions = {}
        self._synchronized = True

    def _check_views(self) -> None:
        """Checked as each block is gathered (``BlockGather.wait``): between steps the views hold no storage."""

    def _publish(self) -> None:
        """Nothing to write: the next forward gathers the updated slices block by block."""

    def _pending(self) -> bool:
        return any(slot.pending is not None or slot.ready for slot in self._slots)

    # -- the model's weights in the unsharded layout --------------------------------------------------
    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The model's full ``state_dict()`` (loadable by the plain model), on every rank: a collective, every rank calls it."""
        assert self._gather is not None
        self._gather.gathered_all()
        try:
            with self._allowed():
                return {k: v.detach().clone() for k, v in self._model.state_dict(keep_vars=True).items()}
        finally:
            self._gather.free_all()

    def load_model_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load a full ``state_dict`` (saved by any number of ranks, or by the plain model): each rank keeps its slices.

        Raises:
            StrategyError: a parameter or buffer of the model missing from ``state_dict`` (before any change).
        """
        named = dict(self._model.named_parameters())
        missing = [k for k in list(named) + [n for n, _ in self._model.named_buffers()] if k not in state_dict]
        if missing:
            raise StrategyError(f"state_dict lacks {len(missing)} of the model's entries ({', '.join(missing[:3])})")
        assert self._gather is not None
        self._gather.free_all()  # a block still gathered would hold the old values
        with torch.no_grad():
            for slot in self._slots:
                flat = torch.zeros(slot.bucket.padded, dtype=slot.flat.dtype, device=slot.flat.device)
                for p, offset, size in zip(slot.members, slot.bucket.offsets, slot.bucket.sizes):
                    flat[offset:offset + size].copy_(state_dict[self._model_names[id(p)]].reshape(-1))
                slot.flat.copy_(flat[slot.start:slot.start + slot.bucket.shard])
            for name, p in named.items():
                if p not in self._slot_of:
                    p.copy_(state_dict[name])
            for name, buffer in self._model.named_buffers():
                buffer.copy_(state_dict[name])

    def _allowed(self) -> "_Allow":
        return _Allow(self)

    def _refuse_state_dict(self, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "_allow", False):
            raise StrategyError(
                "the model's parameters are sharded (shard='parameters'): between steps no rank holds them in full; "
                "call optimizer.model_state_dict() on every rank (then save on one), and "
                "optimizer.load_model_state_dict(sd) to load")


class _Allow:
    """While open, ``model.state_dict()`` is allowed (every block is gathered)."""

    def __init__(self, owner: ParameterShardedOptimizer) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner._allow = True

    def __exit__(self, *exc: Any) -> None:
        self.owner._allow = False
