"""The memory advisor behind ``dualframe plan``: framework-neutral arithmetic over a measured model.

Example:
    >>> from dualframe.plan import Hardware, ModelSpec, Training, advise, measure
    >>> (profile,), devices = measure([ModelSpec("my_models:mlp", (784,))])      # doctest: +SKIP
    >>> plan = advise(profile, Training(batch_size=64), Hardware(16 * 2**30, 4))  # doctest: +SKIP
    >>> plan.recommended.kind                                                     # doctest: +SKIP
    'data parallel'
"""
from dualframe.plan.advisor import Option, Plan, advise, bubble, options, pipeline_chunks
from dualframe.plan.hardware import Hardware, detect as detect_hardware, format_bytes, parse_bytes
from dualframe.plan.memory import Memory, Training, group_memory
from dualframe.plan.probe import ModelSpec, ProbeError, measure
from dualframe.plan.cuts import checkpoint_starts, stage_starts
from dualframe.plan.profile import LayerProfile, ModelProfile, Shared, Value
from dualframe.plan.units import merge_units
from dualframe.plan.report import render, to_json

__all__ = [
    "Option", "Plan", "advise", "bubble", "options", "pipeline_chunks", "Hardware", "detect_hardware",
    "format_bytes", "parse_bytes", "Memory", "Training", "group_memory", "ModelSpec", "ProbeError",
    "measure", "LayerProfile", "ModelProfile", "Shared", "Value", "merge_units", "checkpoint_starts", "stage_starts", "render", "to_json",
]
