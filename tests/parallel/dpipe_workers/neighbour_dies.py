"""Stage 1 dies (DPIPE_FAULT=die) or hangs (=hang) mid-training; stage 0 must stop with a clear error.

Started by tests/parallel/test_dpipe_failure.py under each launcher; not a pytest module.
"""
import os
import sys
import time

import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.torch.distributed_pipeline import DistributedPipeline

hvd.init()
torch.manual_seed(0)
pipe = DistributedPipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), [2, 1], chunks=2,
                           loss_fn=nn.MSELoss(), timeout=float(os.environ.get("DPIPE_TIMEOUT", "20")))
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(1000):
    if step == 3 and pipe.stage_index == 1:
        fault = os.environ.get("DPIPE_FAULT", "die")
        print(f"rank {hvd.rank()}: stage 1 {'dies' if fault == 'die' else 'hangs'} now", flush=True)
        if fault == "die":
            os._exit(7)
        time.sleep(3600)
    started = time.monotonic()
    try:
        pipe.train_step(x, y)
    except hvd.PeerLostError as error:
        print(f"rank {hvd.rank()}: PeerLostError after {time.monotonic() - started:.1f} s: {error}", flush=True)
        sys.stdout.flush()
        os._exit(3)
print("unreachable: the pipeline kept training without its neighbour", flush=True)
