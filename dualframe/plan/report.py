"""A plan as text and JSON: the options table, the recommendation and its exact dualframe arguments."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List, Mapping, Optional

from dualframe.plan.advisor import Option, Plan
from dualframe.plan.hardware import Hardware, format_bytes
from dualframe.strategy import DataParallel, Hybrid, ModelParallel, Pipeline



class _Code(str):
    """Python source that is shown as is inside another call."""

    def __repr__(self) -> str:
        return str(self)


def _call(name: str, kwargs: Mapping[str, Any]) -> _Code:
    return _Code(f"dualframe.{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")")


def strategy_call(option: Option, framework: str, hardware: Hardware) -> str:
    """The dualframe strategy to construct, as Python; built once here so its arguments are valid."""
    balance = list(option.balance)
    in_one_process = option.replicas == 1 and option.stages <= hardware.devices_per_node
    if option.kind.startswith("data parallel"):
        kwargs: Dict[str, Any] = {}
        if option.backward_passes_per_step > 1:
            kwargs["backward_passes_per_step"] = option.backward_passes_per_step
        if option.shard:
            kwargs["shard"] = option.shard
        DataParallel(**kwargs)
        return _call("DataParallel", kwargs)
    devices = list(hardware.device_names(option.stages, framework))
    if option.kind == "model split":
        ModelParallel(balance, devices)
        return _call("ModelParallel", {"balance": balance, "devices": devices})
    pipeline: Dict[str, Any] = {"balance": balance, "chunks": option.chunks, "checkpoint": option.checkpoint}
    if in_one_process:
        Pipeline(balance, devices, option.chunks, option.checkpoint)
        return _call("Pipeline", {**pipeline, "devices": devices})
    Hybrid(Pipeline(balance, None, option.chunks, option.checkpoint), stages_as_processes=True)
    return _call("Hybrid", {"pipeline": _call("Pipeline", pipeline), "stages_as_processes": True})


def processes(option: Option, hardware: Hardware) -> int:
    """Processes to launch: one per device, except a pipeline that lives in one process."""
    if option.replicas == 1 and 1 < option.stages <= hardware.devices_per_node:
        return 1
    return option.devices


def launch_line(option: Option, hardware: Hardware, script: str = "train.py") -> str:
    """The ``dualframe run`` line that starts the option."""
    hosts = " --hostfile hosts" if hardware.nodes > 1 and processes(option, hardware) > hardware.devices_per_node else ""
    return f"dualframe run -np {processes(option, hardware)}{hosts} {script}"


def adapter_line(option: Option, framework: str, hardware: Hardware) -> str:
    """The same choice as a call of the framework's adapter (``import dualframe.torch as hvd`` ...)."""
    balance, chunks, checkpoint = list(option.balance), option.chunks, option.checkpoint
    devices = list(hardware.device_names(option.stages, framework))
    model = "model" if framework == "torch" else "layers"
    if option.kind.startswith("data parallel"):
        passes = f", backward_passes_per_step={option.backward_passes_per_step}" if option.backward_passes_per_step > 1 else ""
        named = ", named_parameters=model.named_parameters()" if framework == "torch" else ""
        shard = f", shard={option.shard!r}" if option.shard else ""
        if option.shard == "parameters" and framework != "torch":  # Keras: a new model, holding no values
            return f"optimizer = hvd.DistributedOptimizer(optimizer{passes}{shard}); model = optimizer.shard_model(model)"
        shard += ", model=model" if option.shard == "parameters" else ""
        return f"optimizer = hvd.DistributedOptimizer(optimizer{named}{passes}{shard})"
    if option.kind == "model split":
        return f"model = hvd.ModelParallel({model}, balance={balance}, devices={devices})"
    if processes(option, hardware) == 1:
        return (f"model = hvd.Pipeline({model}, balance={balance}, devices={devices}, chunks={chunks}, "
                f"checkpoint={checkpoint!r})")
    replicas = f", data_parallel={option.replicas}" if option.replicas > 1 else ""
    return (f"pipe = hvd.DistributedPipeline({model}, {balance}, chunks={chunks}, loss_fn=loss_fn{replicas}, "
            f"checkpoint={checkpoint!r})")


def extra_lines(option: Option, framework: str = "torch") -> List[str]:
    """What the training script changes besides the strategy (split points, checkpointing, batch per pass)."""
    lines = []
    points = list(option.split_points)
    if option.stages > 1:
        lines.append(f"split_points={points}  # where stages 2.. begin; for a graph model pass these, not balance=")
    if option.cuts:
        how = ("torch.utils.checkpoint.checkpoint(segment, ..., use_reentrant=False)" if framework == "torch"
               else "keras.remat(segment)")
        lines.append(f"# checkpoint each segment of the graph, segments beginning at split_points={points}: {how}")
    elif option.checkpoint == "segments":
        lines.append(f"output = torch.utils.checkpoint.checkpoint_sequential(model, {option.segments}, batch, "
                     "use_reentrant=False)")
    if option.checkpoint == "layers":
        lines.append('with keras.RematScope(mode="full"): model = build_model()')
    if option.backward_passes_per_step > 1:
        lines.append(f"# feed {option.backward_passes_per_step} batches per optimizer step "
                     f"(backward_passes_per_step), each 1/{option.backward_passes_per_step} of the batch")
    return lines


