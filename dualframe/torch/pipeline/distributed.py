"""DistributedPipeline for torch: an nn.Module split over processes (a chain is a graph with edges j - 1 -> j)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import stage_count
from dualframe.pipeline.action import Action, splits_backward
from dualframe.pipeline.link import check_transport
from dualframe.pipeline.stage import open_stage
from dualframe.pipeline.stage_view import StageView
from dualframe.pipeline.walk import StepRecord
from dualframe.pipeline.layout import StageLayout, layout_pipeline
from dualframe.pipeline.schedule import virtual_count
from dualframe.pipeline.tied import TiedPlan
from dualframe.torch.backend import BACKEND
from dualframe.torch.pipeline.activation_meter import ActivationMeter
from dualframe.torch.graph.chain import ChainPart, chain_layers
from dualframe.torch.pipeline.graph import GraphPart
from dualframe.torch.graph.devices import place_stage
from dualframe.torch.graph.capture import Leaves
from dualframe.torch.pipeline.graph_work import HeldStageWorks
from dualframe.torch.pipeline.state import StageState
from dualframe.torch.split.loss import model_loss
from dualframe.torch.split.model_parallel import is_graph_split
from dualframe.torch.dp.shard.stage import StageShardedOptimizer
from dualframe.torch.pipeline.optimizer import sharded_step, stage_optimizer
from dualframe.torch.split.tied import TiedCopies, find_stage_tied, tensor_names


class DistributedPipeline(StageState, StageView, nn.Module):  # type: ignore[misc]  # state_dict: the full model's keys
    """A model whose stages are processes: rank j of each pipeline holds stage j.

    An ``nn.Sequential`` is split by ``balance`` (layers per stage); any other model, or one given
    ``split_points``/``stages``, is captured as a graph and cut as in ``ModelParallel``: each value
    then goes from the rank that makes it straight to every rank that reads it (model inputs from
    stage 0, model outputs to the last stage, which computes the loss). Every rank builds the same
    pipeline from the same full model (same seed); each keeps its stage. ``train_step`` runs one mini-batch through the schedule and returns its mean loss on
    every rank; ``parameters()`` are the local stage's; ``state_dict()`` uses the full model's keys.

    Args:
        module: the whole model, an ``nn.Sequential`` or any ``nn.Module`` cut as a graph.
        balance: layers per stage, e.g. ``[3, 3]`` (a graph: top-level units per stage); one stage per rank.
        chunks: micro-batches per mini-batch.
        schedule: ``"gpipe"``, ``"1f1b"`` (at most ``stages`` micro-batches' activations alive) or ``"zb-h1"``
            (1F1B with the backward split into the input's gradient, sent back at once, and the weights',
            computed in ticks 1F1B leaves idle: ``dualframe.torch.pipeline.backward``; at most ``stages``
            micro-batches held on every stage); with ``virtual_stages`` > 1, ``"interleaved-1f1b"`` (stage j
            on rank ``j % ranks``; ``chunks`` a multiple of the ranks) or ``"zb-v"`` (two stages per rank in a
            V: rank r holds stages r and ``2 ranks - 1 - r``, the loss on rank 0; the backward split as ZB-H1's).
        loss_fn: ``loss_fn(output, target)``, the mean over a micro-batch's rows (e.g. ``nn.MSELoss()``);
            ``output`` is what the model returns (a tuple or dict for several outputs). None (a graph):
            the model's own loss, ``output.loss`` of a Hugging Face model whose labels are among its inputs
            (``train_step({"input_ids": ids, "labels": ids})``, no targets; the sample holds labels too).
        devices: one device per stage (default: CPU).
        data_parallel: replicas of the pipeline (default: processes // stages); checked against the world.
        timeout: seconds to wait for a neighbouring stage before raising PeerLostError.
        split_points, stages, sample, leaves: how to cut a graph (see ``ModelParallel``). ``stages=n``
            evens out parameter bytes here (every rank must cut alike; timings differ between ranks).
            Inputs of several tensors: ``train_step((tokens, mask), y)`` (a tuple: positional arguments),
            ``train_step({"input_ids": ids, "attention_mask": mask}, y)`` or
            ``train_step(targets=y, input_ids=ids, attention_mask=mask)`` (keyword inputs); ``sample=`` alike.
        transport: how messages travel: ``"auto"`` (MPI point-to-point under mpirun, ZeroMQ elsewhere, else
            Horovod broadcasts), ``"mpi"``, ``"zmq"`` (an error where a rank lacks it) or ``"horovod"``;
            every rank must pass the same. None (default): ``DUALFRAME_PIPELINE_TRANSPORT``, else auto.
            ``pipe.transport`` tells which one was taken.
        checkpoint: activation checkpointing in each stage, as ``Pipeline``'s: ``"never"`` (default),
            ``"always"`` or ``"except_last"`` (every micro-batch but the last): such a micro-batch keeps
            only its stage's input from forward to backward, where the stage's forward runs again (the
            same random state, buffers such as BatchNorm's statistics updated once); under ``"zb-h1"``
            the recomputed graph lives from B to W; with ``virtual_stages``, each held stage recomputes its
            own (``pipe.recomputes``). Results equal those without it.
        virtual_stages: stages each rank holds: ``balance`` (or ``split_points``, ``stages``) then describes all
            ``ranks x virtual_stages`` stages, and the schedule places them (``pipe.held_stages``); with
            ``data_parallel`` replicas, each rank's stages are averaged among the replicas of its position.

    Raises:
        BalanceError, ChunksError, ScheduleError, StrategyError: bad arguments, on every rank, before
        any communication.

    Example:
        >>> import dualframe.torch as hvd                                          # doctest: +SKIP
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))   # doctest: +SKIP
        >>> pipe = hvd.DistributedPipeline(model, [2, 1], chunks=4, loss_fn=nn.MSELoss())  # doctest: +SKIP
        >>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)                      # doctest: +SKIP
        >>> loss = pipe.train_step(x, y); opt.step(); opt.zero_grad()              # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, balance: Optional[Sequence[int]] = None, chunks: int = 1,
                 schedule: str = "gpipe", loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
                 devices: Optional[Sequence[str]] = None, data_parallel: Optional[int] = None,
                 timeout: float = 45.0, *, split_points: Optional[Sequence[str]] = None, stages: Optional[int] = None,
                 sample: Any = None, leaves: Leaves = (), transport: Optional[str] = None,
                 checkpoint: str = "never", virtual_stages: int = 1) -> None:
        super().__init__()
        transport = check_transport(transport)
        layout = self._cut(module, balance, chunks, schedule, loss_fn, devices, data_parallel, timeout, checkpoint,
                           virtual_stages, split_points=split_points, stages=stages, sample=sample, leaves=leaves)
        self.chunks, self.schedule, self.grid, self.checkpoint = chunks, layout.schedule, layout.grid, layout.checkpoint
        self.loss_fn, self.timeout = loss_fn, timeout
        modules, held = self._stage_modules(module, layout)
        tied = find_stage_tied(module, held)  # weights several stages read: each holds a copy
        # From here on, Horovod: every argument above is checked on every rank.
        split = self.graph.split if self.graph is not None else self.chain.split  # type: ignore[union-attr]
        self.split, self._unflatten = split, self.graph.captured.unflatten if self.graph is not None else \
            self.chain.unflatten  # type: ignore[union-attr]
        self.role = open_stage(BACKEND, layout, split=split, transport=transport, tied=tied)
        self.device, self.direct = self.role.device, self.role.direct  # direct None: Horovod broadcasts
        self.stage = held[self.role.index]
        place_stage(self.stage, self.device)  # a graph's recorded devices too (graph_devices)
        #: The stages this rank holds, by index j (one, j = stage_index, unless virtual_stages > 1).
        self.held_stages = {j: modules[j] for j in layout.held(self.role.index)}
        # A graph stage's (stage key, model key) pairs: a tied weight under each of the model's names, the
        # model's non-persistent buffers left out.
        self._keys = self.graph.model_keys(self.stage) if self.graph is not None else None
        self._names = tensor_names(module)
        self.tied = TiedCopies(TiedPlan.build(tied, layout.grid, BACKEND.collectives.rank()), self.stage, module,
                               self.role.sets, self.role.link.prefix)
        self.tied.broadcast()
        self.meter = ActivationMeter(self.stage.parameters())
        single = len(self.held_stages) == 1  # then the rank's own module, under the model's names
        self._held = HeldStageWorks({self.role.index: self.stage} if single else self.held_stages, self.split,
                                    self._unflatten, self.device, chain=self.graph is None,
                                    split_backward=splits_backward(self.actions), recomputed=layout.recomputed)
        #: Per held stage j: its split backward (zero-bubble schedules), its activation checkpointing.
        self.split_backwards, self.recomputes = self._held.split_backwards, self._held.recomputes
        self.split_backward = self.split_backwards.get(self.role.index) if single else None
        #: The stage's ZeRO-3 optimizer (``distributed_optimizer(..., shard="parameters")``): gathered once per step.
        self.sharded: Optional[StageShardedOptimizer] = None

    def _cut(self, module: nn.Module, balance: Optional[Sequence[int]], chunks: int, schedule: str, loss_fn: Any,
             devices: Optional[Sequence[str]], data_parallel: Optional[int], timeout: float, checkpoint: str,
             virtual_stages: int, *, split_points: Optional[Sequence[str]], stages: Optional[int], sample: Any,
             leaves: Leaves) -> StageLayout:
        """The checked layout of the stages: a graph's (``self.graph``) or an ``nn.Sequential``'s (``self.chain``)."""
        self.graph: Optional[GraphPart] = None
        self.chain: Optional[ChainPart] = None  # an nn.Sequential: its stages as a graph whose edges are (j - 1, j)
        if is_graph_split(module, split_points, stages):
            n = stage_count(split_points, balance, stages)
            layout = layout_pipeline(n, [1] * n, chunks, schedule, loss_fn, devices, data_parallel, timeout,
                                     BACKEND.collectives.world_size(), checkpoint, virtual_count(virtual_stages))
            self.graph = GraphPart(module, split_points=split_points, balance=balance, stages=stages, sample=sample,
                                   leaves=leaves)
            return layout
        if not isinstance(module, nn.Sequential):
            raise StrategyError(f"DistributedPipeline splits an nn.Sequential (module: {type(module).__name__})")
        layout = layout_pipeline(len(module), balance or [], chunks, schedule, loss_fn, devices, data_parallel,
                                 timeout, BACKEND.collectives.world_size(), checkpoint, virtual_stages)
        self.chain = ChainPart(len(layout.ranges))
        return layout

    def _stage_modules(self, module: nn.Module, layout: StageLayout) -> Tuple[List[nn.Module], List[nn.Module]]:
        """Every stage's module and every rank's, referencing the model's own parameters (all built, to find tied ones).

        A rank's module holds its stages' (with virtual stages, several) under the model's names, for its
        parameters and ``state_dict``.
        """
        modules = [self.graph.module(j) if self.graph is not None else chain_layers(module, layout.ranges[j])
                   for j in range(len(layout.ranges))]
        held = [chain_layers(module, (i for j in layout.held(r) for i in layout.ranges[j])) if self.graph is None
                else modules[r] if layout.virtual_stages == 1 else
                nn.ModuleDict({str(j): modules[j] for j in layout.held(r)}) for r in range(self.grid.stages)]
        return modules, held

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` so each stage's gradients are averaged among its replicas only.

        Returns ``dualframe.torch.DistributedOptimizer`` on this stage's process set, counting the
        ``chunks`` micro-batch backwards of a step as one (``backward_passes_per_step`` multiplies);
        with a single replica, the optimizer itself. Extra arguments (``compression``, ``op`` ...)
        pass through. A model with tied weights: their holders' gradients are summed in its ``step``,
        after the replicas' average (``shard=`` is refused there). ``shard="parameters"`` (ZeRO-3,
        schedules ``gpipe``, ``1f1b``, ``zb-h1``): each replica keeps 1/R of the stage's parameters,
        gradients and optimizer state between steps; the stage is gathered once per step
        (``dualframe.torch.dp.shard.stage``); ``state_dict()`` is then a collective of the stage's replicas.

        Raises:
            StrategyError: ``shard=`` with tied weights; ``shard="parameters"`` with virtual stages, ``model=`` or
                ``keep_gathered=`` (on every rank alike, before any message).
        """
        return stage_optimizer(self, optimizer, **kwargs)

    def _run(self, actions: Sequence[Action], inputs: Any, targets: Optional[torch.Tensor],
             train: bool, keywords: Dict[str, Any]) -> Tuple[Any, StepRecord]:
        values: Dict[str, Any] = {}
        key = inputs
        if keywords and self.graph is None:
            raise TypeError(f"an nn.Sequential pipeline takes one tensor, not keyword inputs ({', '.join(keywords)})")
        if self.graph is not None:
            self.graph.check_mode(self.training)
        if self.graph is not None and self.is_first and (inputs is not None or keywords):
            values, key = self.graph.inputs(inputs, keywords)
        sizes = self.role.agree(key, targets, train, own_loss=self.loss_fn is None)
        micro_inputs, micro_targets = self.role.micro_batches(
            inputs.to(self.device) if self.graph is None and self.is_first and inputs is not None else None,
            targets.to(self.device) if self.is_last and train and targets is not None else None, sizes, train)
        weights = [s / sum(sizes) for s in sizes]
        loss_fn = (self.loss_fn or model_loss) if train else None
        if self.graph is not None:
            micro_inputs = self.graph.micro_inputs(values, sizes, self.device) if self.is_first else []
        else:
            micro_inputs = self.chain.micro_inputs(micro_inputs)  # type: ignore[union-attr]
        works = self._held.works(loss_fn, micro_targets, weights, self.meter)
        # A graph stage (GraphPipelineStage) walks one work, a rank of virtual stages one per stage it holds.
        work: Any = works if len(works) > 1 else works[self.role.index]
        with sharded_step(self.sharded, self.stage, self.meter, train, wait=self.graph is not None), \
                torch.set_grad_enabled(train), self.meter.counting():
            record = self.role.step(actions, micro_inputs, work, train)
        last = len(self.role.layout.ranges) - 1
        return works.get(last, works[min(works)]), record

    def train_step(self, inputs: Any = None, targets: Optional[torch.Tensor] = None, **keywords: Any) -> float:
        """Run one mini-batch forward and backward through the pipeline; gradients land in ``.grad``.

        Inputs are read on the first stage, targets on the last (others may pass them or None). A graph's
        inputs: a tuple (positional arguments), a dict of keyword inputs (``{"input_ids": ids,
        "attention_mask": mask}``), one value, and/or keyword arguments
        (``train_step(targets=y, input_ids=ids)``).
        Returns the mini-batch's mean loss on every rank of the pipeline (over all replicas' batches
        with ``data_parallel`` > 1). The optimizer step is the caller's, as with a plain model.
        """
        if self.loss_fn is None and (self.graph is None or self.graph.loss is None):
            why = "an nn.Sequential's output" if self.graph is None else "the model's output (captured on the sample)"
            raise StrategyError(f"train_step needs a loss_fn: {why} holds no loss of its own; pass loss_fn= to "
                                "DistributedPipeline, or (a Hugging Face model) labels among the sample's inputs")
        work, _ = self._run(self.actions, inputs, targets, train=True, keywords=keywords)
        if self.stage_process_set is None:  # with replicas: in distributed_optimizer's step, after their average
            self.tied.sum_gradients()
        return self.role.mean_loss(work.loss_sum)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Inference through the pipeline (no gradients): the output on the last stage, None elsewhere.

        Takes what the model takes (positional and keyword inputs), or one tuple or dict as ``train_step``;
        a loss the model computes itself (labels among the inputs) is the micro-batches' weighted by rows.
        """
        forwards = self.role.forward_actions(self.chunks)
        inputs = args[0] if len(args) == 1 else (args if args else None)
        work, _ = self._run(forwards, inputs, None, train=False, keywords=kwargs)
        if not self.is_last:
            return None
        if self.graph is not None:
            return self.graph.joined_outputs(work.outputs, work.weights)
        return self.chain.joined_outputs(work.outputs)  # type: ignore[union-attr]
