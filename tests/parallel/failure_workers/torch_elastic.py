"""Elastic torch data parallelism: a worker SIGKILLed mid-epoch, the survivor restores the last commit and finishes.

Started by tests/parallel/test_failures.py with ``dualframe run`` (horovodrun --min-np 1 --max-np 2,
a discovery script naming this machine twice). Rank 1 kills itself before step ``KILL_AT``; the
survivor rolls back to the commit of step ``COMMIT_EVERY * (KILL_AT // COMMIT_EVERY)`` and trains
alone to ``STEPS``. It then checks its weights against a one-process reference that trains on both
ranks' batches up to that commit and on rank 0's alone after it (SGD with momentum: the optimizer's
state must be rolled back too).

``--grow MARKER``: started on one worker (the discovery script lists one slot until MARKER exists).
Each step trains on one global batch of ``GLOBAL`` rows split over the current workers, so the
result does not depend on the world size. After the commit of step ``COMMIT_EVERY`` the worker
writes MARKER and waits (committing, which is where Horovod notices new hosts) until a second worker
joins; the two finish, and both must equal a one-process reference on the whole batches, and each other.

``--shard optimizer|gradients``: the same runs with a sharded optimizer, whose state is gathered at
each commit and re-cut for the new number of workers at each reset.
"""
import argparse
import os
import pathlib
import signal
import time

import torch
import torch.nn as nn

import dualframe.torch as hvd
from dualframe.torch.reliability import elastic

STEPS, KILL_AT, COMMIT_EVERY = 12, 7, 3
GLOBAL, GROW_WAIT_S = 8, 150.0


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 6, generator=generator)
    return x, x.sum(1, keepdim=True)


def fresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_step(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def reference():
    model, optimizer = fresh()
    commit = COMMIT_EVERY * (KILL_AT // COMMIT_EVERY)
    for step in range(STEPS):
        parts = [batch(step, r) for r in ((0, 1) if step < commit else (0,))]
        one_step(model, optimizer, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    return model


def global_batch(step):
    return torch.randn(GLOBAL, 6, generator=torch.Generator().manual_seed(7000 + step))


def shard(step):
    """This worker's rows of the step's global batch (equal shares: averaging the gradients = the whole batch)."""
    x = global_batch(step)
    rows = GLOBAL // hvd.size()
    x = x[hvd.rank() * rows:(hvd.rank() + 1) * rows]
    return x, x.sum(1, keepdim=True)


def grow_reference():
    model, optimizer = fresh()
    for step in range(STEPS):
        x = global_batch(step)
        one_step(model, optimizer, x, x.sum(1, keepdim=True))
    return model


def wait_for_a_second_worker(state, marker):
    """Hold training (committing) until Horovod resets with a new worker: HostsUpdatedInterrupt leaves this loop."""
    marker.write_text("committed\n")
    print(f"dualframe-test: wrote {marker.name} after step {state.step}, waiting for a worker", flush=True)
    deadline = time.monotonic() + GROW_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        state.commit()
    raise SystemExit(f"no second worker joined within {GROW_WAIT_S} s of {marker}")


def grow(marker, shard_mode=None):
    hvd.init()
    model, optimizer = fresh()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), shard=shard_mode)
    state = elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: print(f"dualframe-test: reset, now {hvd.size()} worker(s)", flush=True)])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            one_step(state.model, state.optimizer, *shard(state.step))
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                if state.step == COMMIT_EVERY and hvd.size() == 1:
                    wait_for_a_second_worker(state, marker)

    train(state)
    assert hvd.size() == 2, f"the job ended on {hvd.size()} worker(s), it never grew"
    flat = torch.cat([v.flatten() for v in model.state_dict().values()])
    gathered = hvd.allgather(flat[None]).reshape(2, -1)
    assert torch.equal(gathered[0], gathered[1]), f"the workers differ by {(gathered[0] - gathered[1]).abs().max()}"
    for (name, value), want in zip(model.state_dict().items(), grow_reference().state_dict().values()):
        error = (value - want).abs().max().item()
        assert error <= 1e-5, f"{name} differs from the one-process reference by {error}"
    print(f"dualframe-test: grown run finished {STEPS} steps on {hvd.size()} workers, rank {hvd.rank()} equal to "
          f"the reference and to the other worker", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grow", type=pathlib.Path, help="marker file the discovery script waits for")
    parser.add_argument("--shard", default=None, help="DistributedOptimizer(shard=...): re-cut at each reset")
    args = parser.parse_args()
    if args.grow:
        return grow(args.grow, args.shard)
    hvd.init()
    model, optimizer = fresh()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), shard=args.shard)
    state = elastic.TorchState(model, optimizer, step=0, restarts=0)
    state.register_reset_callbacks([lambda: print(f"dualframe-test: reset, now {hvd.size()} worker(s)", flush=True)])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == KILL_AT and hvd.size() == 2 and hvd.rank() == 1:
                print(f"dualframe-test: fault kill at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            one_step(state.model, state.optimizer, *batch(state.step, hvd.rank()))
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    expected = reference()
    for (name, value), want in zip(model.state_dict().items(), expected.state_dict().values()):
        error = (value - want).abs().max().item()
        assert error < 1e-5, f"{name} differs from the reference by {error}"
    print(f"dualframe-test: elastic run finished {STEPS} steps on {hvd.size()} worker(s), equal to the reference",
          flush=True)


if __name__ == "__main__":
    main()
