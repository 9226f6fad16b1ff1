"""Exact resume of torch data parallelism: 10 steps straight == 5 steps, job killed, resumed for 5.

``--phase crash``: train 10 steps straight (weights kept in ``straight.pt``), then start again from
the same seeds, checkpointing every step, and SIGKILL rank 1 after the checkpoint of step 5.
``--phase resume``: load the newest checkpoint, train to step 10, compare with ``straight.pt``.
Dropout, per-rank random data and SGD momentum make the RNG and optimizer state matter.
"""
import os

import torch
import torch.nn as nn

import dualframe.torch as hvd
from tests.parallel.resume_phases import kill_after_checkpoint, run_phase  # PYTHONPATH: the repo root

STEPS, KILL_AFTER = 10, 5


def fresh():
    torch.manual_seed(1234 + hvd.rank())  # per-rank streams: dropout and data differ by rank
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())
    return model, optimizer


def train(model, optimizer, start, stop, on_step=None):
    for step in range(start, stop):
        x = torch.randn(4, 6)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        if on_step:
            on_step(step)


def crash(args) -> None:
    model, optimizer = fresh()
    train(model, optimizer, 0, STEPS)
    if hvd.rank() == 0:
        torch.save(model.state_dict(), os.path.join(args.dir, "straight.pt"))
    model, optimizer = fresh()

    def save(step):
        hvd.save_checkpoint(os.path.join(args.dir, "ckpt"), model, optimizer, step=step,
                            data_position={"next_step": step + 1}, keep=2)
        kill_after_checkpoint(step, KILL_AFTER, victim=hvd.rank() == 1)

    train(model, optimizer, 0, STEPS, save)
    raise AssertionError("rank 1 should have been killed")


def resume(args) -> None:
    straight, ckpt = os.path.join(args.dir, "straight.pt"), os.path.join(args.dir, "ckpt")
    model, optimizer = fresh()
    torch.manual_seed(999)  # a different stream: the checkpoint must restore the saved one
    state = hvd.load_checkpoint(ckpt, model, optimizer)
    assert state is not None and state.data_position == {"next_step": KILL_AFTER}, state
    train(model, optimizer, state.data_position["next_step"], STEPS)
    if hvd.rank() == 0:
        expected = torch.load(straight, weights_only=True)
        for key, value in model.state_dict().items():
            error = (value - expected[key]).abs().max().item()
            assert error < 1e-6, f"{key} differs from the straight run by {error}"
        print(f"dualframe-test: resumed run equals the straight run ({len(expected)} tensors)", flush=True)
    hvd.broadcast(torch.zeros(1), 0, name="done")


if __name__ == "__main__":
    run_phase(hvd.init, crash, resume)
