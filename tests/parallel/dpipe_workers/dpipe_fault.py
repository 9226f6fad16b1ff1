"""The failing loop both neighbour_dies workers share: stage 1 dies or hangs after 3 steps, stage 0 reports how it stopped."""
import os
import time


def train_until_fault(pipe, train_step, rank, lost_error):
    """Train until stage 1 fails (DPIPE_FAULT=die: exit 7; =hang: sleep) and stage 0 catches ``lost_error`` (exit 3)."""
    for step in range(1000):
        if step == 3 and pipe.stage_index == 1:
            fault = os.environ.get("DPIPE_FAULT", "die")
            print(f"rank {rank}: stage 1 {'dies' if fault == 'die' else 'hangs'} now", flush=True)
            if fault == "die":
                os._exit(7)
            time.sleep(3600)
        started = time.monotonic()
        try:
            train_step()
        except lost_error as error:
            print(f"rank {rank}: PeerLostError after {time.monotonic() - started:.1f} s: {error}", flush=True)
            os._exit(3)
    print("unreachable: the pipeline kept training without its neighbour", flush=True)
