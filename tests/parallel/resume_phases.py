"""The resume workers' side of their contract with the outer tests: the two phases and the crash phase's kill.

``--phase crash|resume --dir FOLDER`` (test_failures.py, test_dpipe_resume.py, tests/cluster/test_resume.py
start them so), and the ``dualframe-test: fault kill at <time>`` line those tests time the end of the
job from. Framework-free (an adapter module is an argument); the workers, run as scripts, import it as
``tests.parallel.resume_phases`` (every launch sets PYTHONPATH to the repository root).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any, Callable, List, Optional, Sequence

PHASES = ("crash", "resume")


def phase_parser() -> argparse.ArgumentParser:
    """A resume worker's arguments: ``--phase crash|resume --dir FOLDER`` (a worker may add its own)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=PHASES, required=True)
    parser.add_argument("--dir", required=True)
    return parser


def run_phase(init: Callable[[], object], crash: Callable[[argparse.Namespace], None],
              resume: Callable[[argparse.Namespace], None], argv: Optional[List[str]] = None) -> None:
    """Parse ``--phase`` and ``--dir``, start the adapter (``init``), then run that phase with the arguments."""
    args = phase_parser().parse_args(argv)
    init()
    crash(args) if args.phase == "crash" else resume(args)


def kill_after_checkpoint(step: int, kill_after: int, victim: bool) -> None:
    """SIGKILL this process once step ``kill_after - 1`` is saved, where ``victim`` (the rank the test loses)."""
    if step + 1 == kill_after and victim:
        print(f"dualframe-test: fault kill at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def save_straight_losses(folder: str, losses: Sequence[float], writer: bool) -> None:
    """Keep the straight run's losses for the resume phase (``writer``: the one rank that writes them)."""
    if writer:
        with open(os.path.join(folder, "losses.json"), "w") as handle:
            json.dump(list(losses), handle)


def save_stages_until_killed(adapter: Any, pipe: Any, optimizer: Any, step_once: Callable[[int], float],
                             straight_losses: Sequence[float], folder: str, kill_after: int, tol: float) -> None:
    """A process pipeline's crash phase, trained again from the straight run's start: each step's loss equals
    the straight run's, every stage is saved each step (``adapter.save_stage_checkpoint``, keep 2), and
    stage 1's rank is SIGKILLed after the checkpoint of step ``kill_after - 1``."""
    for step, expected in enumerate(straight_losses):
        loss = step_once(step)
        assert abs(loss - expected) <= tol, f"step {step}: loss {loss} != straight {expected}"
        adapter.save_stage_checkpoint(os.path.join(folder, "ckpt"), pipe, optimizer, step=step,
                                      data_position={"next_step": step + 1}, keep=2)
        kill_after_checkpoint(step, kill_after, pipe.stage_index == 1)
    raise AssertionError("stage 1 should have been killed")


def resume_stages(adapter: Any, pipe: Any, optimizer: Any, step_once: Callable[[int], float], folder: str,
                  kill_after: int, steps: int, tol: float) -> List[float]:
    """A process pipeline's resume phase up to the comparisons of weights: load every stage's part of the
    checkpoint of step ``kill_after - 1``, train the remaining steps, each loss equal to the straight run's.

    Returns the straight run's losses (``save_straight_losses``).
    """
    state = adapter.load_stage_checkpoint(os.path.join(folder, "ckpt"), pipe, optimizer)
    assert state is not None and state.step == kill_after - 1, state
    assert state.data_position == {"next_step": kill_after}, state
    with open(os.path.join(folder, "losses.json")) as handle:
        straight_losses: List[float] = json.load(handle)
    for step in range(kill_after, steps):
        loss = step_once(step)
        assert abs(loss - straight_losses[step]) <= tol, f"step {step}: loss {loss} != straight {straight_losses[step]}"
    return straight_losses
