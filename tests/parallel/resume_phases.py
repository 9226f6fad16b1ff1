"""The resume workers' side of their contract with the outer tests: the two phases and the crash phase's kill.

``--phase crash|resume --dir FOLDER`` (test_failures.py, test_dpipe_resume.py, tests/cluster/test_resume.py
start them so), and the ``dualframe-test: fault kill at <time>`` line those tests time the end of the
job from. Framework-free (an adapter module is an argument); the workers, run as scripts, import it as
``tests.parallel.resume_phases`` (every launch sets PYTHONPATH to the repository root).
"""
from __future__ import annotations

import argparse
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
