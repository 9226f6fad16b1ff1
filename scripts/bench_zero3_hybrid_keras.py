"""The Keras arm of bench_zero3_hybrid.py: a Keras hybrid (2 replicas x 2 stages) with shard=None, "gradients", "parameters".

    flock /tmp/dualframe-mp.lock mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \\
        .venv/bin/python scripts/bench_zero3_hybrid.py --framework keras

Every rank builds the three pipelines of the same model (``--depth`` Dense(width, tanh) layers, Adam,
1F1B, ``--chunks`` micro-batches) and trains them in turn, one step each per round; rank 0 prints, per
mode, the bytes each rank holds for its stage's weights (the variables' current storage, the slices and
the optimizer's state; in a step also the step's summed gradients, read after ``train_step``; the most
over the ranks) between steps and in a step, their ratio to ``shard=None``, and the median over rounds
of each round's step-time ratio to ``shard=None``.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict

import keras
import tensorflow as tf

import dualframe.tensorflow as hvd
from bench_zero3_hybrid import MODES, rounds
from dualframe.pipeline.layout import pipeline_process_sets


def build(args: argparse.Namespace, shard: Any) -> Any:
    """A hybrid pipeline of the benchmark's model and its optimizer with ``shard``."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((args.width,))] +
                             [keras.layers.Dense(args.width, activation="tanh") for _ in range(args.depth)])
    half = args.depth // 2
    pipe = hvd.DistributedPipeline(model, [half, args.depth - half], chunks=args.chunks, schedule="1f1b",
                                   loss_fn="mse", data_parallel=2)
    return pipe, pipe.distributed_optimizer(keras.optimizers.Adam(1e-4), shard=shard)


def _nbytes(value: Any) -> int:
    return int(tf.size(value)) * tf.as_dtype(value.dtype).size


def holding(pipe: Any, optimizer: Any, gradients: Any = ()) -> int:
    """Bytes of the stage's variables' storage, the optimizer's slices and state, and ``gradients``."""
    held = sum(_nbytes(v.value) for v in pipe.trainable_variables)
    if hasattr(optimizer, "parameter_bytes"):  # a sharded optimizer: its slices and their state
        held += optimizer.parameter_bytes() + optimizer.state_bytes()
    else:
        held += sum(_nbytes(v) for v in optimizer.variables if len(v.shape))
    return held + sum(_nbytes(g) for g in gradients if g is not None)


def step(pipe: Any, optimizer: Any, x: Any, held: Dict[str, int]) -> float:
    """One timed step; the bytes held after ``train_step`` (its gradients included) and after the update."""
    start = time.perf_counter()
    pipe.train_step(x, x)
    middle = time.perf_counter()
    held["in step"] = holding(pipe, optimizer, pipe.gradients)
    resumed = time.perf_counter()
    pipe.apply_gradients(optimizer)
    elapsed = time.perf_counter() - resumed + middle - start
    held["between"] = holding(pipe, optimizer)
    return elapsed


def run(args: argparse.Namespace) -> None:
    """Every rank trains the three pipelines in turn (A B C ...); rank 0 prints."""
    hvd.init(process_sets=pipeline_process_sets(4, 2))
    runs = {mode: build(args, mode) for mode in MODES}
    x = tf.random.normal([args.batch_size, args.width], seed=1)
    rounds(args, runs, step, x, hvd, f"Keras hybrid 2 x 2, {args.depth} x Dense({args.width}, tanh)")
