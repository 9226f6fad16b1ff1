"""A small torch data-parallel training whose rank ``--rank`` fails on purpose at step ``--step``.

Started by tests/parallel/test_failures.py under horovodrun and mpirun; it must end the job
(non-zero exit) with a message naming the rank and the cause. Faults:
raise, exit (os._exit(3)), kill (SIGKILL), thread (an exception in a thread), early (the rank leaves
the loop and exits 0 while the others still reduce), shape / dtype / name (collectives that disagree).
"""
import argparse
import os
import signal
import threading
import time

import torch
import torch.nn as nn

import dualframe.torch as hvd
from tests.parallel.torch_cases import small_data_parallel  # PYTHONPATH: the repo root


def inject(fault: str) -> None:
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "thread":
        worker = threading.Thread(target=lambda: 1 / 0, name="loader")
        worker.start()
        worker.join()
        time.sleep(30)  # the hook ends the process before this returns
    if fault == "early":
        raise SystemExit(0)
    if fault == "shape":
        hvd.allreduce(torch.ones(5), name="mismatch")
    if fault == "dtype":
        hvd.allreduce(torch.ones(3, dtype=torch.float64), name="mismatch")
    if fault == "name":
        hvd.allreduce(torch.ones(3), name="other name")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=3)
    args = parser.parse_args()
    hvd.init()
    model, optimizer = small_data_parallel(lr=0.1)
    for step in range(200):
        if step == args.step:
            if hvd.rank() == args.rank:
                print(f"dualframe-test: fault {args.fault} at {time.time():.3f}", flush=True)
                inject(args.fault)
            elif args.fault in ("shape", "dtype", "name"):
                hvd.allreduce(torch.ones(3), name="mismatch")
        x = torch.randn(8, 4)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        time.sleep(0.02)
    print(f"rank {hvd.rank()} finished all steps", flush=True)


if __name__ == "__main__":
    main()
