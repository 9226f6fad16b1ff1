"""Measure the peak memory of real torch training steps on the CPU, in this fresh process.

    python measure_torch.py MODULE:FUNCTION BATCH OPTIMIZER INPUT_SHAPE INPUT_DTYPE [CHECKPOINTED [NAMES]]

CHECKPOINTED (optional): comma-separated submodule names, each run under
``torch.utils.checkpoint.checkpoint`` (recomputed in backward, keeping only its inputs).
NAMES (optional): keyword inputs, as ``dualframe plan --input-names``: a transformers model called
with ``input_ids=``, ``attention_mask=`` (ones) and ``labels=`` (the token ids), trained on its loss.
Prints one JSON line: {"peak": bytes}. The peak is the resident-set high-water mark (VmHWM) during
two training steps minus the resident set just before the model is built; the high-water mark is
reset first (/proc/self/clear_refs), after a warm-up step on a tiny model has loaded torch's kernels.
"""
import gc
import importlib
import json
import sys

import torch
import torch.utils.checkpoint

from tests.core.plan.plan_models.resident import status


def _optimizer(name, parameters):
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=0.01)
    if name == "momentum":
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
    return torch.optim.Adam(parameters, lr=1e-3)


def _step(model, optimizer, batch, classes):
    optimizer.zero_grad(set_to_none=True)
    if isinstance(batch, dict):
        loss = model(**batch).loss
    else:
        output = model(batch)
        loss = torch.nn.functional.cross_entropy(output, torch.zeros(len(batch), dtype=torch.long))
    loss.backward()
    optimizer.step()


def _checkpointed(module):
    """Run ``module`` under activation checkpointing from now on."""
    forward = module.forward

    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = run


def main() -> None:
    spec, batch_size, optimizer_name, shape, input_dtype = sys.argv[1:6]
    torch.set_num_threads(1)
    shape = tuple(int(d) for d in shape.split("x"))
    module_name, function = spec.split(":")
    builder = getattr(importlib.import_module(module_name), function)
    warm = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    _step(warm, _optimizer(optimizer_name, warm.parameters()), torch.randn(2, 4), 2)
    del warm
    names = sys.argv[7].split(",") if len(sys.argv) > 7 and sys.argv[7] else []
    if names:  # a library (transformers) loads its modules at build and first call: not the model's memory
        with torch.device("meta"):
            ids = torch.zeros((int(batch_size), *shape), dtype=torch.long)
            builder()(**{name: torch.ones_like(ids) if "mask" in name else ids for name in names}).loss.backward()
    gc.collect()
    baseline = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    model = builder()
    for name in (sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else []):
        _checkpointed(model.get_submodule(name))
    optimizer = _optimizer(optimizer_name, model.parameters())
    for _ in range(2):
        if names:
            ids = torch.randint(0, 100, (int(batch_size), *shape))
            batch = {name: torch.ones_like(ids) if "mask" in name else ids for name in names}
        elif input_dtype == "int64":
            batch = torch.randint(0, 100, (int(batch_size), *shape))
        else:
            batch = torch.randn(int(batch_size), *shape)
        _step(model, optimizer, batch, 10)
    print(json.dumps({"peak": status("VmHWM") - baseline, "baseline": baseline}))


if __name__ == "__main__":
    main()
