"""The ``dualframe`` command line: subcommands dispatch to the modules that own them."""
from __future__ import annotations

import argparse
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="dualframe", description="Data, model and pipeline parallelism for torch and Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the installation, the Horovod build and the launcher environment")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--require", action="append", default=[], choices=("torch", "tensorflow"),
                        help="fail unless this framework works with Horovod (repeatable)")
    from dualframe.observe.charts import add_arguments as add_timeline_arguments
    from dualframe.plan.cli import add_arguments as add_plan_arguments
    from dualframe.launch.run import add_arguments as add_run_arguments

    add_plan_arguments(sub.add_parser("plan", help="estimate memory per device and recommend a strategy for a model"))
    add_run_arguments(sub.add_parser("run", help="start a script on N processes with horovodrun, mpirun or srun"))
    add_timeline_arguments(sub.add_parser("timeline", help="draw a pipeline trace, a Horovod timeline or scaling results as PNG"))
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``dualframe`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from dualframe.launch import doctor

        return doctor.main(as_json=args.json, required=args.require)
    if args.command == "plan":
        from dualframe.plan.cli import main as plan_main

        return plan_main(args)
    if args.command == "run":
        from dualframe.launch.run import main_from_args

        return main_from_args(args)
    if args.command == "timeline":
        from dualframe.observe.charts import main as timeline_main

        return timeline_main(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
