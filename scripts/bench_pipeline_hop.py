"""Round trip of one pipeline message between 2 processes, per transport (torch): point-to-point vs Horovod broadcasts.

    OMP_NUM_THREADS=1 horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/bench_pipeline_hop.py
    mpirun --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_pipeline_hop.py

Rank 0 sends an activation-sized tensor (rows x width float32) to rank 1, which sends it back, the
way a pipeline's forward and gradient messages go; interleaved rounds (A B A B ...), each the
median round trip of ``--trips`` trips, then the median over rounds. What the figures isolate from
``bench_dist_pipeline.py``: the transport, with no computation in between.
"""
import statistics
import time

import torch

import bench_common
import dualframe.torch as hvd
from dualframe.pipeline.link import wait_for
from dualframe.torch.pipeline.link import TorchWire, point_to_point, process_sets


def main() -> None:
    args = bench_common.parser(__doc__, rows=256, width=512, rounds=5, trips=50).parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, peer = hvd.rank(), 1 - hvd.rank()
    direct = point_to_point(torch.device("cpu"), 8, "hop")
    wire, pair = TorchWire(), process_sets([[0, 1]])[(0, 1)]
    x = torch.randn(args.rows, args.width)
    count = iter(range(10**9))

    def over_direct(tensor: torch.Tensor, sender: int) -> None:
        if rank == sender:
            wait_for(direct, direct.send(tensor, peer, 0), "send", 30.0)
        else:
            wait_for(direct, direct.receive(torch.empty_like(tensor), peer, 0), "receive", 30.0)

    def over_horovod(tensor: torch.Tensor, sender: int) -> None:
        buffer = tensor if rank == sender else torch.empty_like(tensor)
        wait_for(wire, wire.broadcast(buffer, sender, f"hop.{next(count)}", pair), "broadcast", 30.0)

    ways = {"Horovod broadcasts": over_horovod}
    if direct is not None:
        ways[f"{direct.name} point-to-point"] = over_direct
    medians = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, hop in ways.items():
            trips = []
            for _ in range(args.trips):
                begin = time.perf_counter()
                hop(x, 0)
                hop(x, 1)
                trips.append(time.perf_counter() - begin)
            medians[name].append(statistics.median(trips))
    if rank == 0:
        print(f"round trip of {args.rows} x {args.width} float32 ({x.numel() * 4 / 2**10:.0f} KiB), "
              f"{args.rounds} rounds of {args.trips} trips")
        for name, values in medians.items():
            print(f"{name}: median {statistics.median(values) * 1e3:.2f} ms "
                  f"(rounds: {' '.join(f'{v * 1e3:.2f}' for v in values)})", flush=True)


if __name__ == "__main__":
    main()
