"""A keras_hub GPT-2 language model split across processes: one stage per rank, cut inside the transformer stack.

The model is keras_hub's ``GPT2Backbone`` built from arguments (nothing downloaded) with a Dense head
over the vocabulary, as one functional model. ``stages=`` counts its transformer layers, so two
processes each hold half the stack; the hidden states and the padding mask cross between them.
The task (synthetic): continue sequences that count up from a random token by a stride of 1, 2 or
3 (modulo the vocabulary); the loss falls as the model reads the stride from the context.

    mpirun -np 2 python tf_examples/keras_hub_pipeline.py
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/keras_hub_pipeline.py --schedule 1f1b --layers 6
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import dualframe.tensorflow as hvd  # noqa: E402


def build_model(vocab: int, layers: int, hidden: int, length: int) -> keras.Model:
    """GPT-2 backbone + language-model head, one functional model whose layers are the backbone's own."""
    keras.utils.set_random_seed(0)  # every rank builds the same model, then keeps its stage
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=4, hidden_dim=hidden,
                                             intermediate_dim=4 * hidden, max_sequence_length=length, dropout=0.0)
    logits = keras.layers.Dense(vocab, name="lm_head")(backbone.output)
    return keras.Model(backbone.input, logits, name="gpt2_lm")


def batch(rng: np.random.RandomState, rows: int, length: int, vocab: int) -> tuple:
    """Inputs (token ids and padding mask, a dict as the backbone takes it) and the next tokens as targets."""
    start = rng.randint(0, vocab, (rows, 1))
    stride = rng.randint(1, 4, (rows, 1))
    sequence = (start + stride * np.arange(length + 1)[None]) % vocab
    inputs = {"token_ids": sequence[:, :-1], "padding_mask": np.ones((rows, length), bool)}
    return inputs, sequence[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    hvd.init()  # dualframe:
    model = build_model(args.vocab, args.layers, args.hidden, args.length)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pipe = hvd.DistributedPipeline(model, stages=hvd.size(), chunks=args.chunks,  # dualframe: one stage a process,
                                   schedule=args.schedule, loss_fn=loss_fn)  # cut between transformer layers
    optimizer = keras.optimizers.Adam(args.lr)  # applied to the local stage's variables only
    if hvd.rank() == 0:
        print(f"{model.name}: {model.count_params()} parameters, {args.layers} transformer layers; "
              f"stages begin at {', '.join(pipe.split.split_points)}", flush=True)

    rng = np.random.RandomState(1)  # the same batches on every rank: stage 0 reads inputs, the last targets
    start, first = time.perf_counter(), None
    for step in range(args.steps):
        x, y = batch(rng, args.batch, args.length, args.vocab)
        loss = pipe.train_step(x, y)  # dualframe: the dict batch goes to stage 0, targets to the last
        pipe.apply_gradients(optimizer)  # dualframe: the stage's gradients, summed over micro-batches
        first = loss if first is None else first
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    elapsed = time.perf_counter() - start

    x, y = batch(rng, args.batch, args.length, args.vocab)
    logits = pipe(x)  # dualframe: inference through the stages; the logits on the last stage, None elsewhere
    if logits is not None:
        accuracy = float(np.mean(np.argmax(logits.numpy(), axis=-1)[:, 2:] == y[:, 2:]))
        print(f"last stage: next-token accuracy after the second token {accuracy:.2f} on a new batch", flush=True)
    if hvd.rank() == 0:
        print(f"{args.schedule}, {hvd.size()} stages, chunks {args.chunks}: loss {first:.3f} -> {loss:.3f}, "
              f"{args.steps * args.batch / elapsed:.0f} sequences/s (first step's tracing included)", flush=True)


if __name__ == "__main__":
    main()
