"""Keras twin of neighbour_dies.py: stage 1 dies (DPIPE_FAULT=die) or hangs (=hang) after 3 steps; stage 0 must stop clearly.

Started by tests/parallel/test_dpipe_failure.py under each launcher; not a pytest module.
"""
import os

import keras
import numpy as np

import dualframe.tensorflow as hvd
from dpipe_fault import train_until_fault
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline

hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)])
pipe = DistributedPipeline(model, [1, 1], chunks=2, loss_fn="mse",
                           timeout=float(os.environ.get("DPIPE_TIMEOUT", "20")))
rng = np.random.RandomState(0)
x, y = rng.randn(8, 4).astype("float32"), rng.randn(8, 1).astype("float32")
train_until_fault(pipe, lambda: pipe.train_step(x, y), hvd.rank(), hvd.PeerLostError)
