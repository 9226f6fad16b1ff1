"""A Hugging Face transformers GPT-2 split across processes: rank j trains decoder blocks of stage j (DistributedPipeline).

The model is built from a small config (nothing downloaded) and trained on synthetic token sequences
that follow a fixed rule (each token is the previous one plus 1, modulo the vocabulary), so the loss
visibly falls. torch.export captures the model once per rank; a cut between two decoder blocks sends
the hidden states, the attention mask and the traced batch size to the next stage.

    mpirun -np 2 python torch_examples/hf_pipeline.py
    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/hf_pipeline.py --schedule 1f1b
"""
import argparse
import time

import torch
import transformers
from torch import nn

import dualframe.torch as hvd


def build_model(vocab: int, width: int, blocks: int) -> nn.Module:
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=width, n_layer=blocks, n_head=4,
                                     use_cache=False,  # training: return logits, not a key/value cache
                                     tie_word_embeddings=False)  # the head's own weight (no weight tied across stages)
    return transformers.GPT2LMHeadModel(config)


def batches(vocab: int, batch: int, length: int, seed: int):
    """Endless batches of sequences that count up from a random start: the next token is predictable."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=generator)
        tokens = (start + torch.arange(length + 1)) % vocab
        mask = torch.ones(batch, length, dtype=torch.long)
        yield {"input_ids": tokens[:, :-1], "attention_mask": mask}, tokens[:, 1:]


def next_token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits (the model returns a CausalLMOutput) against the next token."""
    return nn.functional.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: the stages share the cores
    transformers.logging.set_verbosity_error()

    hvd.init()  # dualframe:
    torch.manual_seed(0)  # every rank builds the same model, then keeps its stage
    model = build_model(args.vocab, args.width, args.blocks)
    data = batches(args.vocab, args.batch, args.length, seed=1)
    sample, _ = next(data)
    start = time.perf_counter()
    pipe = hvd.DistributedPipeline(model, stages=hvd.size(), sample=sample,  # dualframe: blocks split evenly
                                   chunks=args.chunks, schedule=args.schedule, loss_fn=next_token_loss)
    built = time.perf_counter() - start
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)  # the local stage's parameters only
    if hvd.rank() == 0:
        print(f"built in {built:.1f} s, cut at {list(pipe.graph.split.split_points)}")

    start = time.perf_counter()
    for step in range(args.steps):
        inputs, target = next(data)
        optimizer.zero_grad()
        loss = pipe.train_step(inputs, target)  # dualframe: keyword inputs read on stage 0, targets on the last
        optimizer.step()
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    if hvd.rank() == 0:
        print(f"{args.schedule}, {hvd.size()} stages, chunks {args.chunks}: "
              f"{args.steps * args.batch / elapsed:.0f} sequences/s, final loss {loss:.4f}")


if __name__ == "__main__":
    main()
