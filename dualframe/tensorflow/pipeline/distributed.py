"""DistributedPipeline for Keras 3: a chain (a graph with edges j - 1 -> j) or a functional model split over processes."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from dualframe.errors import BalanceError, StrategyError
from dualframe.pipeline.action import fusable, splits_backward
from dualframe.pipeline.schedule import Action
from dualframe.pipeline.stage import open_stage
from dualframe.pipeline.stage_view import StageView
from dualframe.pipeline.walk import StepRecord
from dualframe.pipeline.layout import layout_pipeline
from dualframe.pipeline.schedule import batched_weights, forwards_first, fused_last_stage
from dualframe.pipeline.link import check_transport
from dualframe.tensorflow.backend import BACKEND
from dualframe.tensorflow.pipeline.recompute import StageRecompute
from dualframe.pipeline.graph import GraphSplit, stage_count
from dualframe.tensorflow.graph.capture import KerasGraph, capture
from dualframe.tensorflow.pipeline.graph import GraphStage, graph_of, layers_of, process_stages, refuse_masks_crossing
from dualframe.tensorflow.pipeline.compiled import GraphStageFunction
from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork
from dualframe.tensorflow.pipeline.optimizer import apply_stage_gradients, stage_optimizer
from dualframe.tensorflow.pipeline.precision import ScaledLoss
from dualframe.tensorflow.dp.shard.stage import StageShardedOptimizer
from dualframe.tensorflow.pipeline.fit import KerasFit
from dualframe.tensorflow.pipeline.losses import keras_loss
from dualframe.tensorflow.pipeline.weights import StageWeights
from dualframe.tensorflow.pipeline.virtual_work import VirtualStageWorks, stage_actions
from dualframe.tensorflow.pipeline.xla import use_xla
from dualframe.tensorflow.split.tied import TiedVariables, find_layer_tied
from dualframe.pipeline.tied import TiedPlan, rank_tied


class DistributedPipeline(StageWeights, KerasFit, StageView):
    """Keras layers whose stages are processes: rank j of each pipeline holds stage j.

    Every rank builds the same full model (same seed); each keeps its stage. ``train_step`` runs one
    mini-batch through the schedule, leaves the stage's gradients in ``gradients`` (aligned with
    ``trainable_variables``) and returns the mean loss on every rank; the optimizer step is the caller's.

    Args:
        layers: a ``keras.Sequential`` or a list of layers, each taking and returning one tensor; or a
            functional ``keras.Model`` cut anywhere: each value goes from the rank that makes it straight to
            every rank that reads it (model inputs from stage 0, model outputs to the last stage, which
            computes the loss), one exact byte message per pair of stages and micro-batch.
        balance: layers per stage, e.g. ``[3, 2]`` (a functional model: ``len(model.layers)`` in execution
            order, or its repeated blocks, as ``ModelParallel``); one stage per rank of a pipeline. For a
            functional model give exactly one of ``balance``, ``split_points`` or ``stages``.
        split_points: (a functional model) the layer names where stages 1..n-1 begin, as ``ModelParallel``.
        stages: (a functional model) how many stages, cut to balance parameter and output bytes from the
            static shapes (the same on every rank; for a cut by time pass ``ModelParallel``'s
            ``split_points``).
        chunks: micro-batches per mini-batch.
        schedule: ``"gpipe"``, ``"1f1b"`` (at most ``stages`` micro-batches' tapes alive) or ``"zb-h1"``
            (1F1B's memory, the weights' gradients computed in ticks 1F1B leaves idle:
            ``dualframe.tensorflow.pipeline.graph_backward``); with ``virtual_stages`` > 1, ``"interleaved-1f1b"``
            or ``"zb-v"`` (see torch's ``DistributedPipeline``).
        loss_fn: ``loss_fn(targets, outputs)`` in Keras order (``keras.losses.MeanSquaredError()`` or
            ``"mse"``); per-row results are averaged. ``outputs`` is what the model returns (a list or dict
            for several outputs).
        devices: one TF device per stage (default: the process's default placement).
        data_parallel: replicas of the pipeline (default: processes // stages); checked against the world.
        timeout: seconds to wait for a neighbouring stage before raising PeerLostError.
        jit_compile: True: compile each micro-batch's pass with XLA, where XLA compiles the stage (else a
            plain ``tf.function``, decided at the first call); False: plain ``tf.function``s; None
            (default): chosen per stage where XLA pays its compile time back (``xla_choice.pays_back``: on
            a GPU, and on a CPU for stages of ``Dense`` layers, whose XLA kernels keep their speed per row
            at micro-batch sizes; not for convolutions or attention). A stage with Dropout never uses XLA.
        transport: how messages travel: ``"auto"``, ``"mpi"``, ``"zmq"`` or ``"horovod"``, as torch's
            ``DistributedPipeline``; None (default): ``DUALFRAME_PIPELINE_TRANSPORT``, else auto.
        checkpoint: activation checkpointing in each stage, as ``Pipeline``'s: ``"never"`` (default), ``"always"``
            or ``"except_last"`` (every micro-batch but the last): such a micro-batch's forward runs without a
            tape, keeping only its input, and again under a tape when its backward starts (the same Dropout
            masks; moving statistics updated once). Results equal those without it.
        virtual_stages: stages each rank holds: ``balance`` (a functional model: or ``split_points``, ``stages``)
            then describes all ``ranks x virtual_stages`` stages and the schedule places them (``held_stages``).
            ``checkpoint=`` recomputes each held stage on its own (``recomputes``); with ``data_parallel``
            replicas the ranks at one position hold the same stages and average their gradients
            (``distributed_optimizer``); stage checkpoints save each rank's stages in its part; ``compile`` and
            ``fit`` train them as one stage per rank; a layer several stages call is one variable on a rank
            holding those stages, a copy per rank otherwise (their gradients summed between the ranks).

    Raises:
        BalanceError, ChunksError, ScheduleError, StrategyError: bad arguments, on every rank, before
        any communication.

    Example:
        >>> import dualframe.tensorflow as hvd                                         # doctest: +SKIP
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)])
        >>> pipe = hvd.DistributedPipeline(model, [1, 1], chunks=4, loss_fn="mse")  # doctest: +SKIP
        >>> loss = pipe.train_step(x, y)                                                # doctest: +SKIP
        >>> optimizer.apply_gradients(zip(pipe.gradients, pipe.trainable_variables))    # doctest: +SKIP
    """

    def __init__(self, layers: Any, balance: Optional[Sequence[int]] = None, chunks: int = 1, schedule: str = "gpipe",
                 loss_fn: Optional[Callable[[Any, Any], Any]] = None, devices: Optional[Sequence[str]] = None,
                 data_parallel: Optional[int] = None, timeout: float = 45.0, *,
                 split_points: Optional[Sequence[str]] = None, stages: Optional[int] = None,
                 jit_compile: Optional[bool] = None, transport: Optional[str] = None,
                 checkpoint: str = "never", virtual_stages: int = 1) -> None:
        transport = check_transport(transport)
        if jit_compile is not None and not isinstance(jit_compile, bool):
            raise StrategyError(f"jit_compile must be None, True or False (jit_compile: {jit_compile!r})")
        loss_fn = keras_loss(loss_fn)
        world = BACKEND.collectives.world_size()
        captured = graph_of(layers)
        if captured is None:  # a chain: a graph of one node per layer, cut by balance (edges j - 1 -> j)
            if split_points is not None or stages is not None:
                raise BalanceError("split_points= and stages= cut a functional keras.Model; a list of layers "
                                   "takes balance=[layers per stage]")
            if balance is None:
                raise BalanceError("give balance=[layers per stage] to split a list of layers")
            chain = layers_of(layers)
            layout = layout_pipeline(len(chain), balance, chunks, schedule, loss_fn, devices, data_parallel,
                                     timeout, world, checkpoint, virtual_stages)
            refuse_masks_crossing(chain, layout.ranges)
            captured = capture(layers if isinstance(layers, keras.Sequential) else chain)
        else:  # a functional model: one GraphStage per stage, the same cut on every rank
            n = stage_count(split_points, balance, stages)
            layout = layout_pipeline(n, [1] * n, chunks, schedule, loss_fn, devices, data_parallel, timeout, world,
                                     checkpoint, virtual_stages)
        self.captured: KerasGraph = captured
        self.split: GraphSplit
        self.split, all_layers = process_stages(captured, split_points=split_points, balance=balance, stages=stages)
        # Variables the stages of several ranks read: each such rank holds a copy (one rank's stages share one).
        tied = rank_tied(find_layer_tied(captured, self.split), layout.placement)
        self.chunks, self.schedule, self.grid, self.checkpoint = chunks, layout.schedule, layout.grid, layout.checkpoint
        self.loss_fn, self.timeout = loss_fn, timeout
        # From here on, Horovod: every argument above is checked on every rank.
        # Names without step numbers: each is a traced tf.function (see pipeline_transport).
        self.role = open_stage(BACKEND, layout, step_names=False, split=self.split, transport=transport, tied=tied)
        self.device, self.direct = self.role.device, self.role.direct  # direct None: Horovod broadcasts
        j = self.role.index
        #: The stages this rank holds (one, j = stage_index, unless virtual_stages > 1).
        self.held_stages = layout.held(j)
        self.layer_indices: Sequence[int] = self.held_stages
        self.layers: List[GraphStage] = [all_layers[index] for index in self.layer_indices]
        self._all_layers = all_layers
        #: The model given (saved whole by ``fit``'s checkpoints), None for a list of layers.
        self.keras_model = layers if isinstance(layers, keras.Model) else None
        self.tied = TiedVariables(TiedPlan.build(tied, layout.grid, BACKEND.collectives.rank()), self.trainable_variables,
                                  self.role.sets, self.role.link.prefix, timeout)
        self.tied.broadcast()
        # One trace per training flag and (relaxed) input shape, kept across steps (see compiled): each
        # micro-batch's pass is one compiled call, made once every layer is built (before: eagerly).
        self._jit_compile = use_xla(jit_compile, self.layers, self.device)
        #: The compiled passes, per stage this rank holds (empty until the stage's layers are built).
        self._graph_functions: Dict[int, GraphStageFunction] = {}
        self._compile_stages()
        #: Activation checkpointing: one recompute per held stage, over the Keras layers it calls (its own and
        #: its copies of tied ones), whose state (Dropout's seeds) its replay takes back whatever the rank's
        #: other stages drew.
        self.recomputes = {held: StageRecompute(stage.layers + stage.tied, layout.recomputed)
                           for held, stage in zip(self.held_stages, self.layers)} if layout.recomputed else {}
        self.gradients: List[Optional[tf.Tensor]] = []
        #: The stage's ``shard="parameters"`` optimizer (``distributed_optimizer``), which holds its values between steps.
        self.sharded: Optional[StageShardedOptimizer] = None
        #: What ``distributed_optimizer`` returned, so ``compile`` takes one of them as it is.
        self.made_optimizers: List[Any] = []
        self.peak_live = 0
        #: GPipe: a stage whose split passes run computes its micro-batches' weight gradients in one pass
        #: after its last backward (``schedule.batched_weights``); False: each in its backward.
        self.batch_weights = True
        gpipe = forwards_first(layout.actions) and not splits_backward(layout.actions[j])
        self._batched_actions = fused_last_stage(batched_weights(layout.actions))[j] if gpipe else None
        #: GPipe on compiled stages: the last stage's backward runs with its forward, the others' in that order.
        self._fused_actions = fused_last_stage(layout.actions)[j] if gpipe and len(self.held_stages) == 1 else None

    def _compile_stages(self) -> None:
        """Make the held stages' compiled passes once their layers are built (variables exist only then)."""
        if not self._graph_functions and all(layer.built for stage in self.layers for layer in stage.layers):
            self._graph_functions = {held: GraphStageFunction(self._all_layers[held], self.split, held, self.captured,
                                                              self.loss_fn, self._jit_compile)
                                     for held in self.held_stages}

    def recompile(self) -> None:
        """Make the held stages' compiled passes again (the stage's variables were replaced)."""
        self._graph_functions = {}
        self._compile_stages()

    @property
    def _graph_function(self) -> Optional[GraphStageFunction]:
        """The compiled passes of this rank's own stage (``stage_index``) of a graph."""
        return self._graph_functions.get(self.stage_index)

    def distributed_optimizer(self, optimizer: keras.optimizers.Optimizer, **kwargs: Any) -> Any:
        """Wrap ``optimizer`` so each stage's gradients are averaged among its replicas only.

        Returns ``dualframe.tensorflow.keras.DistributedOptimizer`` on this stage's process set (the
        pipeline already sums a step's micro-batches, so one ``apply_gradients`` per step); with a
        single replica, the optimizer itself. Extra arguments (``compression``, ``op`` ...) pass through.
        ``shard="parameters"``: ZeRO-3 among the stage's replicas (``StageShardedOptimizer``: the stage
        gathered once per step; between steps each replica holds 1/R of its values and optimizer state).
        A ``LossScaleOptimizer`` (or any optimizer under the ``mixed_float16`` policy, but with
        ``shard="parameters"``): a ``PipelineLossScaleOptimizer`` around the stage's optimizer, the last
        stage's loss scaled by it (``dualframe.tensorflow.pipeline.precision``). ``compile`` takes the
        result as it is. See ``dualframe.tensorflow.pipeline.optimizer``.
        """
        made = stage_optimizer(self, optimizer, **kwargs)
        self.made_optimizers.append(made)
        return made

    def apply_gradients(self, optimizer: Any) -> None:
        """``optimizer.apply_gradients`` on the last step's gradients and the stage's variables."""
        apply_stage_gradients(self, optimizer)

    def _batches_weights(self, actions: Sequence[Action], train: bool) -> bool:
        """Whether this step runs GPipe's W passes as one after its last B (``schedule.batched_weights``).

        Only where every forward runs before any backward (GPipe, ``schedule.forwards_first``: 1F1B would
        have to keep every micro-batch's layer inputs until the end, GPipe's memory), on compiled stages
        whose split passes run (``splittable``: no layer with state) and re-run cheaply (no node owning
        weights through sublayers, ``reruns_cheaply``) over rows (``batchable``), and not with
        checkpointing, whose point is to keep no more than their inputs.
        """
        if not (train and self._batched_actions is not None and self.batch_weights and not self.recomputes
                and self._graph_functions):
            return False
        passes = [f.passes for f in self._graph_functions.values()]
        return all(p.splittable() and p.reruns_cheaply() and p.batchable() for p in passes)

    def _run(self, actions: Sequence[Action], inputs: Any, targets: Any, train: bool) -> Tuple[Any, StepRecord]:
        """One step's walk of this rank's stages (a ``TFGraphStageWork`` each) on the agreed micro-batches."""
        targets = None if targets is None or not self.is_last else tf.convert_to_tensor(targets)
        if self.sharded is not None:  # the stage's values, gathered once for the step's micro-batches
            self.sharded.begin_step()
        values: Dict[str, Any] = {}
        if self.is_first and inputs is not None:
            flat = [tf.convert_to_tensor(v) for v in self.captured.flat_inputs(inputs)]
            values = dict(zip(self.split.graph.inputs, flat))
        key = next(iter(values.values())) if values else None  # its shape keys the step (its rows: the batch)
        sizes = self.role.agree(key, targets, train)
        parts = {name: tf.split(value, sizes) for name, value in values.items()}
        micro_inputs = [{name: part[i] for name, part in parts.items()} for i in range(len(sizes))] if values else []
        micro_targets = tf.split(targets, sizes) if train and targets is not None else []
        self._compile_stages()
        batch_weights = self._batches_weights(actions, train)
        if batch_weights:  # W actions send nothing: each stage decides alone
            assert self._batched_actions is not None
            actions = self._batched_actions
        elif train and self._fused_actions is not None and self._graph_functions and not self.recomputes:
            actions = self._fused_actions  # every stage takes it: the B's travel in its order
        last = len(self.role.layout.ranges) - 1
        works: Dict[int, Any] = {j: TFGraphStageWork(
            self._all_layers[j], self.split, j, self.captured, self.loss_fn if train else None,
            micro_targets if j == last else [], [s / sum(sizes) for s in sizes], self.device,
            self._graph_functions.get(j), split_backward=splits_backward(actions), recompute=self.recomputes.get(j),
            fused=fusable(stage_actions(actions, j) if len(self.held_stages) > 1 else actions),
            batch_weights=batch_weights, local=self.held_stages) for j in self.held_stages}
        if len(works) == 1:
            work = works[self.stage_index]
            return work, self.role.step(actions, micro_inputs, work, train)
        return VirtualStageWorks(works, last), self.role.step(actions, micro_inputs, works, train)

    def train_step(self, inputs: Any, targets: Any) -> float:
        """Run one mini-batch forward and backward through the pipeline; the stage's gradients land in ``gradients``.

        Inputs are read on the first stage, targets on the last (others may pass them or None).
        Returns the mini-batch's mean loss on every rank of the pipeline (over all replicas' batches
        with ``data_parallel`` > 1). Apply the gradients with ``apply_gradients(optimizer)``.
        """
        if self.loss_fn is None:
            raise StrategyError("train_step needs a loss_fn; pass loss_fn= to DistributedPipeline")
        work, _ = self._run(self.actions, inputs, targets, train=True)
        self.gradients = self.tied.sum_gradients(work.step_gradients())  # tied copies: summed over their holders
        self.peak_live = max(self.peak_live, work.peak_live)
        scaled = self.loss_fn.optimizer.dynamic_scale if isinstance(self.loss_fn, ScaledLoss) else None
        return self.role.mean_loss(work.loss_sum / (1.0 if scaled is None else float(scaled)))

    def __call__(self, inputs: Any) -> Any:
        """Inference through the pipeline (no gradients): the model's output on the last stage, None elsewhere."""
        work, _ = self._run(self.role.forward_actions(self.chunks), inputs, None, train=False)
        if self.sharded is not None:
            self.sharded.end_inference()
        if not self.is_last:
            return None
        return self.captured.pack_outputs([BACKEND.batches.concat(list(parts)) for parts in zip(*work.outputs)])
