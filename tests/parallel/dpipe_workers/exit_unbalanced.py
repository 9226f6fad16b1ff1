"""A script that trains 2-process pipelines and simply ends, one stage finishing well before the other.

Started by tests/parallel/test_dpipe_exit.py under each launcher; not a pytest module. Two pipelines in
one process: the first is dropped after training, the second is still open when the script ends. In the
second, DPIPE_FIRST=last makes the last stage light, so its rank finishes and exits while the first
stage still has a step to compute (the SIGSEGV of a finalized MPI under the other rank); =first makes
the first stage light. Each step's loss is compared with one process training the same model, and the
rank that finishes first then sleeps a little less than the other, so it leaves while the other works.
No barrier and no collective at the end: the script ends as a user's does.
"""
import torch
from torch import nn

import dualframe.torch as hvd
from exit_order import check_losses, train_then_leave

hvd.init()
torch.set_num_threads(1)
LAYERS, WIDTH, ROWS, STEPS = 12, 512, 256, 3  # the heavy stage computes ~0.1 s a step on one thread


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def batches():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, WIDTH, generator=generator)


def one_process_losses():
    whole, (x, y) = model(), batches()
    optimizer, losses = torch.optim.SGD(whole.parameters(), lr=0.05), []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(whole(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train(balance, expected):
    pipe = hvd.DistributedPipeline(model(), balance=balance, chunks=4, loss_fn=nn.MSELoss())
    optimizer, (x, y) = torch.optim.SGD(pipe.parameters(), lr=0.05), batches()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        optimizer.step()
    check_losses(losses, expected, 1e-5, hvd.rank(), balance)
    return pipe


expected = one_process_losses()  # before training: the light rank must leave right after its last step
train_then_leave(lambda balance: train(balance, expected), LAYERS, hvd.rank())
