"""Torch data parallelism on the cluster's nodes that trains until the test breaks a node.

Started by tests/cluster/test_faults.py; rank 0 prints ``dualframe-test: step N`` every 10 steps so
the test knows training runs before it cuts a node off (its veth down) or kills the node's processes.
"""
import time

import torch
import torch.nn as nn

import dualframe.torch as hvd
from tests.parallel.torch_cases import small_data_parallel  # PYTHONPATH: the repo root


def main() -> None:
    hvd.init()
    model, optimizer = small_data_parallel(lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step in range(100000):  # about 80 minutes: the test ends it long before
        optimizer.zero_grad()
        nn.functional.mse_loss(model(hvd.shard_batch(x)), hvd.shard_batch(y)).backward()
        optimizer.step()
        if hvd.rank() == 0 and step % 10 == 0:
            print(f"dualframe-test: step {step} on {hvd.size()} ranks", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
