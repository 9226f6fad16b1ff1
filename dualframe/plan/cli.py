"""``dualframe plan``: arguments, and the run from a model spec to the printed plan."""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional, Tuple

from dualframe.errors import DualframeError
from dualframe.plan.advisor import advise
from dualframe.plan.hardware import detect, parse_bytes
from dualframe.plan.memory import OPTIMIZER_SLOTS, Training
from dualframe.plan.probe import FRAMEWORKS, ModelSpec, measure
from dualframe.plan.profile import DTYPE_BYTES
from dualframe.plan.report import render, to_json


def shape(text: str) -> Tuple[int, ...]:
    """``"3,224,224"`` or ``"3x224x224"`` as a tuple of ints."""
    parts = [p for p in re.split(r"[,x\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"an input shape is ints >= 1 without the batch, e.g. 3,224,224 (got {text!r})")
    return tuple(int(p) for p in parts)


def names(text: str) -> Tuple[str, ...]:
    """``"input_ids,attention_mask"`` as a tuple of names."""
    parts = tuple(p for p in re.split(r"[,\s]+", text.strip()) if p)
    if not parts or not all(p.isidentifier() for p in parts):
        raise argparse.ArgumentTypeError(f"input names are identifiers separated by commas, e.g. "
                                         f"input_ids,attention_mask (got {text!r})")
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments."""
    parser.add_argument("model", help="module:function or file.py:function building a torch or Keras model, "
                                      "or a saved Keras model (.keras, .h5, SavedModel folder)")
    parser.add_argument("--input-shape", type=shape, required=True, help="one sample's shape, e.g. 3,224,224")
    parser.add_argument("--input-dtype", default="float32", help="float32, or int64 (torch) / int32 (Keras) token ids")
    parser.add_argument("--input-names", type=names, default=(),
                        help="keyword inputs, each of --input-shape, e.g. input_ids,attention_mask (a name with "
                             "'mask' in it is a mask of ones); default: input_ids and attention_mask for int "
                             "inputs when forward takes input_ids (transformers), a Keras model's own input names")
    parser.add_argument("--framework", choices=FRAMEWORKS, default="auto", help="default: from what the module loads, else from the built model's classes")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per replica per step (default 32)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZER_SLOTS), default="adam")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default=None,
                        help="parameter dtype (default: the model's)")
    parser.add_argument("--mixed-precision", action="store_true", help="float16/bfloat16 compute, float32 weights")
    parser.add_argument("--memory-per-device", type=parse_bytes, default=None,
                        help="e.g. 16GiB, 80GB (default: the visible GPUs', else this machine's RAM)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="default: the visible GPUs, else 1")
    parser.add_argument("--nodes", type=int, default=None, help="default: SLURM_JOB_NUM_NODES, else 1")
    parser.add_argument("--device-kind", choices=("cpu", "gpu"), default=None,
                        help="device names in the arguments (default: gpu when GPUs are seen or sizes are given)")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of each device kept free (default 0.1)")
    parser.add_argument("--script", default="train.py", help="training script named in the launch line")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    """Measure, plan, print. Exit 0 with a recommendation, 1 when nothing fits, 2 on bad input."""
    try:
        spec = ModelSpec(args.model, args.input_shape, args.input_dtype, args.framework, args.input_names)
        # Checked before the (slow) probe; rebuilt after it with the model's own dtype.
        training = Training(args.batch_size, args.optimizer, args.dtype or "float32", args.mixed_precision)
        (profile,), devices = measure([spec])
        training = Training(args.batch_size, args.optimizer, args.dtype or profile.dtype, args.mixed_precision)
        hardware = detect(devices, memory_per_device=args.memory_per_device, devices_per_node=args.devices_per_node,
                          nodes=args.nodes, kind=args.device_kind, headroom=args.headroom)
    except DualframeError as error:
        print(f"dualframe plan: {error}", file=sys.stderr)
        return 2
    plan = advise(profile, training, hardware)
    print(json.dumps(to_json(plan, args.script), indent=2) if args.json else render(plan, args.script))
    return 0 if plan.recommended is not None else 1


def run(argv: Optional[list] = None) -> int:
    """``main`` from a list of arguments (for tests and ``python -m dualframe.plan.cli``)."""
    parser = argparse.ArgumentParser(prog="dualframe plan")
    add_arguments(parser)
    return main(parser.parse_args(argv))
