"""The ending both exit_unbalanced workers share: two pipelines trained, then one rank leaves while the other works.

DPIPE_FIRST=last makes the last stage of the second (kept) pipeline light, =first its first stage; the first
pipeline, balanced the other way, is dropped after training (its transport closes when collected).
"""
import os
import time


def train_then_leave(train, layers, rank):
    """``train(balance)`` twice, then the light stage's rank leaves at once and the other a second later."""
    light_last = os.environ.get("DPIPE_FIRST", "last") == "last"
    train([1, layers - 1] if light_last else [layers - 1, 1])
    kept = train([layers - 1, 1] if light_last else [1, layers - 1])
    # The heavy stage is still computing its last step when the light one gets here; the light one leaves
    # at once, the other keeps working a little after its pipeline finished (as a script that evaluates would).
    if kept.is_last == light_last:
        print(f"rank {rank}: leaving first", flush=True)
    else:
        time.sleep(1.0)
        print(f"rank {rank}: leaving after the other rank", flush=True)


def check_losses(losses, expected, tolerance, rank, balance):
    """Each step's pipeline loss within ``tolerance`` of one process's; say so on this rank."""
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) < tolerance, f"rank {rank} balance {balance} step {step}: loss {got}, one process {want}"
    print(f"rank {rank}: balance {balance}: {len(losses)} losses equal one process", flush=True)
