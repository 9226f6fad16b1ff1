"""Sharded data parallelism for torch (ZeRO-1/2): ``DistributedOptimizer(..., shard="optimizer"|"gradients")``.

The core's ``dualframe.dp.shard.ShardLayout`` cuts each param group's trainable parameters into
buckets (flat buffers of one dtype) and each bucket into one equal slice per rank of the process set.
Here, per bucket: as soon as backward has produced every gradient of the bucket, the flat gradient
is reduced (asynchronously, overlapping the rest of backward; by ``scatter``: an in-place allreduce
or a reduce-scatter) and the rank keeps its slice of the result; ``step()`` gives each rank's
reduced slice to a copy of the user's optimizer class whose parameters are the rank's flat slices
(so it holds state for 1/N of the elements), then allgathers the updated slices back into every
parameter. ``shard="gradients"`` also drops each parameter's full ``.grad`` once its bucket is sent.
``clip_grad_norm_`` clips by the global norm, computed from each rank's reduced slice. The gradient
path (reduce, synchronize, clip) is in ``dp/shard/gradients.py``; the buckets in ``dp/shard/buckets.py``.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from dualframe.dp.settings import ReduceSettings
from dualframe.dp.shard import (BUCKET_ELEMENTS, ShardLayout, check_same_parameters, check_scatter, check_shard,
                                parameter_signature)
from dualframe.errors import StrategyError
from dualframe.torch.dp import checks as dp_checks
from dualframe.torch.collectives import OPS, check_initialized, hvd
from dualframe.torch.dp.compression import Compression
from dualframe.torch.dp.optimizer import DistributedOptimizer
from dualframe.torch.dp.wrapped_optimizer import check_optimizer, claim, weak_hook
from dualframe.torch.dp.shard import state_dict as shard_state
from dualframe.torch.dp.shard.buckets import (Slot, adopt, arrived, check_elementwise, make_inner, master_slice,
                                           precision_of, travelling)
from dualframe.torch.dp.shard.gradients import SliceGradients

#: Buckets whose updated slices are being allgathered at once.
GATHER_WINDOW = 2
#: The path ``scatter="auto"`` takes: "allreduce" (in place, then this rank keeps its slice). Under mpirun
#: on a 2-core box Horovod 0.28's allreduce of 50 M floats took 0.85x the time of its reducescatter (and
#: moves the result in place, with no output tensor); on a real network "reducescatter" moves half the
#: bytes. The sums are the same either way (docs/torch_data_parallel.md).
AUTO_SCATTER = "allreduce"

class ShardedOptimizer(SliceGradients, DistributedOptimizer):
    """``DistributedOptimizer(..., shard="optimizer"|"gradients")``: optimizer state (and gradients) kept 1/N per rank.

    Built by ``DistributedOptimizer`` when ``shard`` is given; the arguments are its arguments.
    ``param_groups`` are the wrapped optimizer's (an LR scheduler's changes reach the slices at the
    next step); ``state_dict()`` is a collective that returns the full state in the unsharded
    optimizer's format on every rank, and ``load_state_dict`` takes such a dict (from a plain or a
    sharded optimizer, at any number of ranks) and keeps this rank's slice. ``scatter`` picks the
    collective of the gradients: ``"reducescatter"``, ``"allreduce"`` (in place, the rank keeps its
    slice) or ``"auto"`` (``AUTO_SCATTER``). Clip with ``optimizer.clip_grad_norm_(max_norm)``, not
    ``torch.nn.utils.clip_grad_norm_`` (the reduced gradients live in the slices, not in ``.grad``).

    Example:
        >>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)                            # doctest: +SKIP
        >>> opt = hvd.DistributedOptimizer(opt, model.named_parameters(), shard="optimizer")  # doctest: +SKIP
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()                    # doctest: +SKIP
        >>> full = opt.state_dict()   # every rank calls it (it gathers the slices)         # doctest: +SKIP

    Raises:
        StrategyError: unknown ``shard`` or ``scatter``, op Adasum/Min/Max/Product, ``groups``, a non element-wise
            optimizer, a rank outside ``process_set`` (all before any communication); parameters that
            differ between ranks (after one allgather of their signature, on every rank).
    """

    #: torch.amp.GradScaler then hands step() its own found_inf, which step() refuses: that flag is this
    #: rank's alone, and a rank that skips while another steps would hang in the allgather.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: Any = hvd.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: dp_checks.GroupsArg = None, sparse_as_dense: bool = False,
                 process_set: Any = hvd.global_process_set, *, shard: Optional[str] = "optimizer",
                 scatter: Optional[str] = "auto") -> None:
        check_initialized("DistributedOptimizer")
        self._optimizer = check_optimizer(optimizer, sharded=True)
        self._compression = dp_checks.check_compression(compression, Compression)
        self.op_name = dp_checks.check_numbers(backward_passes_per_step, op, gradient_predivide_factor)
        self.op = OPS[self.op_name]
        self.shard = check_shard(shard, self.op_name)
        self.scatter = check_scatter(scatter, self.shard)
        #: The collective each bucket's gradient goes through: "allreduce" or "reducescatter".
        self.gradient_path = AUTO_SCATTER if self.scatter == "auto" else str(self.scatter)  # not None: shard is given
        if groups is not None or num_groups:
            raise StrategyError(f"groups= fuses allreduces; with shard={self.shard!r} the buckets are the fusion "
                                f"(groups: {groups if groups is not None else num_groups}); drop groups=")
        check_elementwise(optimizer)
        self._names = dp_checks.parameter_names(optimizer, named_parameters)
        self.process_set = dp_checks.check_process_set(process_set)
        if not self.process_set.included():
            raise StrategyError(f"this rank ({hvd.rank()}) is not in process_set {self.process_set}; a sharded "
                                f"optimizer shards among the ranks of its set; wrap with a set that includes it")
        trainable = [p for p in dp_checks.optimizer_params(optimizer) if p.requires_grad]
        if not trainable:
            raise StrategyError("shard= needs at least one parameter with requires_grad=True in the optimizer")
        self.settings = ReduceSettings(compression=self._compression, op=self.op_name, sparse_as_dense=True,
                                       gradient_predivide_factor=float(gradient_predivide_factor),
                                       process_set=self.process_set, backward_passes_per_step=backward_passes_per_step)
        # The one collective before a refusal: every rank raises alike. Elastic workers build their
        # optimizers at different times: there the check runs at each sync (dualframe.torch.reliability.elastic).
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if not self._elastic:
            self.check_same_parameters()
        self._delay: Dict[torch.Tensor, int] = {p: backward_passes_per_step for p in trainable}
        self._handles: Dict[Any, Any] = {}  # unused by sharding; DistributedOptimizer's methods read it
        self._synchronized = False
        self._should_synchronize = True
        self._clipped = False  # clip_grad_norm_ synchronized: the next step() does not reduce again
        self._versions: Dict[torch.Tensor, Tuple[torch.Tensor, int]] = {}  # .grad at synchronize (ZeRO-1)
        self._adasum = False
        self._active = True
        self._sent = 0
        self._build()
        claim(optimizer, self, sharded=True)
        self._hook_handles = [p.register_post_accumulate_grad_hook(weak_hook(self)) for p in trainable]

    def __repr__(self) -> str:
        return (f"DistributedOptimizer(shard={self.shard!r}, scatter={self.scatter!r}, op={self.op_name}, "
                f"{self._optimizer!r})")

    # -- layout ---------------------------------------------------------------------------------
    def check_same_parameters(self) -> None:
        """Refuse, on every rank of the set, parameters that differ between ranks (one allgather of a signature)."""
        entries = [(f"{g}/{self._names[p]}", tuple(p.shape), str(p.dtype))
                   for g, group in enumerate(self._optimizer.param_groups) for p in group["params"] if p.requires_grad]
        mine = torch.tensor([[parameter_signature(entries), len(entries)]], dtype=torch.int64)
        every = hvd.allgather(mine, name="dualframe.shard.signature", process_set=self.process_set)
        check_same_parameters(every[:, 0].tolist(), every[:, 1].tolist())

    def _build(self) -> None:
        """Cut each param group for the process set's current size and make the inner optimizer (no state)."""
        self.ranks, self.rank = self.process_set.size(), self.process_set.rank()
        # Flat send buffers, reused across steps (at most shard_gradients.REDUCE_WINDOW + 1 alive): allocating 16 MiB
        # blocks each step costs a page fault per 4 KiB page when the allocator returns them to the system.
        self._spare: Dict[Tuple[int, torch.dtype, torch.device], List[torch.Tensor]] = {}
        self._slots: List[Slot] = []
        self._slot_of: Dict[torch.Tensor, Slot] = {}
        self._group_of: List[Tuple[int, int]] = []  # (outer group, inner group)
        inner_groups: List[Dict[str, Any]] = []
        for g, group in enumerate(self._optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            layout = ShardLayout.build([p.numel() for p in params], self.ranks, dtypes=[str(p.dtype) for p in params],
                                       bucket_elements=BUCKET_ELEMENTS)
            flats = []
            for b, bucket in enumerate(layout.buckets):
                members = [params[t] for t in bucket.tensors]
                buffer = adopt(members, bucket)
                start, precision = self.rank * bucket.shard, precision_of(buffer.dtype)
                flat = master_slice(buffer[start:start + bucket.shard], precision)
                slot = Slot(f"{g}.{b}", bucket, params, buffer, flat, start, members=members, precision=precision,
                            seen=buffer._version)
                for p in slot.members:
                    self._slot_of[p] = slot
                self._slots.append(slot)
                flats.append(flat)
            self._group_of.append((g, len(inner_groups)))
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": flats})
        self._inner = make_inner(type(self._optimizer), inner_groups, self._optimizer.defaults)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer of this rank's slices (its state is the rank's share; its hyperparameters follow ``param_groups``)."""
        self._sync_hyperparameters()
        return self._inner

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's state: one entry per flat slice this rank owns."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    # -- step: the slices, then the allgather -----------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        # An LR scheduler (or the user) changes the wrapped optimizer's groups: the slices follow.
        for g, i in self._group_of:
            outer, inner = self._optimizer.param_groups[g], self._inner.param_groups[i]
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Reduce-scatter (unless inside ``skip_synchronize()``), step this rank's slices, allgather the parameters."""
        if closure is not None:
            raise StrategyError("step(closure) is not available with shard= (a closure recomputes gradients that "
                                "would not be reduce-scattered); call loss.backward() before step()")
        if "found_inf" in self.__dict__:  # set by torch.amp.GradScaler.step, on every rank before this call
            raise StrategyError("torch.amp.GradScaler checks only this rank's gradients, so ranks could skip "
                                "different steps; with shard= use hvd.ShardedGradScaler (the same arguments and "
                                "calls), which checks every rank's reduced slices and skips on all ranks alike")
        if not self._should_synchronize:
            self._check_untouched()
        elif not self._clipped:
            self._reduce_for_step()
        self._synchronized = self._clipped = False
        self._versions = {}
        self._sync_hyperparameters()
        self._check_views()
        self._inner.step()
        self._publish()
        return None

    def _check_views(self) -> None:
        for slot in self._slots:
            slot.check_views()
            slot.refresh_master()

    def _publish(self) -> None:
        """Write the updated slices into every rank's parameters (ZeRO-3 leaves them to the next forward)."""
        # At most GATHER_WINDOW buckets gathered at once: the gathered copies never hold all parameters again.
        in_flight: List[Tuple[Slot, Any]] = []
        for slot in self._slots:
            in_flight.append((slot, hvd.allgather_async(travelling(slot.flat, slot.precision),
                                                        name=f"dualframe.shard.param.{slot.name}",
                                                        process_set=self.process_set)))
            if len(in_flight) > GATHER_WINDOW:
                self._write_back(*in_flight.pop(0))
        for slot, handle in in_flight:
            self._write_back(slot, handle)

    @staticmethod
    def _write_back(slot: Slot, handle: Any) -> None:
        with torch.no_grad():
            slot.buffer.copy_(arrived(hvd.synchronize(handle), slot.precision))  # the parameters are views of it
        slot.seen = slot.buffer._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the parameters' gradients and the slices'; refused while reduce-scatters are pending."""
        if self._pending():
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); that would race with the pending gradient reductions")
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._inner.zero_grad(set_to_none=set_to_none)
        self._clipped, self._versions = False, {}
        self._synchronized = False  # a step a ShardedGradScaler skipped left its reduced slices behind

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Refused: every rank would have to re-cut its slices; add groups to the optimizer before wrapping it."""
        raise StrategyError("add_param_group is not available with shard=; give the optimizer all its param "
                            "groups before wrapping it")

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the inner optimizer of the slices (the hook receives it)."""
        return self._inner.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the inner optimizer of the slices (the hook receives it)."""
        return self._inner.register_step_post_hook(hook)

    # -- state: gathered full on every rank, loaded as the rank's slice ----------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The full optimizer state in the unsharded optimizer's format (a collective: every rank calls it)."""
        self._sync_hyperparameters()
        return shard_state.gather(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (plain or sharded, any size): re-cut for the current size, keep this rank's slice."""
        for slot in getattr(self, "_slots", []):
            slot.pending, slot.ready, slot.done = None, 0, False
        self._synchronized = self._clipped = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._build()
        shard_state.scatter(self, state_dict)

    def resize(self) -> None:
        """Re-cut for the process set's current size if it changed (elastic), keeping no state across a change."""
        if self.process_set.size() != self.ranks or self.process_set.rank() != self.rank:
            self._build()

    def broadcast_state(self, root_rank: int = 0) -> None:
        """Make every rank's state and hyperparameters root_rank's (``broadcast_optimizer_state`` for shards)."""
        from dualframe.torch.functions import broadcast_object
        full = broadcast_object(self.state_dict(), root_rank=root_rank, name="dualframe.shard.broadcast_state",
                                process_set=self.process_set)
        self.load_state_dict(full)
