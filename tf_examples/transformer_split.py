"""A Keras Transformer encoder taking (tokens, padding mask), its residual blocks each reading the mask, split in two.

One process: a GPipe Pipeline over two devices (two logical CPUs without GPUs). Under a launcher: a
DistributedPipeline, one stage per process; rank 0 chooses the cut (even bytes: a cut timed with sample=
stops on the Embedding's sparse gradient) and tells the other ranks. The task: is the marker token among
the real tokens? Padding holds random tokens too (the marker sometimes): only a model reading the mask learns it.

    python tf_examples/transformer_split.py                                    # /CPU:0 and /CPU:1, cut chosen
    python tf_examples/transformer_split.py --split-points b1_norm1 --blocks 4 --devices /GPU:0,/GPU:1
    mpirun -np 2 python tf_examples/transformer_split.py --chunks 8
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dualframe.tensorflow as hvd  # noqa: E402
from dualframe.launch.topology import detect  # noqa: E402
from dualframe.observe.timeline import report  # noqa: E402

MARKER, VOCAB = 1, 32


class Positions(keras.layers.Layer):
    """Adds a learned vector per position."""

    def build(self, input_shape: tuple) -> None:
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="table")

    def call(self, h: tf.Tensor) -> tf.Tensor:
        return h + self.table


def encoder(dim: int, heads: int, blocks: int, length: int) -> keras.Model:
    """Embedding, pre-norm residual blocks (attention that skips the padding, then an MLP), masked mean."""
    keras.utils.set_random_seed(0)  # every rank builds the same model, then keeps its stage
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    mask = keras.Input((length,), dtype="bool", name="mask")  # True: a real token (Keras' convention)
    attend = keras.layers.Reshape((1, length), name="attention_mask")(mask)  # every query sees the real keys
    h = keras.layers.Embedding(VOCAB, dim, name="embed")(tokens)
    h = Positions(name="position")(h)
    for b in range(blocks):  # every block reads the mask: it crosses to every stage
        x = keras.layers.LayerNormalization(name=f"b{b}_norm1")(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads, name=f"b{b}_attention")(x, x, attention_mask=attend)
        h = keras.layers.Add(name=f"b{b}_res1")([h, a])
        x = keras.layers.LayerNormalization(name=f"b{b}_norm2")(h)
        x = keras.layers.Dense(2 * dim, activation="gelu", name=f"b{b}_fc1")(x)
        h = keras.layers.Add(name=f"b{b}_res2")([h, keras.layers.Dense(dim, name=f"b{b}_fc2")(x)])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h, mask=mask)  # mean over the real tokens only
    return keras.Model({"tokens": tokens, "mask": mask}, keras.layers.Dense(2, name="head")(h), name="encoder")


def synthetic(rows: int, length: int, rng: np.random.RandomState) -> tuple:
    """Tokens of varying length (mask False past it); label 1 when the marker is among the real tokens."""
    tokens = rng.randint(2, VOCAB, (rows, length)).astype("int32")
    lengths = rng.randint(length // 4, length + 1, rows)
    y = rng.randint(0, 2, rows)
    for k in range(rows):
        if y[k]:
            tokens[k, rng.randint(0, lengths[k])] = MARKER
        if lengths[k] < length and rng.rand() < 0.5:  # a marker in the padding
            tokens[k, rng.randint(lengths[k], length)] = MARKER
    return {"tokens": tokens, "mask": np.arange(length)[None, :] < lengths[:, None]}, y


def rows(x: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in x.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="one process: comma-separated, one per stage (default /CPU:0,/CPU:1)")
    parser.add_argument("--split-points", help="layer names where stages 1.. begin, e.g. b1_norm1 (default: timed)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    processes = detect().distributed  # dualframe: launched with -np 2: one stage per process
    devices = None if processes else args.devices.split(",") if args.devices else hvd.logical_cpus(2)  # dualframe:
    if processes:
        hvd.init()  # dualframe:
    rank = hvd.rank() if processes else 0  # dualframe:
    model = encoder(args.dim, args.heads, args.blocks, args.length)
    rng = np.random.RandomState(1)
    x, y = synthetic(args.batch * args.steps, args.length, rng)
    test_x, test_y = synthetic(256, args.length, np.random.RandomState(2))
    cut = ({"split_points": args.split_points.split(",")} if args.split_points
           else {"stages": 2, "by": "memory"})  # dualframe: even bytes (a timed cut: see the docstring)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if processes:  # timings differ between ranks: rank 0 measures, every rank cuts where it says
        plan = hvd.ModelParallel(encoder(args.dim, args.heads, args.blocks, args.length), devices=["/CPU:0"] * 2,
                                 **cut) if rank == 0 else None
        # dualframe: a name every rank agrees on (Horovod's default is the object's type: list here, None there)
        balance = hvd.broadcast_object(plan and list(plan.balance), root_rank=0, name="balance")
        pipe = hvd.DistributedPipeline(model, balance, chunks=args.chunks, loss_fn=loss_fn)  # dualframe:
    else:
        pipe = plan = hvd.Pipeline(model, devices=devices, chunks=args.chunks, **cut)  # dualframe:
    optimizer = keras.optimizers.Adam(2e-3)  # processes: applied to the local stage's variables only
    if rank == 0:
        print(f"cut points: {list(plan.split_points)}, balance {list(plan.balance)} layers")  # dualframe:
        print(plan.describe())  # dualframe: the stages and the tensors crossing each boundary, with sizes

    forward = pipe if processes else tf.function(lambda batch: pipe(batch, training=False))

    def accuracy() -> float:
        logits = forward(test_x)  # dualframe: processes: on the last stage, None elsewhere
        value = float(np.mean(np.argmax(logits, 1) == test_y)) if logits is not None else None
        return hvd.broadcast_object(value, root_rank=hvd.size() - 1, name="accuracy") if processes else value

    def eager_step(batch: dict, labels: np.ndarray) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(labels, pipe(batch, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(loss, pipe.trainable_variables), pipe.trainable_variables))
        return loss

    graph_step = tf.function(eager_step)  # one process: the whole pipelined step traced once

    def one_step(batch: dict, labels: np.ndarray) -> float:
        if processes:
            loss = pipe.train_step(batch, labels)  # dualframe: inputs read on stage 0, labels on the last
            pipe.apply_gradients(optimizer)  # dualframe: the stage's gradients, summed over micro-batches
            return loss
        return float(graph_step(batch, labels))

    start = time.perf_counter()
    for step in range(args.steps):
        s = step * args.batch
        loss = one_step(rows(x, s, s + args.batch), y[s:s + args.batch])
        if step % 10 == 0 or step == args.steps - 1:
            held_out = accuracy()
            if rank == 0:
                print(f"step {step:3d}  loss {loss:.4f}  held-out accuracy {held_out:.2f}", flush=True)
    elapsed = time.perf_counter() - start

    if processes:
        timings = pipe.timings()  # dualframe: every stage's line (a collective), printed on rank 0
        text = "\n".join("  " + line for line in timings)
    else:
        with pipe.record() as timeline:  # dualframe: one eager step, each (micro-batch, stage) cell timed
            eager_step(rows(x, 0, args.batch), y[:args.batch])
        text = report(timeline.events)
    if rank == 0:
        print(f"{args.steps} steps in {elapsed:.2f} s (tracing, accuracy checks included), chunks {args.chunks}")
        print(text)


if __name__ == "__main__":
    main()
