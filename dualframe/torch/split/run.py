"""Runs one training step of a split torch model over the core's one-process schedule, cell by cell.

Every cell (micro-batch i, stage j) is its own small autograd graph: its input is detached and moved to
the stage's device, so the backward pass can also run cell by cell, in the mirrored clock-tick order,
with the cells of one tick in threads, one per device (on GPUs they overlap; cells sharing a device
run one after another in the calling thread, with no hand-off). One ``autograd.Function`` ties the
whole step into the caller's graph: ``loss.backward()`` runs the scheduled backward and returns the
gradients of the input and of the parameters, summed over micro-batches.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from dualframe.pipeline.executor import RecordFn, run_ticks
from dualframe.pipeline.action import Cell
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.pipeline.split import Split
from dualframe.torch.split.rng import checkpointed


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the work a stage thread enqueues (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class StepRun:
    """State of one step: the micro-batches, each cell's input and output, and the gradients."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device], plan: Split,
                 parts: Sequence[torch.Tensor], params: Sequence[Sequence[nn.Parameter]],
                 record: Optional[RecordFn] = None, lanes: Optional[Sequence[Hashable]] = None,
                 masters: Optional[Mapping[int, torch.Tensor]] = None) -> None:
        self.stages, self.devices, self.plan, self.parts = stages, devices, plan, list(parts)
        self.params = params
        self.masters = masters or {}  # a copy's id -> the model's tensor it stands for (tied_devices)
        self.record = record
        self.lanes = lanes  # run_ticks' lanes: cells of a tick in one lane share a thread
        self.inputs: Dict[Cell, torch.Tensor] = {}
        self.outputs: Dict[Cell, torch.Tensor] = {}
        self.grad_inputs: Dict[Cell, Optional[torch.Tensor]] = {}
        self.grad_outputs: List[torch.Tensor] = []
        self.param_grads: List[List[Optional[torch.Tensor]]] = [[None] * len(p) for p in params]
        self.grad = False

    def forward(self, grad: bool) -> Any:
        """Run every forward cell by clock tick; return the joined output on the last device."""
        self.grad = grad
        ticks = one_process_ticks(self.plan.schedule, len(self.parts), self.plan.stages, "F")
        run_ticks(ticks, self._forward_cell, self.plan.stages, "F", record=self.record, lanes=self.lanes)
        return self._result()

    def _result(self) -> Any:
        """The step's output: the last stage's micro-batch outputs joined."""
        last = self.plan.stages - 1
        return torch.cat([self.outputs[(i, last)].detach() for i in range(len(self.parts))])

    def _forward_cell(self, i: int, j: int) -> None:
        source = self.parts[i] if j == 0 else self.outputs[(i, j - 1)]
        device = self.devices[j]
        with device_scope(device), torch.set_grad_enabled(self.grad):
            x = source.detach().to(device, non_blocking=True)
            if self.grad and source.requires_grad:
                x.requires_grad_()
            if self.grad and self.plan.checkpointed(i):
                out = checkpointed(self.stages[j], device, x)
            else:
                out = self.stages[j](x)
        self.inputs[(i, j)], self.outputs[(i, j)] = x, out

    def backward(self, grad_output: Any) -> Tuple[Any, List[Optional[torch.Tensor]]]:
        """Run every backward cell by mirrored clock tick; return (input gradient, parameter gradients)."""
        self._start_backward(grad_output)
        ticks = one_process_ticks(self.plan.schedule, len(self.parts), self.plan.stages, "B")
        run_ticks(ticks, self._backward_cell, self.plan.stages, "B", record=self.record, lanes=self.lanes)
        return self._input_gradient(), self._param_gradients()

    def _start_backward(self, grad_output: Any) -> None:
        """Cut the output's gradient into micro-batches."""
        sizes = [part.shape[0] for part in self.parts]
        self.grad_outputs = list(torch.split(grad_output, sizes))

    def _input_gradient(self) -> Any:
        """The batch's gradient: stage 0's micro-batch input gradients joined (None: no gradient)."""
        firsts = [self.grad_inputs.get((i, 0)) for i in range(len(self.parts))]
        return None if any(g is None for g in firsts) else torch.cat(firsts)  # type: ignore[arg-type]

    def _param_gradients(self) -> List[Optional[torch.Tensor]]:
        """Every parameter's gradient summed over micro-batches (and over the stages sharing it or its copies)."""
        summed: Dict[int, Optional[torch.Tensor]] = {}
        for stage, grads in zip(self.params, self.param_grads):
            for p, g in zip(stage, grads):
                key = id(self.masters.get(id(p), p))
                old = summed.get(key)
                summed[key] = g if old is None else (old if g is None else old + g.to(old.device))
        return [summed.get(id(p)) for p in unique_params(self.params, self.masters)]

    def _backward_cell(self, i: int, j: int) -> None:
        device, last = self.devices[j], self.plan.stages - 1
        x, out = self.inputs.pop((i, j)), self.outputs.pop((i, j))
        upstream = self.grad_outputs[i] if j == last else self.grad_inputs.pop((i, j + 1))
        if upstream is None or not out.requires_grad:
            self.grad_inputs[(i, j)] = None
            return
        with device_scope(device):
            targets = ([x] if x.requires_grad else []) + [p for p in self.params[j] if p.requires_grad]
            grads = torch.autograd.grad(out, targets, upstream.to(device, non_blocking=True), allow_unused=True)
        self.grad_inputs[(i, j)] = grads[0] if x.requires_grad else None
        self._accumulate(j, grads[1:] if x.requires_grad else grads)

    def _accumulate(self, j: int, found: Sequence[Optional[torch.Tensor]]) -> None:
        """Add stage j's parameter gradients of one micro-batch (``found``: one per trainable parameter) into the step's."""
        trainable = iter(found)
        for index, p in enumerate(self.params[j]):
            if p.requires_grad:
                g = next(trainable)
                if g is not None:
                    old = self.param_grads[j][index]
                    if old is None:
                        self.param_grads[j][index] = g  # a fresh tensor from autograd.grad: ours to add into
                    else:
                        old.add_(g)


class PipeFunction(torch.autograd.Function):
    """The whole step as one node of the caller's graph (inputs: the batch and every parameter)."""

    @staticmethod
    def forward(ctx: Any, run: StepRun, batch: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.run = run
        return run.forward(grad=True)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("a pipeline step can be back-propagated once; run the forward again")
        grad_input, param_grads = run.backward(grad_output)
        return (None, grad_input, *param_grads)


def unique_params(params: Sequence[Sequence[nn.Parameter]],
                  masters: Optional[Mapping[int, Any]] = None) -> List[nn.Parameter]:
    """Every stage's parameters in order, each once (a parameter may be shared by two stages; a copy on
    another device stands for its master, ``masters``: id of a copy -> the model's parameter)."""
    seen: Dict[int, nn.Parameter] = {}
    for stage in params:
        for p in stage:
            p = (masters or {}).get(id(p), p)
            seen.setdefault(id(p), p)
    return list(seen.values())
