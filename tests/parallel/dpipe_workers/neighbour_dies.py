"""Stage 1 dies (DPIPE_FAULT=die) or hangs (=hang) mid-training; stage 0 must stop with a clear error.

Started by tests/parallel/test_dpipe_failure.py under each launcher; not a pytest module.
"""
import os

import torch
from torch import nn

import dualframe.torch as hvd
from dpipe_fault import train_until_fault
from dualframe.torch.pipeline.distributed import DistributedPipeline

hvd.init()
torch.manual_seed(0)
pipe = DistributedPipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), [2, 1], chunks=2,
                           loss_fn=nn.MSELoss(), timeout=float(os.environ.get("DPIPE_TIMEOUT", "20")))
x, y = torch.randn(8, 4), torch.randn(8, 1)
train_until_fault(pipe, lambda: pipe.train_step(x, y), hvd.rank(), hvd.PeerLostError)