_COLUMNS = ("option", "devices", "per device", "params", "grads", "optimizer", "activations", "buffers",
            "fits", "bubble")


def _row(option: Option, recommended: Optional[Option]) -> List[str]:
    memory = option.memory
    mark = "* " if option is recommended else "  "
    label = option.kind + (f" x{option.stages}" if option.stages > 1 else "")
    if option.backward_passes_per_step > 1:
        label += f" ({option.backward_passes_per_step} passes)"
    return [mark + label, str(option.devices), format_bytes(memory.total), format_bytes(memory.parameters),
            format_bytes(memory.gradients), format_bytes(memory.optimizer), format_bytes(memory.activations),
            format_bytes(memory.buffers), "yes" if option.fits else "NO",
            f"{option.bubble:.0%}" if option.stages > 1 else "-"]


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[c]) if c == 0 else cell.rjust(widths[c]) for c, cell in enumerate(row)).rstrip()
            for row in rows]


def render(plan: Plan, script: str = "train.py") -> str:
    """The plan as readable text: what was measured, the table, the recommendation."""
    p, t, h = plan.profile, plan.training, plan.hardware
    lines = [
        f"model     {p.framework} {p.source}: {p.num_layers} {'nodes (a graph)' if p.is_graph else 'layers'}, "
        f"{p.parameters / 1e6:.2f} M parameters ({p.dtype}), "
        f"input {list(p.input_shape)}",
        f"training  batch {t.batch_size} per replica, {t.optimizer}, "
        f"{'mixed precision' if t.mixed_precision else t.dtype}",
        f"hardware  {h.nodes} node(s) x {h.devices_per_node} {h.kind} device(s), {format_bytes(h.memory_per_device)} "
        f"each, {format_bytes(h.usable_memory)} usable ({h.headroom:.0%} kept free)",
        "",
    ]
    lines += _table([list(_COLUMNS)] + [_row(o, plan.recommended) for o in plan.options])
    staged = [o for o in plan.options if o.stages > 1]
    if staged:
        lines += [""] + [f"{o.kind} x{o.stages} begins stages at split_points={list(o.split_points)}" for o in staged]
    lines += ["", f"why: {plan.reason}"]
    if plan.recommended is not None:
        lines += recommendation_lines(plan, script)
    return "\n".join(lines + [f"note: {note}" for note in p.notes])


def recommendation_lines(plan: Plan, script: str = "train.py") -> List[str]:
    """The recommended option's arguments and launch line."""
    option, framework = plan.recommended, plan.profile.framework
    assert option is not None
    lines = [f"recommended: {option.kind}" + (f", {option.stages} stages" if option.stages > 1 else "")
             + (f", bubble {option.bubble:.0%}" if option.stages > 1 else ""),
             f"  strategy = {strategy_call(option, framework, plan.hardware)}",
             f"  {adapter_line(option, framework, plan.hardware)}"]
    lines += [f"  {line}" for line in extra_lines(option, framework)]
    if 1 < option.stages and option.chunks < 4 * option.stages:
        lines.append(f"  # chunks {option.chunks} < 4 x {option.stages} stages: the batch ({plan.training.batch_size}) "
                     f"caps the micro-batches; a larger batch shrinks the bubble")
    lines.append(f"  {launch_line(option, plan.hardware, script)}")
    for other in plan.alternatives:
        lines.append(f"  or: {other.kind}: {strategy_call(other, framework, plan.hardware)}")
    return lines


def _option_json(option: Option, plan: Plan, script: str) -> Dict[str, Any]:
    data = {key: value for key, value in asdict(option).items() if key != "memory"}
    data.update(balance=list(option.balance), devices=option.devices, bubble=option.bubble,
                cuts=list(option.cuts), split_points=list(option.split_points),
                memory={**asdict(option.memory), "total": option.memory.total},
                strategy=strategy_call(option, plan.profile.framework, plan.hardware),
                adapter=adapter_line(option, plan.profile.framework, plan.hardware),
                extra=extra_lines(option, plan.profile.framework),
                launch=launch_line(option, plan.hardware, script))
    return data


def to_json(plan: Plan, script: str = "train.py") -> Dict[str, Any]:
    """The plan as plain data (what ``dualframe plan --json`` prints)."""
    recommended = plan.recommended
    return {
        "model": plan.profile.to_dict(),
        "training": asdict(plan.training),
        "hardware": {**asdict(plan.hardware), "devices": plan.hardware.devices,
                     "usable_memory": plan.hardware.usable_memory},
        "options": [_option_json(o, plan, script) for o in plan.options],
        "recommended": _option_json(recommended, plan, script) if recommended else None,
        "alternatives": [_option_json(o, plan, script) for o in plan.alternatives],
        "reason": plan.reason,
    }
