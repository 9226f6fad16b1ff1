"""The resume workers' two phases, ``--phase crash|resume --dir FOLDER``: how the outer tests start them.

Framework-free; the workers (dpipe_workers/*_resume.py, failure_workers/torch_resume.py, run as scripts)
import it as ``tests.parallel.resume_phases`` (every launch sets PYTHONPATH to the repository root).
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Optional

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
