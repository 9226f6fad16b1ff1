"""Exact resume of a torch process pipeline (2 stages, 1F1B): 10 steps straight == 5 steps, job killed, 5 resumed.

``--phase crash``: train 10 steps straight (each stage's weights in ``straight-{j}.pt``, the losses
in ``losses.json``), start again from the same seeds, save the stages every step and SIGKILL stage
1's rank after the checkpoint of step 5. ``--phase resume``: load every stage's part, train steps
6-10, compare losses and weights with the straight run, merge the stages into the full model's
checkpoint and compare it with the straight run and with one process training the plain model.
Dropout in stage 0 (rank 0's own RNG stream) and SGD momentum make the RNG and optimizer state matter.
Started by tests/parallel/test_dpipe_resume.py; not a pytest module.
"""
import os

import torch
from torch import nn

import dualframe.torch as hvd
# PYTHONPATH is the repository root (every launch sets it): tests.parallel imports from this folder too.
from tests.parallel.resume_phases import resume_stages, run_phase, save_stages_until_killed, save_straight_losses

STEPS, KILL_AFTER, BATCH, CHUNKS, TOL = 10, 5, 8, 4, 1e-6


def build():
    torch.manual_seed(7)  # the same initial weights everywhere
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))


def batch(step):
    """The data of ``step`` (its own generator: the position in the data is the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 6, generator=generator)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=generator)


def fresh():
    pipe = hvd.DistributedPipeline(build(), [3, 3], chunks=CHUNKS, schedule="1f1b", loss_fn=nn.MSELoss())
    torch.manual_seed(1234 + hvd.rank())  # each rank's own stream (dropout on stage 0)
    return pipe, torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)


def step_once(pipe, optimizer, step):
    optimizer.zero_grad()
    loss = pipe.train_step(*batch(step))
    optimizer.step()
    return loss


def reference():
    """One process, the plain model, rank 0's dropout stream, micro-batch by micro-batch: losses and weights."""
    model = build()
    torch.manual_seed(1234)
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            loss = nn.functional.mse_loss(model(xi), yi) * (len(xi) / len(x))
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses, model.state_dict()


def assert_close(got, expected, what, tol=TOL):
    for key, value in expected.items():
        error = (got[key] - value).abs().max().item()
        assert error <= tol, f"{what}: {key} differs by {error} (tolerance {tol})"


def crash(args):
    pipe, optimizer = fresh()
    losses = [step_once(pipe, optimizer, step) for step in range(STEPS)]
    torch.save(pipe.state_dict(), os.path.join(args.dir, f"straight-{pipe.stage_index}.pt"))
    save_straight_losses(args.dir, losses, writer=hvd.rank() == 0)
    pipe, optimizer = fresh()
    save_stages_until_killed(hvd, pipe, optimizer, lambda step: step_once(pipe, optimizer, step), losses, args.dir,
                             KILL_AFTER, TOL)


def resume(args):
    ckpt, merged = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "full.pt")
    pipe, optimizer = fresh()
    torch.manual_seed(999)  # another stream: the checkpoint must restore each rank's own
    straight_losses = resume_stages(hvd, pipe, optimizer, lambda step: step_once(pipe, optimizer, step), args.dir,
                                    KILL_AFTER, STEPS, TOL)
    straight = torch.load(os.path.join(args.dir, f"straight-{pipe.stage_index}.pt"), weights_only=True)
    assert_close(pipe.state_dict(), straight, f"stage {pipe.stage_index} after resuming")
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=STEPS - 1, data_position={"next_step": STEPS}, keep=2)
    if hvd.rank() == 0:
        check_merged(args.dir, ckpt, merged, straight_losses)
    hvd.broadcast(torch.zeros(1), 0, name="merged")  # full.pt is complete before anyone reads it
    again, _ = fresh()
    assert hvd.load_stage_checkpoint(merged, again).step == STEPS - 1
    assert_close(again.state_dict(), pipe.state_dict(), f"stage {again.stage_index} taken from the merged file", 0.0)
    if hvd.rank() == 0:
        print("dualframe-test: resumed run equals the straight run (losses, weights, merged full model, "
              "one-process reference)", flush=True)
    hvd.broadcast(torch.zeros(1), 0, name="done")


def check_merged(folder, ckpt, merged, straight_losses):
    """Rank 0 alone, no communication: the merged file loads into the plain model and equals the straight run."""
    hvd.merge_stage_checkpoints(ckpt, merged)
    content = torch.load(merged, weights_only=True)
    assert content["step"] == STEPS - 1 and content["optimizer"] is None, content.keys()
    full = build()
    full.load_state_dict(content["model"], strict=True)
    straight = {}
    for j in range(2):
        straight.update(torch.load(os.path.join(folder, f"straight-{j}.pt"), weights_only=True))
    assert sorted(straight) == sorted(full.state_dict()), (sorted(straight), sorted(full.state_dict()))
    assert_close(full.state_dict(), straight, "merged checkpoint vs straight run")
    losses, weights = reference()
    assert_close(full.state_dict(), weights, "merged checkpoint vs one-process reference", 1e-5)
    assert max(abs(a - b) for a, b in zip(losses, straight_losses)) <= 1e-5, (losses, straight_losses)


if __name__ == "__main__":
    run_phase(hvd.init, crash, resume)
